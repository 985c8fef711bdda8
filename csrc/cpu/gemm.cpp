// CPU fp8_gemm: the reference of the cuBLASLt kernel. Dequantise both operands to float32,
// multiply, add the bias, round once to the output dtype.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "../gemm_checks.h"

namespace transformer_fp8 {
namespace {

at::Tensor fp8_gemm_cpu(const at::Tensor& a, const at::Tensor& a_scale_inv, const at::Tensor& b,
                        const at::Tensor& b_scale_inv, at::ScalarType out_dtype,
                        const c10::optional<at::Tensor>& bias, bool use_fast_accum) {
  (void)use_fast_accum;  // CPU always accumulates in float32
  check_gemm_args(a, a_scale_inv, b, b_scale_inv, out_dtype, bias);
  const at::Tensor a_hp = a.to(at::kFloat) * a_scale_inv.reshape({});
  const at::Tensor b_hp = b.to(at::kFloat) * b_scale_inv.reshape({});
  at::Tensor out = at::matmul(a_hp, b_hp.t());
  if (bias.has_value()) out.add_(bias->to(at::kFloat));
  return out.to(out_dtype);
}

}  // namespace

TORCH_LIBRARY_IMPL(transformer_fp8, CPU, m) { m.impl("fp8_gemm", &fp8_gemm_cpu); }

}  // namespace transformer_fp8
