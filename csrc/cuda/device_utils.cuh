// Small device helpers shared by the CUDA kernels: element loads, the saturating FP8 cast,
// block-wide max reductions and the number of multiprocessors.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "../fp8_common.h"

namespace transformer_fp8 {
namespace cuda {

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }

template <Fp8Format F>
constexpr __nv_fp8_interpretation_t interpretation() {
  return F == Fp8Format::E4M3 ? __NV_E4M3 : __NV_E5M2;
}

// NaN keeps its sign and becomes the all-ones pattern, as torch's conversion does.
__device__ __forceinline__ uint8_t fp8_nan_like(float v) {
  return static_cast<uint8_t>(((__float_as_uint(v) >> 24) & 0x80u) | 0x7Fu);
}

// Saturating cast of a pair (v0 in the low byte): clamp to +-fp8_max, then round to nearest
// even in hardware (cvt.rn.satfinite). The clamp would turn NaN into fp8_max, so NaN lanes are
// put back afterwards.
template <Fp8Format F>
__device__ __forceinline__ uint16_t cast_pair(float v0, float v1) {
  constexpr float kMax = F == Fp8Format::E4M3 ? kE4M3Max : kE5M2Max;
  const float2 clamped = make_float2(fminf(fmaxf(v0, -kMax), kMax), fminf(fmaxf(v1, -kMax), kMax));
  uint16_t pair = __nv_cvt_float2_to_fp8x2(clamped, __NV_SATFINITE, interpretation<F>());
  if (v0 != v0) pair = static_cast<uint16_t>((pair & 0xFF00u) | fp8_nan_like(v0));
  if (v1 != v1) pair = static_cast<uint16_t>((pair & 0x00FFu) | (fp8_nan_like(v1) << 8));
  return pair;
}

template <Fp8Format F>
__device__ __forceinline__ uint8_t cast_one(float v) {
  return static_cast<uint8_t>(cast_pair<F>(v, 0.0f) & 0xFFu);
}

// Packs of 8 elements, loaded with 16-byte (or 2 x 16-byte) accesses.
template <typename T>
struct alignas(8 * sizeof(T)) Pack8 {
  T v[8];
};

// Block-wide NaN-propagating max; the result is valid in thread 0. blockDim.x % 32 == 0.
__device__ __forceinline__ float block_nan_max(float v) {
  __shared__ float warp_max[32];
  for (int offset = 16; offset > 0; offset >>= 1)
    v = nan_max(v, __shfl_xor_sync(0xffffffffu, v, offset));
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();  // warp_max may still be read by a previous call
  if (lane == 0) warp_max[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < static_cast<int>(blockDim.x >> 5) ? warp_max[lane] : 0.0f;
    for (int offset = 16; offset > 0; offset >>= 1)
      v = nan_max(v, __shfl_xor_sync(0xffffffffu, v, offset));
  }
  return v;
}

// *slot = max(*slot, v) for v >= 0 or NaN (positive sign): on such floats the order of the bit
// patterns read as int is the order of the values, with NaN above +inf, so NaN propagates.
__device__ __forceinline__ void atomic_amax(float* slot, float v) {
  atomicMax(reinterpret_cast<int*>(slot), __float_as_int(v));
}

// Reduce a per-thread |x| maximum over the block and fold it into *amax (if not null).
__device__ __forceinline__ void commit_amax(float* amax, float local) {
  if (amax == nullptr) return;
  const float block_max = block_nan_max(local);
  if (threadIdx.x == 0) atomic_amax(amax, block_max);
}

int multiprocessor_count();

}  // namespace cuda
}  // namespace transformer_fp8
