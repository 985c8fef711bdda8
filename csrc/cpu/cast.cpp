// CPU kernels of amax, cast_to_fp8, cast_transpose_to_fp8 and cast_from_fp8.
// They are the executable reference of the CUDA kernels: same checks, same numerics.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>

#include "../checks/checks.h"
#include "fp8_cast_cpu.h"

namespace transformer_fp8 {
namespace {

// max |x| over a contiguous buffer, NaN propagating; 0 for an empty buffer.
template <typename T>
float amax_contiguous(const T* x, int64_t n) {
  return at::parallel_reduce(
      0, n, kGrain, 0.0f,
      [&](int64_t begin, int64_t end, float acc) {
        for (int64_t i = begin; i < end; ++i) acc = nan_max(acc, std::abs(static_cast<float>(x[i])));
        return acc;
      },
      [](float a, float b) { return nan_max(a, b); });
}

void update_amax_slot(const c10::optional<at::Tensor>& amax, float block_amax) {
  if (!amax.has_value()) return;
  float* slot = amax->data_ptr<float>();
  *slot = nan_max(*slot, block_amax);
}

at::Tensor amax_cpu(const at::Tensor& x) {
  check_high_precision(x, "x");
  const at::Tensor xc = x.contiguous();
  float result = 0.0f;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, xc.scalar_type(), "amax_cpu", [&] {
    result = amax_contiguous(xc.data_ptr<scalar_t>(), xc.numel());
  });
  return at::full({}, result, x.options().dtype(at::kFloat));
}

at::Tensor cast_to_fp8_cpu(const at::Tensor& x, const at::Tensor& scale, at::ScalarType fp8_dtype,
                           const c10::optional<at::Tensor>& amax) {
  const Fp8Format fmt = check_cast_args(x, scale, fp8_dtype, amax);
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty(x.sizes(), x.options().dtype(fp8_dtype));
  const float s = scale.item<float>();
  const float x_amax =
      fmt == Fp8Format::E4M3
          ? cast_buffer(xc, s, kE4M3Max, out.data_ptr<c10::Float8_e4m3fn>())
          : cast_buffer(xc, s, kE5M2Max, out.data_ptr<c10::Float8_e5m2>());
  if (xc.numel() > 0) update_amax_slot(amax, x_amax);
  return out;
}

std::tuple<at::Tensor, at::Tensor> cast_transpose_to_fp8_cpu(
    const at::Tensor& x, const at::Tensor& scale, at::ScalarType fp8_dtype,
    const c10::optional<at::Tensor>& amax) {
  check_cast_args(x, scale, fp8_dtype, amax);
  TORCH_CHECK(x.dim() == 2, "transformer_fp8: argument 'x' of cast_transpose_to_fp8 must be "
              "2-D, got ", describe(x));
  at::Tensor out = cast_to_fp8_cpu(x, scale, fp8_dtype, amax);
  // The transpose of the FP8 bytes is the FP8 cast of the transpose: no rounding is involved.
  // (A copy always: for one row or column, contiguous() would return out itself, and the
  // schema promises two tensors that do not alias.)
  at::Tensor out_t = out.t().clone(at::MemoryFormat::Contiguous);
  return {out, out_t};
}

at::Tensor cast_from_fp8_cpu(const at::Tensor& x_fp8, const at::Tensor& scale_inv,
                             at::ScalarType dtype) {
  check_dequant_args(x_fp8, scale_inv, dtype);
  // Dequantise in float32 (every FP8 value is exact there), then round once to dtype. The
  // result is contiguous whatever x_fp8's strides, as the CUDA and fake kernels' results are.
  const at::Tensor x = x_fp8.to(at::kFloat, /*non_blocking=*/false, /*copy=*/false,
                                at::MemoryFormat::Contiguous);
  return (x * scale_inv.reshape({})).to(dtype);
}

}  // namespace

TORCH_LIBRARY_IMPL(transformer_fp8, CPU, m) {
  m.impl("amax", &amax_cpu);
  m.impl("cast_to_fp8", &cast_to_fp8_cpu);
  m.impl("cast_transpose_to_fp8", &cast_transpose_to_fp8_cpu);
  m.impl("cast_from_fp8", &cast_from_fp8_cpu);
}

}  // namespace transformer_fp8
