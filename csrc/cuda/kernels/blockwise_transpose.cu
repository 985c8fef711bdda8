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
// 8 rows, one shuffle, then 8 warps through shared memory). The packs stay in registers:
//   1. row amax -> row scale -> x_fp8 (8-byte stores) and scale_inv;
//   2. column amax -> column scale -> scale_inv_t;
//   3. the packs cast with their column scales into the swizzled shared FP8 tile, which
//      cast_transpose's phase 2 (fp8_tile.cuh) writes to x_t_fp8 with 16-byte stores.
// Elements outside x are loaded as 0: |0| leaves an amax unchanged, and their bytes are never
// stored.
#include "blockwise_kernels.h"
#include "device_utils.cuh"
#include "fp8_tile.cuh"

namespace transformer_fp8 {
namespace cuda {
namespace {

constexpr int kThreads = kTileThreads;                    // 256
constexpr int kWarps = kThreads / 32;
constexpr int kVec = 8;                                   // elements per pack
constexpr int kPacksPerRow = kTile / kVec;                // 16
constexpr int kPacks = kTile * kTile / kVec / kThreads;   // 8 packs per thread
constexpr int kRowsPerPass = kThreads / kPacksPerRow;     // 16 rows per pack index u

__device__ __forceinline__ void set_zero(float& v) { v = 0.0f; }
__device__ __forceinline__ void set_zero(__nv_bfloat16& v) { v = __ushort_as_bfloat16(0); }
__device__ __forceinline__ void set_zero(__half& v) { v = __ushort_as_half(0); }

// One tile: its first row and column in x, its extent inside x, and what phase 2 needs: out_t at
// the tile's first transposed element, the row pitch of out_t.
struct Tile {
  int64_t r0, c0;
  int n_rows, n_cols;
  uint8_t* out_t;
  int64_t pitch_t;
};

// The pack at tile row r, tile columns c .. c + 7 (zeros outside x). vec: cols % 8 == 0 and x
// aligned, so that a pack is wholly inside or wholly outside.
template <typename InT>
__device__ __forceinline__ Pack8<InT> load_pack(const InT* __restrict__ x, int64_t cols,
                                                const Tile& t, int r, int c, bool vec) {
  Pack8<InT> p;
  const bool in_row = r < t.n_rows;
  if (vec && in_row && c < t.n_cols)
    return *reinterpret_cast<const Pack8<InT>*>(x + (t.r0 + r) * cols + t.c0 + c);
#pragma unroll
  for (int j = 0; j < kVec; ++j) {
    if (!vec && in_row && c + j < t.n_cols)
      p.v[j] = x[(t.r0 + r) * cols + t.c0 + c + j];
    else
      set_zero(p.v[j]);
  }
  return p;
}

__device__ __forceinline__ void store_bytes(uint8_t* __restrict__ out, int64_t cols, const Tile& t,
                                            int r, int c, bool vec, uint2 bytes) {
  if (r >= t.n_rows) return;
  uint8_t* at = out + (t.r0 + r) * cols + t.c0 + c;
  if (vec) {
    if (c < t.n_cols) *reinterpret_cast<uint2*>(at) = bytes;
    return;
  }
  const uint64_t word = (static_cast<uint64_t>(bytes.y) << 32) | bytes.x;
#pragma unroll
  for (int j = 0; j < kVec; ++j)
    if (c + j < t.n_cols) at[j] = static_cast<uint8_t>(word >> (8 * j));
}

// g: the blocks of x [rows, cols]; gt: those of x^T [cols, rows]. row_vec: cols % 8 == 0, x and
// out aligned; col_vec: rows % 16 == 0, out_t 16-byte aligned.
template <Fp8Format F, typename InT>
__global__ void __launch_bounds__(kThreads)
quantize_rows_and_cols_kernel(const InT* __restrict__ x, BlockGeometry g, BlockGeometry gt,
                              bool power_2_scale, bool row_vec, bool col_vec,
                              uint8_t* __restrict__ out, float* __restrict__ scale_inv,
                              uint8_t* __restrict__ out_t, float* __restrict__ scale_inv_t) {
  constexpr double kMax = F == Fp8Format::E4M3 ? kE4M3Max : kE5M2Max;
  __shared__ float4 col_partial[kWarps][kTile / 4];  // per warp, the amax of each column
  __shared__ float col_scale[kTile];
  __shared__ __align__(16) uint32_t tile[kTile * kTileWords];  // 8-byte stores into it

  const int64_t tiles_across = g.scale_cols;  // 1x128 blocks per row = 128-column tiles
  const int64_t br = blockIdx.x / tiles_across, bc = blockIdx.x % tiles_across;
  Tile t;
  t.r0 = br * kTile;
  t.c0 = bc * kTile;
  t.n_rows = static_cast<int>(g.rows - t.r0 < kTile ? g.rows - t.r0 : kTile);
  t.n_cols = static_cast<int>(g.cols - t.c0 < kTile ? g.cols - t.c0 : kTile);
  t.out_t = out_t + t.c0 * g.rows + t.r0;
  t.pitch_t = g.rows;

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int c = (threadIdx.x % kPacksPerRow) * kVec, first_row = threadIdx.x / kPacksPerRow;
  Pack8<InT> packs[kPacks];
#pragma unroll
  for (int u = 0; u < kPacks; ++u)
    packs[u] = load_pack(x, g.cols, t, first_row + u * kRowsPerPass, c, row_vec);

  // 1. Rows: amax over the half-warp that holds the row, scale, cast, store.
  float col_amax[kVec];
#pragma unroll
  for (int j = 0; j < kVec; ++j) col_amax[j] = 0.0f;
  float unused = 0.0f;
#pragma unroll
  for (int u = 0; u < kPacks; ++u) {
    const int r = first_row + u * kRowsPerPass;
    float row_amax = 0.0f;
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      const float a = fabsf(to_float(packs[u].v[j]));
      row_amax = nan_max(row_amax, a);
      col_amax[j] = nan_max(col_amax[j], a);
    }
    for (int offset = kPacksPerRow / 2; offset > 0; offset >>= 1)
      row_amax = nan_max(row_amax, __shfl_xor_sync(0xffffffffu, row_amax, offset));
    const float scale = block_scale_from_amax(row_amax, kMax, power_2_scale);
    store_bytes(out, g.cols, t, r, c, row_vec, cast_pack8<F>(packs[u], scale, unused));
    if (c == 0 && r < t.n_rows) scale_inv[(t.r0 + r) * g.stride0 + bc * g.stride1] = 1.0f / scale;
  }

