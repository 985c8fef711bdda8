// Statistics of one FP8 GEMM operand (transformer_fp8/debug/stats.py states them and keeps the
// pure-torch reference): the element rule, the per-block partials and their combination, shared
// by the CPU kernel (csrc/cpu/operand_stats.cpp) and the CUDA ones
// (csrc/cuda/kernels/operand_stats.cu), so that both compute the same function. Plain C++,
// usable from host and device code.
//
// x [rows, cols] (high precision), q its FP8 data, s the scale that multiplied x before the
// saturating cast: one per tensor, or one per br x bc block (edge blocks partial). The work is
// cut into units: chunk k of block b holds elements [k * chunk, (k + 1) * chunk) of the block,
// row-major inside it. A unit's partial sums and extremes are combined chunk by chunk, then
// block by block, in a fixed order: the result does not depend on the thread count.
#pragma once

#include <cmath>
#include <cstdint>

#include "fp8_common.h"

namespace transformer_fp8 {

// The FIELDS order of transformer_fp8/debug/stats.py.
constexpr int kStatsFields = 12;

TFP8_HOST_DEVICE float nan_min(float acc, float v) { return (v < acc || v != v) ? v : acc; }
TFP8_HOST_DEVICE double nan_max_f64(double acc, double v) {
  return (v > acc || v != v) ? v : acc;
}

// x^2 added to a float64 sum, rounded as two operations (no fused multiply-add), as torch's
// square() then sum() round it.
TFP8_HOST_DEVICE double add_square(double acc, double v) {
#if defined(__CUDA_ARCH__)
  return __dadd_rn(acc, __dmul_rn(v, v));
#else
  return acc + v * v;  // (x86-64 host code has no fused multiply-add without -mfma)
#endif
}

// Sums and extremes of some elements of one block.
struct StatsPartial {
  unsigned long long underflow, nonzero, saturated;
  float min_nonzero, amax;
  double signal, noise;
};

TFP8_HOST_DEVICE StatsPartial stats_empty() {
  return StatsPartial{0, 0, 0, INFINITY, -INFINITY, 0.0, 0.0};
}

// One element: x and q as float32, s its block's scale.
TFP8_HOST_DEVICE void stats_add_element(StatsPartial& p, float x, float q, float s,
                                        float saturation_bound) {
  const bool nonzero = x != 0.0f;  // (NaN counts as non-zero)
  p.nonzero += nonzero;
  p.underflow += nonzero && q == 0.0f;  // flushed to zero by the cast
  p.saturated += fabsf(x * s) > saturation_bound;  // clamped to +-fp8_max by the cast
  const float a = fabsf(x);
  if (nonzero) p.min_nonzero = nan_min(p.min_nonzero, a);
  p.amax = nan_max(p.amax, a);
  const float error = x + -q / s;  // x - q / s in float32, as the GEMM sees q
  p.signal = add_square(p.signal, static_cast<double>(x));
  p.noise = add_square(p.noise, static_cast<double>(error));
}

TFP8_HOST_DEVICE void stats_merge(StatsPartial& p, const StatsPartial& o) {
  p.underflow += o.underflow;
  p.nonzero += o.nonzero;
  p.saturated += o.saturated;
  p.min_nonzero = nan_min(p.min_nonzero, o.min_nonzero);
  p.amax = nan_max(p.amax, o.amax);
  p.signal += o.signal;
  p.noise += o.noise;
}

// The statistics of whole blocks.
struct StatsTotal {
  StatsPartial sum;
  float block_amax_min, scale_min, scale_max;
  double worst_noise_ratio;
  long long blocks;
};

TFP8_HOST_DEVICE StatsTotal total_empty() {
  return StatsTotal{stats_empty(), INFINITY, INFINITY, -INFINITY, -INFINITY, 0};
}

// One whole block with its scale s. Its noise / signal ratio counts 0 when it has no signal,
// NaN when its signal is NaN (a NaN element: the worst block, as in the reference).
TFP8_HOST_DEVICE void total_add_block(StatsTotal& t, const StatsPartial& block, float s) {
  stats_merge(t.sum, block);
  // A block's amax covers its zeros too (the reference pads blocks with zeros): never below 0.
  const float amax = nan_max(block.amax, 0.0f);
  t.block_amax_min = nan_min(t.block_amax_min, amax);
  t.scale_min = nan_min(t.scale_min, s);
  t.scale_max = nan_max(t.scale_max, s);
  const bool nan_signal = block.signal != block.signal;
  const double ratio = block.signal > 0.0 || nan_signal ? block.noise / block.signal : 0.0;
  t.worst_noise_ratio = nan_max_f64(t.worst_noise_ratio, ratio);
  t.blocks += 1;
}

TFP8_HOST_DEVICE void total_merge(StatsTotal& t, const StatsTotal& o) {
  stats_merge(t.sum, o.sum);
  t.block_amax_min = nan_min(t.block_amax_min, o.block_amax_min);
  t.scale_min = nan_min(t.scale_min, o.scale_min);
  t.scale_max = nan_max(t.scale_max, o.scale_max);
  t.worst_noise_ratio = nan_max_f64(t.worst_noise_ratio, o.worst_noise_ratio);
  t.blocks += o.blocks;
}

// The FIELDS vector: scale_min, min_nonzero, block_amax_min, amax, scale_max,
// block_worst_noise_ratio, underflow, nonzero, saturated, signal, noise, blocks. No block at all
// gives the neutral vector (minima inf, maxima -inf, sums 0).
TFP8_HOST_DEVICE void total_write(const StatsTotal& t, double* out) {
  const bool any = t.blocks > 0;
  out[0] = t.scale_min;
  out[1] = t.sum.min_nonzero;
  out[2] = t.block_amax_min;
  out[3] = any ? nan_max(t.sum.amax, 0.0f) : -INFINITY;
  out[4] = t.scale_max;
  out[5] = t.worst_noise_ratio;
  out[6] = static_cast<double>(t.sum.underflow);
  out[7] = static_cast<double>(t.sum.nonzero);
  out[8] = static_cast<double>(t.sum.saturated);
  out[9] = t.sum.signal;
  out[10] = t.sum.noise;
  out[11] = static_cast<double>(t.blocks);
}

// How x is cut into blocks and units. Per-tensor scaling is one block of 1 x numel.
struct StatsGeometry {
  int64_t rows, cols;        // x's extent (per tensor: 1 x numel)
  int64_t block_rows, block_cols;
  int64_t blocks_down, blocks_across;
  int64_t chunk, chunks_per_block;

