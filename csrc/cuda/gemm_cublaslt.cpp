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

#define TFP8_CHECK_CUBLAS(call, shapes)                                                       \
  do {                                                                                        \
    const cublasStatus_t status_ = (call);                                                    \
    TORCH_CHECK(status_ == CUBLAS_STATUS_SUCCESS, "transformer_fp8: ", #call, " failed with ", \
                cublasLt_status_name(status_), " for fp8_gemm ", shapes);                     \
  } while (0)

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

// One handle per device, and one 32 MiB workspace per (device, stream) so that GEMMs on
// different streams never share scratch memory. Both live until the process exits.
struct LtResources {
  std::mutex mutex;
  std::map<int, cublasLtHandle_t> handles;
  std::map<std::pair<int, cudaStream_t>, at::Tensor> workspaces;
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
  TFP8_CHECK_CUBLAS(cublasLtCreate(&handle), "(creating the cuBLASLt handle)");
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
  TFP8_CHECK_CUBLAS(cublasLtMatmulDescCreate(&desc.op, CUBLAS_COMPUTE_32F, CUDA_R_32F), shapes);
  const cublasOperation_t trans_a = CUBLAS_OP_T, trans_b = CUBLAS_OP_N;
  TFP8_CHECK_CUBLAS(cublasLtMatmulDescSetAttribute(desc.op, CUBLASLT_MATMUL_DESC_TRANSA, &trans_a,
                                                   sizeof(trans_a)), shapes);
  TFP8_CHECK_CUBLAS(cublasLtMatmulDescSetAttribute(desc.op, CUBLASLT_MATMUL_DESC_TRANSB, &trans_b,
                                                   sizeof(trans_b)), shapes);
  const int8_t fast_accum = use_fast_accum ? 1 : 0;
  TFP8_CHECK_CUBLAS(cublasLtMatmulDescSetAttribute(desc.op, CUBLASLT_MATMUL_DESC_FAST_ACCUM,
                                                   &fast_accum, sizeof(fast_accum)), shapes);
  // cuBLASLt's A is our b, its B is our a.
  const void* lt_a_scale = b_scale_inv.data_ptr();
  const void* lt_b_scale = a_scale_inv.data_ptr();
  TFP8_CHECK_CUBLAS(cublasLtMatmulDescSetAttribute(desc.op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER,
                                                   &lt_a_scale, sizeof(lt_a_scale)), shapes);
  TFP8_CHECK_CUBLAS(cublasLtMatmulDescSetAttribute(desc.op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER,
                                                   &lt_b_scale, sizeof(lt_b_scale)), shapes);
  if (bias_in_epilogue) {
    const cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_BIAS;
    const void* bias_ptr = bias_c->data_ptr();
    const cudaDataType_t bias_type = cuda_type(out_dtype);
    TFP8_CHECK_CUBLAS(cublasLtMatmulDescSetAttribute(desc.op, CUBLASLT_MATMUL_DESC_EPILOGUE,
                                                     &epilogue, sizeof(epilogue)), shapes);
    TFP8_CHECK_CUBLAS(cublasLtMatmulDescSetAttribute(desc.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                                                     &bias_ptr, sizeof(bias_ptr)), shapes);
    TFP8_CHECK_CUBLAS(cublasLtMatmulDescSetAttribute(
                          desc.op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_type,
                          sizeof(bias_type)), shapes);
  }
  TFP8_CHECK_CUBLAS(cublasLtMatrixLayoutCreate(&desc.a, cuda_type(b.scalar_type()), K, N, K), shapes);
  TFP8_CHECK_CUBLAS(cublasLtMatrixLayoutCreate(&desc.b, cuda_type(a.scalar_type()), K, M, K), shapes);
  TFP8_CHECK_CUBLAS(cublasLtMatrixLayoutCreate(&desc.d, cuda_type(out_dtype), N, M, N), shapes);

  TFP8_CHECK_CUBLAS(cublasLtMatmulPreferenceCreate(&desc.pref), shapes);
  const size_t ws_bytes = kWorkspaceBytes;
  TFP8_CHECK_CUBLAS(cublasLtMatmulPreferenceSetAttribute(
                        desc.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes,
                        sizeof(ws_bytes)), shapes);
  const uint32_t align_a = alignment_of(b.data_ptr()), align_b = alignment_of(a.data_ptr()),
                 align_d = alignment_of(out.data_ptr());
  TFP8_CHECK_CUBLAS(cublasLtMatmulPreferenceSetAttribute(
                        desc.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &align_a,
                        sizeof(align_a)), shapes);
  TFP8_CHECK_CUBLAS(cublasLtMatmulPreferenceSetAttribute(
                        desc.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &align_b,
                        sizeof(align_b)), shapes);
  TFP8_CHECK_CUBLAS(cublasLtMatmulPreferenceSetAttribute(
                        desc.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &align_d,
                        sizeof(align_d)), shapes);
  TFP8_CHECK_CUBLAS(cublasLtMatmulPreferenceSetAttribute(
                        desc.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &align_d,
                        sizeof(align_d)), shapes);
  cublasLtMatmulHeuristicResult_t heuristic = {};
  int found = 0;
  TFP8_CHECK_CUBLAS(cublasLtMatmulAlgoGetHeuristic(handle, desc.op, desc.a, desc.b, desc.d,
                                                   desc.d, desc.pref, 1, &heuristic, &found),
                    shapes);
  TORCH_CHECK(found > 0, "transformer_fp8: cuBLASLt found no FP8 algorithm for fp8_gemm ", shapes,
              " and out_dtype ", c10::toString(out_dtype), " (FP8 GEMMs need sm_89 or newer)");

  const float alpha = 1.0f, beta = 0.0f;
  TFP8_CHECK_CUBLAS(cublasLtMatmul(handle, desc.op, &alpha, b.data_ptr(), desc.a, a.data_ptr(),
                                   desc.b, &beta, out.data_ptr(), desc.d, out.data_ptr(), desc.d,
                                   &heuristic.algo, workspace, kWorkspaceBytes, stream),
                    shapes);
  if (bias_c.has_value() && !bias_in_epilogue) out.add_(*bias_c);
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(transformer_fp8, CUDA, m) { m.impl("fp8_gemm", &fp8_gemm_cuda); }

}  // namespace transformer_fp8
