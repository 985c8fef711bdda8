// CUDA fp8_gemm_blockwise through cuBLASLt (12.9+, Hopper): block-scaled FP8 operands.
// Reference: csrc/cpu/blockwise.cpp; scale layouts: csrc/blockwise_common.h.
//
// The TN mapping of cublaslt_shared.h: cuBLASLt computes out^T [N, M] = b . a^T, its "A" is our
// b [N, K] (K x N column-major, ld K, transposed) and its "B" our a [M, K] (K x M, ld K). Both are
// scaled along K, their contraction dimension:
//   1x128   -> CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F: one float per 128 K-elements of each
//              row of op(A) / column of op(B); [rows, ceil(K/128)] with the rows contiguous
//              (ld = round_up(rows, 4)).
//   128x128 -> CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F: one float per 128 x 128 block;
//              [ceil(rows/128), ceil(K/128)] with the K blocks contiguous (ld = round_up(., 4)).
//   row-wise-> CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F: a vector of N floats for A and of M
//              for B; element (i, j) of the product is multiplied by A's i-th and B's j-th.
// The scales are dequantisation factors (scale_inv), read from device memory. Accumulation is
// split (CUBLASLT_MATMUL_DESC_FAST_ACCUM = 0): block scaling is defined only with it.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <cublasLt.h>
#include <torch/library.h>

#include <memory>
#include <string>
#include <tuple>

#include "../../checks/blockwise_checks.h"
#include "../cuda_checks.h"
#include "cublaslt_shared.h"

