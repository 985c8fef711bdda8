// Stores of the fused kernels: a float32 result rounded to the input's type, and its FP8 byte.
#pragma once

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
__device__ __forceinline__ __nv_bfloat16 round_to<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <>
__device__ __forceinline__ __half round_to<__half>(float v) { return __float2half_rn(v); }

// Which FP8 bytes a kernel instance writes: none, E4M3 or E5M2 (a template parameter, so the
// cast is compiled in only where it is used).
enum class Fp8Out : int { None = 0, E4M3 = 1, E5M2 = 2 };

// FP8 byte of the float32 value v (not of v rounded to the input's type), amax folded in.
template <Fp8Out kOut>
__device__ __forceinline__ uint8_t fp8_byte(float v, float scale, float& amax) {
  if constexpr (kOut == Fp8Out::E4M3) return cast_one<Fp8Format::E4M3>(v, scale, amax);
  else return cast_one<Fp8Format::E5M2>(v, scale, amax);
}

// The same for an input element itself (a plain cast): NaN keeps the sign of the input's bits.
template <Fp8Out kOut, typename InT>
__device__ __forceinline__ uint8_t fp8_byte_of_input(InT v, float scale, float& amax) {
  if constexpr (kOut == Fp8Out::E4M3) return cast_one<Fp8Format::E4M3>(v, scale, amax);
  else return cast_one<Fp8Format::E5M2>(v, scale, amax);
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
