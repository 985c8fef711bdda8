// Argument checks of fp8_gemm, shared by the CPU and CUDA kernels.
#pragma once

#include "checks.h"

namespace transformer_fp8 {

// a [M, K] and b [N, K], both FP8 and row-major (K contiguous): out = a @ b^T is the "TN"
// product, the only FP8 layout Hopper's tensor cores take.
inline void check_gemm_args(const at::Tensor& a, const at::Tensor& a_scale_inv,
                            const at::Tensor& b, const at::Tensor& b_scale_inv,
                            at::ScalarType out_dtype, const c10::optional<at::Tensor>& bias) {
  check_fp8_tensor(a, "a");
  check_fp8_tensor(b, "b");
  TORCH_CHECK(a.dim() == 2 && b.dim() == 2, "transformer_fp8: fp8_gemm needs 2-D 'a' [M, K] and "
              "'b' [N, K], got a: ", describe(a), ", b: ", describe(b));
  TORCH_CHECK(a.size(1) == b.size(1), "transformer_fp8: fp8_gemm computes a @ b.T, so 'a' [M, K] "
              "and 'b' [N, K] must share K; got a: ", describe(a), ", b: ", describe(b));
  TORCH_CHECK(!(a.scalar_type() == at::kFloat8_e5m2 && b.scalar_type() == at::kFloat8_e5m2),
              "transformer_fp8: fp8_gemm does not take two float8_e5m2 operands (no tensor-core "
              "support); use float8_e4m3fn for at least one of 'a' and 'b'");
  check_same_device(b, "b", a, "a");
  check_scalar_f32(a_scale_inv, "a_scale_inv", a, "a");
  check_scalar_f32(b_scale_inv, "b_scale_inv", a, "a");
  TORCH_CHECK(out_dtype == at::kFloat || out_dtype == at::kBFloat16 || out_dtype == at::kHalf,
              "transformer_fp8: argument 'out_dtype' must be torch.float32, torch.bfloat16 or "
              "torch.float16, got ", c10::toString(out_dtype));
  if (bias.has_value()) {
    const at::Tensor& bv = *bias;
    TORCH_CHECK(bv.dim() == 1 && bv.size(0) == b.size(0) && bv.scalar_type() == out_dtype,
                "transformer_fp8: argument 'bias' must be a 1-D ", c10::toString(out_dtype),
                " tensor of length N = ", b.size(0), " (the out_dtype), got ", describe(bv));
    check_same_device(bv, "bias", a, "a");
  }
}

}  // namespace transformer_fp8