namespace transformer_fp8 {
namespace {

#if CUBLAS_VERSION >= 120900
#define TFP8_HAS_BLOCK_SCALED_GEMM 1

cublasLtMatmulMatrixScale_t cublas_scale_mode(BlockMode mode) {
  switch (mode) {
    case BlockMode::Vec128: return CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
    case BlockMode::Blk128: return CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
    default: return CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F;
  }
}

// Shapes, types, modes, epilogue and the alignment of every buffer: what the choice of
// algorithm depends on (the scale and bias pointers too: they are set at the query).
using PlanKey = std::tuple<int, int64_t, int64_t, int64_t, int, int, int, int, int, bool,
                           uint32_t, uint32_t, uint32_t, uint32_t, uint32_t, uint32_t>;

// Per thread, so that a call takes no lock and may set pointers on a cached descriptor.
CublasLtPlanCache<PlanKey>& thread_plans() {
  thread_local CublasLtPlanCache<PlanKey> plans;
  return plans;
}

std::string describe_problem(const at::Tensor& a, const at::Tensor& b, BlockwiseGemmModes m) {
  return c10::str("for fp8_gemm_blockwise with a [", a.size(0), ", ", a.size(1), "] ",
                  a.scalar_type(), " (", block_mode_name(m.a), " scales) and b [", b.size(0),
                  ", ", b.size(1), "] ", b.scalar_type(), " (", block_mode_name(m.b), " scales)");
}

void check_status(cublasStatus_t status, const char* what, const at::Tensor& a,
                  const at::Tensor& b, BlockwiseGemmModes modes) {
  check_cublaslt(status, what, [&] { return describe_problem(a, b, modes); });
}

// Descriptors and heuristic choice of a new problem. The scale and bias pointers are set before
// the algorithm query: for the block scale modes (VEC128, BLK128x128, OUTER_VEC) cuBLASLt checks
// the scale pointers at the query and finds no algorithm without them. A cached plan gets the
// pointers of each call set again before it runs.
std::unique_ptr<CublasLtPlan> make_plan(cublasLtHandle_t handle, const at::Tensor& a,
                                        const at::Tensor& b, BlockwiseGemmModes modes,
                                        at::ScalarType out_dtype, bool bias_in_epilogue,
                                        const GemmPointers& pointers,
                                        const GemmAlignments& align) {
  auto plan = std::make_unique<CublasLtPlan>();
  auto check = [&](cublasStatus_t status, const char* what) {
    check_status(status, what, a, b, modes);
  };
  create_tn_matmul_desc(*plan, /*fast_accum=*/false, check);
  // cuBLASLt's A is our b, its B our a.
  set_matmul_attribute(plan->op, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, "A_SCALE_MODE",
                       static_cast<int32_t>(cublas_scale_mode(modes.b)), check);
  set_matmul_attribute(plan->op, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, "B_SCALE_MODE",
                       static_cast<int32_t>(cublas_scale_mode(modes.a)), check);
  if (bias_in_epilogue) set_bias_epilogue(plan->op, out_dtype, check);
  set_gemm_pointers(plan->op, pointers, bias_in_epilogue, check);
  create_tn_layouts(*plan, a, b, out_dtype, check);
  const CublasLtPreference pref = create_preference(align, check);
  const HeuristicAnswer answer = query_algorithm(handle, *plan, pref);
  if (bias_in_epilogue && answer.unsupported()) {
    // Block-scaled kernels may come without a bias epilogue: plan the bare product instead
    // and let the caller add the bias afterwards. (Any other failure is an error; so is this
    // one when the bare product is refused too.)
    return make_plan(handle, a, b, modes, out_dtype, /*bias_in_epilogue=*/false, pointers,
                     align);
  }
  TORCH_CHECK(answer.status == CUBLAS_STATUS_SUCCESS && answer.found,
              "transformer_fp8: cuBLASLt has no block-scaled FP8 algorithm ",
              describe_problem(a, b, modes), " and out_dtype ", out_dtype, " (status ",
              cublaslt_status_string(answer.status), "; block-scaled FP8 GEMMs run on Hopper, "
              "sm_90, with cuBLASLt 12.9 or newer)");
  plan->bias_in_epilogue = bias_in_epilogue;
  return plan;
}

// The scale tensor of an operand in the layout cuBLASLt reads (blockwise_common.h), 16-byte
// aligned: the tensor itself when it already is, else a copy (scales are small).
at::Tensor scales_for_cublas(const at::Tensor& operand, const at::Tensor& scale_inv,
                             BlockMode mode) {
  const BlockGeometry g = block_geometry(mode, operand.size(0), operand.size(1));
  const bool rows_contiguous = g.scale_cols == 1 || scale_inv.stride(1) == g.stride1;
  const bool laid_out = mode == BlockMode::Blk128
                            ? (scale_inv.stride(1) == 1 || g.scale_cols == 1) &&
                                  (scale_inv.stride(0) == g.stride0 || g.scale_rows == 1)
                            : (scale_inv.stride(0) == 1 || g.scale_rows == 1) && rows_contiguous;
  if (laid_out && cublaslt_alignment_of(scale_inv.data_ptr()) >= 16) return scale_inv;
  at::Tensor copy = new_scale_tensor(g, scale_inv.options());
  copy.copy_(scale_inv);
  return copy;
}

#endif  // CUBLAS_VERSION >= 120900

at::Tensor fp8_gemm_blockwise_cuda(const at::Tensor& a_in, const at::Tensor& a_scale_inv,
                                   const at::Tensor& b_in, const at::Tensor& b_scale_inv,
                                   at::ScalarType out_dtype,
                                   const c10::optional<at::Tensor>& bias) {
  const BlockwiseGemmModes modes =
      check_gemm_blockwise_args(a_in, a_scale_inv, b_in, b_scale_inv, out_dtype, bias);
  check_cuda_tensor(a_in, "a");
#ifndef TFP8_HAS_BLOCK_SCALED_GEMM
  TORCH_CHECK(false, "transformer_fp8: fp8_gemm_blockwise on CUDA needs cuBLASLt 12.9 or newer "
              "at build time; this build has cuBLAS ", CUBLAS_VERSION);
  return at::Tensor();
#else
  TORCH_CHECK(cublasLtGetVersion() >= 120900, "transformer_fp8: fp8_gemm_blockwise on CUDA needs "
              "cuBLASLt 12.9 or newer at run time, got ", cublasLtGetVersion());
  const int64_t M = a_in.size(0), K = a_in.size(1), N = b_in.size(0);
  TORCH_CHECK(M % 16 == 0 && N % 16 == 0 && K % 16 == 0, "transformer_fp8: fp8_gemm_blockwise "
              "on CUDA needs M, N and K to be multiples of 16 (cuBLASLt FP8 alignment), got a: ",
              describe(a_in), ", b: ", describe(b_in));
  const c10::cuda::CUDAGuard guard(a_in.device());
  at::Tensor out = at::empty({M, N}, a_in.options().dtype(out_dtype));
  if (fill_trivial_product(out, K, bias)) return out;
  const CublasLtCall call = prepare_cublaslt_call(a_in, b_in, bias);
  const at::Tensor &a = call.a, &b = call.b;
  const at::Tensor a_si = scales_for_cublas(a, a_scale_inv, modes.a);
  const at::Tensor b_si = scales_for_cublas(b, b_scale_inv, modes.b);

  // The bias epilogue takes a bias of the output type for bf16 / fp16 outputs; for float32
  // outputs, or when cuBLASLt has no block-scaled kernel with that epilogue (the plan says),
  // the bias is added after the product.
  const bool try_bias_epilogue = bias.has_value() && out_dtype != at::kFloat;
  const GemmPointers pointers{a_si.data_ptr(), b_si.data_ptr(),
                              call.bias.has_value() ? call.bias->data_ptr() : nullptr};
  const GemmAlignments align = gemm_alignments(a, b, out);
  // cuBLASLt's A is our b, its B is our a (cublaslt_shared.h).
  const PlanKey key{call.device, M, N, K, static_cast<int>(a.scalar_type()),
                    static_cast<int>(b.scalar_type()), static_cast<int>(out_dtype),
                    static_cast<int>(modes.a), static_cast<int>(modes.b), try_bias_epilogue,
                    align.b, align.a, align.out, cublaslt_alignment_of(pointers.a_scale),
                    cublaslt_alignment_of(pointers.b_scale),
                    pointers.bias ? cublaslt_alignment_of(pointers.bias) : 0u};
  const CublasLtPlan& plan = find_or_make_plan(thread_plans(), key, [&] {
    return make_plan(call.handle, a, b, modes, out_dtype, try_bias_epilogue, pointers, align);
  });
  auto check = [&](cublasStatus_t status, const char* what) {
    check_status(status, what, a, b, modes);
  };
  // The plan says whether the bias is in its epilogue or added after the product.
  run_plan(call, plan, pointers, out, check);
  return out;
#endif
}

}  // namespace

TORCH_LIBRARY_IMPL(transformer_fp8, CUDA, m) {
  m.impl("fp8_gemm_blockwise", &fp8_gemm_blockwise_cuda);
}

}  // namespace transformer_fp8
