// Launchers of the raw CUDA kernels (the *.cu files beside this one). They take plain pointers
// and the stream, know nothing of ATen, and return the launch status; the *_ops.cpp files here
// check the arguments, allocate and call them.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "../../activation_kind.h"
#include "../../fp8_common.h"
#include "../../operand_stats.h"

namespace transformer_fp8 {
namespace cuda {

// amax: *amax = max(*amax, max |x|) over n contiguous elements (NaN propagating).
cudaError_t launch_amax(const void* x, HpType x_type, int64_t n, float* amax, cudaStream_t stream);

// out[i] = saturating fp8(x[i] * *scale); if amax is not null it is raised to max |x|.
cudaError_t launch_cast(const void* x, HpType x_type, int64_t n, const float* scale,
                        Fp8Format fmt, uint8_t* out, float* amax, cudaStream_t stream);

// x [rows, cols] contiguous -> out [rows, cols] and out_t [cols, rows], one read of x.
cudaError_t launch_cast_transpose(const void* x, HpType x_type, int64_t rows, int64_t cols,
                                  const float* scale, Fp8Format fmt, uint8_t* out,
                                  uint8_t* out_t, float* amax, cudaStream_t stream);

// out[i] = (float(x_fp8[i]) * *scale_inv) rounded to out_type.
cudaError_t launch_cast_from_fp8(const uint8_t* x, Fp8Format fmt, int64_t n,
                                 const float* scale_inv, void* out, HpType out_type,
                                 cudaStream_t stream);

// One history [L, n] with its scale [n] and scale_inv [n]: what the update kernel reads per
// tensor. The launcher passes these to the kernel by value (kernel parameters, in batches), so
// one launch serves hundreds of tensors with no copy to device memory, and a CUDA graph that
// captures the launch keeps its own copy of them.
struct DelayedScalingTensor {
  float* history;
  float* scale;
  float* scale_inv;
  int64_t history_len;
  int64_t columns;
  double fp8_max;  // as given: the scale is computed in fp64
};

// tensors: a host array of count descriptors (read before the function returns).
cudaError_t launch_update_delayed_scaling(const DelayedScalingTensor* tensors, int64_t count,
                                          int margin, AmaxAlgo algo, cudaStream_t stream);

cudaError_t launch_compute_scale_from_amax(const float* amax, int64_t n, double fp8_max,
                                           int margin, float* scale, cudaStream_t stream);

// ---------------------------------------------------------------- fused operators
// (norm.cu, activation.cu, fused_common.cu; operators in norm_ops.cpp and
// activation_ops.cpp). Matrices are contiguous and row-major.

// Where a fused kernel writes its float32 result: rounded to the input's type (hp, or null)
// and / or as FP8 bytes (fp8, or null: the first rows of a row-padded buffer) of v * *scale,
// with *amax (if not null) raised to max |v| over the rows written.
struct FusedOutput {
  void* hp = nullptr;
  uint8_t* fp8 = nullptr;
  Fp8Format fmt = Fp8Format::E4M3;
  const float* scale = nullptr;
  float* amax = nullptr;
};

// Column sums (dbias, dweight) are deterministic and two-stage: per chunk of kColumnChunkRows
// rows a partial sum per column into a float32 workspace [column_chunks(rows), cols], then
// launch_column_sums adds the chunks in order.
constexpr int64_t kColumnChunkRows = 64;
inline int64_t column_chunks(int64_t rows) {
  return (rows + kColumnChunkRows - 1) / kColumnChunkRows;
}

// LayerNorm (mean != null) or RMSNorm (mean == null) of x [rows, cols] with float32 weight and
// bias (or null); gamma = weight (+ 1 if zero_centered_gamma). Writes mean (LayerNorm) and
// rstd [rows], and out.
cudaError_t launch_norm_fwd(const void* x, HpType x_type, int64_t rows, int64_t cols,
                            const float* weight, const float* bias, bool zero_centered_gamma,
                            float eps, float* mean, float* rstd, const FusedOutput& out,
                            cudaStream_t stream);

// Norm backward: dx [rows, cols] in x_type, and the partial column sums of dy * xhat
// (partial_dweight) and, for LayerNorm, of dy (partial_dbias, or null), each
// [column_chunks(rows), cols].
cudaError_t launch_norm_bwd(const void* dy, const void* x, HpType x_type, int64_t rows,
                            int64_t cols, const float* mean, const float* rstd,
                            const float* weight, bool zero_centered_gamma, void* dx,
                            float* partial_dweight, float* partial_dbias, cudaStream_t stream);

// Activation forward (dy == null: out [rows, out_cols] of act(x)) or backward (out [rows,
// in_cols] of d(loss)/dx) of x [rows, in_cols]. If partials is not null, the partial column
// sums of the float32 result [column_chunks(rows), result cols] for a dbias.
cudaError_t launch_activation(const void* x, const void* dy, HpType x_type, int64_t rows,
                              int64_t in_cols, Activation act, const FusedOutput& out,
                              float* partials, cudaStream_t stream);

// out[c] = sum over k (in order) of partials[k, c], rounded to out_type; 0 when chunks == 0.
cudaError_t launch_column_sums(const float* partials, int64_t chunks, int64_t cols, void* out,
                               HpType out_type, cudaStream_t stream);

// out [cols, rows] = transpose of the bytes in [rows, cols].
cudaError_t launch_transpose_bytes(const uint8_t* in, int64_t rows, int64_t cols, uint8_t* out,
                                   cudaStream_t stream);

// fp8_operand_stats (csrc/operand_stats.h) of x [g.rows, g.cols] contiguous and its FP8 data q:
// the units' partials into partials [g.units()], then the 12 float64 fields into out. scale:
// the block (i, j) scale at scale[i * stride_down + j * stride_across] (per tensor: scale[0]).
cudaError_t launch_operand_stats(const void* x, HpType x_type, const uint8_t* q, Fp8Format fmt,
                                 const float* scale, int64_t scale_stride_down,
                                 int64_t scale_stride_across, const StatsGeometry& g,
                                 float saturation_bound, StatsPartial* partials, double* out,
                                 cudaStream_t stream);

}  // namespace cuda
}  // namespace transformer_fp8
