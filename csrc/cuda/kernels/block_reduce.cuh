// Block-wide float sums for the fused kernels (the NaN-aware max lives in device_utils.cuh).
#pragma once

#include <cuda_runtime.h>

namespace transformer_fp8 {
namespace cuda {

__device__ __forceinline__ float warp_sum(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// Sum of v over the block, returned to every thread. blockDim.x % 32 == 0, at most 1024.
// The order of the additions is fixed by the block shape: the result is deterministic.
__device__ __forceinline__ float block_sum(float v) {
  __shared__ float partial[32];
  __shared__ float total;
  v = warp_sum(v);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();  // partial / total may still be read by a previous call
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < static_cast<int>(blockDim.x >> 5) ? partial[lane] : 0.0f;
    v = warp_sum(v);
    if (lane == 0) total = v;
  }
  __syncthreads();
  return total;
}

}  // namespace cuda
}  // namespace transformer_fp8
