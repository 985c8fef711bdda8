// CUDA operators amax, cast_to_fp8, cast_transpose_to_fp8 and cast_from_fp8: argument checks,
// allocation, device guard and stream; the kernels are in cast.cu.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "../cuda_checks.h"
#include "kernels.h"

namespace transformer_fp8 {
namespace {

uint8_t* fp8_ptr(at::Tensor& t) { return static_cast<uint8_t*>(t.data_ptr()); }

float* amax_ptr(const c10::optional<at::Tensor>& amax) {
  return amax.has_value() ? amax->data_ptr<float>() : nullptr;
}

at::Tensor amax_cuda(const at::Tensor& x) {
  check_high_precision(x, "x");
  check_cuda_tensor(x, "x");
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor xc = x.contiguous();
  at::Tensor result = at::zeros({}, x.options().dtype(at::kFloat));
  const auto status = cuda::launch_amax(xc.data_ptr(), hp_type_of(xc.scalar_type()), xc.numel(),
                                        result.data_ptr<float>(),
                                        c10::cuda::getCurrentCUDAStream());
  TFP8_CHECK_LAUNCH(status, "amax");
  return result;
}

at::Tensor cast_to_fp8_cuda(const at::Tensor& x, const at::Tensor& scale, at::ScalarType fp8_dtype,
                            const c10::optional<at::Tensor>& amax) {
  const Fp8Format fmt = check_cast_args(x, scale, fp8_dtype, amax);
  check_cuda_tensor(x, "x");
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty(x.sizes(), x.options().dtype(fp8_dtype));
  const auto status = cuda::launch_cast(xc.data_ptr(), hp_type_of(xc.scalar_type()), xc.numel(),
                                        scale.data_ptr<float>(), fmt, fp8_ptr(out),
                                        amax_ptr(amax), c10::cuda::getCurrentCUDAStream());
  TFP8_CHECK_LAUNCH(status, "cast_to_fp8");
  return out;
}

std::tuple<at::Tensor, at::Tensor> cast_transpose_to_fp8_cuda(
    const at::Tensor& x, const at::Tensor& scale, at::ScalarType fp8_dtype,
    const c10::optional<at::Tensor>& amax) {
  const Fp8Format fmt = check_cast_args(x, scale, fp8_dtype, amax);
  check_cuda_tensor(x, "x");
  TORCH_CHECK(x.dim() == 2, "transformer_fp8: argument 'x' of cast_transpose_to_fp8 must be "
              "2-D, got ", describe(x));
  // Column tiles of 128 run along gridDim.y, which holds at most 65535 blocks.
  TORCH_CHECK(x.size(1) <= 65535LL * 128, "transformer_fp8: argument 'x' of "
              "cast_transpose_to_fp8 may have at most 8388480 columns, got ", describe(x));
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor xc = x.contiguous();
  const int64_t rows = x.size(0), cols = x.size(1);
  at::Tensor out = at::empty({rows, cols}, x.options().dtype(fp8_dtype));
  at::Tensor out_t = at::empty({cols, rows}, x.options().dtype(fp8_dtype));
  const auto status = cuda::launch_cast_transpose(
      xc.data_ptr(), hp_type_of(xc.scalar_type()), rows, cols, scale.data_ptr<float>(), fmt,
      fp8_ptr(out), fp8_ptr(out_t), amax_ptr(amax), c10::cuda::getCurrentCUDAStream());
  TFP8_CHECK_LAUNCH(status, "cast_transpose_to_fp8");
  return {out, out_t};
}

at::Tensor cast_from_fp8_cuda(const at::Tensor& x_fp8, const at::Tensor& scale_inv,
                              at::ScalarType dtype) {
  check_dequant_args(x_fp8, scale_inv, dtype);
  check_cuda_tensor(x_fp8, "x_fp8");
  const c10::cuda::CUDAGuard guard(x_fp8.device());
  at::Tensor xc = x_fp8.contiguous();
  at::Tensor out = at::empty(x_fp8.sizes(), x_fp8.options().dtype(dtype));
  const Fp8Format fmt =
      x_fp8.scalar_type() == at::kFloat8_e4m3fn ? Fp8Format::E4M3 : Fp8Format::E5M2;
  const auto status = cuda::launch_cast_from_fp8(
      fp8_ptr(xc), fmt, xc.numel(), scale_inv.data_ptr<float>(), out.data_ptr(),
      hp_type_of(dtype), c10::cuda::getCurrentCUDAStream());
  TFP8_CHECK_LAUNCH(status, "cast_from_fp8");
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(transformer_fp8, CUDA, m) {
  m.impl("amax", &amax_cuda);
  m.impl("cast_to_fp8", &cast_to_fp8_cuda);
  m.impl("cast_transpose_to_fp8", &cast_transpose_to_fp8_cuda);
  m.impl("cast_from_fp8", &cast_from_fp8_cuda);
}

}  // namespace transformer_fp8
