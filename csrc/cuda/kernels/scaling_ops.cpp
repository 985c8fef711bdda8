// CUDA operators update_delayed_scaling and compute_scale_from_amax; kernels in scaling.cu.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <vector>

#include "../cuda_checks.h"
#include "kernels.h"

namespace transformer_fp8 {
namespace {

void update_delayed_scaling_cuda(at::TensorList amax_histories, at::TensorList scales,
                                 at::TensorList scale_invs, at::ArrayRef<double> fp8_maxes,
                                 int64_t margin, c10::string_view amax_compute_algo) {
  check_delayed_scaling_args(amax_histories, scales, scale_invs, fp8_maxes, margin);
  const AmaxAlgo algo = parse_amax_algo(amax_compute_algo);
  check_cuda_tensor(amax_histories[0], "amax_histories[0]");
  const c10::cuda::CUDAGuard guard(amax_histories[0].device());

  std::vector<cuda::DelayedScalingTensor> desc(amax_histories.size());
  for (size_t i = 0; i < desc.size(); ++i) {
    desc[i] = {amax_histories[i].data_ptr<float>(), scales[i].data_ptr<float>(),
               scale_invs[i].data_ptr<float>(), amax_histories[i].size(0),
               amax_histories[i].size(1), fp8_maxes[i]};
  }
  // The descriptors travel as kernel parameters: no device copy, nothing kept between calls.
  const auto status = cuda::launch_update_delayed_scaling(
      desc.data(), static_cast<int64_t>(desc.size()), static_cast<int>(margin), algo,
      c10::cuda::getCurrentCUDAStream());
  TFP8_CHECK_LAUNCH(status, "update_delayed_scaling");
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
