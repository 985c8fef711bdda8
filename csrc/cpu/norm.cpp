// CPU kernels of layernorm_fwd(_fp8), layernorm_bwd, rmsnorm_fwd(_fp8) and rmsnorm_bwd.
// The float32 math is a fixed composition of ATen ops, the one that transformer_fp8/reference.py
// writes in torch, so that the CPU results (and the FP8 bytes) are bit-identical to it; the CUDA
// kernels (csrc/cuda/kernels/norm.cu) compute the same formulas with their own rounding.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <tuple>

#include "../checks/fused_checks.h"
#include "fp8_cast_cpu.h"

namespace transformer_fp8 {
namespace {

using Tensor = at::Tensor;

// gamma in float32: weight, or weight + 1 for a zero-centred weight.
Tensor gamma_f32(const Tensor& weight, bool zero_centered_gamma) {
  Tensor gamma = weight.to(at::kFloat);
  return zero_centered_gamma ? gamma + 1.0 : gamma;
}

// LayerNorm in float32: mean and biased variance per row, rstd = 1 / sqrt(var + eps),
// y = ((x - mean) * rstd) * gamma (+ bias).
std::tuple<Tensor, Tensor, Tensor> layernorm_f32(const Tensor& x, const Tensor& weight,
                                                 const c10::optional<Tensor>& bias, double eps,
                                                 bool zero_centered_gamma) {
  const Tensor xf = x.to(at::kFloat).contiguous();
  if (xf.size(0) == 0) {  // no rows: var_mean would warn about a reduction over nothing
    const Tensor stat = at::empty({0}, xf.options());
    return {xf.clone(), stat, stat.clone()};
  }
  auto [var, mean] = at::var_mean(xf, {1}, /*correction=*/0, /*keepdim=*/false);
  const Tensor rstd = at::rsqrt(var + eps);
  Tensor y = (xf - mean.unsqueeze(1)) * rstd.unsqueeze(1) * gamma_f32(weight, zero_centered_gamma);
  if (bias.has_value()) y = y + bias->to(at::kFloat);
  return {y, mean, rstd};
}

// RMSNorm in float32: rstd = 1 / sqrt(mean(x^2) + eps), y = (x * rstd) * gamma.
std::tuple<Tensor, Tensor> rmsnorm_f32(const Tensor& x, const Tensor& weight, double eps,
                                       bool zero_centered_gamma) {
  const Tensor xf = x.to(at::kFloat).contiguous();
  const Tensor rstd = at::rsqrt((xf * xf).mean({1}) + eps);
  Tensor y = xf * rstd.unsqueeze(1) * gamma_f32(weight, zero_centered_gamma);
  return {y, rstd};
}

std::tuple<Tensor, Tensor, Tensor> layernorm_fwd_cpu(const Tensor& x, const Tensor& weight,
                                                     const c10::optional<Tensor>& bias,
                                                     double eps, bool zero_centered_gamma) {
  check_norm_fwd_args(x, weight, bias, eps, "layernorm_fwd");
  auto [y, mean, rstd] = layernorm_f32(x, weight, bias, eps, zero_centered_gamma);
  return {y.to(x.scalar_type()), mean, rstd};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> layernorm_fwd_fp8_cpu(
    const Tensor& x, const Tensor& weight, const c10::optional<Tensor>& bias, double eps,
    bool zero_centered_gamma, const Tensor& scale, at::ScalarType fp8_dtype,
    const c10::optional<Tensor>& amax, bool with_transpose, bool return_hp,
    int64_t row_multiple) {
  check_norm_fwd_args(x, weight, bias, eps, "layernorm_fwd_fp8");
  check_fp8_output_args(x, scale, fp8_dtype, amax, row_multiple, &weight, "weight",
                        bias.has_value() ? &*bias : nullptr, "bias");
  auto [y, mean, rstd] = layernorm_f32(x, weight, bias, eps, zero_centered_gamma);
  // The FP8 bytes come from the float32 y, not from y rounded to x's dtype.
  auto [y_fp8, y_t_fp8] = emit_fp8_rows(y, scale, fp8_dtype, amax, with_transpose, row_multiple);
  Tensor y_hp = return_hp ? y.to(x.scalar_type()) : at::empty({0}, x.options());
  return {y_fp8, y_t_fp8, y_hp, mean, rstd};
}

std::tuple<Tensor, Tensor> rmsnorm_fwd_cpu(const Tensor& x, const Tensor& weight, double eps,
                                           bool zero_centered_gamma) {
  check_norm_fwd_args(x, weight, c10::nullopt, eps, "rmsnorm_fwd");
  auto [y, rstd] = rmsnorm_f32(x, weight, eps, zero_centered_gamma);
  return {y.to(x.scalar_type()), rstd};
}

std::tuple<Tensor, Tensor, Tensor, Tensor> rmsnorm_fwd_fp8_cpu(
    const Tensor& x, const Tensor& weight, double eps, bool zero_centered_gamma,
    const Tensor& scale, at::ScalarType fp8_dtype, const c10::optional<Tensor>& amax,
    bool with_transpose, bool return_hp, int64_t row_multiple) {
  check_norm_fwd_args(x, weight, c10::nullopt, eps, "rmsnorm_fwd_fp8");
  check_fp8_output_args(x, scale, fp8_dtype, amax, row_multiple, &weight, "weight");
  auto [y, rstd] = rmsnorm_f32(x, weight, eps, zero_centered_gamma);
  auto [y_fp8, y_t_fp8] = emit_fp8_rows(y, scale, fp8_dtype, amax, with_transpose, row_multiple);
  Tensor y_hp = return_hp ? y.to(x.scalar_type()) : at::empty({0}, x.options());
  return {y_fp8, y_t_fp8, y_hp, rstd};
}

// Backward of y = xhat * gamma (+ bias), xhat = (x - mean) * rstd, in float32, g = dy * gamma:
//   dx = (g - (xhat * mean(g * xhat) + mean(g))) * rstd      (per row)
//   dweight = sum over rows of dy * xhat, dbias = sum over rows of dy.
std::tuple<Tensor, Tensor, Tensor> layernorm_bwd_cpu(const Tensor& dy, const Tensor& x,
                                                     const Tensor& mean, const Tensor& rstd,
                                                     const Tensor& weight,
                                                     bool zero_centered_gamma) {
  check_norm_bwd_args(dy, x, &mean, rstd, weight, "layernorm_bwd");
  const Tensor xhat = (x.to(at::kFloat).contiguous() - mean.unsqueeze(1)) * rstd.unsqueeze(1);
  const Tensor dyf = dy.to(at::kFloat).contiguous();
  const Tensor g = dyf * gamma_f32(weight, zero_centered_gamma);
  const Tensor c1 = (g * xhat).mean({1}, /*keepdim=*/true);
  const Tensor c2 = g.mean({1}, /*keepdim=*/true);
  const Tensor dx = (g - (xhat * c1 + c2)) * rstd.unsqueeze(1);
  const Tensor dweight = (dyf * xhat).sum({0});
  const Tensor dbias = dyf.sum({0});
  return {dx.to(x.scalar_type()), dweight.to(weight.scalar_type()),
          dbias.to(weight.scalar_type())};
}

// The same without the mean: xhat = x * rstd, dx = (g - xhat * mean(g * xhat)) * rstd.
std::tuple<Tensor, Tensor> rmsnorm_bwd_cpu(const Tensor& dy, const Tensor& x, const Tensor& rstd,
                                           const Tensor& weight, bool zero_centered_gamma) {
  check_norm_bwd_args(dy, x, nullptr, rstd, weight, "rmsnorm_bwd");
  const Tensor xhat = x.to(at::kFloat).contiguous() * rstd.unsqueeze(1);
  const Tensor dyf = dy.to(at::kFloat).contiguous();
  const Tensor g = dyf * gamma_f32(weight, zero_centered_gamma);
  const Tensor c1 = (g * xhat).mean({1}, /*keepdim=*/true);
  const Tensor dx = (g - xhat * c1) * rstd.unsqueeze(1);
  const Tensor dweight = (dyf * xhat).sum({0});
  return {dx.to(x.scalar_type()), dweight.to(weight.scalar_type())};
}

}  // namespace

TORCH_LIBRARY_IMPL(transformer_fp8, CPU, m) {
  m.impl("layernorm_fwd", &layernorm_fwd_cpu);
  m.impl("layernorm_fwd_fp8", &layernorm_fwd_fp8_cpu);
  m.impl("layernorm_bwd", &layernorm_bwd_cpu);
  m.impl("rmsnorm_fwd", &rmsnorm_fwd_cpu);
  m.impl("rmsnorm_fwd_fp8", &rmsnorm_fwd_fp8_cpu);
  m.impl("rmsnorm_bwd", &rmsnorm_bwd_cpu);
}

}  // namespace transformer_fp8
