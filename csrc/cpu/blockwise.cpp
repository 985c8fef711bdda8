// CPU kernels of quantize_blockwise and fp8_gemm_blockwise: the executable reference of the
// CUDA ones (csrc/cuda/kernels/blockwise.cu, csrc/cuda/cublaslt/gemm_blockwise_cublaslt.cpp).
// Numerics and layouts: csrc/blockwise_common.h.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <torch/library.h>

#include <algorithm>
#include <tuple>

#include "../checks/blockwise_checks.h"

namespace transformer_fp8 {
namespace {

// Saturating cast, as in cast.cpp: clamp first (overflow and +-inf become +-fp8_max), NaN stays.
template <typename Fp8T>
inline Fp8T saturate(float v, float fp8_max) {
  if (!(v != v)) v = std::min(std::max(v, -fp8_max), fp8_max);
  return Fp8T(v);
}

// Quantises a contiguous float32 x [rows, cols] block by block: two passes over each block
// (amax, then the cast with the block's scale). scale_inv points at the scale tensor's storage.
template <typename Fp8T>
void quantize_blocks(const float* x, const BlockGeometry& g, float fp8_max, bool power_2_scale,
                     Fp8T* out, float* scale_inv) {
  at::parallel_for(0, g.scale_rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t br = begin; br < end; ++br) {
      const int64_t r0 = br * g.block_rows, r1 = std::min(g.rows, r0 + g.block_rows);
      for (int64_t bc = 0; bc < g.scale_cols; ++bc) {
        const int64_t c0 = bc * g.block_cols, c1 = std::min(g.cols, c0 + g.block_cols);
        float amax = 0.0f;
        for (int64_t r = r0; r < r1; ++r)
          for (int64_t c = c0; c < c1; ++c) amax = nan_max(amax, std::abs(x[r * g.cols + c]));
        const float scale = block_scale_from_amax(amax, fp8_max, power_2_scale);
        for (int64_t r = r0; r < r1; ++r)
          for (int64_t c = c0; c < c1; ++c)
            out[r * g.cols + c] = saturate<Fp8T>(x[r * g.cols + c] * scale, fp8_max);
        scale_inv[br * g.stride0 + bc * g.stride1] = 1.0f / scale;
      }
    }
  });
}

// (x_fp8, scale_inv) of a contiguous float32 x with the blocks of g.
std::tuple<at::Tensor, at::Tensor> quantize_one(const at::Tensor& xf, const BlockGeometry& g,
                                                at::ScalarType fp8_dtype, bool power_2_scale) {
  at::Tensor out = at::empty({g.rows, g.cols}, xf.options().dtype(fp8_dtype));
  at::Tensor scale_inv = new_scale_tensor(g, xf.options());
  float* s = scale_inv.data_ptr<float>();  // the storage: as_strided keeps offset 0
  if (fp8_dtype == at::kFloat8_e4m3fn) {
    quantize_blocks(xf.data_ptr<float>(), g, kE4M3Max, power_2_scale,
                    out.data_ptr<c10::Float8_e4m3fn>(), s);
  } else {
    quantize_blocks(xf.data_ptr<float>(), g, kE5M2Max, power_2_scale,
                    out.data_ptr<c10::Float8_e5m2>(), s);
  }
  return {out, scale_inv};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_blockwise_cpu(
    const at::Tensor& x, int64_t block_rows, int64_t block_cols, at::ScalarType fp8_dtype,
    bool power_2_scale, bool with_transpose) {
  const BlockMode mode = check_quantize_blockwise_args(x, block_rows, block_cols, fp8_dtype);
  // float32 holds every float32 / bfloat16 / float16 value exactly: widen once.
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const BlockGeometry g = block_geometry(mode, x.size(0), x.size(1));
  auto [x_fp8, scale_inv] = quantize_one(xf, g, fp8_dtype, power_2_scale);
  if (!with_transpose) {
    return {x_fp8, scale_inv, at::empty({0}, x.options().dtype(fp8_dtype)),
            at::empty({0}, x.options().dtype(at::kFloat))};
  }
  // The transpose is quantised from the high-precision values with its own blocks (not
  // transposed FP8 bytes, except that 128x128 blocks give the same bytes and scales).
  auto [x_t_fp8, scale_inv_t] =
      quantize_one(xf.t().contiguous(), transposed_geometry(g), fp8_dtype, power_2_scale);
  return {x_fp8, scale_inv, x_t_fp8, scale_inv_t};
}

// x_fp8 * (its block's scale_inv), in float32.
at::Tensor dequantize_operand(const at::Tensor& q, const at::Tensor& scale_inv, BlockMode mode) {
  const int64_t rows = q.size(0), K = q.size(1);
  at::Tensor full;
  if (mode == BlockMode::Rowwise) {
    full = scale_inv;  // [rows, 1] broadcasts along K
  } else if (mode == BlockMode::Vec128) {
    full = scale_inv.repeat_interleave(kScaleBlock, 1).narrow(1, 0, K);
  } else {
    full = scale_inv.repeat_interleave(kScaleBlock, 0).repeat_interleave(kScaleBlock, 1)
               .narrow(0, 0, rows).narrow(1, 0, K);
  }
  return q.to(at::kFloat) * full;
}

at::Tensor fp8_gemm_blockwise_cpu(const at::Tensor& a, const at::Tensor& a_scale_inv,
                                  const at::Tensor& b, const at::Tensor& b_scale_inv,
                                  at::ScalarType out_dtype, const c10::optional<at::Tensor>& bias) {
  const BlockwiseGemmModes modes =
      check_gemm_blockwise_args(a, a_scale_inv, b, b_scale_inv, out_dtype, bias);
  // Dequantise, multiply in float32 (whatever the caller's torch.autocast: see gemm.cpp), add
  // the bias, round once to out_dtype.
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  at::Tensor out = at::matmul(dequantize_operand(a, a_scale_inv, modes.a),
                              dequantize_operand(b, b_scale_inv, modes.b).t());
  if (bias.has_value()) out.add_(bias->to(at::kFloat));
  return out.to(out_dtype);
}

}  // namespace

TORCH_LIBRARY_IMPL(transformer_fp8, CPU, m) {
  m.impl("quantize_blockwise", &quantize_blockwise_cpu);
  m.impl("fp8_gemm_blockwise", &fp8_gemm_blockwise_cpu);
}

}  // namespace transformer_fp8
