// CUDA operators activation_fwd(_fp8), activation_bwd(_fp8) and cast_transpose_dbias:
// argument checks, allocation, device guard and stream; the kernels are in activation.cu.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <tuple>

#include "fused_ops_common.h"

namespace transformer_fp8 {
namespace {

using Tensor = at::Tensor;

Tensor activation_fwd_cuda(const Tensor& x, c10::string_view activation) {
  const Activation act = parse_activation(activation);
  const int64_t out_cols = check_activation_input(x, act, "activation_fwd");
  check_cuda_input(x, "x", "activation_fwd");
  const c10::cuda::CUDAGuard guard(x.device());
  const Tensor xc = x.contiguous();
  Tensor y = at::empty({x.size(0), out_cols}, x.options());
  cuda::FusedOutput out;
  out.hp = y.data_ptr();
  const auto status = cuda::launch_activation(xc.data_ptr(), nullptr, hp_type_of(x.scalar_type()),
                                              x.size(0), x.size(1), act, out, nullptr,
                                              c10::cuda::getCurrentCUDAStream());
  TFP8_CHECK_LAUNCH(status, "activation_fwd");
  return y;
}

// The FP8 forward / backward / plain cast: result [rows, result_cols] as FP8 rows (padded),
// its transpose if asked, and (partials) the dbias column sums in x's dtype.
std::tuple<Tensor, Tensor, Tensor> fused_fp8(const Tensor& x, const Tensor* dy, Activation act,
                                             int64_t result_cols, const Tensor& scale,
                                             at::ScalarType fp8_dtype,
                                             const c10::optional<Tensor>& amax,
                                             bool with_transpose, bool with_dbias,
                                             int64_t row_multiple, const char* op) {
  const Fp8Format fmt = check_fp8_output_args(x, scale, fp8_dtype, amax, row_multiple, dy, "dy");
  check_cuda_input(x, "x", op);
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const Tensor xc = x.contiguous();
  const Tensor dyc = dy != nullptr ? dy->contiguous() : Tensor();
  const int64_t rows = x.size(0);
  Fp8Rows fp8 = alloc_fp8_rows(x, rows, result_cols, fp8_dtype, with_transpose, row_multiple,
                               stream);
  Tensor partials = with_dbias ? column_partials(x, rows, result_cols) : Tensor();
  const auto status = cuda::launch_activation(
      xc.data_ptr(), dy != nullptr ? dyc.data_ptr() : nullptr, hp_type_of(x.scalar_type()), rows,
      x.size(1), act, fp8_output(fp8, fmt, scale, amax),
      with_dbias ? partials.data_ptr<float>() : nullptr, stream);
  TFP8_CHECK_LAUNCH(status, op);
  write_transpose(fp8, with_transpose, stream, op);
  Tensor dbias = with_dbias ? finish_column_sums(partials, x.scalar_type(), stream, op)
                            : at::empty({0}, x.options());
  return {fp8.out, fp8.out_t, dbias};
}

std::tuple<Tensor, Tensor> activation_fwd_fp8_cuda(const Tensor& x, c10::string_view activation,
                                                   const Tensor& scale, at::ScalarType fp8_dtype,
                                                   const c10::optional<Tensor>& amax,
                                                   bool with_transpose, int64_t row_multiple) {
  const Activation act = parse_activation(activation);
  const int64_t out_cols = check_activation_input(x, act, "activation_fwd_fp8");
  auto [y_fp8, y_t_fp8, unused] = fused_fp8(x, nullptr, act, out_cols, scale, fp8_dtype, amax,
                                            with_transpose, false, row_multiple,
                                            "activation_fwd_fp8");
  return {y_fp8, y_t_fp8};
}

Tensor activation_bwd_cuda(const Tensor& dy, const Tensor& x, c10::string_view activation) {
  const Activation act = parse_activation(activation);
  const int64_t out_cols = check_activation_input(x, act, "activation_bwd");
  check_activation_grad(dy, x, out_cols);
  check_cuda_input(x, "x", "activation_bwd");
  const c10::cuda::CUDAGuard guard(x.device());
  const Tensor xc = x.contiguous(), dyc = dy.contiguous();
  Tensor dx = at::empty(x.sizes(), x.options());
  cuda::FusedOutput out;
  out.hp = dx.data_ptr();
  const auto status = cuda::launch_activation(xc.data_ptr(), dyc.data_ptr(),
                                              hp_type_of(x.scalar_type()), x.size(0), x.size(1),
                                              act, out, nullptr,
                                              c10::cuda::getCurrentCUDAStream());
  TFP8_CHECK_LAUNCH(status, "activation_bwd");
  return dx;
}

std::tuple<Tensor, Tensor, Tensor> activation_bwd_fp8_cuda(
    const Tensor& dy, const Tensor& x, c10::string_view activation, const Tensor& scale,
    at::ScalarType fp8_dtype, const c10::optional<Tensor>& amax, bool with_transpose,
    bool with_dbias, int64_t row_multiple) {
  const Activation act = parse_activation(activation);
  const int64_t out_cols = check_activation_input(x, act, "activation_bwd_fp8");
  check_activation_grad(dy, x, out_cols);
  return fused_fp8(x, &dy, act, x.size(1), scale, fp8_dtype, amax, with_transpose, with_dbias,
                   row_multiple, "activation_bwd_fp8");
}

std::tuple<Tensor, Tensor, Tensor> cast_transpose_dbias_cuda(const Tensor& x, const Tensor& scale,
                                                             at::ScalarType fp8_dtype,
                                                             const c10::optional<Tensor>& amax,
                                                             int64_t row_multiple) {
  check_2d_input(x, "x", "cast_transpose_dbias");
  // The identity "activation": a plain cast of x, with the column sums of x.
  return fused_fp8(x, nullptr, Activation::Identity, x.size(1), scale, fp8_dtype, amax, true,
                   true, row_multiple, "cast_transpose_dbias");
}

}  // namespace

TORCH_LIBRARY_IMPL(transformer_fp8, CUDA, m) {
  m.impl("activation_fwd", &activation_fwd_cuda);
  m.impl("activation_fwd_fp8", &activation_fwd_fp8_cuda);
  m.impl("activation_bwd", &activation_bwd_cuda);
  m.impl("activation_bwd_fp8", &activation_bwd_fp8_cuda);
  m.impl("cast_transpose_dbias", &cast_transpose_dbias_cuda);
}

}  // namespace transformer_fp8
