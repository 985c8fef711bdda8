// CUDA operator quantize_blockwise: argument checks, allocation, device guard and stream; the
// kernels are in blockwise.cu and blockwise_transpose.cu (1x128 blocks with the transpose, one
// read of x; its two kernels are chosen here, by TRANSFORMER_FP8_BLOCKWISE_TRANSPOSE_KERNEL).
// Same checks and layouts as the CPU kernel (csrc/cpu/blockwise.cpp).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <string>
#include <tuple>

#include "../../checks/blockwise_checks.h"
#include "blockwise_kernels.h"
#include "kernels.h"
#include "../cuda_checks.h"
#include "blockwise_transpose_choice.h"

namespace transformer_fp8 {
namespace {

// transpose_bytes runs 128-column tiles along gridDim.y, which holds at most 65535 blocks.
constexpr int64_t kMaxTransposeCols = 65535LL * 128;

// TRANSFORMER_FP8_BLOCKWISE_TRANSPOSE_KERNEL, read at the first 1x128 quantisation with the
// transpose and kept (reread_blockwise_transpose_kernel reads it again): -1 until then.
constexpr const char* kTransposeKernelVariable = "TRANSFORMER_FP8_BLOCKWISE_TRANSPOSE_KERNEL";
std::atomic<int> transpose_kernel_choice{-1};

cuda::BlockwiseTransposeKernel parse_transpose_kernel() {
  const char* value = std::getenv(kTransposeKernelVariable);
  if (value == nullptr || value[0] == '\0' || std::strcmp(value, "registers") == 0)
    return cuda::BlockwiseTransposeKernel::Registers;
  TORCH_CHECK(std::strcmp(value, "staged") == 0, "transformer_fp8: environment variable ",
              kTransposeKernelVariable, " must be 'registers' (the default) or 'staged', got '",
              value, "'");
  return cuda::BlockwiseTransposeKernel::Staged;
}

// A bad value is not kept: every call raises until it is fixed (and reread).
cuda::BlockwiseTransposeKernel transpose_kernel() {
  int choice = transpose_kernel_choice.load(std::memory_order_relaxed);
  if (choice < 0) {
    choice = static_cast<int>(parse_transpose_kernel());
    transpose_kernel_choice.store(choice, std::memory_order_relaxed);
  }
  return static_cast<cuda::BlockwiseTransposeKernel>(choice);
}

uint8_t* fp8_ptr(const at::Tensor& t) { return static_cast<uint8_t*>(t.data_ptr()); }
Fp8Format fp8_format(at::ScalarType fp8_dtype) {
  return fp8_dtype == at::kFloat8_e4m3fn ? Fp8Format::E4M3 : Fp8Format::E5M2;
}

std::tuple<at::Tensor, at::Tensor> quantize_one(const at::Tensor& xc, const BlockGeometry& g,
                                                at::ScalarType fp8_dtype, bool power_2_scale) {
  at::Tensor out = at::empty({g.rows, g.cols}, xc.options().dtype(fp8_dtype));
  at::Tensor scale_inv = new_scale_tensor(g, xc.options());
  const auto status = cuda::launch_quantize_blockwise(
      xc.data_ptr(), hp_type_of(xc.scalar_type()), g, fp8_format(fp8_dtype), power_2_scale,
      fp8_ptr(out), scale_inv.data_ptr<float>(), c10::cuda::getCurrentCUDAStream());
  TFP8_CHECK_LAUNCH(status, "quantize_blockwise");
  return {out, scale_inv};
}

// 1x128 blocks of xc and of xc^T (their own blocks: 128 x 1 columns of xc), one kernel.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_1x128_with_transpose(
    const at::Tensor& xc, const BlockGeometry& g, at::ScalarType fp8_dtype, bool power_2_scale) {
  const cuda::BlockwiseTransposeKernel kernel = transpose_kernel();
  at::Tensor out = at::empty({g.rows, g.cols}, xc.options().dtype(fp8_dtype));
  at::Tensor out_t = at::empty({g.cols, g.rows}, xc.options().dtype(fp8_dtype));
  at::Tensor scale_inv = new_scale_tensor(g, xc.options());
  at::Tensor scale_inv_t = new_scale_tensor(transposed_geometry(g), xc.options());
  const auto status = cuda::launch_quantize_blockwise_with_transpose(
      xc.data_ptr(), hp_type_of(xc.scalar_type()), g, fp8_format(fp8_dtype), power_2_scale,
      fp8_ptr(out), scale_inv.data_ptr<float>(), fp8_ptr(out_t), scale_inv_t.data_ptr<float>(),
      kernel, c10::cuda::getCurrentCUDAStream());
  TFP8_CHECK_LAUNCH(status, "quantize_blockwise");
  return {out, scale_inv, out_t, scale_inv_t};
}

// The transpose of the FP8 bytes x_fp8 [rows, cols], a new contiguous tensor [cols, rows].
at::Tensor transpose_fp8(const at::Tensor& x_fp8) {
  // Wider than transpose_bytes' grid: ATen's copy (a copy always: for one row or column
  // contiguous() would return a view of x_fp8).
  if (x_fp8.size(1) > kMaxTransposeCols) return x_fp8.t().clone(at::MemoryFormat::Contiguous);
  at::Tensor out = at::empty({x_fp8.size(1), x_fp8.size(0)}, x_fp8.options());
  const auto status = cuda::launch_transpose_bytes(fp8_ptr(x_fp8), x_fp8.size(0), x_fp8.size(1),
                                                   fp8_ptr(out), c10::cuda::getCurrentCUDAStream());
  TFP8_CHECK_LAUNCH(status, "quantize_blockwise");
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_blockwise_cuda(
    const at::Tensor& x, int64_t block_rows, int64_t block_cols, at::ScalarType fp8_dtype,
    bool power_2_scale, bool with_transpose) {
  const BlockMode mode = check_quantize_blockwise_args(x, block_rows, block_cols, fp8_dtype);
  check_cuda_tensor(x, "x");
  const c10::cuda::CUDAGuard guard(x.device());
  const BlockGeometry g = block_geometry(mode, x.size(0), x.size(1));
  // One warp (1-D blocks) or one thread block (128x128, and 1x128 with the transpose: 128 x 128
  // tiles, fewer than the 1x128 blocks) per block, on a 1-D grid.
  TORCH_CHECK(g.scale_rows * g.scale_cols <= (int64_t{1} << 31) - 1,
              "transformer_fp8: argument 'x' of quantize_blockwise has too many blocks for one "
              "launch, got ", describe(x));
  const at::Tensor xc = x.contiguous();
  if (with_transpose && mode == BlockMode::Vec128)
    return quantize_1x128_with_transpose(xc, g, fp8_dtype, power_2_scale);
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
    return {x_fp8, scale_inv, transpose_fp8(x_fp8), scale_inv_t};
  }
  // Row-wise x^T: one block per column of x, quantised from the high-precision values.
  auto [x_t_fp8, scale_inv_t] = quantize_one(xc.t().contiguous(), gt, fp8_dtype, power_2_scale);
  return {x_fp8, scale_inv, x_t_fp8, scale_inv_t};
}

}  // namespace

std::string reread_blockwise_transpose_kernel() {
  transpose_kernel_choice.store(-1, std::memory_order_relaxed);
  return transpose_kernel() == cuda::BlockwiseTransposeKernel::Staged ? "staged" : "registers";
}

TORCH_LIBRARY_IMPL(transformer_fp8, CUDA, m) {
  m.impl("quantize_blockwise", &quantize_blockwise_cuda);
}

}  // namespace transformer_fp8
