// Numerics and scale layouts of block-scaled FP8 (quantize_blockwise, fp8_gemm_blockwise),
// shared by the CPU and CUDA kernels. Plain C++, usable from host and device code.
//
// Blocks of a row-major x [rows, cols]:
//   Vec128    1 x 128 tiles along the rows (the last one of a row may be shorter)
//   Blk128    128 x 128 tiles (edge tiles may be smaller)
//   Rowwise   1 x cols: one block per row
// Per block: amax = max |x| (NaN propagating), scale = fp8_max / amax (fp64, then fp32; a power
// of two rounded down with power_2_scale; 1.0 when amax is 0 or not finite), x_fp8 = saturating
// cast of x * scale, and the stored factor is scale_inv = 1 / scale (the dequantisation
// multiplier cuBLASLt takes on its A/B scale pointers).
//
// Scale tensors ("scale_inv"), float32, in the layout cuBLASLt's block-scaled GEMM reads
// (Transformer Engine calls it GEMM_READY; PyTorch's _scaled_mm checks the same strides):
//   Vec128  / Rowwise: logical [rows, nb] (nb = ceil(cols / 128), or 1), strides (1, ld) with
//                      ld = round_up(rows, 4): the rows of one column block are contiguous
//                      ("outer dimension fastest") and every column block starts 16-byte aligned.
//   Blk128:            logical [ceil(rows / 128), nb], strides (ld, 1) with ld = round_up(nb, 4):
//                      the K blocks of one row block are contiguous.
// Storage elements beyond the logical extent (the padding to 4) are zero and never read.
#pragma once

#include <cfloat>
#include <cmath>
#include <cstdint>

#include "fp8_common.h"

namespace transformer_fp8 {

enum class BlockMode : int { Vec128 = 0, Blk128 = 1, Rowwise = 2 };

constexpr int64_t kScaleBlock = 128;

TFP8_HOST_DEVICE int64_t ceil_div64(int64_t a, int64_t b) { return (a + b - 1) / b; }
TFP8_HOST_DEVICE int64_t round_up4(int64_t a) { return (a + 3) / 4 * 4; }

// The scale of one block. fp8_max / amax is computed in fp64 and rounded to fp32 once (as
// compute_scale_from_amax does). With power_2_scale the fp64 quotient is rounded DOWN to a power
// of two (2**floor(log2(q))), so that scale * amax <= fp8_max still holds and scale_inv = 1/scale
// is exact; powers above the fp32 range become 2**127. Without it, overflow clamps to FLT_MAX.
TFP8_HOST_DEVICE float block_scale_from_amax(float amax, double fp8_max, bool power_2_scale) {
  if (!amax_is_usable(amax)) return 1.0f;
  const double q = fp8_max / static_cast<double>(amax);
  if (power_2_scale) {
    const int e = ilogb(q);  // q is a positive normal double: exact floor(log2(q))
    return e > 127 ? ldexpf(1.0f, 127) : static_cast<float>(ldexp(1.0, e));
  }
  return q > static_cast<double>(FLT_MAX) ? FLT_MAX : static_cast<float>(q);
}

// Geometry of the blocks and of the scale tensor of one quantised [rows, cols] operand.
struct BlockGeometry {
  BlockMode mode;
  int64_t rows, cols;
  int64_t block_rows, block_cols;  // block extent (block_cols = cols for Rowwise)
  int64_t scale_rows, scale_cols;  // logical shape of the scale tensor
  int64_t stride0, stride1;        // its strides, in elements
  int64_t storage;                 // elements of its storage (padding included)
};

TFP8_HOST_DEVICE BlockGeometry block_geometry(BlockMode mode, int64_t rows, int64_t cols) {
  BlockGeometry g{};
  g.mode = mode;
  g.rows = rows;
  g.cols = cols;
  if (mode == BlockMode::Blk128) {
    g.block_rows = kScaleBlock;
    g.block_cols = kScaleBlock;
    g.scale_rows = ceil_div64(rows, kScaleBlock);
    g.scale_cols = ceil_div64(cols, kScaleBlock);
    const int64_t ld = round_up4(g.scale_cols);
    g.stride0 = ld;
    g.stride1 = 1;
    g.storage = g.scale_rows * ld;
  } else {
    g.block_rows = 1;
    g.block_cols = mode == BlockMode::Rowwise ? (cols > 0 ? cols : 1) : kScaleBlock;
    g.scale_rows = rows;
    g.scale_cols = mode == BlockMode::Rowwise ? 1 : ceil_div64(cols, kScaleBlock);
    const int64_t ld = round_up4(rows);
    g.stride0 = 1;
    g.stride1 = ld;
    g.storage = g.scale_cols * ld;
  }
  return g;
}

// The blocks of the transpose x^T [cols, rows] that the backward GEMMs need: a 1 x 128 tile of
// x^T is a 128 x 1 column block of x; a 128 x 128 block stays a block (its scale is transposed);
// row-wise scaling of x^T is one scale per column of x.
TFP8_HOST_DEVICE BlockGeometry transposed_geometry(const BlockGeometry& g) {
  return block_geometry(g.mode, g.cols, g.rows);
}

}  // namespace transformer_fp8
