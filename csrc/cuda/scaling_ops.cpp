// CUDA operators update_delayed_scaling and compute_scale_from_amax; kernels in scaling.cu.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstring>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "cuda_checks.h"
#include "kernels.h"

namespace transformer_fp8 {
namespace {

// Device copies of descriptor arrays, keyed by (device, stream, descriptor bytes). A training
// loop updates the same tensors every step, so after the first step no copy is made at all; the
// pinned host copy is kept alongside, so that a call captured in a CUDA graph replays a copy of
// memory that stays valid. Bounded: cleared when it grows past kMaxEntries.
class DescriptorCache {
 public:
  const cuda::DelayedScalingTensor* device_copy(const std::vector<cuda::DelayedScalingTensor>& desc,
                                                const at::Device& device, cudaStream_t stream) {
    const size_t bytes = desc.size() * sizeof(cuda::DelayedScalingTensor);
    std::string key(reinterpret_cast<const char*>(desc.data()), bytes);
    key += std::to_string(device.index()) + "/" + std::to_string(reinterpret_cast<uintptr_t>(stream));
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = entries_.find(key);
    if (it == entries_.end()) {
      if (entries_.size() >= kMaxEntries) entries_.clear();
      at::Tensor host = at::empty({static_cast<int64_t>(bytes)},
                                  at::TensorOptions().dtype(at::kByte).pinned_memory(true));
      std::memcpy(host.data_ptr(), desc.data(), bytes);
      // Asynchronous on the current stream; the copy keeps the pinned block alive until it ran.
      at::Tensor on_device = host.to(device, /*non_blocking=*/true);
      it = entries_.emplace(std::move(key), std::make_pair(host, on_device)).first;
    }
    return reinterpret_cast<const cuda::DelayedScalingTensor*>(it->second.second.data_ptr());
  }

 private:
  static constexpr size_t kMaxEntries = 256;
  std::mutex mutex_;
  std::unordered_map<std::string, std::pair<at::Tensor, at::Tensor>> entries_;
};

DescriptorCache& descriptor_cache() {
  static auto* cache = new DescriptorCache();  // never destroyed: CUDA may be gone at exit
  return *cache;
}

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
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const auto* device_desc = descriptor_cache().device_copy(desc, amax_histories[0].device(), stream);
  const auto status = cuda::launch_update_delayed_scaling(
      device_desc, static_cast<int64_t>(desc.size()), static_cast<int>(margin), algo, stream);
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
