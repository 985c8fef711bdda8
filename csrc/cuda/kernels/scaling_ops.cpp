// CUDA operators update_delayed_scaling and compute_scale_from_amax; kernels in scaling.cu.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <vector>

#include "../cuda_checks.h"
#include "kernels.h"
#include "../../prepared_update.h"

namespace transformer_fp8 {
namespace {

// The update of checked tensors (see prepared_update.h): one launch for all of them.
void run_update_cuda(const UpdateTensor* tensors, size_t count, int margin, AmaxAlgo algo,
                     c10::Device device) {
  const c10::cuda::CUDAGuard guard(device);
  std::vector<cuda::DelayedScalingTensor> desc(count);
  for (size_t i = 0; i < count; ++i) {
    const UpdateTensor& t = tensors[i];
    desc[i] = {t.history, t.scale, t.scale_inv, t.history_len, t.columns, t.fp8_max};
  }
  // The descriptors travel as kernel parameters: no device copy, nothing kept between calls.
  const auto status = cuda::launch_update_delayed_scaling(
      desc.data(), static_cast<int64_t>(count), margin, algo,
      c10::cuda::getCurrentCUDAStream());
  TFP8_CHECK_LAUNCH(status, "update_delayed_scaling");
}

const RegisterUpdateRunner register_cuda_runner(c10::DeviceType::CUDA, &run_update_cuda);

void update_delayed_scaling_cuda(at::TensorList amax_histories, at::TensorList scales,
                                 at::TensorList scale_invs, at::ArrayRef<double> fp8_maxes,
                                 int64_t margin, c10::string_view amax_compute_algo) {
  check_delayed_scaling_args(amax_histories, scales, scale_invs, fp8_maxes, margin);
  const AmaxAlgo algo = parse_amax_algo(amax_compute_algo);
  check_cuda_tensor(amax_histories[0], "amax_histories[0]");
  const auto tensors = update_tensors(amax_histories, scales, scale_invs, fp8_maxes);
  run_update_cuda(tensors.data(), tensors.size(), static_cast<int>(margin), algo,
                  amax_histories[0].device());
}

at::Tensor compute_scale_from_amax_cuda(const at::Tensor& amax, double fp8_max, int64_t margin) {
  check_compute_scale_args(amax, fp8_max, margin);
  check_cuda_tensor(amax, "amax");
  const c10::cuda::CUDAGuard guard(amax.device());
  const at::Tensor a = amax.contiguous();
  at::Tensor scale = at::empty(amax.sizes(), amax.options());
  const auto status = cuda::launch_compute_scale_from_amax(
      a.data_ptr<float>(), a.numel(), fp8_max, static_cast<int>(margin),
      scale.data_ptr<float>(), c10::cuda::getCurrentCUDAStream());
  TFP8_CHECK_LAUNCH(status, "compute_scale_from_amax");
  return scale;
}

}  // namespace

TORCH_LIBRARY_IMPL(transformer_fp8, CUDA, m) {
  m.impl("update_delayed_scaling", &update_delayed_scaling_cuda);
  m.impl("compute_scale_from_amax", &compute_scale_from_amax_cuda);
}

}  // namespace transformer_fp8
