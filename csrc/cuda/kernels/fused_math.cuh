// Float32 device math of the fused operators: the activations and their derivatives, written
// as the CPU kernels (ATen) compute them, up to the rounding of tanhf / expf.
#pragma once

#include <cuda_runtime.h>

#include "../../activation_kind.h"

namespace transformer_fp8 {
namespace cuda {

// gelu, tanh approximation: 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3), computed
// as x * sigmoid(2u) (the same function: 1 + tanh(u) = 2 sigmoid(2u)). 1 + tanh(u) cancels for
// x below about -4, where tanh(u) is within a few float32 steps of -1: its relative error there
// reaches 100%, and one ulp of tanhf on one device against another changed E5M2 codes by up
// to 23. sigmoid(2u) keeps full relative precision. Same formula, same operation order as the
// CPU kernel (csrc/cpu/activation.cpp) and reference.py.
constexpr float kGeluTwoBeta = 1.5957691216057308f;  // 2 sqrt(2 / pi)
constexpr float kGeluKappa = 0.044715f;
constexpr float kGeluThreeKappa = 0.134145f;

// The gelu formulas below round after every operation, as the CPU kernel's ATen operations do:
// __fmul_rn / __fadd_rn, which nvcc never contracts into a fused multiply-add.
__device__ __forceinline__ float sigmoid(float v) {
  return __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-v)));
}

__device__ __forceinline__ float gelu_two_u(float v) {
  const float cube = __fmul_rn(__fmul_rn(v, v), v);
  return __fmul_rn(__fadd_rn(v, __fmul_rn(cube, kGeluKappa)), kGeluTwoBeta);
}

__device__ __forceinline__ float pointwise(float v, Activation act) {
  switch (act) {
    case Activation::Gelu: return __fmul_rn(v, sigmoid(gelu_two_u(v)));
    // relu keeps -0.0 and NaN as they are (torch's clamp_min(x, 0) does).
    case Activation::Relu: return v < 0.0f ? 0.0f : v;
    case Activation::Silu: return v / (1.0f + expf(-v));
    case Activation::Qgelu: return __fmul_rn(v, sigmoid(__fmul_rn(v, kQgeluAlpha)));
    case Activation::Srelu: {
      const float r = v < 0.0f ? 0.0f : v;  // (relu's, -0.0 and NaN kept)
      return __fmul_rn(r, r);
    }
    case Activation::Sigmoid: return sigmoid(v);
    default: return v;
  }
}

// d * act'(v), as torch's autograd: relu passes d where v > 0 or v is NaN.
__device__ __forceinline__ float pointwise_grad(float d, float v, Activation act) {
  switch (act) {
    case Activation::Gelu: {
      // d/dx x sigmoid(2u) = s + x s (1 - s) 2u', with s = sigmoid(2u), 1 - s = sigmoid(-2u)
      // (not 1 - s, which cancels) and 2u' = 2 sqrt(2/pi) (1 + 3 * 0.044715 x^2).
      const float two_u = gelu_two_u(v);
      const float s = sigmoid(two_u), one_minus_s = sigmoid(-two_u);
      const float two_u_prime =
          __fmul_rn(__fadd_rn(__fmul_rn(__fmul_rn(v, v), kGeluThreeKappa), 1.0f), kGeluTwoBeta);
      const float tail = __fmul_rn(__fmul_rn(__fmul_rn(v, s), one_minus_s), two_u_prime);
      return __fmul_rn(d, __fadd_rn(s, tail));
    }
    case Activation::Relu: return v <= 0.0f ? 0.0f : d;
    case Activation::Silu: {
      const float sigmoid = 1.0f / (1.0f + expf(-v));
      return d * sigmoid * (1.0f + v * (1.0f - sigmoid));
    }
    case Activation::Qgelu: {
      // d (s + v s (1 - s) 1.702), s = sigmoid(1.702 v), 1 - s = sigmoid(-1.702 v).
      const float s = sigmoid(__fmul_rn(v, kQgeluAlpha));
      const float one_minus_s = sigmoid(__fmul_rn(v, -kQgeluAlpha));
      const float tail = __fmul_rn(__fmul_rn(__fmul_rn(v, s), one_minus_s), kQgeluAlpha);
      return __fmul_rn(d, __fadd_rn(s, tail));
    }
    // d * 2v where v > 0 or v is NaN (relu's rule), else 0.
    case Activation::Srelu: return v <= 0.0f ? 0.0f : __fmul_rn(d, __fadd_rn(v, v));
    case Activation::Sigmoid: return __fmul_rn(d, __fmul_rn(sigmoid(v), sigmoid(-v)));
    default: return d;
  }
}

}  // namespace cuda
}  // namespace transformer_fp8
