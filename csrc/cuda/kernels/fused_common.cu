// Kernels shared by the fused operators: the second stage of the column sums (dbias, dweight)
// and the transpose of FP8 bytes (the y_t / dx_t outputs, padding columns included).
#include "fused_store.cuh"
#include "kernels.h"

namespace transformer_fp8 {
namespace cuda {
namespace {

constexpr int kSumThreads = 256;
constexpr int kTransposeTile = 32;
constexpr int kTransposeRowsPerPass = 8;

// One thread per column, chunks added in index order: the result does not depend on timing.
template <typename OutT>
__global__ void __launch_bounds__(kSumThreads)
column_sums_kernel(const float* __restrict__ partials, int64_t chunks, int64_t cols,
                   OutT* __restrict__ out) {
  const int64_t col = static_cast<int64_t>(blockIdx.x) * kSumThreads + threadIdx.x;
  if (col >= cols) return;
  float sum = 0.0f;
  for (int64_t k = 0; k < chunks; ++k) sum += partials[k * cols + col];
  out[col] = round_to<OutT>(sum);
}

// 32 x 32 byte tiles through shared memory (one padding byte per row against bank conflicts):
// reads along the rows of in and writes along the rows of out, both coalesced.
__global__ void __launch_bounds__(kTransposeTile * kTransposeRowsPerPass)
transpose_bytes_kernel(const uint8_t* __restrict__ in, int64_t rows, int64_t cols,
                       uint8_t* __restrict__ out) {
  __shared__ uint8_t tile[kTransposeTile][kTransposeTile + 1];
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * kTransposeTile;
  const int64_t c0 = static_cast<int64_t>(blockIdx.y) * kTransposeTile;
  for (int i = threadIdx.y; i < kTransposeTile; i += kTransposeRowsPerPass) {
    const int64_t r = r0 + i, c = c0 + threadIdx.x;
    if (r < rows && c < cols) tile[i][threadIdx.x] = in[r * cols + c];
  }
  __syncthreads();
  for (int i = threadIdx.y; i < kTransposeTile; i += kTransposeRowsPerPass) {
    const int64_t c = c0 + i, r = r0 + threadIdx.x;
    if (r < rows && c < cols) out[c * rows + r] = tile[threadIdx.x][i];
  }
}

}  // namespace

cudaError_t launch_column_sums(const float* partials, int64_t chunks, int64_t cols, void* out,
                               HpType out_type, cudaStream_t stream) {
  if (cols == 0) return cudaSuccess;
  const unsigned grid = static_cast<unsigned>((cols + kSumThreads - 1) / kSumThreads);
  with_input_type(out_type, [&](auto* tag) {
    using OutT = std::remove_pointer_t<decltype(tag)>;
    column_sums_kernel<OutT><<<grid, kSumThreads, 0, stream>>>(partials, chunks, cols,
                                                               static_cast<OutT*>(out));
  });
  return cudaGetLastError();
}

cudaError_t launch_transpose_bytes(const uint8_t* in, int64_t rows, int64_t cols, uint8_t* out,
                                   cudaStream_t stream) {
  if (rows == 0 || cols == 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>((rows + kTransposeTile - 1) / kTransposeTile),
                  static_cast<unsigned>((cols + kTransposeTile - 1) / kTransposeTile));
  const dim3 block(kTransposeTile, kTransposeRowsPerPass);
  transpose_bytes_kernel<<<grid, block, 0, stream>>>(in, rows, cols, out);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace transformer_fp8
