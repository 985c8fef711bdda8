// The shared-memory FP8 tile of the transposing kernels (cast_transpose and transpose_bytes in
// cast.cu, the fused 1x128 quantisation in blockwise_transpose.cu): 128 x 128 FP8 bytes stored
// row by row in a swizzled layout, and phase 2, which reads it by columns and writes out_t.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace transformer_fp8 {
namespace cuda {

constexpr int kTile = 128;
constexpr int kTileThreads = 256;     // the block size the phase-2 writers are written for
constexpr int kTileWords = kTile / 4;  // 4 FP8 bytes per 32-bit shared word
constexpr int kColRows = 16;           // phase 2: rows per 16-byte out_t store

// Shared word of (row r, word column w). Each row holds its 32 words in the order
// w ^ (4 * (r / 16)). A phase-2 warp instruction reads word columns 4k..4k+3 of the rows
// 16 i + j, i = 0..7: without the swizzle all 8 rows would hit the same 4 banks, with it they
// hit 32 distinct banks. XOR with a multiple of 4 keeps 8-byte word pairs (w even) adjacent and
// every row's 32 words on 32 banks.
__device__ __forceinline__ int tile_word(int r, int w) { return r * kTileWords + (w ^ ((r >> 4) << 2)); }
__device__ __forceinline__ int tile_byte(int r, int c) { return 4 * tile_word(r, c >> 2) + (c & 3); }

// Phase 2 takes any View with out_t (the tile's first element of out_t [cols, rows]), pitch_t
// (the row pitch of out_t), n_rows and n_cols (the tile's extent inside x).

// Phase 2, vectors (rows % 16 == 0, out_t 16-byte aligned): thread t reads rows 16 (t % 8) ..
// + 15 of word column t / 8 (4 FP8 columns), transposes the 16 x 4 bytes in registers and writes
// 16 bytes to each of the 4 out_t rows. A warp writes 4 out_t rows x 128 contiguous bytes per
// store.
template <typename View>
__device__ __forceinline__ void write_tile_cols_vec(const View& v, const uint32_t* tile) {
  const int r = (threadIdx.x % (kTile / kColRows)) * kColRows, w = threadIdx.x / (kTile / kColRows);
  if (r >= v.n_rows) return;
  uint32_t col[4][kColRows / 4];  // col[q][m]: column 4w + q, rows r + 4m .. r + 4m + 3
#pragma unroll
  for (int m = 0; m < kColRows / 4; ++m) {
    const uint32_t a = tile[tile_word(r + 4 * m, w)], b = tile[tile_word(r + 4 * m + 1, w)];
    const uint32_t c = tile[tile_word(r + 4 * m + 2, w)], d = tile[tile_word(r + 4 * m + 3, w)];
    // 4 x 4 byte transpose: a word holds 4 columns of one row, low byte first.
    const uint32_t ab_lo = __byte_perm(a, b, 0x5140), ab_hi = __byte_perm(a, b, 0x7362);
    const uint32_t cd_lo = __byte_perm(c, d, 0x5140), cd_hi = __byte_perm(c, d, 0x7362);
    col[0][m] = __byte_perm(ab_lo, cd_lo, 0x5410);
    col[1][m] = __byte_perm(ab_lo, cd_lo, 0x7632);
    col[2][m] = __byte_perm(ab_hi, cd_hi, 0x5410);
    col[3][m] = __byte_perm(ab_hi, cd_hi, 0x7632);
  }
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const int c = 4 * w + q;
    if (c < v.n_cols)
      *reinterpret_cast<uint4*>(v.out_t + c * v.pitch_t + r) =
          make_uint4(col[q][0], col[q][1], col[q][2], col[q][3]);
  }
}

// Phase 2, element by element (any shape); consecutive threads take consecutive rows.
template <typename View>
__device__ __forceinline__ void write_tile_cols_scalar(const View& v, const uint32_t* tile) {
  const uint8_t* tile_bytes = reinterpret_cast<const uint8_t*>(tile);
  for (int k = threadIdx.x; k < kTile * kTile; k += kTileThreads) {
    const int c = k / kTile, r = k % kTile;
    if (r < v.n_rows && c < v.n_cols) v.out_t[c * v.pitch_t + r] = tile_bytes[tile_byte(r, c)];
  }
}

}  // namespace cuda
}  // namespace transformer_fp8