  TFP8_HOST_DEVICE int64_t blocks() const { return blocks_down * blocks_across; }
  TFP8_HOST_DEVICE int64_t units() const { return blocks() * chunks_per_block; }
  TFP8_HOST_DEVICE int64_t block_elements() const { return block_rows * block_cols; }

  // The flat index in x of element e of block b, or -1 for a place past x's edge.
  TFP8_HOST_DEVICE int64_t element(int64_t b, int64_t e) const {
    const int64_t row = (b / blocks_across) * block_rows + e / block_cols;
    const int64_t col = (b % blocks_across) * block_cols + e % block_cols;
    return (row < rows && col < cols) ? row * cols + col : -1;
  }
};

// The geometry of x [rows, cols] with per-block scales (block_rows 0: per tensor).
inline StatsGeometry stats_geometry(int64_t rows, int64_t cols, int64_t block_rows,
                                    int64_t block_cols, int64_t chunk) {
  StatsGeometry g{};
  g.chunk = chunk;
  if (rows == 0 || cols == 0) return g;  // no element, no block
  if (block_rows == 0) {
    g.rows = 1;
    g.cols = rows * cols;
    g.block_rows = 1;
    g.block_cols = rows * cols;
  } else {  // (a block larger than x is x: clamped, which changes no figure)
    g.rows = rows;
    g.cols = cols;
    g.block_rows = block_rows < rows ? block_rows : rows;
    g.block_cols = block_cols < cols ? block_cols : cols;
  }
  g.blocks_down = (g.rows + g.block_rows - 1) / g.block_rows;
  g.blocks_across = (g.cols + g.block_cols - 1) / g.block_cols;
  const int64_t per_block = g.block_elements();
  g.chunks_per_block = per_block == 0 ? 0 : (per_block + chunk - 1) / chunk;
  return g;
}

}  // namespace transformer_fp8
