// Helpers of the CUDA operator glue: device checks and launch-status checks.
#pragma once

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>

#include "../checks/checks.h"

namespace transformer_fp8 {

inline void check_cuda_tensor(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda(), "transformer_fp8: argument '", name, "' must be a CUDA tensor, got ",
              describe(t));
}

#define TFP8_CHECK_LAUNCH(status, what)                                                     \
  TORCH_CHECK((status) == cudaSuccess, "transformer_fp8: CUDA launch of ", what, " failed: ", \
              cudaGetErrorString(status))

}  // namespace transformer_fp8
