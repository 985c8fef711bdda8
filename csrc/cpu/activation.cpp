// CPU kernels of activation_fwd(_fp8), activation_bwd(_fp8) and cast_transpose_dbias.
// The float32 math is the ATen composition that transformer_fp8/reference.py writes in torch
// (bit-identical to it); the CUDA kernels (csrc/cuda/kernels/activation.cu) follow the same formulas.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <tuple>

#include "../checks/fused_checks.h"
#include "fp8_cast_cpu.h"

namespace transformer_fp8 {
namespace {

using Tensor = at::Tensor;

// gelu, tanh approximation, as x * sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3): the function
// of F.gelu(approximate="tanh"), without its cancellation in 1 + tanh(u) for x below about -4
// (csrc/cuda/kernels/fused_math.cuh says more; the CUDA kernel does the same operations).
constexpr float kGeluTwoBeta = 1.5957691216057308f;  // 2 sqrt(2 / pi)
constexpr float kGeluKappa = 0.044715f;
constexpr float kGeluThreeKappa = 0.134145f;

Tensor gelu_two_u(const Tensor& a) { return (a + (a * a) * a * kGeluKappa) * kGeluTwoBeta; }

Tensor gelu_tanh(const Tensor& a) { return a * at::sigmoid(gelu_two_u(a)); }

// d * gelu'(a): s + a s (1 - s) 2u', s = sigmoid(2u), 1 - s as sigmoid(-2u).
Tensor gelu_tanh_grad(const Tensor& d, const Tensor& a) {
  const Tensor two_u = gelu_two_u(a);
  const Tensor s = at::sigmoid(two_u), one_minus_s = at::sigmoid(two_u.neg());
  const Tensor two_u_prime = ((a * a) * kGeluThreeKappa + 1.0f) * kGeluTwoBeta;
  return d * (s + a * s * one_minus_s * two_u_prime);
}

// d * qgelu'(a), qgelu(a) = a s with s = sigmoid(1.702 a): s + a s (1 - s) 1.702, 1 - s as
// sigmoid(-1.702 a) (no cancellation).
Tensor qgelu_grad(const Tensor& d, const Tensor& a) {
  const Tensor s = at::sigmoid(a * kQgeluAlpha), one_minus_s = at::sigmoid(a * -kQgeluAlpha);
  return d * (s + a * s * one_minus_s * kQgeluAlpha);
}

// The pointwise activation in float32.
Tensor pointwise(const Tensor& a, Activation act) {
  switch (act) {
    case Activation::Gelu: return gelu_tanh(a);
    case Activation::Relu: return at::relu(a);
    case Activation::Silu: return at::silu(a);
    case Activation::Qgelu: return a * at::sigmoid(a * kQgeluAlpha);
    case Activation::Srelu: {
      const Tensor r = at::relu(a);
      return r * r;
    }
    case Activation::Sigmoid: return at::sigmoid(a);
    default: return a;
  }
}

// d * act'(a) in float32, as torch's autograd computes it (relu: d where a > 0 or a is NaN;
// srelu: d * 2a there).
Tensor pointwise_grad(const Tensor& d, const Tensor& a, Activation act) {
  switch (act) {
    case Activation::Gelu: return gelu_tanh_grad(d, a);
    case Activation::Relu: return at::threshold_backward(d, a, 0);
    case Activation::Silu: return at::silu_backward(d, a);
    case Activation::Qgelu: return qgelu_grad(d, a);
    case Activation::Srelu: return at::threshold_backward(d * (a + a), a, 0);
    // d s (1 - s), 1 - s as sigmoid(-a) (no cancellation for large a)
    case Activation::Sigmoid: return d * (at::sigmoid(a) * at::sigmoid(a.neg()));
    default: return d;
  }
}

// out = act(x), or act(x[:, :N]) * x[:, N:] for a gated act; float32.
Tensor activation_f32(const Tensor& x, Activation act) {
  const Tensor xf = x.to(at::kFloat).contiguous();
  if (!is_gated(act)) return pointwise(xf, act);
  const int64_t n = xf.size(1) / 2;
  const Tensor a = xf.narrow(1, 0, n), b = xf.narrow(1, n, n);
  return pointwise(a, base_activation(act)) * b;
}

// d(loss)/dx for d(loss)/d(out) = dy, float32, x's shape. Gated:
//   dx[:, :N] = (dy * b) * act'(a),  dx[:, N:] = dy * act(a).
Tensor activation_grad_f32(const Tensor& dy, const Tensor& x, Activation act) {
  const Tensor xf = x.to(at::kFloat).contiguous(), dyf = dy.to(at::kFloat).contiguous();
  if (!is_gated(act)) return pointwise_grad(dyf, xf, act);
  const int64_t n = xf.size(1) / 2;
  const Tensor a = xf.narrow(1, 0, n), b = xf.narrow(1, n, n);
  const Activation base = base_activation(act);
  return at::cat({pointwise_grad(dyf * b, a, base), dyf * pointwise(a, base)}, 1);
}

// Column sums over the M rows, accumulated in float32, returned in dtype.
Tensor column_sums(const Tensor& value, at::ScalarType dtype) {
  return value.to(at::kFloat).contiguous().sum({0}).to(dtype);
}

Tensor activation_fwd_cpu(const Tensor& x, c10::string_view activation) {
  const Activation act = parse_activation(activation);
  check_activation_input(x, act, "activation_fwd");
  return activation_f32(x, act).to(x.scalar_type());
}

std::tuple<Tensor, Tensor> activation_fwd_fp8_cpu(const Tensor& x, c10::string_view activation,
                                                  const Tensor& scale, at::ScalarType fp8_dtype,
                                                  const c10::optional<Tensor>& amax,
                                                  bool with_transpose, int64_t row_multiple) {
  const Activation act = parse_activation(activation);
  check_activation_input(x, act, "activation_fwd_fp8");
  check_fp8_output_args(x, scale, fp8_dtype, amax, row_multiple);
  // The FP8 bytes come from the float32 result, not from it rounded to x's dtype.
  return emit_fp8_rows(activation_f32(x, act), scale, fp8_dtype, amax, with_transpose,
                       row_multiple);
}

Tensor activation_bwd_cpu(const Tensor& dy, const Tensor& x, c10::string_view activation) {
  const Activation act = parse_activation(activation);
  const int64_t out_cols = check_activation_input(x, act, "activation_bwd");
  check_activation_grad(dy, x, out_cols);
  return activation_grad_f32(dy, x, act).to(x.scalar_type());
}

std::tuple<Tensor, Tensor, Tensor> activation_bwd_fp8_cpu(
    const Tensor& dy, const Tensor& x, c10::string_view activation, const Tensor& scale,
    at::ScalarType fp8_dtype, const c10::optional<Tensor>& amax, bool with_transpose,
    bool with_dbias, int64_t row_multiple) {
  const Activation act = parse_activation(activation);
  const int64_t out_cols = check_activation_input(x, act, "activation_bwd_fp8");
  check_activation_grad(dy, x, out_cols);
  check_fp8_output_args(x, scale, fp8_dtype, amax, row_multiple, &dy, "dy");
  const Tensor dx = activation_grad_f32(dy, x, act);
  auto [dx_fp8, dx_t_fp8] =
      emit_fp8_rows(dx, scale, fp8_dtype, amax, with_transpose, row_multiple);
  Tensor dbias = with_dbias ? column_sums(dx, x.scalar_type()) : at::empty({0}, x.options());
  return {dx_fp8, dx_t_fp8, dbias};
}

std::tuple<Tensor, Tensor, Tensor> cast_transpose_dbias_cpu(const Tensor& x, const Tensor& scale,
                                                            at::ScalarType fp8_dtype,
                                                            const c10::optional<Tensor>& amax,
                                                            int64_t row_multiple) {
  check_2d_input(x, "x", "cast_transpose_dbias");
  check_fp8_output_args(x, scale, fp8_dtype, amax, row_multiple);
  auto [x_fp8, x_t_fp8] = emit_fp8_rows(x, scale, fp8_dtype, amax, /*with_transpose=*/true,
                                        row_multiple);
  return {x_fp8, x_t_fp8, column_sums(x, x.scalar_type())};
}

}  // namespace

TORCH_LIBRARY_IMPL(transformer_fp8, CPU, m) {
  m.impl("activation_fwd", &activation_fwd_cpu);
  m.impl("activation_fwd_fp8", &activation_fwd_fp8_cpu);
  m.impl("activation_bwd", &activation_bwd_cpu);
  m.impl("activation_bwd_fp8", &activation_bwd_fp8_cpu);
  m.impl("cast_transpose_dbias", &cast_transpose_dbias_cpu);
}

}  // namespace transformer_fp8
