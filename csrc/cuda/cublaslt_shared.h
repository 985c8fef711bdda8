// The cuBLASLt handle and workspace of gemm_cublaslt.cpp, shared with the other cuBLASLt
// callers (gemm_blockwise_cublaslt.cpp): one handle per device, one workspace per stream.
#pragma once

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

}  // namespace transformer_fp8
