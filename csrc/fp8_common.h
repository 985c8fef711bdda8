// Numerics shared by the CPU and CUDA kernels: FP8 format limits and the delayed-scaling rule.
// Everything here is plain C++ usable from host code and from CUDA device code, so both
// backends compute the very same function.
#pragma once

#include <cfloat>
#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define TFP8_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define TFP8_HOST_DEVICE inline
#endif

namespace transformer_fp8 {

// The FP8 formats the kernels produce: those of torch.float8_e4m3fn and torch.float8_e5m2.
enum class Fp8Format : int { E4M3 = 0, E5M2 = 1 };

// Input / output element types that the raw kernels understand.
enum class HpType : int { Float32 = 0, BFloat16 = 1, Float16 = 2 };

constexpr float kE4M3Max = 448.0f;
constexpr float kE5M2Max = 57344.0f;

TFP8_HOST_DEVICE bool finite_f32(float v) {
#if defined(__CUDA_ARCH__)
  return isfinite(v);
#else
  return std::isfinite(v);
#endif
}

// max(|.|) accumulation that propagates NaN, like torch's amax.
TFP8_HOST_DEVICE float nan_max(float acc, float v) {
  return (v > acc || v != v) ? v : acc;
}

// max over the finite values only; the accumulator starts at -inf ("nothing finite yet").
TFP8_HOST_DEVICE float finite_max(float acc, float v) {
  return (finite_f32(v) && v > acc) ? v : acc;
}

// An amax gives a scale only when it is finite and positive.
TFP8_HOST_DEVICE bool amax_is_usable(float amax) {
  return finite_f32(amax) && amax > 0.0f;
}

// scale = fp8_max / amax / 2**margin. Computed in fp64 and rounded to fp32 once, so that a
// tiny amax does not overflow halfway. Clamped to [FLT_MIN, FLT_MAX] (FLT_MIN: the smallest
// normal float32): an overflow keeps the scale finite and scale_inv = 1/scale non-zero; an
// underflow (a huge amax with a large margin) keeps the scale non-zero and scale_inv finite.
TFP8_HOST_DEVICE float scale_from_amax(float amax, double fp8_max, int margin) {
  const double s = ldexp(fp8_max / static_cast<double>(amax), -margin);
  if (s > static_cast<double>(FLT_MAX)) return FLT_MAX;
  if (s < static_cast<double>(FLT_MIN)) return FLT_MIN;
  return static_cast<float>(s);
}

// How update_delayed_scaling derives the amax from the window (csrc/cpu/scaling.cpp's
// update_column and csrc/cuda/kernels/scaling.cu run the rule, as transformer_fp8/ops/__init__.py
// states it).
enum class AmaxAlgo : int { Max = 0, MostRecent = 1 };

}  // namespace transformer_fp8
