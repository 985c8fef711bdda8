// CUDA operator quantize_blockwise: argument checks, allocation, device guard and stream; the
// kernels are in blockwise.cu. Same checks and layouts as the CPU kernel (csrc/cpu/blockwise.cpp).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <tuple>

#include "../../checks/blockwise_checks.h"
#include "blockwise_kernels.h"
#include "../cuda_checks.h"

namespace transformer_fp8 {
namespace {

std::tuple<at::Tensor, at::Tensor> quantize_one(const at::Tensor& xc, const BlockGeometry& g,
                                                at::ScalarType fp8_dtype, bool power_2_scale) {
  at::Tensor out = at::empty({g.rows, g.cols}, xc.options().dtype(fp8_dtype));
  at::Tensor scale_inv = new_scale_tensor(g, xc.options());
  const Fp8Format fmt = fp8_dtype == at::kFloat8_e4m3fn ? Fp8Format::E4M3 : Fp8Format::E5M2;
  const auto status = cuda::launch_quantize_blockwise(
      xc.data_ptr(), hp_type_of(xc.scalar_type()), g, fmt, power_2_scale,
      static_cast<uint8_t*>(out.data_ptr()), scale_inv.data_ptr<float>(),
      c10::cuda::getCurrentCUDAStream());
  TFP8_CHECK_LAUNCH(status, "quantize_blockwise");
  return {out, scale_inv};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_blockwise_cuda(
    const at::Tensor& x, int64_t block_rows, int64_t block_cols, at::ScalarType fp8_dtype,
    bool power_2_scale, bool with_transpose) {
  const BlockMode mode = check_quantize_blockwise_args(x, block_rows, block_cols, fp8_dtype);
  check_cuda_tensor(x, "x");
  const c10::cuda::CUDAGuard guard(x.device());
  const BlockGeometry g = block_geometry(mode, x.size(0), x.size(1));
  // One warp (1-D blocks) or one thread block (128x128) per block, on a 1-D grid.
  TORCH_CHECK(g.scale_rows * g.scale_cols <= (int64_t{1} << 31) - 1,
              "transformer_fp8: argument 'x' of quantize_blockwise has too many blocks for one "
              "launch, got ", describe(x));
  const at::Tensor xc = x.contiguous();
  auto [x_fp8, scale_inv] = quantize_one(xc, g, fp8_dtype, power_2_scale);
  if (!with_transpose) {
    return {x_fp8, scale_inv, at::empty({0}, x.options().dtype(fp8_dtype)),
            at::empty({0}, x.options().dtype(at::kFloat))};
  }
  const BlockGeometry gt = transposed_geometry(g);
  if (mode == BlockMode::Blk128) {
    // Same blocks: the transpose's bytes and scales are the transposed bytes and scales.
    at::Tensor scale_inv_t = new_scale_tensor(gt, x.options());
    scale_inv_t.copy_(scale_inv.t());
    // (A copy always: for one row or column contiguous() would return a view of x_fp8.)
    return {x_fp8, scale_inv, x_fp8.t().clone(at::MemoryFormat::Contiguous), scale_inv_t};
  }
  // 1-D blocks of x^T are other blocks: quantise x^T from the high-precision values.
  // TODO(perf): a fused cast-transpose kernel would save this extra read and write of x.
  auto [x_t_fp8, scale_inv_t] = quantize_one(xc.t().contiguous(), gt, fp8_dtype, power_2_scale);
  return {x_fp8, scale_inv, x_t_fp8, scale_inv_t};
}

}  // namespace

TORCH_LIBRARY_IMPL(transformer_fp8, CUDA, m) {
  m.impl("quantize_blockwise", &quantize_blockwise_cuda);
}

}  // namespace transformer_fp8
