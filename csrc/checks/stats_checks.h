// Argument checks and input preparation of fp8_operand_stats, shared by its CPU and CUDA
// operators.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>

#include "../operand_stats.h"
#include "checks.h"

namespace transformer_fp8 {

// What the kernels read: x and q cut to their common rows, contiguous; the scales as float32
// (with their strides: block scales may be laid out column-major); the geometry.
struct StatsInputs {
  at::Tensor x, q, scale;
  StatsGeometry geometry;
  int64_t scale_stride_down, scale_stride_across;
  float saturation_bound;  // |x * s| above it: clamped by the cast (saturation_bound below)
};

// The cast clamps x * s to +-fp8_max, then rounds to nearest even. The clamp changes the result
// only where |x * s| would round past fp8_max: beyond fp8_max plus half the format's step there
// (E4M3: 448 + 16; E5M2: 57344 + 4096). A tie at that point rounds to the even neighbour:
// E4M3's max (mantissa 110) keeps it, E5M2's (mantissa 11) does not, so for E5M2 the tie itself
// saturates. The bound returned is the largest |x * s| the clamp leaves unchanged.
inline float saturation_bound(double fp8_max, at::ScalarType fp8_dtype) {
  const bool e4m3 = fp8_dtype == at::kFloat8_e4m3fn;
  int exponent;
  std::frexp(fp8_max, &exponent);  // fp8_max = m * 2^exponent, m in [0.5, 1)
  const float tie = static_cast<float>(fp8_max + std::ldexp(1.0, exponent - 2 - (e4m3 ? 3 : 2)));
  return e4m3 ? tie : std::nextafter(tie, 0.0f);
}

inline StatsInputs prepare_operand_stats(const at::Tensor& x, const at::Tensor& q,
                                         const at::Tensor& scale, double fp8_max,
                                         int64_t block_rows, int64_t block_cols, int64_t chunk) {
  check_high_precision(x, "x");
  TORCH_CHECK(x.dim() == 2, "transformer_fp8: fp8_operand_stats: argument 'x' must be 2-D, got ",
              describe(x));
  check_fp8_tensor(q, "q");
  TORCH_CHECK(q.dim() == 2 && q.size(1) == x.size(1),
              "transformer_fp8: fp8_operand_stats: argument 'q' must be 2-D with x's ", x.size(1),
              " columns, got ", describe(q));
  check_same_device(q, "q", x, "x");
  check_defined(scale, "x_scale");
  TORCH_CHECK(at::isFloatingType(scale.scalar_type()),
              "transformer_fp8: fp8_operand_stats: argument 'x_scale' must be a floating tensor, "
              "got ", describe(scale));
  check_same_device(scale, "x_scale", x, "x");
  TORCH_CHECK(std::isfinite(fp8_max) && fp8_max > 0.0,
              "transformer_fp8: fp8_operand_stats: argument 'fp8_max' must be finite and "
              "positive, got ", fp8_max);
  const bool per_tensor = block_rows == 0 && block_cols == 0;
  TORCH_CHECK(per_tensor || (block_rows > 0 && block_cols > 0),
              "transformer_fp8: fp8_operand_stats: arguments 'block_rows' and 'block_cols' must "
              "be both 0 (per-tensor scaling) or both positive, got ", block_rows, " and ",
              block_cols);
  const int64_t rows = std::min(x.size(0), q.size(0)), cols = x.size(1);
  StatsInputs in;
  in.geometry = stats_geometry(rows, cols, block_rows, block_cols, chunk);
  if (per_tensor) {
    TORCH_CHECK(scale.numel() == 1, "transformer_fp8: fp8_operand_stats: argument 'x_scale' must "
                "have 1 element for per-tensor scaling, got ", describe(scale));
  } else {
    const StatsGeometry& g = in.geometry;
    TORCH_CHECK(scale.dim() == 2 && scale.size(0) >= g.blocks_down &&
                scale.size(1) >= g.blocks_across,
                "transformer_fp8: fp8_operand_stats: argument 'x_scale' must be 2-D with at least [",
                g.blocks_down, ", ", g.blocks_across, "] blocks for x of ", rows, " x ", cols,
                " in ", block_rows, " x ", block_cols, " blocks, got ", describe(scale));
  }
  in.x = x.narrow(0, 0, rows).contiguous();
  in.q = q.narrow(0, 0, rows).contiguous();
  in.scale = scale.to(at::kFloat);
  in.scale_stride_down = per_tensor ? 0 : in.scale.stride(0);
  in.scale_stride_across = per_tensor ? 0 : in.scale.stride(1);
  in.saturation_bound = saturation_bound(fp8_max, q.scalar_type());
  return in;
}

}  // namespace transformer_fp8
