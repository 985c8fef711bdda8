// The pieces both 1x128-with-transpose kernels share (blockwise_transpose.cu: packs in
// registers; blockwise_transpose_staged.cu: packs in shared memory): the tile geometry, the
// pack loads and stores, phase 1 for one pack and phase 2. See blockwise_transpose.cu's header
// for the algorithm; both kernels give the same bits because they run these same functions on
// the same packs.
#pragma once

#include "blockwise_kernels.h"
#include "device_utils.cuh"
#include "fp8_tile.cuh"

namespace transformer_fp8 {
namespace cuda {
namespace rows_and_cols {

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

// This block's tile (one block per 128 x 128 tile, tiles row by row) and its block indices br
// (row block of x^T's scales) and bc (column block of x's scales).
__device__ __forceinline__ Tile tile_of_block(const BlockGeometry& g, uint8_t* out_t, int64_t& br,
                                              int64_t& bc) {
  const int64_t tiles_across = g.scale_cols;  // 1x128 blocks per row = 128-column tiles
  br = blockIdx.x / tiles_across;
  bc = blockIdx.x % tiles_across;
  Tile t;
  t.r0 = br * kTile;
  t.c0 = bc * kTile;
  t.n_rows = static_cast<int>(g.rows - t.r0 < kTile ? g.rows - t.r0 : kTile);
  t.n_cols = static_cast<int>(g.cols - t.c0 < kTile ? g.cols - t.c0 : kTile);
  t.out_t = out_t + t.c0 * g.rows + t.r0;
  t.pitch_t = g.rows;
  return t;
}

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

// Phase 1 for the pack p at tile row r, columns c .. c + 7: the row's amax over the half-warp
// that holds its 16 packs (4 shuffles), its scale, x_fp8 (8 bytes) and scale_inv; |p| folded
// into col_amax. Every lane of the warp calls it (the shuffles).
template <Fp8Format F, typename InT>
__device__ __forceinline__ void quantize_row_pack(const Pack8<InT>& p, int r, int c, const Tile& t,
                                                  const BlockGeometry& g, int64_t bc,
                                                  bool power_2_scale, bool row_vec,
                                                  uint8_t* __restrict__ out,
                                                  float* __restrict__ scale_inv,
                                                  float (&col_amax)[kVec]) {
  constexpr double kMax = F == Fp8Format::E4M3 ? kE4M3Max : kE5M2Max;
  float row_amax = 0.0f;
#pragma unroll
  for (int j = 0; j < kVec; ++j) {
    const float a = fabsf(to_float(p.v[j]));
    row_amax = nan_max(row_amax, a);
    col_amax[j] = nan_max(col_amax[j], a);
  }
  for (int offset = kPacksPerRow / 2; offset > 0; offset >>= 1)
    row_amax = nan_max(row_amax, __shfl_xor_sync(0xffffffffu, row_amax, offset));
  const float scale = block_scale_from_amax(row_amax, kMax, power_2_scale);
  float unused = 0.0f;
  store_bytes(out, g.cols, t, r, c, row_vec, cast_pack8<F>(p, scale, unused));
  if (c == 0 && r < t.n_rows) scale_inv[(t.r0 + r) * g.stride0 + bc * g.stride1] = 1.0f / scale;
}

// Phase 2's shared memory: per warp the amax of each column, then each column's scale.
struct ColumnScratch {
  float4 partial[kWarps][kTile / 4];
  float scale[kTile];
};

// Phase 2: lanes l and l + 16 hold the same columns; then the 8 warps' partials through shared
// memory. Leaves every column's scale in s.scale (after a __syncthreads) and writes scale_inv_t.
template <Fp8Format F>
__device__ __forceinline__ void column_scales(float (&col_amax)[kVec], int c, const Tile& t,
                                              const BlockGeometry& gt, int64_t br,
                                              bool power_2_scale, float* __restrict__ scale_inv_t,
                                              ColumnScratch& s) {
  constexpr double kMax = F == Fp8Format::E4M3 ? kE4M3Max : kE5M2Max;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int j = 0; j < kVec; ++j)
    col_amax[j] = nan_max(col_amax[j], __shfl_xor_sync(0xffffffffu, col_amax[j], 16));
  if (lane < 16) {
    s.partial[warp][c / 4] = make_float4(col_amax[0], col_amax[1], col_amax[2], col_amax[3]);
    s.partial[warp][c / 4 + 1] = make_float4(col_amax[4], col_amax[5], col_amax[6], col_amax[7]);
  }
  __syncthreads();
  if (threadIdx.x < kTile) {
    const int col = threadIdx.x;
    float amax = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w)
      amax = nan_max(amax, reinterpret_cast<const float*>(s.partial[w])[col]);
    const float scale = block_scale_from_amax(amax, kMax, power_2_scale);
    s.scale[col] = scale;
    // Column c0 + col of x is row c0 + col of x^T; this tile's rows are its block br.
    if (col < t.n_cols) scale_inv_t[(t.c0 + col) * gt.stride0 + br * gt.stride1] = 1.0f / scale;
  }
  __syncthreads();
}

// Host side of both launchers. One block per 128 x 128 tile: as many as 1x128 blocks in 128-row
// groups (<= g.scale_rows * g.scale_cols, which the operator holds to one launch). row_vec:
// cols % 8 == 0, x and out aligned (8-element packs, 8-byte stores); col_vec: rows % 16 == 0,
// out_t 16-byte aligned (phase 2's 16-byte stores).
struct Launch {
  unsigned tiles;
  bool row_vec, col_vec;
};

inline bool aligned(const void* p, size_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

template <typename InT>
Launch launch_of(const void* x, const BlockGeometry& g, const uint8_t* out, const uint8_t* out_t) {
  Launch l;
  l.tiles = static_cast<unsigned>(ceil_div64(g.rows, kTile) * g.scale_cols);
  l.row_vec = g.cols % kVec == 0 && aligned(x, sizeof(Pack8<InT>)) && aligned(out, 8);
  l.col_vec = g.rows % kColRows == 0 && aligned(out_t, 16);
  return l;
}

// blockwise_transpose_staged.cu: the staged kernel, for bf16 and fp16 x only.
cudaError_t launch_staged(const void* x, HpType x_type, const BlockGeometry& g, Fp8Format fmt,
                          bool power_2_scale, uint8_t* out, float* scale_inv, uint8_t* out_t,
                          float* scale_inv_t, cudaStream_t stream);

}  // namespace rows_and_cols
}  // namespace cuda
}  // namespace transformer_fp8
