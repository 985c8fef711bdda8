// CUDA kernels of update_delayed_scaling (one launch for every tensor of a training step) and
// compute_scale_from_amax. Reference: csrc/cpu/scaling.cpp.
#include "device_utils.cuh"
#include "kernels.h"

namespace transformer_fp8 {
namespace cuda {
namespace {

constexpr int kThreads = 256;

// Up to kBatch descriptors as one kernel parameter. Kernel parameters may total 32764 bytes
// (CUDA 12.1+, Volta and newer): 640 descriptors of 48 bytes fit; a small batch for the common
// case of a few dozen tensors keeps the parameter copy short.
template <int kBatch>
struct DelayedScalingBatch {
  DelayedScalingTensor tensors[kBatch];
};
constexpr int kSmallBatch = 64, kLargeBatch = 640;
static_assert(sizeof(DelayedScalingBatch<kLargeBatch>) + 64 <= 32764, "kernel parameter limit");

__device__ __forceinline__ float block_max_finite(float v) {
  __shared__ float warp_max[32];
  for (int offset = 16; offset > 0; offset >>= 1)
    v = finite_max(v, __shfl_xor_sync(0xffffffffu, v, offset));
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();
  if (lane == 0) warp_max[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < static_cast<int>(blockDim.x >> 5) ? warp_max[lane] : -INFINITY;
    for (int offset = 16; offset > 0; offset >>= 1)
      v = finite_max(v, __shfl_xor_sync(0xffffffffu, v, offset));
  }
  return v;
}

// One block per tensor; its columns one after another. The roll moves rows up by one in place,
// a chunk of blockDim.x rows at a time: every thread reads its row r + 1 before the barrier and
// writes row r after it, so no row is overwritten before it has been read.
template <int kBatch>
__global__ void update_delayed_scaling_kernel(const __grid_constant__ DelayedScalingBatch<kBatch> batch,
                                              int margin, AmaxAlgo algo) {
  const DelayedScalingTensor t = batch.tensors[blockIdx.x];
  const int64_t L = t.history_len, n = t.columns;
  for (int64_t col = 0; col < n; ++col) {
    float* h = t.history + col;
    const float cur = h[0];
    __syncthreads();  // every thread has read row 0 before thread 0 may reset it
    if (cur == 0.0f) continue;  // nothing recorded this step (same branch for the whole block)
    float window_max = -INFINITY;
    if (threadIdx.x == 0 && L >= 2) window_max = finite_max(window_max, h[n]);  // old row 1
    for (int64_t chunk = 1; chunk + 1 < L; chunk += blockDim.x) {
      const int64_t r = chunk + threadIdx.x;
      const bool active = r + 1 < L;
      float v = 0.0f;
      if (active) {
        v = h[(r + 1) * n];
        window_max = finite_max(window_max, v);
      }
      __syncthreads();
      if (active) h[r * n] = v;
      __syncthreads();
    }
    window_max = block_max_finite(window_max);
    if (threadIdx.x == 0) {
      window_max = finite_max(window_max, cur);
      if (L >= 2) h[(L - 1) * n] = cur;
      h[0] = 0.0f;
      const float amax = algo == AmaxAlgo::Max ? window_max : (finite_f32(cur) ? cur : -INFINITY);
      if (amax_is_usable(amax)) t.scale[col] = scale_from_amax(amax, t.fp8_max, margin);
      t.scale_inv[col] = 1.0f / t.scale[col];
    }
  }
}

__global__ void compute_scale_kernel(const float* __restrict__ amax, int64_t n, double fp8_max,
                                     int margin, float* __restrict__ scale) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) scale[i] = amax_is_usable(amax[i]) ? scale_from_amax(amax[i], fp8_max, margin) : 1.0f;
}

template <int kBatch>
cudaError_t launch_update_batch(const DelayedScalingTensor* tensors, int64_t count, int margin,
                                AmaxAlgo algo, cudaStream_t stream) {
  DelayedScalingBatch<kBatch> batch;
  for (int64_t i = 0; i < count; ++i) batch.tensors[i] = tensors[i];
  update_delayed_scaling_kernel<kBatch><<<static_cast<unsigned>(count), kThreads, 0, stream>>>(
      batch, margin, algo);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_update_delayed_scaling(const DelayedScalingTensor* tensors, int64_t count,
                                          int margin, AmaxAlgo algo, cudaStream_t stream) {
  if (count <= kSmallBatch) {
    return count == 0 ? cudaSuccess
                      : launch_update_batch<kSmallBatch>(tensors, count, margin, algo, stream);
  }
  // One launch per 640 tensors: more than most models have FP8 tensors.
  for (int64_t start = 0; start < count; start += kLargeBatch) {
    const int64_t n = count - start < kLargeBatch ? count - start : kLargeBatch;
    const cudaError_t status =
        launch_update_batch<kLargeBatch>(tensors + start, n, margin, algo, stream);
    if (status != cudaSuccess) return status;
  }
  return cudaSuccess;
}

cudaError_t launch_compute_scale_from_amax(const float* amax, int64_t n, double fp8_max,
                                           int margin, float* scale, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  const unsigned grid = static_cast<unsigned>((n + kThreads - 1) / kThreads);
  compute_scale_kernel<<<grid, kThreads, 0, stream>>>(amax, n, fp8_max, margin, scale);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace transformer_fp8
