// Host helpers of the fused CUDA operators (norm_ops.cpp, activation_ops.cpp): the row-padded
// FP8 outputs, their transpose, and the size limits of the launch grids.
#pragma once

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>

#include "../../checks/fused_checks.h"
#include "../cuda_checks.h"
#include "kernels.h"

namespace transformer_fp8 {

// Grid limits of the fused kernels: one block per row (gridDim.x) and 32-column transpose
// tiles (gridDim.y <= 65535).
constexpr int64_t kMaxFusedRows = (1LL << 31) - 1;
constexpr int64_t kMaxFusedCols = 65535LL * 32;

inline void check_cuda_input(const at::Tensor& x, const char* name, const char* op) {
  check_cuda_tensor(x, name);
  TORCH_CHECK(x.size(0) <= kMaxFusedRows && x.size(1) <= kMaxFusedCols, "transformer_fp8: "
              "argument '", name, "' of ", op, " may have at most ", kMaxFusedRows, " rows and ",
              kMaxFusedCols, " columns on CUDA, got ", describe(x));
}

// out [rows_pad, cols] with its padding rows zeroed (on the stream) and out_t [cols, rows_pad]
// or an empty [0]; the kernel writes the first rows of out, write_transpose fills out_t.
struct Fp8Rows {
  at::Tensor out;
  at::Tensor out_t;
};

inline Fp8Rows alloc_fp8_rows(const at::Tensor& x, int64_t rows, int64_t cols,
                              at::ScalarType fp8_dtype, bool with_transpose,
                              int64_t row_multiple, cudaStream_t stream) {
  const int64_t rows_pad = padded_rows(rows, row_multiple);
  Fp8Rows o;
  o.out = at::empty({rows_pad, cols}, x.options().dtype(fp8_dtype));
  if (rows_pad > rows && cols > 0) {
    C10_CUDA_CHECK(cudaMemsetAsync(static_cast<uint8_t*>(o.out.data_ptr()) + rows * cols, 0,
                                   static_cast<size_t>((rows_pad - rows) * cols), stream));
  }
  o.out_t = with_transpose ? at::empty({cols, rows_pad}, x.options().dtype(fp8_dtype))
                           : at::empty({0}, x.options().dtype(fp8_dtype));
  return o;
}

inline void write_transpose(Fp8Rows& o, bool with_transpose, cudaStream_t stream,
                            const char* op) {
  if (!with_transpose) return;
  const auto status = cuda::launch_transpose_bytes(
      static_cast<const uint8_t*>(o.out.data_ptr()), o.out.size(0), o.out.size(1),
      static_cast<uint8_t*>(o.out_t.data_ptr()), stream);
  TFP8_CHECK_LAUNCH(status, op);
}

inline cuda::FusedOutput fp8_output(Fp8Rows& o, Fp8Format fmt, const at::Tensor& scale,
                                    const c10::optional<at::Tensor>& amax) {
  cuda::FusedOutput out;
  out.fp8 = static_cast<uint8_t*>(o.out.data_ptr());
  out.fmt = fmt;
  out.scale = scale.data_ptr<float>();
  out.amax = amax.has_value() ? amax->data_ptr<float>() : nullptr;
  return out;
}

// A float32 workspace of per-chunk column sums, [column_chunks(rows), cols].
inline at::Tensor column_partials(const at::Tensor& x, int64_t rows, int64_t cols) {
  return at::empty({cuda::column_chunks(rows), cols}, x.options().dtype(at::kFloat));
}

// The column sums of partials, in dtype.
inline at::Tensor finish_column_sums(const at::Tensor& partials, at::ScalarType dtype,
                                     cudaStream_t stream, const char* op) {
  at::Tensor out = at::empty({partials.size(1)}, partials.options().dtype(dtype));
  const auto status = cuda::launch_column_sums(partials.data_ptr<float>(), partials.size(0),
                                               partials.size(1), out.data_ptr(),
                                               hp_type_of(dtype), stream);
  TFP8_CHECK_LAUNCH(status, op);
  return out;
}

}  // namespace transformer_fp8
