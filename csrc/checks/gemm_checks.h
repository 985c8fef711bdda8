// Argument checks of fp8_gemm, shared by the CPU and CUDA kernels; its operand, output dtype
// and bias checks also serve fp8_gemm_blockwise (blockwise_checks.h).
#pragma once

#include "checks.h"

namespace transformer_fp8 {

// The operands of a GEMM op ("fp8_gemm", "fp8_gemm_blockwise"): a [M, K] and b [N, K], both FP8
// and row-major (K contiguous), on one device: out = a @ b^T is the "TN" product, the only FP8
// layout Hopper's tensor cores take.
inline void check_gemm_operands(const at::Tensor& a, const at::Tensor& b, const char* op) {
  check_fp8_tensor(a, "a");
  check_fp8_tensor(b, "b");
  TORCH_CHECK(a.dim() == 2 && b.dim() == 2, "transformer_fp8: ", op, " needs 2-D 'a' [M, K] and "
              "'b' [N, K], got a: ", describe(a), ", b: ", describe(b));
  TORCH_CHECK(a.size(1) == b.size(1), "transformer_fp8: ", op, " computes a @ b.T, so 'a' [M, K] "
              "and 'b' [N, K] must share K; got a: ", describe(a), ", b: ", describe(b));
  TORCH_CHECK(!(a.scalar_type() == at::kFloat8_e5m2 && b.scalar_type() == at::kFloat8_e5m2),
              "transformer_fp8: ", op, " does not take two float8_e5m2 operands (no tensor-core "
              "support); use float8_e4m3fn for at least one of 'a' and 'b'");
  check_same_device(b, "b", a, "a");
}

// The output dtype of a GEMM op and its optional bias [N] of that dtype, on a's device.
inline void check_gemm_out_dtype_and_bias(at::ScalarType out_dtype,
                                          const c10::optional<at::Tensor>& bias,
                                          const at::Tensor& a, const at::Tensor& b) {
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

// fp8_gemm: the operands, one float32 scale_inv each, the output dtype and the bias.
inline void check_gemm_args(const at::Tensor& a, const at::Tensor& a_scale_inv,
                            const at::Tensor& b, const at::Tensor& b_scale_inv,
                            at::ScalarType out_dtype, const c10::optional<at::Tensor>& bias) {
  check_gemm_operands(a, b, "fp8_gemm");
  check_scalar_f32(a_scale_inv, "a_scale_inv", a, "a");
  check_scalar_f32(b_scale_inv, "b_scale_inv", a, "a");
  check_gemm_out_dtype_and_bias(out_dtype, bias, a, b);
}

}  // namespace transformer_fp8
