// What the cuBLASLt GEMMs (gemm_cublaslt.cpp, gemm_blockwise_cublaslt.cpp) share, defined once
// in cublaslt_shared.cpp: one handle per device and one workspace per stream, the preparation of
// their operands, and the setup of their descriptors, preference, algorithm query and call.
//
// The TN mapping of every GEMM here: cuBLASLt is column-major, and a row-major [R, C] matrix is a
// column-major [C, R] one, so with row-major a [M, K], b [N, K] and out [M, N] cuBLASLt computes
// out^T [N, M] = b . a^T: its "A" is our b read transposed (K x N, ld K), its "B" is our a as is
// (K x M, ld K), the layout Hopper's FP8 tensor cores require. The functions below take our a and
// b and swap them for cuBLASLt themselves.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/FunctionRef.h>
#include <c10/util/Optional.h>
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <type_traits>
#include <utility>

namespace transformer_fp8 {

cublasLtHandle_t cublaslt_handle(int device);
void* cublaslt_workspace(int device, cudaStream_t stream);
size_t cublaslt_workspace_bytes();
const char* cublaslt_status_string(cublasStatus_t status);
// The largest power of two (<= 256) that divides the address.
uint32_t cublaslt_alignment_of(const void* p);
// The cuBLASLt data type of an FP8 operand or an output / bias dtype.
cudaDataType_t cublaslt_data_type(at::ScalarType st);

// t as cuBLASLt's FP8 kernels read it: contiguous and 16-byte aligned (a fresh copy always is).
at::Tensor cublaslt_operand(const at::Tensor& t);

// The product out [M, N] of a [M, K] and b [N, K] when it has nothing to compute (M, N or K is
// 0): fills out (zeros plus the bias when K is 0) and returns true; else returns false.
bool fill_trivial_product(at::Tensor& out, int64_t K, const c10::optional<at::Tensor>& bias);

// What one GEMM call hands cuBLASLt, on the current device (the caller's guard) and stream.
struct CublasLtCall {
  at::Tensor a, b;                  // the operands, as cublaslt_operand makes them
  c10::optional<at::Tensor> bias;   // likewise
  int device;
  cudaStream_t stream;
  cublasLtHandle_t handle;
  void* workspace;                  // cublaslt_workspace_bytes() long: the stream's, or
                                    // under capture workspace_owner's
  at::Tensor workspace_owner;       // under capture: a workspace of the graph's own pool
};
CublasLtCall prepare_cublaslt_call(const at::Tensor& a, const at::Tensor& b,
                                   const c10::optional<at::Tensor>& bias);

// Throws "transformer_fp8: <what> failed with <status> <problem()>" unless status is
// CUBLAS_STATUS_SUCCESS; problem() describes the GEMM and is called only for the message.
template <typename Problem>
void check_cublaslt(cublasStatus_t status, const char* what, const Problem& problem) {
  TORCH_CHECK(status == CUBLAS_STATUS_SUCCESS, "transformer_fp8: ", what, " failed with ",
              cublaslt_status_string(status), " ", problem());
}

// A GEMM's status check (a call of check_cublaslt with its problem), given to the setup below.
using CublasLtCheck = c10::function_ref<void(cublasStatus_t status, const char* what)>;

// The descriptors and the algorithm of one problem, made once and reused by every call of a
// thread with the same problem: only the scale and bias pointers change from call to call.
struct CublasLtPlan {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;  // cuBLASLt's A (our b), B, D
  cublasLtMatmulAlgo_t algo = {};
  bool bias_in_epilogue = false;  // else the bias is added after the product
  CublasLtPlan() = default;
  CublasLtPlan(const CublasLtPlan&) = delete;
  CublasLtPlan& operator=(const CublasLtPlan&) = delete;
  ~CublasLtPlan() {
    if (d) cublasLtMatrixLayoutDestroy(d);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (op) cublasLtMatmulDescDestroy(op);
  }
};

// A thread's plans by problem; find_or_make_plan starts it afresh beyond kMaxCachedPlans.
template <typename Key>
using CublasLtPlanCache = std::map<Key, std::unique_ptr<CublasLtPlan>>;
constexpr size_t kMaxCachedPlans = 512;

// The plan of key, made by make() (a std::unique_ptr<CublasLtPlan>) when plans has none yet.
template <typename Key, typename Make>
CublasLtPlan& find_or_make_plan(CublasLtPlanCache<Key>& plans, const Key& key, const Make& make) {
  auto it = plans.find(key);
  if (it == plans.end()) {
    auto plan = make();
    if (plans.size() >= kMaxCachedPlans) plans.clear();
    it = plans.emplace(key, std::move(plan)).first;
  }
  return *it->second;
}

// The alignment in bytes of each buffer: cuBLASLt's heuristic assumes 256-byte aligned buffers
// unless told otherwise, and may pick a kernel a view cannot feed. a and b are ours.
struct GemmAlignments {
  uint32_t a, b, out;
};
GemmAlignments gemm_alignments(const at::Tensor& a, const at::Tensor& b, const at::Tensor& out);

template <typename T>
void set_matmul_attribute(cublasLtMatmulDesc_t op, cublasLtMatmulDescAttributes_t attribute,
                          const char* name, const T& value, CublasLtCheck check) {
  check(cublasLtMatmulDescSetAttribute(op, attribute, &value, sizeof(value)), name);
}

// plan.op: the TN product (A transposed, B as is) with float32 compute and scale types, and
// split (fast_accum false) or fast accumulation.
void create_tn_matmul_desc(CublasLtPlan& plan, bool fast_accum, CublasLtCheck check);

// The bias epilogue on op: a bias [N] of out_dtype, added to every row of out [M, N].
void set_bias_epilogue(cublasLtMatmulDesc_t op, at::ScalarType out_dtype, CublasLtCheck check);

// The device buffers cuBLASLt reads through the descriptor (the scales stay on the device).
struct GemmPointers {
  const void* a_scale;  // our a's scales (cuBLASLt's B)
  const void* b_scale;  // our b's scales (cuBLASLt's A)
  const void* bias;     // nullptr without a bias
};
// Sets the scale pointers, and the bias pointer when bias_in_epilogue.
void set_gemm_pointers(cublasLtMatmulDesc_t op, const GemmPointers& pointers,
                       bool bias_in_epilogue, CublasLtCheck check);

// plan.a, plan.b, plan.d: the layouts of b, a and out [M, N] of out_dtype in the TN mapping.
void create_tn_layouts(CublasLtPlan& plan, const at::Tensor& a, const at::Tensor& b,
                       at::ScalarType out_dtype, CublasLtCheck check);

using CublasLtPreference =
    std::unique_ptr<std::remove_pointer_t<cublasLtMatmulPreference_t>,
                    decltype(&cublasLtMatmulPreferenceDestroy)>;
// The algorithm preference: at most the shared workspace, and the alignments of the buffers
// (C and D are both out).
CublasLtPreference create_preference(const GemmAlignments& align, CublasLtCheck check);

// The heuristic's answer for a plan: its status and whether it found an algorithm.
struct HeuristicAnswer {
  cublasStatus_t status;
  bool found;
  // cuBLASLt has no kernel for the problem (rather than failing to answer). It refuses a
  // descriptor it has no kernel for with NOT_SUPPORTED or, for some block-scaled attribute
  // combinations, INVALID_VALUE.
  bool unsupported() const {
    return status == CUBLAS_STATUS_NOT_SUPPORTED || status == CUBLAS_STATUS_INVALID_VALUE ||
           (status == CUBLAS_STATUS_SUCCESS && !found);
  }
};
// Asks the heuristic for the best algorithm of plan's descriptors (C = D); stores it in
// plan.algo when it finds one. The caller turns a failed answer into its error.
HeuristicAnswer query_algorithm(cublasLtHandle_t handle, CublasLtPlan& plan,
                                const CublasLtPreference& pref);

// out = a @ b^T + bias: sets the call's pointers on the plan, runs it (alpha 1, beta 0,
// C = D = out) on the call's stream and workspace, and adds the bias after the product when the
// plan has no bias epilogue.
void run_plan(const CublasLtCall& call, const CublasLtPlan& plan, const GemmPointers& pointers,
              at::Tensor& out, CublasLtCheck check);

}  // namespace transformer_fp8
