// Small device helpers shared by the CUDA kernels: element loads, the saturating FP8 cast,
// block-wide max reductions and the number of multiprocessors.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

#include "../../fp8_common.h"

namespace transformer_fp8 {
namespace cuda {

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }

template <Fp8Format F>
__host__ __device__ constexpr __nv_fp8_interpretation_t interpretation() {
  return F == Fp8Format::E4M3 ? __NV_E4M3 : __NV_E5M2;
}

// The sign bit of an input element, read from its own bits: converting a NaN to float (fp16)
// or multiplying it may drop the sign on the GPU.
__device__ __forceinline__ uint32_t sign_bit(float v) { return __float_as_uint(v) >> 31; }
__device__ __forceinline__ uint32_t sign_bit(__nv_bfloat16 v) { return __bfloat16_as_ushort(v) >> 15; }
__device__ __forceinline__ uint32_t sign_bit(__half v) { return __half_as_ushort(v) >> 15; }

// The FP8 byte of a NaN product x * scale, with the sign the CPU (x86) gives: a NaN x keeps its
// sign, a NaN scale gives its own, and inf * 0 gives the negative default NaN. All ones below.
template <typename InT>
__device__ __forceinline__ uint8_t fp8_nan_byte(InT x, float scale) {
  const float xf = to_float(x);
  const uint32_t sign = xf != xf ? sign_bit(x) : (scale != scale ? sign_bit(scale) : 1u);
  return static_cast<uint8_t>((sign << 7) | 0x7Fu);
}

// Saturating cast of (x0 * scale0, x1 * scale1), x0 in the low byte: clamp to +-fp8_max, then
// round to nearest even in hardware (cvt.rn.satfinite). The clamp turns NaN into fp8_max, so NaN
// lanes are put back afterwards. Also folds |x0|, |x1| into amax (NaN propagating).
template <Fp8Format F, typename InT>
__device__ __forceinline__ uint16_t cast_pair(InT x0, InT x1, float scale0, float scale1,
                                              float& amax) {
  constexpr float kMax = F == Fp8Format::E4M3 ? kE4M3Max : kE5M2Max;
  const float a = to_float(x0), b = to_float(x1);
  amax = nan_max(nan_max(amax, fabsf(a)), fabsf(b));
  const float pa = a * scale0, pb = b * scale1;
  const float2 clamped = make_float2(fminf(fmaxf(pa, -kMax), kMax), fminf(fmaxf(pb, -kMax), kMax));
  uint16_t pair = __nv_cvt_float2_to_fp8x2(clamped, __NV_SATFINITE, interpretation<F>());
  if (pa != pa) pair = static_cast<uint16_t>((pair & 0xFF00u) | fp8_nan_byte(x0, scale0));
  if (pb != pb) pair = static_cast<uint16_t>((pair & 0x00FFu) | (fp8_nan_byte(x1, scale1) << 8));
  return pair;
}

// Both elements with one scale.
template <Fp8Format F, typename InT>
__device__ __forceinline__ uint16_t cast_pair(InT x0, InT x1, float scale, float& amax) {
  return cast_pair<F>(x0, x1, scale, scale, amax);
}

template <Fp8Format F, typename InT>
__device__ __forceinline__ uint8_t cast_one(InT x, float scale, float& amax) {
  return static_cast<uint8_t>(cast_pair<F>(x, x, scale, amax) & 0xFFu);
}

// Packs of 8 elements, loaded with 16-byte (or 2 x 16-byte) accesses.
template <typename T>
struct alignas(8 * sizeof(T)) Pack8 {
  T v[8];
};

// Cast 8 elements to 8 FP8 bytes, packed little-endian (element 0 in the lowest byte).
template <Fp8Format F, typename InT>
__device__ __forceinline__ uint2 cast_pack8(const Pack8<InT>& pack, float scale, float& amax) {
  uint32_t pairs[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) pairs[j] = cast_pair<F>(pack.v[2 * j], pack.v[2 * j + 1], scale, amax);
  return make_uint2(pairs[0] | (pairs[1] << 16), pairs[2] | (pairs[3] << 16));
}

// The same with a scale per element (element j times scales[j]).
template <Fp8Format F, typename InT>
__device__ __forceinline__ uint2 cast_pack8(const Pack8<InT>& pack, const float (&scales)[8],
                                            float& amax) {
  uint32_t pairs[4];
#pragma unroll
  for (int j = 0; j < 4; ++j)
    pairs[j] = cast_pair<F>(pack.v[2 * j], pack.v[2 * j + 1], scales[2 * j], scales[2 * j + 1], amax);
  return make_uint2(pairs[0] | (pairs[1] << 16), pairs[2] | (pairs[3] << 16));
}

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

// *slot = nan_max(*slot, v), atomically: the same rule as the CPU kernel, whatever *slot holds
// (a NaN slot stays NaN, -0.0 stays -0.0 against +0.0). One compare-and-swap loop per block.
__device__ __forceinline__ void atomic_amax(float* slot, float v) {
  int* address = reinterpret_cast<int*>(slot);
  int observed = *address;
  while (true) {
    const int desired = __float_as_int(nan_max(__int_as_float(observed), v));
    if (desired == observed) return;
    const int previous = atomicCAS(address, observed, desired);
    if (previous == observed) return;
    observed = previous;
  }
}

// Reduce a per-thread |x| maximum over the block and fold it into *amax (if not null).
__device__ __forceinline__ void commit_amax(float* amax, float local) {
  if (amax == nullptr) return;
  const float block_max = block_nan_max(local);
  if (threadIdx.x == 0) atomic_amax(amax, block_max);
}

// Multiprocessors of the current device, queried once per device and cached (a race between
// two first calls only stores the same value twice).
inline int multiprocessor_count() {
  constexpr int kMaxCached = 64;
  static std::atomic<int> cached[kMaxCached];  // zero: not queried yet
  int device = 0, count = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return 132;
  if (device < kMaxCached && (count = cached[device].load(std::memory_order_relaxed)) > 0)
    return count;
  if (cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
      count <= 0) {
    return 132;
  }
  if (device < kMaxCached) cached[device].store(count, std::memory_order_relaxed);
  return count;
}

}  // namespace cuda
}  // namespace transformer_fp8
