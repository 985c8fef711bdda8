// The CPU saturating FP8 cast (the numeric contract of cast_to_fp8) and the FP8 outputs of the
// fused operators built on it: row padding, fused amax, optional transpose.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>

#include <algorithm>
#include <cstring>
#include <tuple>

#include "../checks/checks.h"

namespace transformer_fp8 {

constexpr int64_t kGrain = 1 << 14;

// Saturating cast of one float: clamp to [-fp8_max, fp8_max] first (so overflow and +-inf become
// +-fp8_max instead of NaN), then let c10 round to nearest even. NaN passes the clamp as NaN.
template <typename Fp8T>
inline Fp8T saturating_cast(float v, float fp8_max) {
  if (!(v != v)) v = std::min(std::max(v, -fp8_max), fp8_max);
  return Fp8T(v);
}

// One pass over a contiguous x: writes the saturating cast of x * scale and returns max |x|.
template <typename Fp8T>
float cast_buffer(const at::Tensor& xc, float scale, float fp8_max, Fp8T* out) {
  float amax = 0.0f;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, xc.scalar_type(), "cast_cpu", [&] {
    const scalar_t* x = xc.data_ptr<scalar_t>();
    amax = at::parallel_reduce(
        0, xc.numel(), kGrain, 0.0f,
        [&](int64_t begin, int64_t end, float acc) {
          for (int64_t i = begin; i < end; ++i) {
            const float v = static_cast<float>(x[i]);
            acc = nan_max(acc, std::abs(v));
            out[i] = saturating_cast<Fp8T>(v * scale, fp8_max);
          }
          return acc;
        },
        [](float a, float b) { return nan_max(a, b); });
  });
  return amax;
}

// The FP8 outputs of a fused operator from its result `value` [M, N] (float32 for the fused
// kernels: the FP8 bytes come from the float32 value, never from a copy rounded to x's dtype):
//   out   [M_pad, N], M_pad = M rounded up to row_multiple, padding rows zero bytes;
//   out_t [N, M_pad] contiguous if with_transpose, else an empty [0] of the FP8 dtype;
//   amax (if given) = max(amax, max |value|) over the M real rows, NaN propagating.
inline std::tuple<at::Tensor, at::Tensor> emit_fp8_rows(
    const at::Tensor& value, const at::Tensor& scale, at::ScalarType fp8_dtype,
    const c10::optional<at::Tensor>& amax, bool with_transpose, int64_t row_multiple) {
  const at::Tensor vc = value.contiguous();
  const int64_t rows = vc.size(0), cols = vc.size(1);
  const int64_t rows_pad = (rows + row_multiple - 1) / row_multiple * row_multiple;
  at::Tensor out = at::empty({rows_pad, cols}, vc.options().dtype(fp8_dtype));
  const float s = scale.item<float>();
  const float value_amax =
      fp8_dtype == at::kFloat8_e4m3fn
          ? cast_buffer(vc, s, kE4M3Max, out.data_ptr<c10::Float8_e4m3fn>())
          : cast_buffer(vc, s, kE5M2Max, out.data_ptr<c10::Float8_e5m2>());
  // Padding rows: zero bytes (+0.0 in both formats), outside amax.
  std::memset(static_cast<uint8_t*>(out.data_ptr()) + rows * cols, 0,
              static_cast<size_t>((rows_pad - rows) * cols));
  if (amax.has_value() && vc.numel() > 0) {
    float* slot = amax->data_ptr<float>();
    *slot = nan_max(*slot, value_amax);
  }
  // The transpose of the FP8 bytes is the cast of the transpose: no rounding is involved.
  // (A copy always: for one row or column contiguous() would return a view of out.)
  at::Tensor out_t = with_transpose ? out.t().clone(at::MemoryFormat::Contiguous)
                                    : at::empty({0}, vc.options().dtype(fp8_dtype));
  return {out, out_t};
}

}  // namespace transformer_fp8
