// Which kernel quantises 1x128 blocks with the transpose (blockwise_transpose.cu's header):
// the environment variable TRANSFORMER_FP8_BLOCKWISE_TRANSPOSE_KERNEL=registers|staged (unset or
// empty: registers), read once, at the first such call (blockwise_ops.cpp). Another value is an
// error of every such call.
#pragma once

#include <string>

namespace transformer_fp8 {

// Reads the variable again (tests and benchmarks that switch kernels in one process; Python:
// transformer_fp8._C._reread_blockwise_transpose_kernel()) and returns the kernel now chosen,
// "registers" or "staged"; raises on another value.
std::string reread_blockwise_transpose_kernel();

}  // namespace transformer_fp8
