// The cuBLASLt resources and setup shared by the GEMMs (cublaslt_shared.h).
#include "cublaslt_shared.h"

#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAStream.h>

#include <mutex>

namespace transformer_fp8 {
namespace {

constexpr size_t kWorkspaceBytes = 32u << 20;

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
              cublaslt_status_string(status));
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

// Per thread, so that a call takes no lock.
struct ThreadCache {
  std::map<int, cublasLtHandle_t> handles;
  std::map<std::pair<int, cudaStream_t>, void*> workspaces;
};

ThreadCache& thread_cache() {
  thread_local ThreadCache cache;
  return cache;
}

}  // namespace

cublasLtHandle_t cublaslt_handle(int device) {
  auto& handles = thread_cache().handles;
  auto it = handles.find(device);
  if (it == handles.end()) it = handles.emplace(device, create_or_get_handle(device)).first;
  return it->second;
}

void* cublaslt_workspace(int device, cudaStream_t stream) {
  auto& workspaces = thread_cache().workspaces;
  const auto key = std::make_pair(device, stream);
  auto it = workspaces.find(key);
  if (it == workspaces.end())
    it = workspaces.emplace(key, create_or_get_workspace(device, stream)).first;
  return it->second;
}

size_t cublaslt_workspace_bytes() { return kWorkspaceBytes; }

const char* cublaslt_status_string(cublasStatus_t status) {
  switch (status) {
    case CUBLAS_STATUS_NOT_INITIALIZED: return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_ALLOC_FAILED: return "CUBLAS_STATUS_ALLOC_FAILED";
    case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_ARCH_MISMATCH:
      return "CUBLAS_STATUS_ARCH_MISMATCH (FP8 needs sm_89 or newer)";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "CUBLAS_STATUS_EXECUTION_FAILED";
    case CUBLAS_STATUS_INTERNAL_ERROR: return "CUBLAS_STATUS_INTERNAL_ERROR";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED";
    default: return "an unknown cuBLAS status";
  }
}

uint32_t cublaslt_alignment_of(const void* p) {
  const auto address = reinterpret_cast<uintptr_t>(p);
  uint32_t alignment = 256;
  while (alignment > 1 && address % alignment != 0) alignment /= 2;
  return alignment;
}

cudaDataType_t cublaslt_data_type(at::ScalarType st) {
  switch (st) {
    case at::kFloat8_e4m3fn: return CUDA_R_8F_E4M3;
    case at::kFloat8_e5m2: return CUDA_R_8F_E5M2;
    case at::kBFloat16: return CUDA_R_16BF;
    case at::kHalf: return CUDA_R_16F;
    default: return CUDA_R_32F;
  }
}

at::Tensor cublaslt_operand(const at::Tensor& t) {
  at::Tensor c = t.contiguous();
  return cublaslt_alignment_of(c.data_ptr()) >= 16 ? c : c.clone();
}

bool fill_trivial_product(at::Tensor& out, int64_t K, const c10::optional<at::Tensor>& bias) {
  if (out.numel() == 0) return true;
  if (K != 0) return false;
  out.zero_();
  if (bias.has_value()) out.add_(*bias);
  return true;
}

CublasLtCall prepare_cublaslt_call(const at::Tensor& a, const at::Tensor& b,
                                   const c10::optional<at::Tensor>& bias) {
  CublasLtCall call;
  call.a = cublaslt_operand(a);
  call.b = cublaslt_operand(b);
  if (bias.has_value()) call.bias = cublaslt_operand(*bias);
  call.device = call.a.get_device();
  call.stream = c10::cuda::getCurrentCUDAStream();
  call.handle = cublaslt_handle(call.device);
  if (c10::cuda::currentStreamCaptureStatusMayInitCtx() == c10::cuda::CaptureStatus::None) {
    call.workspace = cublaslt_workspace(call.device, call.stream);
  } else {
    // Under CUDA graph capture the stream's shared workspace would be baked into the graph, and
    // two graphs captured on one stream (torch.cuda.graph's default) and replayed at once on
    // two streams, or a replay overlapping eager GEMMs, would write the same scratch memory.
    // Allocated now, the workspace comes from the capturing graph's memory pool, reused in
    // stream order by its later GEMMs. Graphs that share a pool (torch.cuda.graph(pool=...),
    // make_graphed_callables' graphs) share it too, and must not replay at the same time, as
    // torch asks of graphs sharing a pool. A capture that torch did not start has no pool: the
    // workspace then comes from, and goes back to, the ordinary allocator.
    call.workspace_owner = at::empty(
        {static_cast<int64_t>(kWorkspaceBytes)},
        at::TensorOptions().dtype(at::kByte).device(at::kCUDA, call.device));
    call.workspace = call.workspace_owner.data_ptr();
  }
  return call;
}

GemmAlignments gemm_alignments(const at::Tensor& a, const at::Tensor& b, const at::Tensor& out) {
  return {cublaslt_alignment_of(a.data_ptr()), cublaslt_alignment_of(b.data_ptr()),
          cublaslt_alignment_of(out.data_ptr())};
}

