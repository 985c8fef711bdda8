// Launchers of the raw CUDA kernels (csrc/cuda/*.cu). They take plain pointers and the stream,
// know nothing of ATen, and return the launch status; csrc/cuda/*_ops.cpp check the arguments,
// allocate and call them.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "../fp8_common.h"

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

}  // namespace cuda
}  // namespace transformer_fp8
