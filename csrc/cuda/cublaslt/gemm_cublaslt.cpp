// CUDA fp8_gemm through cuBLASLt: out[M, N] = (a[M, K] * a_scale_inv) @ (b[N, K] * b_scale_inv)^T.
// Reference: csrc/cpu/gemm.cpp.
//
// cuBLASLt is column-major. A row-major [R, C] matrix is a column-major [C, R] one, so with
// row-major a [M, K], b [N, K] and out [M, N] we ask cuBLASLt for out^T [N, M] = b . a^T:
// its "A" is b read transposed (K x N, ld K), its "B" is a as is (K x M, ld K): the TN layout
// that Hopper's FP8 tensor cores require. The scale_inv pointers stay on the device.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cublasLt.h>
#include <torch/library.h>

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

#include "../../checks/gemm_checks.h"
#include "cublaslt_shared.h"
#include "../cuda_checks.h"

namespace transformer_fp8 {
namespace {

constexpr size_t kWorkspaceBytes = 32u << 20;

const char* cublasLt_status_name(cublasStatus_t s) {
  switch (s) {
    case CUBLAS_STATUS_NOT_INITIALIZED: return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_ALLOC_FAILED: return "CUBLAS_STATUS_ALLOC_FAILED";
    case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_ARCH_MISMATCH: return "CUBLAS_STATUS_ARCH_MISMATCH (FP8 needs sm_89 or newer)";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "CUBLAS_STATUS_EXECUTION_FAILED";
    case CUBLAS_STATUS_INTERNAL_ERROR: return "CUBLAS_STATUS_INTERNAL_ERROR";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED";
    default: return "an unknown cuBLAS status";
  }
}

// One handle per device and one 32 MiB workspace per (device, stream), so that GEMMs on
// different streams never share scratch memory. Both live until the process exits; each thread
// keeps its own lock-free view of them (ThreadCache below).
struct SharedResources {
  std::mutex mutex;
  std::map<int, cublasLtHandle_t> handles;
  std::map<std::pair<int, cudaStream_t>, at::Tensor> workspaces;
};

SharedResources& shared_resources() {
  static auto* r = new SharedResources();  // never destroyed: CUDA may be gone at exit
  return *r;
}

cublasLtHandle_t create_or_get_handle(int device) {
  auto& r = shared_resources();
  std::lock_guard<std::mutex> lock(r.mutex);
  auto it = r.handles.find(device);
  if (it != r.handles.end()) return it->second;
  cublasLtHandle_t handle = nullptr;
  const cublasStatus_t status = cublasLtCreate(&handle);
  TORCH_CHECK(status == CUBLAS_STATUS_SUCCESS, "transformer_fp8: cublasLtCreate failed with ",
              cublasLt_status_name(status));
  r.handles.emplace(device, handle);
  return handle;
}

void* create_or_get_workspace(int device, cudaStream_t stream) {
  auto& r = shared_resources();
  std::lock_guard<std::mutex> lock(r.mutex);
  auto key = std::make_pair(device, stream);
  auto it = r.workspaces.find(key);
  if (it == r.workspaces.end()) {
    at::Tensor ws = at::empty({static_cast<int64_t>(kWorkspaceBytes)},
                              at::TensorOptions().dtype(at::kByte).device(at::kCUDA, device));
    it = r.workspaces.emplace(key, ws).first;
  }
  return it->second.data_ptr();
}

cudaDataType_t cuda_type(at::ScalarType st) {
  switch (st) {
    case at::kFloat8_e4m3fn: return CUDA_R_8F_E4M3;
    case at::kFloat8_e5m2: return CUDA_R_8F_E5M2;
    case at::kBFloat16: return CUDA_R_16BF;
    case at::kHalf: return CUDA_R_16F;
    default: return CUDA_R_32F;
  }
}

// The largest power of two (<= 256) that divides the address: cuBLASLt's heuristic assumes
// 256-byte aligned buffers unless told otherwise, and may pick a kernel a view cannot feed.
uint32_t alignment_of(const void* p) {
  const auto address = reinterpret_cast<uintptr_t>(p);
  uint32_t alignment = 256;
  while (alignment > 1 && address % alignment != 0) alignment /= 2;
  return alignment;
}

// Everything cuBLASLt's choice of kernel depends on: shapes, types, epilogue, accumulation and
// the alignment of every buffer (cuBLASLt's heuristic assumes 256-byte aligned buffers unless
// told otherwise, and may pick a kernel a view cannot feed).
using ProblemKey = std::tuple<int, int64_t, int64_t, int64_t, int, int, int, bool, bool, uint32_t,
                              uint32_t, uint32_t>;

// The descriptors and the algorithm of one problem, made once and reused by every call of this
// thread with the same problem: only the scale and bias pointers change from call to call.
struct GemmPlan {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulAlgo_t algo = {};
  GemmPlan() = default;
  GemmPlan(const GemmPlan&) = delete;
  GemmPlan& operator=(const GemmPlan&) = delete;
  ~GemmPlan() {
    if (d) cublasLtMatrixLayoutDestroy(d);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (op) cublasLtMatmulDescDestroy(op);
  }
};

// Per thread, so that a call takes no lock and may set pointers on a cached descriptor.
struct ThreadCache {
  static constexpr size_t kMaxPlans = 512;  // distinct problems kept before starting afresh
  std::map<ProblemKey, std::unique_ptr<GemmPlan>> plans;
  std::map<int, cublasLtHandle_t> handles;
  std::map<std::pair<int, cudaStream_t>, void*> workspaces;
};

ThreadCache& thread_cache() {
  thread_local ThreadCache cache;
  return cache;
}

cublasLtHandle_t handle_for(int device) {
  auto& handles = thread_cache().handles;
  auto it = handles.find(device);
  if (it == handles.end()) it = handles.emplace(device, create_or_get_handle(device)).first;
  return it->second;
}

void* workspace_for(int device, cudaStream_t stream) {
  auto& workspaces = thread_cache().workspaces;
  const auto key = std::make_pair(device, stream);
  auto it = workspaces.find(key);
  if (it == workspaces.end())
    it = workspaces.emplace(key, create_or_get_workspace(device, stream)).first;
  return it->second;
}

// "with a [M, K] <type> and b [N, K] <type>": for error messages only.
std::string describe_operands(const at::Tensor& a, const at::Tensor& b) {
  return c10::str("with a [", a.size(0), ", ", a.size(1), "] ", a.scalar_type(), " and b [",
                  b.size(0), ", ", b.size(1), "] ", b.scalar_type());
}

void check_status(cublasStatus_t status, const char* what, const at::Tensor& a,
                  const at::Tensor& b) {
  TORCH_CHECK(status == CUBLAS_STATUS_SUCCESS, "transformer_fp8: ", what, " failed with ",
              cublasLt_status_name(status), " for fp8_gemm ", describe_operands(a, b));
}

// Descriptors and heuristic choice of a new problem. a, b: the operands as passed to cuBLASLt.
std::unique_ptr<GemmPlan> make_plan(const ProblemKey& key, cublasLtHandle_t handle,
                                    const at::Tensor& a, const at::Tensor& b,
                                    at::ScalarType out_dtype, bool bias_in_epilogue,
                                    bool use_fast_accum) {
  const int64_t M = a.size(0), K = a.size(1), N = b.size(0);
  auto plan = std::make_unique<GemmPlan>();
  auto check = [&](cublasStatus_t status, const char* what) { check_status(status, what, a, b); };
  auto set_op = [&](cublasLtMatmulDescAttributes_t attribute, const char* name, const auto& value) {
    check(cublasLtMatmulDescSetAttribute(plan->op, attribute, &value, sizeof(value)), name);
  };
  check(cublasLtMatmulDescCreate(&plan->op, CUBLAS_COMPUTE_32F, CUDA_R_32F),
        "cublasLtMatmulDescCreate");
  set_op(CUBLASLT_MATMUL_DESC_TRANSA, "TRANSA", CUBLAS_OP_T);
  set_op(CUBLASLT_MATMUL_DESC_TRANSB, "TRANSB", CUBLAS_OP_N);
  set_op(CUBLASLT_MATMUL_DESC_FAST_ACCUM, "FAST_ACCUM", static_cast<int8_t>(use_fast_accum));
  if (bias_in_epilogue) {
    set_op(CUBLASLT_MATMUL_DESC_EPILOGUE, "EPILOGUE", CUBLASLT_EPILOGUE_BIAS);
    set_op(CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, "BIAS_DATA_TYPE", cuda_type(out_dtype));
  }
  check(cublasLtMatrixLayoutCreate(&plan->a, cuda_type(b.scalar_type()), K, N, K), "layout of b");
  check(cublasLtMatrixLayoutCreate(&plan->b, cuda_type(a.scalar_type()), K, M, K), "layout of a");
  check(cublasLtMatrixLayoutCreate(&plan->d, cuda_type(out_dtype), N, M, N), "layout of out");

  cublasLtMatmulPreference_t pref = nullptr;
  check(cublasLtMatmulPreferenceCreate(&pref), "cublasLtMatmulPreferenceCreate");
  std::unique_ptr<std::remove_pointer_t<cublasLtMatmulPreference_t>,
                  decltype(&cublasLtMatmulPreferenceDestroy)>
      pref_owner(pref, &cublasLtMatmulPreferenceDestroy);
  auto set_pref = [&](cublasLtMatmulPreferenceAttributes_t attribute, const char* name,
                      const auto& value) {
    check(cublasLtMatmulPreferenceSetAttribute(pref, attribute, &value, sizeof(value)), name);
  };
  const uint32_t align_a = std::get<9>(key), align_b = std::get<10>(key),
                 align_out = std::get<11>(key);
  set_pref(CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, "MAX_WORKSPACE_BYTES", kWorkspaceBytes);
  set_pref(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, "MIN_ALIGNMENT_A", align_a);
  set_pref(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, "MIN_ALIGNMENT_B", align_b);
  set_pref(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, "MIN_ALIGNMENT_C", align_out);
  set_pref(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, "MIN_ALIGNMENT_D", align_out);
  cublasLtMatmulHeuristicResult_t heuristic = {};
  int found = 0;
  check(cublasLtMatmulAlgoGetHeuristic(handle, plan->op, plan->a, plan->b, plan->d, plan->d,
                                       pref, 1, &heuristic, &found),
        "cublasLtMatmulAlgoGetHeuristic");
  TORCH_CHECK(found > 0, "transformer_fp8: cuBLASLt found no FP8 algorithm for fp8_gemm ",
              describe_operands(a, b), " and out_dtype ", out_dtype,
              " (FP8 GEMMs need sm_89 or newer)");
  plan->algo = heuristic.algo;
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
  const at::Tensor a = cublaslt_operand(a_in), b = cublaslt_operand(b_in);
  const c10::optional<at::Tensor> bias_c =
      bias.has_value() ? c10::optional<at::Tensor>(cublaslt_operand(*bias)) : c10::nullopt;
  const int device = a.get_device();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  cublasLtHandle_t handle = handle_for(device);
  void* workspace = workspace_for(device, stream);

  // The bias epilogue takes a bias of the output type for bf16 / fp16 outputs; for float32
  // outputs the bias is added after the product.
  const bool bias_in_epilogue = bias.has_value() && out_dtype != at::kFloat;
  // cuBLASLt's A is our b, its B is our a (see the top of this file).
  const ProblemKey key{device, M, N, K, static_cast<int>(a.scalar_type()),
                       static_cast<int>(b.scalar_type()), static_cast<int>(out_dtype),
                       bias_in_epilogue, use_fast_accum, alignment_of(b.data_ptr()),
                       alignment_of(a.data_ptr()), alignment_of(out.data_ptr())};
  auto& plans = thread_cache().plans;
  auto it = plans.find(key);
  if (it == plans.end()) {
    auto plan = make_plan(key, handle, a, b, out_dtype, bias_in_epilogue, use_fast_accum);
    if (plans.size() >= ThreadCache::kMaxPlans) plans.clear();
    it = plans.emplace(key, std::move(plan)).first;
  }
  GemmPlan& plan = *it->second;

  auto check = [&](cublasStatus_t status, const char* what) { check_status(status, what, a, b); };
  auto set_pointer = [&](cublasLtMatmulDescAttributes_t attribute, const char* name,
                         const void* pointer) {
    check(cublasLtMatmulDescSetAttribute(plan.op, attribute, &pointer, sizeof(pointer)), name);
  };
  // The scales stay on the device. cuBLASLt's A is our b: the scale pointers swap accordingly.
  set_pointer(CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, "A_SCALE_POINTER", b_scale_inv.data_ptr());
  set_pointer(CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, "B_SCALE_POINTER", a_scale_inv.data_ptr());
  if (bias_in_epilogue)
    set_pointer(CUBLASLT_MATMUL_DESC_BIAS_POINTER, "BIAS_POINTER", bias_c->data_ptr());

  const float alpha = 1.0f, beta = 0.0f;
  check(cublasLtMatmul(handle, plan.op, &alpha, b.data_ptr(), plan.a, a.data_ptr(), plan.b, &beta,
                       out.data_ptr(), plan.d, out.data_ptr(), plan.d, &plan.algo, workspace,
                       kWorkspaceBytes, stream),
        "cublasLtMatmul");
  if (bias_c.has_value() && !bias_in_epilogue) out.add_(*bias_c);
  return out;
}

}  // namespace

// Shared with the other cuBLASLt callers (cublaslt_shared.h).
cublasLtHandle_t cublaslt_handle(int device) { return handle_for(device); }
void* cublaslt_workspace(int device, cudaStream_t stream) { return workspace_for(device, stream); }
size_t cublaslt_workspace_bytes() { return kWorkspaceBytes; }
const char* cublaslt_status_string(cublasStatus_t status) { return cublasLt_status_name(status); }
uint32_t cublaslt_alignment_of(const void* p) { return alignment_of(p); }

at::Tensor cublaslt_operand(const at::Tensor& t) {
  at::Tensor c = t.contiguous();
  return alignment_of(c.data_ptr()) >= 16 ? c : c.clone();
}

bool fill_trivial_product(at::Tensor& out, int64_t K, const c10::optional<at::Tensor>& bias) {
  if (out.numel() == 0) return true;
  if (K != 0) return false;
  out.zero_();
  if (bias.has_value()) out.add_(*bias);
  return true;
}

TORCH_LIBRARY_IMPL(transformer_fp8, CUDA, m) { m.impl("fp8_gemm", &fp8_gemm_cuda); }

}  // namespace transformer_fp8
