// Float32 device math of the fused operators: the activations and their derivatives, written
// as the CPU kernels (ATen) compute them, up to the rounding of tanhf / expf.
#pragma once

#include <cuda_runtime.h>

#include "../../activation_kind.h"

namespace transformer_fp8 {
namespace cuda {

// gelu, tanh approximation: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
constexpr float kGeluBeta = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluKappa = 0.044715f;

__device__ __forceinline__ float pointwise(float v, Activation act) {
  switch (act) {
    case Activation::Gelu: {
      const float inner = kGeluBeta * (v + kGeluKappa * v * v * v);
      return 0.5f * v * (1.0f + tanhf(inner));
    }
    // relu keeps -0.0 and NaN as they are (torch's clamp_min(x, 0) does).
    case Activation::Relu: return v < 0.0f ? 0.0f : v;
    case Activation::Silu: return v / (1.0f + expf(-v));
    default: return v;
  }
}

// d * act'(v), as torch's autograd: relu passes d where v > 0 or v is NaN.
__device__ __forceinline__ float pointwise_grad(float d, float v, Activation act) {
  switch (act) {
    case Activation::Gelu: {
      const float v_sq = v * v;
      const float t = tanhf(kGeluBeta * (v + kGeluKappa * v_sq * v));
      const float left = 0.5f * v, right = 1.0f + t;
      const float right_derivative =
          left * (1.0f - t * t) * kGeluBeta * (1.0f + 3.0f * kGeluKappa * v_sq);
      return d * (0.5f * right + right_derivative);
    }
    case Activation::Relu: return v <= 0.0f ? 0.0f : d;
    case Activation::Silu: {
      const float sigmoid = 1.0f / (1.0f + expf(-v));
      return d * sigmoid * (1.0f + v * (1.0f - sigmoid));
    }
    default: return d;
  }
}

}  // namespace cuda
}  // namespace transformer_fp8
