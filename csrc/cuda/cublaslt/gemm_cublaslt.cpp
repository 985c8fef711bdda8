// CUDA fp8_gemm through cuBLASLt: out[M, N] = (a[M, K] * a_scale_inv) @ (b[N, K] * b_scale_inv)^T.
// Reference: csrc/cpu/gemm.cpp. The TN mapping onto cuBLASLt's column-major product, the handle,
// workspace and the descriptor setup: cublaslt_shared.h. The scale_inv pointers stay on the
// device.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <cublasLt.h>
#include <torch/library.h>

#include <cstdint>
#include <memory>
#include <string>
#include <tuple>

#include "../../checks/gemm_checks.h"
#include "../cuda_checks.h"
#include "cublaslt_shared.h"

namespace transformer_fp8 {
namespace {

// Everything cuBLASLt's choice of kernel depends on: shapes, types, epilogue, accumulation and
// the alignment of every buffer (cuBLASLt's heuristic assumes 256-byte aligned buffers unless
// told otherwise, and may pick a kernel a view cannot feed).
using ProblemKey = std::tuple<int, int64_t, int64_t, int64_t, int, int, int, bool, bool, uint32_t,
                              uint32_t, uint32_t>;

// Per thread, so that a call takes no lock and may set pointers on a cached descriptor.
CublasLtPlanCache<ProblemKey>& thread_plans() {
  thread_local CublasLtPlanCache<ProblemKey> plans;
  return plans;
}

// "with a [M, K] <type> and b [N, K] <type>": for error messages only.
std::string describe_operands(const at::Tensor& a, const at::Tensor& b) {
  return c10::str("with a [", a.size(0), ", ", a.size(1), "] ", a.scalar_type(), " and b [",
                  b.size(0), ", ", b.size(1), "] ", b.scalar_type());
}

void check_status(cublasStatus_t status, const char* what, const at::Tensor& a,
                  const at::Tensor& b) {
  check_cublaslt(status, what, [&] { return "for fp8_gemm " + describe_operands(a, b); });
}

// scale_inv itself when its pointer is 16-byte aligned, else a copy (the caching allocator's
// blocks are): cuBLASLt reads the per-tensor scale through an aligned load.
at::Tensor aligned_scale(const at::Tensor& scale_inv) {
  if (reinterpret_cast<uintptr_t>(scale_inv.data_ptr()) % 16 == 0) return scale_inv;
  return scale_inv.clone(at::MemoryFormat::Contiguous);
}

// Descriptors and heuristic choice of a new problem. a, b: the operands as passed to cuBLASLt.
std::unique_ptr<CublasLtPlan> make_plan(cublasLtHandle_t handle, const at::Tensor& a,
                                        const at::Tensor& b, at::ScalarType out_dtype,
                                        bool bias_in_epilogue, bool use_fast_accum,
                                        const GemmAlignments& align) {
  auto plan = std::make_unique<CublasLtPlan>();
  auto check = [&](cublasStatus_t status, const char* what) { check_status(status, what, a, b); };
  create_tn_matmul_desc(*plan, use_fast_accum, check);
  if (bias_in_epilogue) set_bias_epilogue(plan->op, out_dtype, check);
  create_tn_layouts(*plan, a, b, out_dtype, check);
  const CublasLtPreference pref = create_preference(align, check);
  const HeuristicAnswer answer = query_algorithm(handle, *plan, pref);
  check(answer.status, "cublasLtMatmulAlgoGetHeuristic");
  TORCH_CHECK(answer.found, "transformer_fp8: cuBLASLt found no FP8 algorithm for fp8_gemm ",
              describe_operands(a, b), " and out_dtype ", out_dtype,
              " (FP8 GEMMs need sm_89 or newer)");
  plan->bias_in_epilogue = bias_in_epilogue;
  return plan;
}

at::Tensor fp8_gemm_cuda(const at::Tensor& a_in, const at::Tensor& a_scale_inv,
                         const at::Tensor& b_in, const at::Tensor& b_scale_inv,
                         at::ScalarType out_dtype, const c10::optional<at::Tensor>& bias,
                         bool use_fast_accum) {
  check_gemm_args(a_in, a_scale_inv, b_in, b_scale_inv, out_dtype, bias);
  check_cuda_tensor(a_in, "a");
  const int64_t M = a_in.size(0), K = a_in.size(1), N = b_in.size(0);
  TORCH_CHECK(M % 16 == 0 && N % 16 == 0 && K % 16 == 0, "transformer_fp8: fp8_gemm on CUDA "
              "needs M, N and K to be multiples of 16 (cuBLASLt FP8 alignment), got ",
              describe_operands(a_in, b_in));
  const c10::cuda::CUDAGuard guard(a_in.device());
  at::Tensor out = at::empty({M, N}, a_in.options().dtype(out_dtype));
  if (fill_trivial_product(out, K, bias)) return out;
  const CublasLtCall call = prepare_cublaslt_call(a_in, b_in, bias);
  const at::Tensor &a = call.a, &b = call.b;

  // The bias epilogue takes a bias of the output type for bf16 / fp16 outputs; for float32
  // outputs the bias is added after the product.
  const bool bias_in_epilogue = bias.has_value() && out_dtype != at::kFloat;
  const GemmAlignments align = gemm_alignments(a, b, out);
  // cuBLASLt's A is our b, its B is our a (cublaslt_shared.h).
  const ProblemKey key{call.device, M, N, K, static_cast<int>(a.scalar_type()),
                       static_cast<int>(b.scalar_type()), static_cast<int>(out_dtype),
                       bias_in_epilogue, use_fast_accum, align.b, align.a, align.out};
  const CublasLtPlan& plan = find_or_make_plan(thread_plans(), key, [&] {
    return make_plan(call.handle, a, b, out_dtype, bias_in_epilogue, use_fast_accum, align);
  });

  auto check = [&](cublasStatus_t status, const char* what) { check_status(status, what, a, b); };
  // The scales stay on the device; cuBLASLt reads them (and the bias) through the descriptor.
  // cuBLASLt refused (CUBLAS_STATUS_NOT_SUPPORTED, at the call; H200, CUDA 13.0) a scale
  // pointer 4 bytes into a buffer, the second element of a [2] scale_inv; 16- and 32-byte
  // offsets work. A scale that is not 16-byte aligned is copied to a fresh tensor first.
  const at::Tensor a_scale = aligned_scale(a_scale_inv), b_scale = aligned_scale(b_scale_inv);
  const GemmPointers pointers{a_scale.data_ptr(), b_scale.data_ptr(),
                              call.bias.has_value() ? call.bias->data_ptr() : nullptr};
  run_plan(call, plan, pointers, out, check);
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(transformer_fp8, CUDA, m) { m.impl("fp8_gemm", &fp8_gemm_cuda); }

}  // namespace transformer_fp8
