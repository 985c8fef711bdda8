// The Python module transformer_fp8._C: importing it loads the operators (registration.cpp and
// the kernels); it also holds what Python calls without the dispatcher (python_module.h).
#include "python_module.h"

#include <string>

#include "build_config.h"  // written by setup.py into build/generated
#ifdef TRANSFORMER_FP8_WITH_CUDA
#include "cuda/kernels/blockwise_transpose_choice.h"
#endif

// Defaults for a build that did not say.
#ifndef TRANSFORMER_FP8_CUDA_ARCHS
#define TRANSFORMER_FP8_CUDA_ARCHS ""
#endif
#ifndef TRANSFORMER_FP8_CUDA_VERSION
#define TRANSFORMER_FP8_CUDA_VERSION ""
#endif
#ifndef TRANSFORMER_FP8_TORCH_VERSION
#define TRANSFORMER_FP8_TORCH_VERSION ""
#endif

namespace {

pybind11::dict build_info() {
  pybind11::dict info;
#ifdef TRANSFORMER_FP8_WITH_CUDA
  info["cuda"] = true;
  info["cuda_version"] = std::string(TRANSFORMER_FP8_CUDA_VERSION);
#else
  info["cuda"] = false;
  info["cuda_version"] = pybind11::none();
#endif
  info["cuda_archs"] = std::string(TRANSFORMER_FP8_CUDA_ARCHS);
  info["torch_version"] = std::string(TRANSFORMER_FP8_TORCH_VERSION);
  return info;
}

}  // namespace

PYBIND11_MODULE(_C, module) {
  module.doc() = "transformer_fp8 operators (registered under torch.ops.transformer_fp8)";
  module.def("build_info", &build_info, "What this build of the extension contains.");
  transformer_fp8::bind_delayed_scaling_batch(module);
  transformer_fp8::bind_linear_steps(module);
  transformer_fp8::bind_norm_mlp_step(module);
#ifdef TRANSFORMER_FP8_WITH_CUDA
  module.def("_reread_blockwise_transpose_kernel",
             &transformer_fp8::reread_blockwise_transpose_kernel,
             "Reads TRANSFORMER_FP8_BLOCKWISE_TRANSPOSE_KERNEL again and returns the 1x128 "
             "with-transpose kernel now chosen: 'registers' or 'staged' (CUDA builds only).");
#endif
}
