// CUDA fp8_gemm_blockwise through cuBLASLt (12.9+, Hopper): block-scaled FP8 operands.
// Reference: csrc/cpu/blockwise.cpp; scale layouts: csrc/blockwise_common.h.
//
// Same TN mapping as gemm_cublaslt.cpp: cuBLASLt computes out^T [N, M] = b . a^T, its "A" is our
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
#include <c10/cuda/CUDAStream.h>
#include <cublasLt.h>
#include <functional>
#include <torch/library.h>

#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

#include "../../checks/blockwise_checks.h"
#include "cublaslt_shared.h"
#include "../cuda_checks.h"

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

cudaDataType_t cuda_type_of(at::ScalarType st) {
  switch (st) {
    case at::kFloat8_e4m3fn: return CUDA_R_8F_E4M3;
    case at::kFloat8_e5m2: return CUDA_R_8F_E5M2;
    case at::kBFloat16: return CUDA_R_16BF;
    case at::kHalf: return CUDA_R_16F;
    default: return CUDA_R_32F;
  }
}

// Shapes, types, modes, epilogue and the alignment of every buffer: what the choice of
// algorithm depends on.
using PlanKey = std::tuple<int, int64_t, int64_t, int64_t, int, int, int, int, int, bool,
                           uint32_t, uint32_t, uint32_t>;

struct Plan {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulAlgo_t algo = {};
  bool bias_in_epilogue = false;  // else the bias is added after the product
  Plan() = default;
  Plan(const Plan&) = delete;
  Plan& operator=(const Plan&) = delete;
  ~Plan() {
    if (d) cublasLtMatrixLayoutDestroy(d);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (op) cublasLtMatmulDescDestroy(op);
  }
};

// Per thread, so that a call takes no lock and may set pointers on a cached descriptor.
std::map<PlanKey, std::unique_ptr<Plan>>& thread_plans() {
  thread_local std::map<PlanKey, std::unique_ptr<Plan>> plans;
  return plans;
}

std::string describe_problem(const at::Tensor& a, const at::Tensor& b, BlockwiseGemmModes m) {
  return c10::str("for fp8_gemm_blockwise with a [", a.size(0), ", ", a.size(1), "] ",
                  a.scalar_type(), " (", block_mode_name(m.a), " scales) and b [", b.size(0),
                  ", ", b.size(1), "] ", b.scalar_type(), " (", block_mode_name(m.b), " scales)");
}

// The buffers whose pointers cuBLASLt reads from the descriptor. They are set before the
// algorithm query: for the block scale modes (VEC128, BLK128x128, OUTER_VEC) cuBLASLt checks the
// scale pointers at the query and finds no algorithm without them. A cached plan gets the
// pointers of each call set again before it runs.
struct PlanPointers {
  const void* a_scale;  // our a's scales (cuBLASLt's B)
  const void* b_scale;  // our b's scales (cuBLASLt's A)
  const void* bias;     // nullptr without a bias epilogue
};

void set_pointers(cublasLtMatmulDesc_t op, const PlanPointers& pointers, bool bias_in_epilogue,
                  const std::function<void(cublasStatus_t, const char*)>& check) {
  auto set_pointer = [&](cublasLtMatmulDescAttributes_t attribute, const char* name,
                         const void* pointer) {
    check(cublasLtMatmulDescSetAttribute(op, attribute, &pointer, sizeof(pointer)), name);
  };
  // cuBLASLt's A is our b, its B our a.
  set_pointer(CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, "A_SCALE_POINTER", pointers.b_scale);
  set_pointer(CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, "B_SCALE_POINTER", pointers.a_scale);
  if (bias_in_epilogue) set_pointer(CUBLASLT_MATMUL_DESC_BIAS_POINTER, "BIAS_POINTER", pointers.bias);
}

