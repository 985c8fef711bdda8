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
#include <mutex>
#include <string>
#include <utility>

#include "../gemm_checks.h"
#include "cuda_checks.h"

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

// One handle per device, one 32 MiB workspace per (device, stream) so that GEMMs on different
// streams never share scratch memory, and the algorithm cuBLASLt's heuristic chose for each
// problem (asking costs host time on every call). All live until the process exits.
struct LtResources {
  std::mutex mutex;
  std::map<int, cublasLtHandle_t> handles;
  std::map<std::pair<int, cudaStream_t>, at::Tensor> workspaces;
  std::map<std::string, cublasLtMatmulAlgo_t> algorithms;
};

LtResources& resources() {
  static auto* r = new LtResources();  // never destroyed: CUDA may be gone at exit
  return *r;
}

cublasLtHandle_t handle_for(int device) {
  auto& r = resources();
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

void* workspace_for(int device, cudaStream_t stream) {
  auto& r = resources();
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

// The algorithm chosen for a problem, or null if none was chosen yet.
const cublasLtMatmulAlgo_t* cached_algorithm(const std::string& problem) {
  auto& r = resources();
  std::lock_guard<std::mutex> lock(r.mutex);
  auto it = r.algorithms.find(problem);
  return it == r.algorithms.end() ? nullptr : &it->second;  // std::map entries never move
}

const cublasLtMatmulAlgo_t* remember_algorithm(const std::string& problem,
                                               const cublasLtMatmulAlgo_t& algo) {
  auto& r = resources();
  std::lock_guard<std::mutex> lock(r.mutex);
  return &r.algorithms.emplace(problem, algo).first->second;
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

// Owns the cuBLASLt descriptors of one call.
struct LtDescriptors {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  ~LtDescriptors() {
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    if (d) cublasLtMatrixLayoutDestroy(d);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (op) cublasLtMatmulDescDestroy(op);
  }
};

at::Tensor fp8_gemm_cuda(const at::Tensor& a_in, const at::Tensor& a_scale_inv,
                         const at::Tensor& b_in, const at::Tensor& b_scale_inv,
                         at::ScalarType out_dtype, const c10::optional<at::Tensor>& bias,
                         bool use_fast_accum) {
  check_gemm_args(a_in, a_scale_inv, b_in, b_scale_inv, out_dtype, bias);
  check_cuda_tensor(a_in, "a");
  const int64_t M = a_in.size(0), K = a_in.size(1), N = b_in.size(0);
  const std::string shapes = "with a [" + std::to_string(M) + ", " + std::to_string(K) +
                             "] " + c10::toString(a_in.scalar_type()) + " and b [" +
                             std::to_string(N) + ", " + std::to_string(K) + "] " +
                             c10::toString(b_in.scalar_type());
  TORCH_CHECK(M % 16 == 0 && N % 16 == 0 && K % 16 == 0, "transformer_fp8: fp8_gemm on CUDA "
              "needs M, N and K to be multiples of 16 (cuBLASLt FP8 alignment), got ", shapes);
  const c10::cuda::CUDAGuard guard(a_in.device());
  at::Tensor out = at::empty({M, N}, a_in.options().dtype(out_dtype));
  if (M == 0 || N == 0) return out;
  if (K == 0) {
    out.zero_();
    if (bias.has_value()) out.add_(*bias);
    return out;
  }
  // cuBLASLt's FP8 kernels need 16-byte aligned operands; a fresh copy always is.
  auto aligned16 = [](const at::Tensor& t) {
    at::Tensor c = t.contiguous();
    return alignment_of(c.data_ptr()) >= 16 ? c : c.clone();
  };
  const at::Tensor a = aligned16(a_in), b = aligned16(b_in);
  const c10::optional<at::Tensor> bias_c =
      bias.has_value() ? c10::optional<at::Tensor>(aligned16(*bias)) : c10::nullopt;
  const int device = a.get_device();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  cublasLtHandle_t handle = handle_for(device);
  void* workspace = workspace_for(device, stream);

  // The bias epilogue takes a bias of the output type for bf16 / fp16 outputs; for float32
  // outputs the bias is added after the product.
  const bool bias_in_epilogue = bias.has_value() && out_dtype != at::kFloat;

  LtDescriptors desc;
  auto check = [&](cublasStatus_t status, const char* what) {
    TORCH_CHECK(status == CUBLAS_STATUS_SUCCESS, "transformer_fp8: ", what, " failed with ",
                cublasLt_status_name(status), " for fp8_gemm ", shapes);
  };
  auto set_op = [&](cublasLtMatmulDescAttributes_t attribute, const char* name, const auto& value) {
    check(cublasLtMatmulDescSetAttribute(desc.op, attribute, &value, sizeof(value)), name);
  };
  auto set_pref = [&](cublasLtMatmulPreferenceAttributes_t attribute, const char* name,
                      const auto& value) {
    check(cublasLtMatmulPreferenceSetAttribute(desc.pref, attribute, &value, sizeof(value)), name);
  };

  check(cublasLtMatmulDescCreate(&desc.op, CUBLAS_COMPUTE_32F, CUDA_R_32F), "cublasLtMatmulDescCreate");
  set_op(CUBLASLT_MATMUL_DESC_TRANSA, "TRANSA", CUBLAS_OP_T);
  set_op(CUBLASLT_MATMUL_DESC_TRANSB, "TRANSB", CUBLAS_OP_N);
  set_op(CUBLASLT_MATMUL_DESC_FAST_ACCUM, "FAST_ACCUM", static_cast<int8_t>(use_fast_accum));
  // cuBLASLt's A is our b, its B is our a: the scale pointers swap accordingly.
  set_op(CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, "A_SCALE_POINTER",
         static_cast<const void*>(b_scale_inv.data_ptr()));
  set_op(CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, "B_SCALE_POINTER",
         static_cast<const void*>(a_scale_inv.data_ptr()));
  if (bias_in_epilogue) {
    set_op(CUBLASLT_MATMUL_DESC_EPILOGUE, "EPILOGUE", CUBLASLT_EPILOGUE_BIAS);
    set_op(CUBLASLT_MATMUL_DESC_BIAS_POINTER, "BIAS_POINTER",
           static_cast<const void*>(bias_c->data_ptr()));
    set_op(CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, "BIAS_DATA_TYPE", cuda_type(out_dtype));
  }
  check(cublasLtMatrixLayoutCreate(&desc.a, cuda_type(b.scalar_type()), K, N, K), "layout of b");
  check(cublasLtMatrixLayoutCreate(&desc.b, cuda_type(a.scalar_type()), K, M, K), "layout of a");
  check(cublasLtMatrixLayoutCreate(&desc.d, cuda_type(out_dtype), N, M, N), "layout of out");

  // Everything the heuristic's choice depends on: shapes, types, epilogue, accumulation and
  // the alignment of every buffer.
  const uint32_t align_a = alignment_of(b.data_ptr()), align_b = alignment_of(a.data_ptr()),
                 align_out = alignment_of(out.data_ptr());
  const std::string problem =
      c10::str(device, ":", M, "x", N, "x", K, ":", cuda_type(a.scalar_type()), ",",
               cuda_type(b.scalar_type()), ",", cuda_type(out_dtype), ":", bias_in_epilogue,
               use_fast_accum, ":", align_a, ",", align_b, ",", align_out);
  const cublasLtMatmulAlgo_t* algo = cached_algorithm(problem);
  if (algo == nullptr) {
    check(cublasLtMatmulPreferenceCreate(&desc.pref), "cublasLtMatmulPreferenceCreate");
    set_pref(CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, "MAX_WORKSPACE_BYTES", kWorkspaceBytes);
    set_pref(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, "MIN_ALIGNMENT_A", align_a);
    set_pref(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, "MIN_ALIGNMENT_B", align_b);
    set_pref(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, "MIN_ALIGNMENT_C", align_out);
    set_pref(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, "MIN_ALIGNMENT_D", align_out);
    cublasLtMatmulHeuristicResult_t heuristic = {};
    int found = 0;
    check(cublasLtMatmulAlgoGetHeuristic(handle, desc.op, desc.a, desc.b, desc.d, desc.d,
                                         desc.pref, 1, &heuristic, &found),
          "cublasLtMatmulAlgoGetHeuristic");
    TORCH_CHECK(found > 0, "transformer_fp8: cuBLASLt found no FP8 algorithm for fp8_gemm ",
                shapes, " and out_dtype ", c10::toString(out_dtype),
                " (FP8 GEMMs need sm_89 or newer)");
    algo = remember_algorithm(problem, heuristic.algo);
  }

  const float alpha = 1.0f, beta = 0.0f;
  check(cublasLtMatmul(handle, desc.op, &alpha, b.data_ptr(), desc.a, a.data_ptr(), desc.b, &beta,
                       out.data_ptr(), desc.d, out.data_ptr(), desc.d, algo, workspace,
                       kWorkspaceBytes, stream),
        "cublasLtMatmul");
  if (bias_c.has_value() && !bias_in_epilogue) out.add_(*bias_c);
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(transformer_fp8, CUDA, m) { m.impl("fp8_gemm", &fp8_gemm_cuda); }

}  // namespace transformer_fp8
