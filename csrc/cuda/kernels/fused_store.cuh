// Stores of the fused kernels: a float32 result rounded to the input's type, and its FP8 byte.
#pragma once

#include <initializer_list>
#include <type_traits>

#include "device_utils.cuh"
#include "kernels.h"

namespace transformer_fp8 {
namespace cuda {

template <typename T>
__device__ __forceinline__ T round_to(float v);
template <>
__device__ __forceinline__ float round_to<float>(float v) { return v; }
template <>
__device__ __forceinline__ __nv_bfloat16 round_to<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
template <>
__device__ __forceinline__ __half round_to<__half>(float v) { return __float2half_rn(v); }

// Which FP8 bytes a kernel instance writes: none, E4M3 or E5M2 (a template parameter, so the
// cast is compiled in only where it is used).
enum class Fp8Out : int { None = 0, E4M3 = 1, E5M2 = 2 };

// The FP8 bytes of kVec values, amax folded in: float32 results (not rounded to the input's type
// first), or input elements (a plain cast: NaN keeps the sign of their bits). Converted two at a
// time: cast_one converts a value paired with itself, so one element at a time the conversion,
// clamps and NaN checks ran twice per element. Same bytes, same amax.
template <Fp8Out kOut, typename T, int kVec>
__device__ __forceinline__ void fp8_bytes(const T (&v)[kVec], float scale, float& amax,
                                          uint8_t (&bytes)[kVec]) {
  constexpr Fp8Format F = kOut == Fp8Out::E4M3 ? Fp8Format::E4M3 : Fp8Format::E5M2;
#pragma unroll
  for (int e = 0; e + 1 < kVec; e += 2) {
    const uint16_t pair = cast_pair<F>(v[e], v[e + 1], scale, amax);
    bytes[e] = static_cast<uint8_t>(pair & 0xFFu);
    bytes[e + 1] = static_cast<uint8_t>(pair >> 8);
  }
  if constexpr (kVec % 2 == 1) bytes[kVec - 1] = cast_one<F>(v[kVec - 1], scale, amax);
}

// kVec consecutive elements, loaded and stored with one access (kVec = 1: scalar code).
template <typename T, int kVec>
struct alignas(sizeof(T) * kVec) VecOf {
  T v[kVec];
};

__device__ __forceinline__ uint32_t bits_of(float v) { return __float_as_uint(v); }
__device__ __forceinline__ uint32_t bits_of(__half v) { return __half_as_ushort(v); }
__device__ __forceinline__ uint32_t bits_of(__nv_bfloat16 v) { return __bfloat16_as_ushort(v); }

// Stores a pack at p (aligned to the pack's size) with one access of the pack's size, the word
// built from the elements' bits. A plain assignment of the pack (or of a uint2 / uint4 built
// from it: CUDA's vector types are structs, stored member by member) compiled to 16- or 32-bit
// stores here (st.global.v2.u16 / st.global.u32 in the PTX); 8 and 16 bytes go through
// st.global.v2.b32 / st.global.v4.b32.
template <typename T, int kVec>
__device__ __forceinline__ void store_vec(T* p, const VecOf<T, kVec>& pack) {
  if constexpr (kVec == 1) {
    *p = pack.v[0];
  } else if constexpr (sizeof(T) == 2 && kVec == 4) {
    // Two 32-bit words in one 8-byte store, named to the assembler. Built as one 64-bit
    // integer instead, ptxas (CUDA 13.0, sm_90) lost the high word of one row of the fp16
    // reglu backward: it stored a register holding another value (seen in the SASS and on the
    // H100: test_activation_fwd_bwd_hp[...-float16-reglu-cuda]).
    const uint32_t lo = bits_of(pack.v[0]) | (bits_of(pack.v[1]) << 16);
    const uint32_t hi = bits_of(pack.v[2]) | (bits_of(pack.v[3]) << 16);
    asm volatile("st.global.v2.b32 [%0], {%1, %2};" ::"l"(p), "r"(lo), "r"(hi) : "memory");
  } else if constexpr (sizeof(T) == 4 && kVec == 4) {
    asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(bits_of(pack.v[0])),
                 "r"(bits_of(pack.v[1])), "r"(bits_of(pack.v[2])), "r"(bits_of(pack.v[3]))
                 : "memory");
  } else {
    *reinterpret_cast<VecOf<T, kVec>*>(p) = pack;
  }
}

// Stores kVec FP8 bytes at p (4-byte aligned when kVec == 4), element 0 in the lowest byte.
template <int kVec>
__device__ __forceinline__ void store_bytes(uint8_t* p, const uint8_t (&bytes)[kVec]) {
  if constexpr (kVec == 4) {
    *reinterpret_cast<uint32_t*>(p) = bytes[0] | (bytes[1] << 8) | (bytes[2] << 16) |
                                      (static_cast<uint32_t>(bytes[3]) << 24);
  } else {
#pragma unroll
    for (int e = 0; e < kVec; ++e) p[e] = bytes[e];
  }
}

inline bool aligned_to(const void* p, size_t bytes) {
  return p == nullptr || reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

// Calls fn with std::integral_constant<int, 4> when every pointer is aligned for 4-element
// accesses of elem_bytes-sized elements (FP8 ones: 4 bytes) and cols % 4 == 0, else with 1.
template <typename Fn>
void with_vec_width(int64_t cols, size_t elem_bytes, std::initializer_list<const void*> hp_ptrs,
                    const void* fp8_ptr, Fn&& fn) {
  bool ok = cols % 4 == 0 && aligned_to(fp8_ptr, 4);
  for (const void* p : hp_ptrs) ok = ok && aligned_to(p, 4 * elem_bytes);
  if (ok)
    fn(std::integral_constant<int, 4>{});
  else
    fn(std::integral_constant<int, 1>{});
}

// Calls fn with a null pointer of the C++ type of t.
template <typename Fn>
void with_input_type(HpType t, Fn&& fn) {
  switch (t) {
    case HpType::Float32: fn(static_cast<float*>(nullptr)); break;
    case HpType::BFloat16: fn(static_cast<__nv_bfloat16*>(nullptr)); break;
    default: fn(static_cast<__half*>(nullptr)); break;
  }
}

// Calls fn with std::integral_constant<Fp8Out, ...> for the output of o.
template <typename Fn>
void with_fp8_out(const FusedOutput& o, Fn&& fn) {
  if (o.fp8 == nullptr)
    fn(std::integral_constant<Fp8Out, Fp8Out::None>{});
  else if (o.fmt == Fp8Format::E4M3)
    fn(std::integral_constant<Fp8Out, Fp8Out::E4M3>{});
  else
    fn(std::integral_constant<Fp8Out, Fp8Out::E5M2>{});
}

}  // namespace cuda
}  // namespace transformer_fp8
