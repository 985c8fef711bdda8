// CUDA kernels of fp8_operand_stats (numerics in csrc/operand_stats.h, shared with the CPU
// kernel): one launch computes every unit's partial (a thread block per unit, a fixed-shape tree
// reduction), a second one, a single thread block, combines them block by block and writes the
// 12 fields. Deterministic: the order of every addition is fixed by the geometry.
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <climits>

#include "device_utils.cuh"
#include "kernels.h"

namespace transformer_fp8 {
namespace cuda {
namespace {

constexpr int kStatsThreads = 256;
static_assert((kStatsThreads & (kStatsThreads - 1)) == 0, "tree_reduce needs a power of two");

template <Fp8Format F>
__device__ __forceinline__ float fp8_byte_to_float(uint8_t byte) {
  return __half2float(__half(__nv_cvt_fp8_to_halfraw(byte, interpretation<F>())));
}

__device__ __forceinline__ float block_scale(const float* scale, int64_t stride_down,
                                             int64_t stride_across, const StatsGeometry& g,
                                             int64_t block) {
  return scale[(block / g.blocks_across) * stride_down +
               (block % g.blocks_across) * stride_across];
}

// shared[0] = the merge of shared[0..blockDim.x) (blockDim.x a power of two), in a fixed order.
template <typename T, typename Merge>
__device__ void tree_reduce(T* shared, Merge merge) {
  __syncthreads();
  for (int stride = blockDim.x / 2; stride > 0; stride >>= 1) {
    if (threadIdx.x < stride) merge(shared[threadIdx.x], shared[threadIdx.x + stride]);
    __syncthreads();
  }
}

template <typename XT, Fp8Format F>
__global__ void __launch_bounds__(kStatsThreads)
operand_stats_units(const XT* __restrict__ x, const uint8_t* __restrict__ q,
                    const float* __restrict__ scale, int64_t stride_down, int64_t stride_across,
                    StatsGeometry g, float saturation_bound, StatsPartial* __restrict__ partials) {
  __shared__ StatsPartial shared[kStatsThreads];
  const int64_t unit = blockIdx.x;
  const int64_t block = unit / g.chunks_per_block, k = unit % g.chunks_per_block;
  const float s = block_scale(scale, stride_down, stride_across, g, block);
  const int64_t begin = k * g.chunk;
  const int64_t end = begin + g.chunk < g.block_elements() ? begin + g.chunk : g.block_elements();
  StatsPartial p = stats_empty();
  for (int64_t e = begin + threadIdx.x; e < end; e += blockDim.x) {
    const int64_t i = g.element(block, e);
    if (i >= 0) {
      stats_add_element(p, to_float(x[i]), fp8_byte_to_float<F>(q[i]), s, saturation_bound);
    }
  }
  shared[threadIdx.x] = p;
  tree_reduce(shared, [](StatsPartial& a, const StatsPartial& b) { stats_merge(a, b); });
  if (threadIdx.x == 0) partials[unit] = shared[0];
}

__global__ void __launch_bounds__(kStatsThreads)
operand_stats_finish(const StatsPartial* __restrict__ partials, const float* __restrict__ scale,
                     int64_t stride_down, int64_t stride_across, StatsGeometry g,
                     double* __restrict__ out) {
  __shared__ StatsTotal totals[kStatsThreads];
  __shared__ StatsPartial chunks[kStatsThreads];
  StatsTotal t = total_empty();
  if (g.blocks() == 1) {  // one block (per-tensor scaling): its chunks shared by the threads
    StatsPartial p = stats_empty();
    for (int64_t k = threadIdx.x; k < g.chunks_per_block; k += blockDim.x)
      stats_merge(p, partials[k]);
    chunks[threadIdx.x] = p;
    tree_reduce(chunks, [](StatsPartial& a, const StatsPartial& b) { stats_merge(a, b); });
    if (threadIdx.x == 0) total_add_block(t, chunks[0], scale[0]);
  } else {  // many blocks: a thread combines whole blocks, chunk by chunk
    for (int64_t b = threadIdx.x; b < g.blocks(); b += blockDim.x) {
      StatsPartial block = stats_empty();
      for (int64_t k = 0; k < g.chunks_per_block; ++k)
        stats_merge(block, partials[b * g.chunks_per_block + k]);
      total_add_block(t, block, block_scale(scale, stride_down, stride_across, g, b));
    }
  }
  totals[threadIdx.x] = t;
  tree_reduce(totals, [](StatsTotal& a, const StatsTotal& b) { total_merge(a, b); });
  if (threadIdx.x == 0) total_write(totals[0], out);
}

template <typename XT>
void launch_units(const XT* x, const uint8_t* q, Fp8Format fmt, const float* scale,
                  int64_t stride_down, int64_t stride_across, const StatsGeometry& g,
                  float saturation_bound, StatsPartial* partials, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(g.units()));
  if (fmt == Fp8Format::E4M3)
    operand_stats_units<XT, Fp8Format::E4M3><<<grid, kStatsThreads, 0, stream>>>(
        x, q, scale, stride_down, stride_across, g, saturation_bound, partials);
  else
    operand_stats_units<XT, Fp8Format::E5M2><<<grid, kStatsThreads, 0, stream>>>(
        x, q, scale, stride_down, stride_across, g, saturation_bound, partials);
}

}  // namespace

cudaError_t launch_operand_stats(const void* x, HpType x_type, const uint8_t* q, Fp8Format fmt,
                                 const float* scale, int64_t scale_stride_down,
                                 int64_t scale_stride_across, const StatsGeometry& g,
                                 float saturation_bound, StatsPartial* partials, double* out,
                                 cudaStream_t stream) {
  if (g.units() > INT_MAX) return cudaErrorInvalidConfiguration;
  if (g.units() > 0) {
    switch (x_type) {
      case HpType::Float32:
        launch_units(static_cast<const float*>(x), q, fmt, scale, scale_stride_down,
                     scale_stride_across, g, saturation_bound, partials, stream);
        break;
      case HpType::BFloat16:
        launch_units(static_cast<const __nv_bfloat16*>(x), q, fmt, scale, scale_stride_down,
                     scale_stride_across, g, saturation_bound, partials, stream);
        break;
      default:
        launch_units(static_cast<const __half*>(x), q, fmt, scale, scale_stride_down,
                     scale_stride_across, g, saturation_bound, partials, stream);
    }
    const cudaError_t status = cudaGetLastError();
    if (status != cudaSuccess) return status;
  }
  operand_stats_finish<<<1, kStatsThreads, 0, stream>>>(partials, scale, scale_stride_down,
                                                        scale_stride_across, g, out);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace transformer_fp8
