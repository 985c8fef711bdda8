// The activations of the fused activation operators, shared by host and device code.
// qgelu is x * sigmoid(1.702 x), srelu relu(x)^2 (Transformer Engine's "quick gelu" and
// "squared relu").
// Gated ones (swiglu, geglu, reglu, qgeglu, sreglu, glu) take x [M, 2N] and return
// act(x[:, :N]) * x[:, N:]: the
// first half goes through the activation, the second half is the linear gate (the convention
// of Transformer Engine; torch's F.glu gates the other way round).
#pragma once

#include "fp8_common.h"

namespace transformer_fp8 {

// Identity is internal: cast_transpose_dbias runs the activation kernels with it. Sigmoid is
// internal too: glu's first half.
enum class Activation : int {
  Gelu = 0, Relu, Silu, Swiglu, Geglu, Reglu, Identity, Qgelu, Srelu, Qgeglu, Sreglu, Sigmoid,
  Glu
};

TFP8_HOST_DEVICE constexpr bool is_gated(Activation a) {
  return a == Activation::Swiglu || a == Activation::Geglu || a == Activation::Reglu ||
         a == Activation::Qgeglu || a == Activation::Sreglu || a == Activation::Glu;
}

// qgelu's slope: qgelu(x) = x * sigmoid(kQgeluAlpha * x).
constexpr float kQgeluAlpha = 1.702f;

// The pointwise function applied to the first half of a gated activation.
TFP8_HOST_DEVICE constexpr Activation base_activation(Activation a) {
  switch (a) {
    case Activation::Swiglu: return Activation::Silu;
    case Activation::Geglu: return Activation::Gelu;
    case Activation::Reglu: return Activation::Relu;
    case Activation::Qgeglu: return Activation::Qgelu;
    case Activation::Sreglu: return Activation::Srelu;
    case Activation::Glu: return Activation::Sigmoid;
    default: return a;
  }
}

}  // namespace transformer_fp8
