// CUDA kernels of quantize_blockwise. Reference: csrc/cpu/blockwise.cpp; numerics and scale
// layouts: csrc/blockwise_common.h. Two reads of each block (amax, then the cast); the second
// comes from L1/L2. Not tuned: a first, correct version.
#include "blockwise_kernels.h"
#include "device_utils.cuh"

namespace transformer_fp8 {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarpsPerBlock = kThreads / 32;

__device__ __forceinline__ float warp_nan_max(float v) {
  for (int offset = 16; offset > 0; offset >>= 1)
    v = nan_max(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

// 1 x block_cols blocks (1x128 tiles, or whole rows): one warp per block.
template <Fp8Format F, typename InT>
__global__ void __launch_bounds__(kThreads)
quantize_rows_kernel(const InT* __restrict__ x, BlockGeometry g, bool power_2_scale,
                     uint8_t* __restrict__ out, float* __restrict__ scale_inv) {
  constexpr double kMax = F == Fp8Format::E4M3 ? kE4M3Max : kE5M2Max;
  const int64_t block = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x & 31;
  if (block >= g.scale_rows * g.scale_cols) return;  // the whole warp leaves together
  const int64_t r = block / g.scale_cols, bc = block % g.scale_cols;
  const int64_t c0 = bc * g.block_cols;
  const int64_t c1 = c0 + g.block_cols < g.cols ? c0 + g.block_cols : g.cols;
  const InT* row = x + r * g.cols;
  float amax = 0.0f;
  for (int64_t c = c0 + lane; c < c1; c += 32) amax = nan_max(amax, fabsf(to_float(row[c])));
  amax = warp_nan_max(amax);
  const float scale = block_scale_from_amax(amax, kMax, power_2_scale);
  float unused = 0.0f;
  for (int64_t c = c0 + lane; c < c1; c += 32) out[r * g.cols + c] = cast_one<F>(row[c], scale, unused);
  if (lane == 0) scale_inv[r * g.stride0 + bc * g.stride1] = 1.0f / scale;
}

// 128 x 128 blocks: one thread block per block, 128 consecutive columns per pass (coalesced).
template <Fp8Format F, typename InT>
__global__ void __launch_bounds__(kThreads)
quantize_tiles_kernel(const InT* __restrict__ x, BlockGeometry g, bool power_2_scale,
                      uint8_t* __restrict__ out, float* __restrict__ scale_inv) {
  constexpr double kMax = F == Fp8Format::E4M3 ? kE4M3Max : kE5M2Max;
  __shared__ float block_amax;
  const int64_t br = blockIdx.x / g.scale_cols, bc = blockIdx.x % g.scale_cols;
  const int64_t r0 = br * kScaleBlock, c0 = bc * kScaleBlock;
  const int64_t h = g.rows - r0 < kScaleBlock ? g.rows - r0 : kScaleBlock;
  const int64_t w = g.cols - c0 < kScaleBlock ? g.cols - c0 : kScaleBlock;
  float amax = 0.0f;
  for (int i = threadIdx.x; i < kScaleBlock * kScaleBlock; i += kThreads) {
    const int64_t r = i / kScaleBlock, c = i % kScaleBlock;
    if (r < h && c < w) amax = nan_max(amax, fabsf(to_float(x[(r0 + r) * g.cols + c0 + c])));
  }
  amax = block_nan_max(amax);  // valid in thread 0
  if (threadIdx.x == 0) block_amax = amax;
  __syncthreads();
  const float scale = block_scale_from_amax(block_amax, kMax, power_2_scale);
  float unused = 0.0f;
  for (int i = threadIdx.x; i < kScaleBlock * kScaleBlock; i += kThreads) {
    const int64_t r = i / kScaleBlock, c = i % kScaleBlock;
    if (r < h && c < w) {
      const int64_t at = (r0 + r) * g.cols + c0 + c;
      out[at] = cast_one<F>(x[at], scale, unused);
    }
  }
  if (threadIdx.x == 0) scale_inv[br * g.stride0 + bc * g.stride1] = 1.0f / scale;
}

template <Fp8Format F, typename InT>
cudaError_t launch_typed(const InT* x, const BlockGeometry& g, bool power_2_scale, uint8_t* out,
                         float* scale_inv, cudaStream_t stream) {
  const int64_t blocks = g.scale_rows * g.scale_cols;
  if (blocks == 0) return cudaSuccess;
  if (g.mode == BlockMode::Blk128) {
    quantize_tiles_kernel<F, InT><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
        x, g, power_2_scale, out, scale_inv);
  } else {
    const int64_t grid = (blocks + kWarpsPerBlock - 1) / kWarpsPerBlock;
    quantize_rows_kernel<F, InT><<<static_cast<unsigned>(grid), kThreads, 0, stream>>>(
        x, g, power_2_scale, out, scale_inv);
  }
  return cudaGetLastError();
}

template <typename InT>
cudaError_t launch_format(const void* x, const BlockGeometry& g, Fp8Format fmt,
                          bool power_2_scale, uint8_t* out, float* scale_inv,
                          cudaStream_t stream) {
  const InT* xt = static_cast<const InT*>(x);
  return fmt == Fp8Format::E4M3
             ? launch_typed<Fp8Format::E4M3>(xt, g, power_2_scale, out, scale_inv, stream)
             : launch_typed<Fp8Format::E5M2>(xt, g, power_2_scale, out, scale_inv, stream);
}

}  // namespace

cudaError_t launch_quantize_blockwise(const void* x, HpType x_type, const BlockGeometry& g,
                                      Fp8Format fmt, bool power_2_scale, uint8_t* out,
                                      float* scale_inv, cudaStream_t stream) {
  switch (x_type) {
    case HpType::Float32:
      return launch_format<float>(x, g, fmt, power_2_scale, out, scale_inv, stream);
    case HpType::BFloat16:
      return launch_format<__nv_bfloat16>(x, g, fmt, power_2_scale, out, scale_inv, stream);
    default:
      return launch_format<__half>(x, g, fmt, power_2_scale, out, scale_inv, stream);
  }
}

}  // namespace cuda
}  // namespace transformer_fp8
