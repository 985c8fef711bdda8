// Argument checks of quantize_blockwise and fp8_gemm_blockwise, shared by the CPU and CUDA
// kernels, and the allocation of scale tensors in the layout of blockwise_common.h.
#pragma once

#include <ATen/ATen.h>

#include <string>

#include "../blockwise_common.h"
#include "checks.h"
#include "gemm_checks.h"

namespace transformer_fp8 {

inline const char* block_mode_name(BlockMode mode) {
  switch (mode) {
    case BlockMode::Vec128: return "1x128";
    case BlockMode::Blk128: return "128x128";
    default: return "row-wise";
  }
}

// (block_rows, block_cols) -> mode: (1, 128), (128, 128), or one block per row: (1, -1), or
// (1, cols) when cols != 128 (for 128 columns, (1, 128) means 1x128 tiles: their transposes
// differ from row-wise ones).
inline BlockMode check_quantize_blockwise_args(const at::Tensor& x, int64_t block_rows,
                                               int64_t block_cols, at::ScalarType fp8_dtype) {
  check_high_precision(x, "x");
  TORCH_CHECK(x.dim() == 2, "transformer_fp8: argument 'x' of quantize_blockwise must be 2-D "
              "[rows, cols], got ", describe(x));
  check_fp8_dtype(fp8_dtype, "fp8_dtype");
  const int64_t cols = x.size(1);
  if (block_rows == 1 && block_cols == -1) return BlockMode::Rowwise;
  if (block_rows == 1 && block_cols == kScaleBlock) return BlockMode::Vec128;
  if (block_rows == kScaleBlock && block_cols == kScaleBlock) return BlockMode::Blk128;
  if (block_rows == 1 && block_cols == cols && cols > 0) return BlockMode::Rowwise;
  TORCH_CHECK(false, "transformer_fp8: arguments 'block_rows' x 'block_cols' of "
              "quantize_blockwise must be 1 x 128, 128 x 128 or row-wise: 1 x -1 (or 1 x cols, "
              "here 1 x ", cols, "), got ", block_rows, " x ", block_cols);
}

// A zero-filled float32 tensor with the logical shape and strides of g's scale tensor.
inline at::Tensor new_scale_tensor(const BlockGeometry& g, const at::TensorOptions& options) {
  at::Tensor storage = at::zeros({g.storage}, options.dtype(at::kFloat));
  return storage.as_strided({g.scale_rows, g.scale_cols}, {g.stride0, g.stride1});
}

// The mode that a scale tensor's logical shape states for an operand [rows, K].
inline BlockMode scale_mode_of(const at::Tensor& operand, const at::Tensor& scale_inv,
                               const char* name) {
  check_defined(scale_inv, name);
  const int64_t rows = operand.size(0), K = operand.size(1);
  const int64_t kb = ceil_div64(K, kScaleBlock);
  TORCH_CHECK(scale_inv.scalar_type() == at::kFloat && scale_inv.dim() == 2,
              "transformer_fp8: argument '", name, "' must be a 2-D float32 tensor, got ",
              describe(scale_inv));
  const auto s0 = scale_inv.size(0), s1 = scale_inv.size(1);
  if (s0 == rows && s1 == kb) return BlockMode::Vec128;
  if (s0 == ceil_div64(rows, kScaleBlock) && s1 == kb) return BlockMode::Blk128;
  if (s0 == rows && s1 == 1) return BlockMode::Rowwise;
  TORCH_CHECK(false, "transformer_fp8: argument '", name, "' must have shape [", rows, ", ", kb,
              "] (1x128 blocks), [", ceil_div64(rows, kScaleBlock), ", ", kb,
              "] (128x128 blocks) or [", rows, ", 1] (row-wise) for an operand of shape [", rows,
              ", ", K, "], got ", describe(scale_inv));
}

struct BlockwiseGemmModes {
  BlockMode a, b;
};

// a [M, K], b [N, K] FP8 (K contiguous); out = a_hp @ b_hp^T. The scale shapes give the modes.
// cuBLASLt runs 1x128 by 1x128, 1x128 by 128x128 and 128x128 by 1x128, and row-wise by
// row-wise; not 128x128 by 128x128, and row-wise pairs only with row-wise.
inline BlockwiseGemmModes check_gemm_blockwise_args(const at::Tensor& a,
                                                    const at::Tensor& a_scale_inv,
                                                    const at::Tensor& b,
                                                    const at::Tensor& b_scale_inv,
                                                    at::ScalarType out_dtype,
                                                    const c10::optional<at::Tensor>& bias) {
  check_gemm_operands(a, b, "fp8_gemm_blockwise");
  const BlockwiseGemmModes modes{scale_mode_of(a, a_scale_inv, "a_scale_inv"),
                                 scale_mode_of(b, b_scale_inv, "b_scale_inv")};
  check_same_device(a_scale_inv, "a_scale_inv", a, "a");
  check_same_device(b_scale_inv, "b_scale_inv", a, "a");
  TORCH_CHECK(!(modes.a == BlockMode::Blk128 && modes.b == BlockMode::Blk128),
              "transformer_fp8: fp8_gemm_blockwise got 128x128 block scales for both 'a' and 'b'; "
              "2D x 2D is not a supported GEMM (cuBLASLt takes 1x128 x 1x128, 1x128 x 128x128 "
              "and 128x128 x 1x128)");
  TORCH_CHECK((modes.a == BlockMode::Rowwise) == (modes.b == BlockMode::Rowwise),
              "transformer_fp8: fp8_gemm_blockwise pairs row-wise scales only with row-wise "
              "scales; got ", block_mode_name(modes.a), " scales for 'a' and ",
              block_mode_name(modes.b), " for 'b'");
  check_gemm_out_dtype_and_bias(out_dtype, bias, a, b);
  return modes;
}

}  // namespace transformer_fp8