  // 2. Columns: lanes l and l + 16 hold the same columns; then the 8 warps' partials.
#pragma unroll
  for (int j = 0; j < kVec; ++j)
    col_amax[j] = nan_max(col_amax[j], __shfl_xor_sync(0xffffffffu, col_amax[j], 16));
  if (lane < 16) {
    col_partial[warp][c / 4] = make_float4(col_amax[0], col_amax[1], col_amax[2], col_amax[3]);
    col_partial[warp][c / 4 + 1] = make_float4(col_amax[4], col_amax[5], col_amax[6], col_amax[7]);
  }
  __syncthreads();
  if (threadIdx.x < kTile) {
    const int col = threadIdx.x;
    float amax = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w)
      amax = nan_max(amax, reinterpret_cast<const float*>(col_partial[w])[col]);
    const float scale = block_scale_from_amax(amax, kMax, power_2_scale);
    col_scale[col] = scale;
    // Column c0 + col of x is row c0 + col of x^T; this tile's rows are its block br.
    if (col < t.n_cols) scale_inv_t[(t.c0 + col) * gt.stride0 + br * gt.stride1] = 1.0f / scale;
  }
  __syncthreads();

  // 3. The packs with their column scales into the shared tile, then out by columns.
  float scales[kVec];
#pragma unroll
  for (int j = 0; j < kVec; ++j) scales[j] = col_scale[c + j];
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

bool aligned(const void* p, size_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

template <Fp8Format F, typename InT>
cudaError_t launch_typed(const void* x, const BlockGeometry& g, bool power_2_scale, uint8_t* out,
                         float* scale_inv, uint8_t* out_t, float* scale_inv_t,
                         cudaStream_t stream) {
  // 128 x 128 tiles: as many as 1x128 blocks in 128-row groups (<= g.scale_rows * g.scale_cols,
  // which the operator holds to one launch).
  const int64_t tiles = ceil_div64(g.rows, kTile) * g.scale_cols;
  const bool row_vec = g.cols % kVec == 0 && aligned(x, sizeof(Pack8<InT>)) && aligned(out, 8);
  const bool col_vec = g.rows % kColRows == 0 && aligned(out_t, 16);
  quantize_rows_and_cols_kernel<F, InT><<<static_cast<unsigned>(tiles), kThreads, 0, stream>>>(
      static_cast<const InT*>(x), g, transposed_geometry(g), power_2_scale, row_vec, col_vec,
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
                                                     float* scale_inv_t, cudaStream_t stream) {
  if (g.rows == 0 || g.cols == 0) return cudaSuccess;
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
