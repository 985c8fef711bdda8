// The cuBLASLt handle and workspace of gemm_cublaslt.cpp, shared with the other cuBLASLt
// callers (gemm_blockwise_cublaslt.cpp): one handle per device, one workspace per stream; and
// the preparation both GEMMs give their operands.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Optional.h>
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace transformer_fp8 {

cublasLtHandle_t cublaslt_handle(int device);
void* cublaslt_workspace(int device, cudaStream_t stream);
size_t cublaslt_workspace_bytes();
const char* cublaslt_status_string(cublasStatus_t status);
// The largest power of two (<= 256) that divides the address.
uint32_t cublaslt_alignment_of(const void* p);

// t as cuBLASLt's FP8 kernels read it: contiguous and 16-byte aligned (a fresh copy always is).
at::Tensor cublaslt_operand(const at::Tensor& t);

// The product out [M, N] of a [M, K] and b [N, K] when it has nothing to compute (M, N or K is
// 0): fills out (zeros plus the bias when K is 0) and returns true; else returns false.
bool fill_trivial_product(at::Tensor& out, int64_t K, const c10::optional<at::Tensor>& bias);

}  // namespace transformer_fp8
