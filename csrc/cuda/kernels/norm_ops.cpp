// CUDA operators layernorm_fwd(_fp8), layernorm_bwd, rmsnorm_fwd(_fp8) and rmsnorm_bwd:
// argument checks, allocation, device guard and stream; the kernels are in norm.cu.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <tuple>

#include "fused_ops_common.h"

namespace transformer_fp8 {
namespace {

using Tensor = at::Tensor;

void check_norm_fwd_cuda_args(const Tensor& x, const Tensor& weight,
                              const c10::optional<Tensor>& bias, double eps, const char* op) {
  check_norm_fwd_args(x, weight, bias, eps, op);
  check_cuda_input(x, "x", op);
}

// weight / bias as contiguous float32 (the kernels read gamma in float32; no copy when they
// already are).
Tensor as_f32(const Tensor& t) { return t.to(at::kFloat).contiguous(); }

struct NormFwdResult {
  Fp8Rows fp8;
  Tensor y_hp, mean, rstd;
};

// The forward of both norms (rms: no mean, no bias). fp8_dtype == nullopt: y in x's dtype only.
NormFwdResult norm_fwd(const Tensor& x, const Tensor& weight, const c10::optional<Tensor>& bias,
                       double eps, bool zero_centered_gamma, bool rms, const Tensor* scale,
                       c10::optional<at::ScalarType> fp8_dtype,
                       const c10::optional<Tensor>& amax, bool with_transpose, bool return_hp,
                       int64_t row_multiple, const char* op) {
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const Tensor xc = x.contiguous();
  const int64_t rows = x.size(0), cols = x.size(1);
  const Tensor w = as_f32(weight);
  const c10::optional<Tensor> b = bias.has_value() ? c10::optional<Tensor>(as_f32(*bias))
                                                   : c10::nullopt;
  NormFwdResult r;
  r.mean = rms ? Tensor() : at::empty({rows}, x.options().dtype(at::kFloat));
  r.rstd = at::empty({rows}, x.options().dtype(at::kFloat));
  r.y_hp = return_hp ? at::empty({rows, cols}, x.options()) : at::empty({0}, x.options());
  cuda::FusedOutput out;
  if (fp8_dtype.has_value()) {
    const Fp8Format fmt = check_fp8_output_args(x, *scale, *fp8_dtype, amax, row_multiple,
                                                &weight, "weight",
                                                bias.has_value() ? &*bias : nullptr, "bias");
    r.fp8 = alloc_fp8_rows(x, rows, cols, *fp8_dtype, with_transpose, row_multiple, stream);
    out = fp8_output(r.fp8, fmt, *scale, amax);
  }
  if (return_hp) out.hp = r.y_hp.data_ptr();
  const auto status = cuda::launch_norm_fwd(
      xc.data_ptr(), hp_type_of(xc.scalar_type()), rows, cols, w.data_ptr<float>(),
      b.has_value() ? b->data_ptr<float>() : nullptr, zero_centered_gamma,
      static_cast<float>(eps), rms ? nullptr : r.mean.data_ptr<float>(),
      r.rstd.data_ptr<float>(), out, stream);
  TFP8_CHECK_LAUNCH(status, op);
  if (fp8_dtype.has_value()) write_transpose(r.fp8, with_transpose, stream, op);
  return r;
}

std::tuple<Tensor, Tensor, Tensor> layernorm_fwd_cuda(const Tensor& x, const Tensor& weight,
                                                      const c10::optional<Tensor>& bias,
                                                      double eps, bool zero_centered_gamma) {
  check_norm_fwd_cuda_args(x, weight, bias, eps, "layernorm_fwd");
  NormFwdResult r = norm_fwd(x, weight, bias, eps, zero_centered_gamma, false, nullptr,
                             c10::nullopt, c10::nullopt, false, true, 1, "layernorm_fwd");
  return {r.y_hp, r.mean, r.rstd};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> layernorm_fwd_fp8_cuda(
    const Tensor& x, const Tensor& weight, const c10::optional<Tensor>& bias, double eps,
    bool zero_centered_gamma, const Tensor& scale, at::ScalarType fp8_dtype,
    const c10::optional<Tensor>& amax, bool with_transpose, bool return_hp,
    int64_t row_multiple) {
  check_norm_fwd_cuda_args(x, weight, bias, eps, "layernorm_fwd_fp8");
  NormFwdResult r = norm_fwd(x, weight, bias, eps, zero_centered_gamma, false, &scale, fp8_dtype,
                             amax, with_transpose, return_hp, row_multiple, "layernorm_fwd_fp8");
  return {r.fp8.out, r.fp8.out_t, r.y_hp, r.mean, r.rstd};
}

std::tuple<Tensor, Tensor> rmsnorm_fwd_cuda(const Tensor& x, const Tensor& weight, double eps,
                                            bool zero_centered_gamma) {
  check_norm_fwd_cuda_args(x, weight, c10::nullopt, eps, "rmsnorm_fwd");
  NormFwdResult r = norm_fwd(x, weight, c10::nullopt, eps, zero_centered_gamma, true, nullptr,
                             c10::nullopt, c10::nullopt, false, true, 1, "rmsnorm_fwd");
  return {r.y_hp, r.rstd};
}

std::tuple<Tensor, Tensor, Tensor, Tensor> rmsnorm_fwd_fp8_cuda(
    const Tensor& x, const Tensor& weight, double eps, bool zero_centered_gamma,
    const Tensor& scale, at::ScalarType fp8_dtype, const c10::optional<Tensor>& amax,
    bool with_transpose, bool return_hp, int64_t row_multiple) {
  check_norm_fwd_cuda_args(x, weight, c10::nullopt, eps, "rmsnorm_fwd_fp8");
  NormFwdResult r = norm_fwd(x, weight, c10::nullopt, eps, zero_centered_gamma, true, &scale,
                             fp8_dtype, amax, with_transpose, return_hp, row_multiple,
                             "rmsnorm_fwd_fp8");
  return {r.fp8.out, r.fp8.out_t, r.y_hp, r.rstd};
}

// Both backwards: dx, dweight and (LayerNorm: mean given) dbias.
std::tuple<Tensor, Tensor, Tensor> norm_bwd(const Tensor& dy, const Tensor& x,
                                            const Tensor* mean, const Tensor& rstd,
                                            const Tensor& weight, bool zero_centered_gamma,
                                            const char* op) {
  check_norm_bwd_args(dy, x, mean, rstd, weight, op);
  check_cuda_input(x, "x", op);
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const Tensor xc = x.contiguous(), dyc = dy.contiguous(), w = as_f32(weight);
  const Tensor mean_c = mean != nullptr ? mean->contiguous() : Tensor();
  const Tensor rstd_c = rstd.contiguous();
  const int64_t rows = x.size(0), cols = x.size(1);
  Tensor dx = at::empty({rows, cols}, x.options());
  Tensor partial_dweight = column_partials(x, rows, cols);
  Tensor partial_dbias = mean != nullptr ? column_partials(x, rows, cols) : Tensor();
  const auto status = cuda::launch_norm_bwd(
      dyc.data_ptr(), xc.data_ptr(), hp_type_of(xc.scalar_type()), rows, cols,
      mean != nullptr ? mean_c.data_ptr<float>() : nullptr, rstd_c.data_ptr<float>(),
      w.data_ptr<float>(), zero_centered_gamma, dx.data_ptr(), partial_dweight.data_ptr<float>(),
      mean != nullptr ? partial_dbias.data_ptr<float>() : nullptr, stream);
  TFP8_CHECK_LAUNCH(status, op);
  Tensor dweight = finish_column_sums(partial_dweight, weight.scalar_type(), stream, op);
  Tensor dbias = mean != nullptr
                     ? finish_column_sums(partial_dbias, weight.scalar_type(), stream, op)
                     : Tensor();
  return {dx, dweight, dbias};
}

std::tuple<Tensor, Tensor, Tensor> layernorm_bwd_cuda(const Tensor& dy, const Tensor& x,
                                                      const Tensor& mean, const Tensor& rstd,
                                                      const Tensor& weight,
                                                      bool zero_centered_gamma) {
  return norm_bwd(dy, x, &mean, rstd, weight, zero_centered_gamma, "layernorm_bwd");
}

std::tuple<Tensor, Tensor> rmsnorm_bwd_cuda(const Tensor& dy, const Tensor& x, const Tensor& rstd,
                                            const Tensor& weight, bool zero_centered_gamma) {
  auto [dx, dweight, unused] = norm_bwd(dy, x, nullptr, rstd, weight, zero_centered_gamma,
                                        "rmsnorm_bwd");
  return {dx, dweight};
}

}  // namespace

TORCH_LIBRARY_IMPL(transformer_fp8, CUDA, m) {
  m.impl("layernorm_fwd", &layernorm_fwd_cuda);
  m.impl("layernorm_fwd_fp8", &layernorm_fwd_fp8_cuda);
  m.impl("layernorm_bwd", &layernorm_bwd_cuda);
  m.impl("rmsnorm_fwd", &rmsnorm_fwd_cuda);
  m.impl("rmsnorm_fwd_fp8", &rmsnorm_fwd_fp8_cuda);
  m.impl("rmsnorm_bwd", &rmsnorm_bwd_cuda);
}

}  // namespace transformer_fp8