std::unique_ptr<Plan> make_plan(const PlanKey& key, cublasLtHandle_t handle, const at::Tensor& a,
                                const at::Tensor& b, BlockwiseGemmModes modes,
                                at::ScalarType out_dtype, bool bias_in_epilogue,
                                const PlanPointers& pointers) {
  const int64_t M = a.size(0), K = a.size(1), N = b.size(0);
  auto plan = std::make_unique<Plan>();
  auto check = [&](cublasStatus_t status, const char* what) {
    TORCH_CHECK(status == CUBLAS_STATUS_SUCCESS, "transformer_fp8: ", what, " failed with ",
                cublaslt_status_string(status), " ", describe_problem(a, b, modes));
  };
  auto set_op = [&](cublasLtMatmulDescAttributes_t attribute, const char* name, const auto& value) {
    check(cublasLtMatmulDescSetAttribute(plan->op, attribute, &value, sizeof(value)), name);
  };
  check(cublasLtMatmulDescCreate(&plan->op, CUBLAS_COMPUTE_32F, CUDA_R_32F),
        "cublasLtMatmulDescCreate");
  set_op(CUBLASLT_MATMUL_DESC_TRANSA, "TRANSA", CUBLAS_OP_T);
  set_op(CUBLASLT_MATMUL_DESC_TRANSB, "TRANSB", CUBLAS_OP_N);
  set_op(CUBLASLT_MATMUL_DESC_FAST_ACCUM, "FAST_ACCUM", static_cast<int8_t>(0));
  // cuBLASLt's A is our b, its B our a.
  set_op(CUBLASLT_MATMUL_DESC_A_SCALE_MODE, "A_SCALE_MODE",
         static_cast<int32_t>(cublas_scale_mode(modes.b)));
  set_op(CUBLASLT_MATMUL_DESC_B_SCALE_MODE, "B_SCALE_MODE",
         static_cast<int32_t>(cublas_scale_mode(modes.a)));
  if (bias_in_epilogue) {
    set_op(CUBLASLT_MATMUL_DESC_EPILOGUE, "EPILOGUE", CUBLASLT_EPILOGUE_BIAS);
    set_op(CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, "BIAS_DATA_TYPE",
           static_cast<int32_t>(cuda_type_of(out_dtype)));
  }
  set_pointers(plan->op, pointers, bias_in_epilogue, check);
  check(cublasLtMatrixLayoutCreate(&plan->a, cuda_type_of(b.scalar_type()), K, N, K),
        "layout of b");
  check(cublasLtMatrixLayoutCreate(&plan->b, cuda_type_of(a.scalar_type()), K, M, K),
        "layout of a");
  check(cublasLtMatrixLayoutCreate(&plan->d, cuda_type_of(out_dtype), N, M, N), "layout of out");

  cublasLtMatmulPreference_t pref = nullptr;
  check(cublasLtMatmulPreferenceCreate(&pref), "cublasLtMatmulPreferenceCreate");
  std::unique_ptr<std::remove_pointer_t<cublasLtMatmulPreference_t>,
                  decltype(&cublasLtMatmulPreferenceDestroy)>
      pref_owner(pref, &cublasLtMatmulPreferenceDestroy);
  auto set_pref = [&](cublasLtMatmulPreferenceAttributes_t attribute, const char* name,
                      const auto& value) {
    check(cublasLtMatmulPreferenceSetAttribute(pref, attribute, &value, sizeof(value)), name);
  };
  const size_t workspace_bytes = cublaslt_workspace_bytes();
  set_pref(CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, "MAX_WORKSPACE_BYTES", workspace_bytes);
  set_pref(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, "MIN_ALIGNMENT_A", std::get<10>(key));
  set_pref(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, "MIN_ALIGNMENT_B", std::get<11>(key));
  set_pref(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, "MIN_ALIGNMENT_C", std::get<12>(key));
  set_pref(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, "MIN_ALIGNMENT_D", std::get<12>(key));
  cublasLtMatmulHeuristicResult_t heuristic = {};
  int found = 0;
  const cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(
      handle, plan->op, plan->a, plan->b, plan->d, plan->d, pref, 1, &heuristic, &found);
  const bool unsupported = status == CUBLAS_STATUS_NOT_SUPPORTED ||
                           (status == CUBLAS_STATUS_SUCCESS && found == 0);
  if (bias_in_epilogue && unsupported) {
    // Block-scaled kernels may come without a bias epilogue: plan the bare product instead
    // and let the caller add the bias afterwards. (Any other failure is an error.)
    return make_plan(key, handle, a, b, modes, out_dtype, /*bias_in_epilogue=*/false, pointers);
  }
  TORCH_CHECK(status == CUBLAS_STATUS_SUCCESS && found > 0, "transformer_fp8: cuBLASLt has no "
              "block-scaled FP8 algorithm ", describe_problem(a, b, modes), " and out_dtype ",
              out_dtype, " (status ", cublaslt_status_string(status), "; block-scaled FP8 "
              "GEMMs run on Hopper, sm_90, with cuBLASLt 12.9 or newer)");
  plan->algo = heuristic.algo;
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
  const at::Tensor a = cublaslt_operand(a_in), b = cublaslt_operand(b_in);
  const at::Tensor a_si = scales_for_cublas(a, a_scale_inv, modes.a);
  const at::Tensor b_si = scales_for_cublas(b, b_scale_inv, modes.b);
  const c10::optional<at::Tensor> bias_c =
      bias.has_value() ? c10::optional<at::Tensor>(cublaslt_operand(*bias)) : c10::nullopt;
  const int device = a.get_device();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  cublasLtHandle_t handle = cublaslt_handle(device);
  void* workspace = cublaslt_workspace(device, stream);

  // The bias epilogue takes a bias of the output type for bf16 / fp16 outputs; for float32
  // outputs, or when cuBLASLt has no block-scaled kernel with that epilogue (the plan says),
  // the bias is added after the product.
  const bool try_bias_epilogue = bias.has_value() && out_dtype != at::kFloat;
  const PlanPointers pointers{a_si.data_ptr(), b_si.data_ptr(),
                              bias_c.has_value() ? bias_c->data_ptr() : nullptr};
  const PlanKey key{device, M, N, K, static_cast<int>(a.scalar_type()),
                    static_cast<int>(b.scalar_type()), static_cast<int>(out_dtype),
                    static_cast<int>(modes.a), static_cast<int>(modes.b), try_bias_epilogue,
                    cublaslt_alignment_of(b.data_ptr()), cublaslt_alignment_of(a.data_ptr()),
                    cublaslt_alignment_of(out.data_ptr())};
  auto& plans = thread_plans();
  auto it = plans.find(key);
  if (it == plans.end()) {
    auto plan = make_plan(key, handle, a, b, modes, out_dtype, try_bias_epilogue, pointers);
    if (plans.size() >= 512) plans.clear();
    it = plans.emplace(key, std::move(plan)).first;
  }
  Plan& plan = *it->second;
  auto check = [&](cublasStatus_t status, const char* what) {
    TORCH_CHECK(status == CUBLAS_STATUS_SUCCESS, "transformer_fp8: ", what, " failed with ",
                cublaslt_status_string(status), " ", describe_problem(a, b, modes));
  };
  const bool bias_in_epilogue = plan.bias_in_epilogue;
  set_pointers(plan.op, pointers, bias_in_epilogue, check);
  const float alpha = 1.0f, beta = 0.0f;
  check(cublasLtMatmul(handle, plan.op, &alpha, b.data_ptr(), plan.a, a.data_ptr(), plan.b, &beta,
                       out.data_ptr(), plan.d, out.data_ptr(), plan.d, &plan.algo, workspace,
                       cublaslt_workspace_bytes(), stream),
        "cublasLtMatmul");
  if (bias_c.has_value() && !bias_in_epilogue) out.add_(*bias_c);
  return out;
#endif
}

}  // namespace

TORCH_LIBRARY_IMPL(transformer_fp8, CUDA, m) {
  m.impl("fp8_gemm_blockwise", &fp8_gemm_blockwise_cuda);
}

}  // namespace transformer_fp8