void create_tn_matmul_desc(CublasLtPlan& plan, bool fast_accum, CublasLtCheck check) {
  check(cublasLtMatmulDescCreate(&plan.op, CUBLAS_COMPUTE_32F, CUDA_R_32F),
        "cublasLtMatmulDescCreate");
  set_matmul_attribute(plan.op, CUBLASLT_MATMUL_DESC_TRANSA, "TRANSA", CUBLAS_OP_T, check);
  set_matmul_attribute(plan.op, CUBLASLT_MATMUL_DESC_TRANSB, "TRANSB", CUBLAS_OP_N, check);
  set_matmul_attribute(plan.op, CUBLASLT_MATMUL_DESC_FAST_ACCUM, "FAST_ACCUM",
                       static_cast<int8_t>(fast_accum), check);
}

void set_bias_epilogue(cublasLtMatmulDesc_t op, at::ScalarType out_dtype, CublasLtCheck check) {
  set_matmul_attribute(op, CUBLASLT_MATMUL_DESC_EPILOGUE, "EPILOGUE", CUBLASLT_EPILOGUE_BIAS,
                       check);
  set_matmul_attribute(op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, "BIAS_DATA_TYPE",
                       static_cast<int32_t>(cublaslt_data_type(out_dtype)), check);
}

void set_gemm_pointers(cublasLtMatmulDesc_t op, const GemmPointers& pointers,
                       bool bias_in_epilogue, CublasLtCheck check) {
  // A pointer attribute holds the pointer itself: its value, sizeof(const void*) bytes.
  auto set_pointer = [&](cublasLtMatmulDescAttributes_t attribute, const char* name,
                         const void* pointer) {
    set_matmul_attribute(op, attribute, name, pointer, check);
  };
  // cuBLASLt's A is our b, its B our a.
  set_pointer(CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, "A_SCALE_POINTER", pointers.b_scale);
  set_pointer(CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, "B_SCALE_POINTER", pointers.a_scale);
  if (bias_in_epilogue)
    set_pointer(CUBLASLT_MATMUL_DESC_BIAS_POINTER, "BIAS_POINTER", pointers.bias);
}

void create_tn_layouts(CublasLtPlan& plan, const at::Tensor& a, const at::Tensor& b,
                       at::ScalarType out_dtype, CublasLtCheck check) {
  const int64_t M = a.size(0), K = a.size(1), N = b.size(0);
  check(cublasLtMatrixLayoutCreate(&plan.a, cublaslt_data_type(b.scalar_type()), K, N, K),
        "layout of b");
  check(cublasLtMatrixLayoutCreate(&plan.b, cublaslt_data_type(a.scalar_type()), K, M, K),
        "layout of a");
  check(cublasLtMatrixLayoutCreate(&plan.d, cublaslt_data_type(out_dtype), N, M, N),
        "layout of out");
}

CublasLtPreference create_preference(const GemmAlignments& align, CublasLtCheck check) {
  cublasLtMatmulPreference_t pref = nullptr;
  check(cublasLtMatmulPreferenceCreate(&pref), "cublasLtMatmulPreferenceCreate");
  CublasLtPreference owner(pref, &cublasLtMatmulPreferenceDestroy);
  auto set_pref = [&](cublasLtMatmulPreferenceAttributes_t attribute, const char* name,
                      const auto& value) {
    check(cublasLtMatmulPreferenceSetAttribute(pref, attribute, &value, sizeof(value)), name);
  };
  set_pref(CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, "MAX_WORKSPACE_BYTES", kWorkspaceBytes);
  // cuBLASLt's A is our b, its B our a.
  set_pref(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, "MIN_ALIGNMENT_A", align.b);
  set_pref(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, "MIN_ALIGNMENT_B", align.a);
  set_pref(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, "MIN_ALIGNMENT_C", align.out);
  set_pref(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, "MIN_ALIGNMENT_D", align.out);
  return owner;
}

HeuristicAnswer query_algorithm(cublasLtHandle_t handle, CublasLtPlan& plan,
                                const CublasLtPreference& pref) {
  cublasLtMatmulHeuristicResult_t heuristic = {};
  int found = 0;
  const cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(
      handle, plan.op, plan.a, plan.b, plan.d, plan.d, pref.get(), 1, &heuristic, &found);
  const HeuristicAnswer answer{status, found > 0};
  if (status == CUBLAS_STATUS_SUCCESS && answer.found) plan.algo = heuristic.algo;
  return answer;
}

void run_plan(const CublasLtCall& call, const CublasLtPlan& plan, const GemmPointers& pointers,
              at::Tensor& out, CublasLtCheck check) {
  set_gemm_pointers(plan.op, pointers, plan.bias_in_epilogue, check);
  const float alpha = 1.0f, beta = 0.0f;
  check(cublasLtMatmul(call.handle, plan.op, &alpha, call.b.data_ptr(), plan.a, call.a.data_ptr(),
                       plan.b, &beta, out.data_ptr(), plan.d, out.data_ptr(), plan.d, &plan.algo,
                       call.workspace, kWorkspaceBytes, call.stream),
        "cublasLtMatmul");
  if (call.bias.has_value() && !plan.bias_in_epilogue) out.add_(*call.bias);
}

}  // namespace transformer_fp8
