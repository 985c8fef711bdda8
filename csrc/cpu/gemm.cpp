// CPU fp8_gemm: the reference of the cuBLASLt kernel. Multiply the FP8 values in float32, scale
// by the product of the scale_invs, add the bias, round once to the output dtype.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "../checks/gemm_checks.h"

namespace transformer_fp8 {
namespace {

at::Tensor fp8_gemm_cpu(const at::Tensor& a, const at::Tensor& a_scale_inv, const at::Tensor& b,
                        const at::Tensor& b_scale_inv, at::ScalarType out_dtype,
                        const c10::optional<at::Tensor>& bias, bool use_fast_accum) {
  (void)use_fast_accum;  // CPU always accumulates in float32
  check_gemm_args(a, a_scale_inv, b, b_scale_inv, out_dtype, bias);
  // Float32 math whatever the caller's torch.autocast (which at::matmul would otherwise obey
  // here: the custom operator has no autocast kernel, so the mode reaches its kernel).
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  // The product of the FP8 values first, then the product of the two scales, as cuBLASLt
  // applies them: dequantising each operand first would overflow (or underflow) where the
  // product is finite (a_scale_inv = 1e36 with b_scale_inv = 1e-36).
  const at::Tensor scale = a_scale_inv.reshape({}) * b_scale_inv.reshape({});
  at::Tensor out = at::matmul(a.to(at::kFloat), b.to(at::kFloat).t()).mul_(scale);
  if (bias.has_value()) out.add_(bias->to(at::kFloat));
  return out.to(out_dtype);
}

}  // namespace

TORCH_LIBRARY_IMPL(transformer_fp8, CPU, m) { m.impl("fp8_gemm", &fp8_gemm_cpu); }

}  // namespace transformer_fp8
