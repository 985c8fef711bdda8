// Launcher of the block-scaled quantisation kernels (blockwise.cu). Plain pointers
// and the stream; blockwise_ops.cpp checks the arguments, allocates and calls it.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "../../blockwise_common.h"

namespace transformer_fp8 {
namespace cuda {

// x [g.rows, g.cols] contiguous -> out [g.rows, g.cols] (FP8 bytes) and the block scale_invs,
// written at scale_inv[i * g.stride0 + j * g.stride1] for block (i, j).
cudaError_t launch_quantize_blockwise(const void* x, HpType x_type, const BlockGeometry& g,
                                      Fp8Format fmt, bool power_2_scale, uint8_t* out,
                                      float* scale_inv, cudaStream_t stream);

}  // namespace cuda
}  // namespace transformer_fp8
