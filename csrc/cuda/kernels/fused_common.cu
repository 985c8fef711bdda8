// Kernels shared by the fused operators: the second stage of the column sums (dbias, dweight).
// (The transpose of their FP8 outputs, launch_transpose_bytes, is in cast.cu, on
// cast_transpose's tiles.)
#include "fused_store.cuh"
#include "kernels.h"

namespace transformer_fp8 {
namespace cuda {
namespace {

// One warp per block: a column sum of N = 4096 columns gets 128 blocks (it had 16 of 256
// threads, 116 of 132 SMs idle), and each thread keeps kSumUnroll loads in flight before adding
// them.
constexpr int kSumThreads = 32;
constexpr int kSumUnroll = 16;

// One thread per column, chunks added in index order (the loads of kSumUnroll chunks are
// issued first; the adds keep the order): the result does not depend on timing or on the
// unrolling.
template <typename OutT>
__global__ void __launch_bounds__(kSumThreads)
column_sums_kernel(const float* __restrict__ partials, int64_t chunks, int64_t cols,
                   OutT* __restrict__ out) {
  const int64_t col = static_cast<int64_t>(blockIdx.x) * kSumThreads + threadIdx.x;
  if (col >= cols) return;
  float sum = 0.0f;
  int64_t k = 0;
  for (; k + kSumUnroll <= chunks; k += kSumUnroll) {
    float loaded[kSumUnroll];
#pragma unroll
    for (int u = 0; u < kSumUnroll; ++u) loaded[u] = partials[(k + u) * cols + col];
#pragma unroll
    for (int u = 0; u < kSumUnroll; ++u) sum += loaded[u];
  }
  for (; k < chunks; ++k) sum += partials[k * cols + col];
  out[col] = round_to<OutT>(sum);
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

}  // namespace cuda
}  // namespace transformer_fp8
