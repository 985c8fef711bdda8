// Argument checks of the fused norm / activation / dbias operators, identical on every backend.
// Every message names the argument and says what was expected and what was given.
#pragma once

#include <ATen/ATen.h>

#include <string>

#include "../activation_kind.h"
#include "checks.h"

namespace transformer_fp8 {

// x of a fused operator: a 2-D float32, bfloat16 or float16 tensor.
inline void check_2d_input(const at::Tensor& x, const char* name, const char* op) {
  check_high_precision(x, name);
  TORCH_CHECK(x.dim() == 2, "transformer_fp8: argument '", name, "' of ", op,
              " must be a 2-D tensor [M, N], got ", describe(x));
}

// A tensor that must have exactly the shape of another one (dy against x or y).
inline void check_same_shape(const at::Tensor& t, const char* name, at::IntArrayRef shape,
                             const char* what) {
  TORCH_CHECK(t.sizes() == shape, "transformer_fp8: argument '", name, "' must have shape ",
              shape, " (", what, "), got ", describe(t));
}

inline void check_same_dtype(const at::Tensor& t, const char* name, const at::Tensor& ref,
                             const char* ref_name) {
  TORCH_CHECK(t.scalar_type() == ref.scalar_type(), "transformer_fp8: argument '", name,
              "' must have the dtype of '", ref_name, "' (", c10::toString(ref.scalar_type()),
              "), got ", describe(t));
}

// weight or bias of a norm: a float tensor [N] on x's device.
inline void check_norm_param(const at::Tensor& p, const char* name, const at::Tensor& x) {
  check_high_precision(p, name);
  TORCH_CHECK(p.dim() == 1 && p.size(0) == x.size(1), "transformer_fp8: argument '", name,
              "' must have shape [", x.size(1), "] (the last dimension of x), got ", describe(p));
  check_same_device(p, name, x, "x");
}

inline void check_eps(double eps) {
  TORCH_CHECK(std::isfinite(eps) && eps >= 0, "transformer_fp8: argument 'eps' must be finite "
              "and >= 0, got ", eps);
}

inline void check_row_multiple(int64_t row_multiple) {
  TORCH_CHECK(row_multiple >= 1 && row_multiple <= 65536, "transformer_fp8: argument "
              "'row_multiple' must be an integer in [1, 65536], got ", row_multiple);
}

// Rows of the FP8 outputs: M rounded up to a multiple of row_multiple.
inline int64_t padded_rows(int64_t rows, int64_t row_multiple) {
  return (rows + row_multiple - 1) / row_multiple * row_multiple;
}

// scale, fp8_dtype and the optional amax slot of an FP8-emitting operator; ``others``: its
// other inputs (weights, dy), which the slot must not overlap either.
inline Fp8Format check_fp8_output_args(const at::Tensor& x, const at::Tensor& scale,
                                       at::ScalarType fp8_dtype,
                                       const c10::optional<at::Tensor>& amax,
                                       int64_t row_multiple,
                                       const at::Tensor* other = nullptr,
                                       const char* other_name = "",
                                       const at::Tensor* other2 = nullptr,
                                       const char* other2_name = "") {
  check_scalar_f32(scale, "scale", x, "x");
  if (amax.has_value()) {
    check_amax_slot(*amax, x, {{"x", &x}, {"scale", &scale}, {other_name, other},
                               {other2_name, other2}});
  }
  check_row_multiple(row_multiple);
  return check_fp8_dtype(fp8_dtype, "fp8_dtype");
}

inline Activation parse_activation(c10::string_view name) {
  if (name == "gelu") return Activation::Gelu;
  if (name == "relu") return Activation::Relu;
  if (name == "silu") return Activation::Silu;
  if (name == "swiglu") return Activation::Swiglu;
  if (name == "geglu") return Activation::Geglu;
  if (name == "reglu") return Activation::Reglu;
  if (name == "qgelu") return Activation::Qgelu;
  if (name == "srelu") return Activation::Srelu;
  if (name == "qgeglu") return Activation::Qgeglu;
  if (name == "sreglu") return Activation::Sreglu;
  if (name == "glu") return Activation::Glu;
  TORCH_CHECK(false, "transformer_fp8: argument 'activation' must be one of \"gelu\", \"relu\", "
              "\"silu\", \"qgelu\", \"srelu\", \"swiglu\", \"geglu\", \"reglu\", "
              "\"qgeglu\", \"sreglu\", \"glu\", got \"", std::string(name), "\"");
}

// x of an activation: 2-D, with an even last dimension for the gated ones. Returns the number
// of output columns (N for [M, N], or N for a gated [M, 2N]).
inline int64_t check_activation_input(const at::Tensor& x, Activation act, const char* op) {
  check_2d_input(x, "x", op);
  if (!is_gated(act)) return x.size(1);
  TORCH_CHECK(x.size(1) % 2 == 0, "transformer_fp8: argument 'x' of a gated activation must "
              "have an even last dimension [M, 2N], got ", describe(x));
  return x.size(1) / 2;
}

// dy of an activation backward: [M, output columns], x's dtype and device.
inline void check_activation_grad(const at::Tensor& dy, const at::Tensor& x, int64_t out_cols) {
  check_high_precision(dy, "dy");
  check_same_device(dy, "dy", x, "x");
  check_same_shape(dy, "dy", {x.size(0), out_cols}, "the shape of the activation's output");
  check_same_dtype(dy, "dy", x, "x");
}

// The forward of a norm: x 2-D with at least one column, weight (and bias) [N], eps >= 0.
inline void check_norm_fwd_args(const at::Tensor& x, const at::Tensor& weight,
                                const c10::optional<at::Tensor>& bias, double eps,
                                const char* op) {
  check_2d_input(x, "x", op);
  TORCH_CHECK(x.size(1) >= 1, "transformer_fp8: argument 'x' of ", op, " must have at least "
              "one column, got ", describe(x));
  check_norm_param(weight, "weight", x);
  if (bias.has_value()) check_norm_param(*bias, "bias", x);
  check_eps(eps);
}

// The backward of a norm: dy like x, mean / rstd float32 [M], weight [N].
inline void check_norm_bwd_args(const at::Tensor& dy, const at::Tensor& x,
                                const at::Tensor* mean, const at::Tensor& rstd,
                                const at::Tensor& weight, const char* op) {
  check_2d_input(x, "x", op);
  check_high_precision(dy, "dy");
  check_same_device(dy, "dy", x, "x");
  check_same_shape(dy, "dy", x.sizes(), "the shape of x");
  check_same_dtype(dy, "dy", x, "x");
  const at::Tensor* stats[] = {mean, &rstd};
  const char* names[] = {"mean", "rstd"};
  for (int i = 0; i < 2; ++i) {
    if (stats[i] == nullptr) continue;
    const at::Tensor& s = *stats[i];
    check_defined(s, names[i]);
    TORCH_CHECK(s.scalar_type() == at::kFloat && s.dim() == 1 && s.size(0) == x.size(0),
                "transformer_fp8: argument '", names[i], "' must be a float32 tensor of shape [",
                x.size(0), "] (one value per row of x), got ", describe(s));
    check_same_device(s, names[i], x, "x");
  }
  check_norm_param(weight, "weight", x);
}

}  // namespace transformer_fp8
