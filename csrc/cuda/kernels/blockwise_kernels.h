// Launchers of the block-scaled quantisation kernels (blockwise.cu, blockwise_transpose.cu).
// Plain pointers and the stream; blockwise_ops.cpp checks the arguments, allocates and calls
// them.
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

// The two kernels of launch_quantize_blockwise_with_transpose (same bits; blockwise_transpose.cu's
// header): the 8 packs of a thread's share of the tile kept in registers, or parked in shared
// memory (bf16 and fp16 x; float32 x runs Registers whichever is asked).
enum class BlockwiseTransposeKernel : int { Registers = 0, Staged = 1 };

// 1x128 blocks of x [g.rows, g.cols] contiguous (g.mode == Vec128) and of its transpose, from
// one read of x: what launch_quantize_blockwise writes for x and for x.t().contiguous() (with
// transposed_geometry(g)), into out / scale_inv and out_t [g.cols, g.rows] / scale_inv_t.
cudaError_t launch_quantize_blockwise_with_transpose(const void* x, HpType x_type,
                                                     const BlockGeometry& g, Fp8Format fmt,
                                                     bool power_2_scale, uint8_t* out,
                                                     float* scale_inv, uint8_t* out_t,
                                                     float* scale_inv_t,
                                                     BlockwiseTransposeKernel kernel,
                                                     cudaStream_t stream);

}  // namespace cuda
}  // namespace transformer_fp8
