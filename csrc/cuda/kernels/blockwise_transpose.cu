// quantize_blockwise with 1x128 blocks and with_transpose: x [M, K] and x^T [K, M] quantised in
// one read of x. The result is bit for bit that of quantize_rows_kernel (blockwise.cu) on x and
// on x.t().contiguous(): the same scale rule (block_scale_from_amax) and saturating cast
// (cast_pair), and amaxes that are exact maxima (NaN propagating), so the order in which they
// are reduced does not matter.
//
// One block of 256 threads per 128 x 128 tile of x (edge tiles smaller): a tile holds whole
// 1x128 blocks of x (its rows) and of x^T (its columns). Thread t loads packs of 8 elements at
// rows t / 16 + 16 u (u = 0..7), columns 8 (t % 16) .. + 7: each row's 16 packs lie in one
// half-warp (row amax: 4 shuffles), and each thread keeps the same 8 columns (column amax: its
// 8 rows, one shuffle, then 8 warps through shared memory). The packs stay in registers (in
// shared memory in the staged kernel, below):
//   1. row amax -> row scale -> x_fp8 (8-byte stores) and scale_inv;
//   2. column amax -> column scale -> scale_inv_t;
//   3. the packs cast with their column scales into the swizzled shared FP8 tile, which
//      cast_transpose's phase 2 (fp8_tile.cuh) writes to x_t_fp8 with 16-byte stores.
// Elements outside x are loaded as 0: |0| leaves an amax unchanged, and their bytes are never
// stored.
//
// Two kernels, chosen at run time by the environment variable
// TRANSFORMER_FP8_BLOCKWISE_TRANSPOSE_KERNEL (read once, by the operator: blockwise_ops.cpp):
//   registers (the default, or unset/empty): quantize_rows_and_cols_kernel below, the 8 packs in
//            registers through all three phases (111 registers for bf16/fp16: 2 blocks per SM);
//   staged:  blockwise_transpose_staged.cu, the packs parked in shared memory as they arrive
//            (60 registers: 4 blocks per SM); bf16/fp16 only, float32 x runs `registers`.
// Both run the same phase-1/phase-2 functions (blockwise_transpose.cuh) and the same casts on the
// same packs: the same bits.
#include "blockwise_transpose.cuh"

namespace transformer_fp8 {
namespace cuda {
namespace {

using namespace rows_and_cols;

// g: the blocks of x [rows, cols]; gt: those of x^T [cols, rows].
template <Fp8Format F, typename InT>
__global__ void __launch_bounds__(kThreads)
quantize_rows_and_cols_kernel(const InT* __restrict__ x, BlockGeometry g, BlockGeometry gt,
                              bool power_2_scale, bool row_vec, bool col_vec,
                              uint8_t* __restrict__ out, float* __restrict__ scale_inv,
                              uint8_t* __restrict__ out_t, float* __restrict__ scale_inv_t) {
  __shared__ ColumnScratch cols;
  __shared__ __align__(16) uint32_t tile[kTile * kTileWords];  // 8-byte stores into it

  int64_t br, bc;
  const Tile t = tile_of_block(g, out_t, br, bc);
  const int c = (threadIdx.x % kPacksPerRow) * kVec, first_row = threadIdx.x / kPacksPerRow;
  Pack8<InT> packs[kPacks];
#pragma unroll
  for (int u = 0; u < kPacks; ++u)
    packs[u] = load_pack(x, g.cols, t, first_row + u * kRowsPerPass, c, row_vec);

  // 1. Rows.
  float col_amax[kVec];
#pragma unroll
  for (int j = 0; j < kVec; ++j) col_amax[j] = 0.0f;
#pragma unroll
  for (int u = 0; u < kPacks; ++u)
    quantize_row_pack<F>(packs[u], first_row + u * kRowsPerPass, c, t, g, bc, power_2_scale,
                         row_vec, out, scale_inv, col_amax);

  // 2. Columns.
  column_scales<F>(col_amax, c, t, gt, br, power_2_scale, scale_inv_t, cols);

  // 3. The packs with their column scales into the shared tile, then out by columns.
  float scales[kVec];
#pragma unroll
  for (int j = 0; j < kVec; ++j) scales[j] = cols.scale[c + j];
  float unused = 0.0f;
#pragma unroll
  for (int u = 0; u < kPacks; ++u) {
    const int r = first_row + u * kRowsPerPass;
    *reinterpret_cast<uint2*>(&tile[tile_word(r, c / 4)]) = cast_pack8<F>(packs[u], scales, unused);
  }
  __syncthreads();
  if (col_vec)
    write_tile_cols_vec(t, tile);
  else
    write_tile_cols_scalar(t, tile);
}

template <Fp8Format F, typename InT>
cudaError_t launch_typed(const void* x, const BlockGeometry& g, bool power_2_scale, uint8_t* out,
                         float* scale_inv, uint8_t* out_t, float* scale_inv_t,
                         cudaStream_t stream) {
  const Launch l = launch_of<InT>(x, g, out, out_t);
  quantize_rows_and_cols_kernel<F, InT><<<l.tiles, kThreads, 0, stream>>>(
      static_cast<const InT*>(x), g, transposed_geometry(g), power_2_scale, l.row_vec, l.col_vec,
      out, scale_inv, out_t, scale_inv_t);
  return cudaGetLastError();
}

template <typename InT>
cudaError_t launch_format(const void* x, const BlockGeometry& g, Fp8Format fmt,
                          bool power_2_scale, uint8_t* out, float* scale_inv, uint8_t* out_t,
                          float* scale_inv_t, cudaStream_t stream) {
  return fmt == Fp8Format::E4M3
             ? launch_typed<Fp8Format::E4M3, InT>(x, g, power_2_scale, out, scale_inv, out_t,
                                                  scale_inv_t, stream)
             : launch_typed<Fp8Format::E5M2, InT>(x, g, power_2_scale, out, scale_inv, out_t,
                                                  scale_inv_t, stream);
}

}  // namespace

cudaError_t launch_quantize_blockwise_with_transpose(const void* x, HpType x_type,
                                                     const BlockGeometry& g, Fp8Format fmt,
                                                     bool power_2_scale, uint8_t* out,
                                                     float* scale_inv, uint8_t* out_t,
                                                     float* scale_inv_t,
                                                     BlockwiseTransposeKernel kernel,
                                                     cudaStream_t stream) {
  if (g.rows == 0 || g.cols == 0) return cudaSuccess;
  if (kernel == BlockwiseTransposeKernel::Staged && x_type != HpType::Float32)
    return launch_staged(x, x_type, g, fmt, power_2_scale, out, scale_inv, out_t, scale_inv_t,
                         stream);
  switch (x_type) {
    case HpType::Float32:
      return launch_format<float>(x, g, fmt, power_2_scale, out, scale_inv, out_t, scale_inv_t,
                                  stream);
    case HpType::BFloat16:
      return launch_format<__nv_bfloat16>(x, g, fmt, power_2_scale, out, scale_inv, out_t,
                                          scale_inv_t, stream);
    default:
      return launch_format<__half>(x, g, fmt, power_2_scale, out, scale_inv, out_t, scale_inv_t,
                                   stream);
  }
}

}  // namespace cuda
}  // namespace transformer_fp8
