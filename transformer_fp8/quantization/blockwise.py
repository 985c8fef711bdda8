"""The block-scaled quantizer (Float8BlockScaling, Float8RowwiseScaling).

Every tensor takes its scales from its own blocks at the time of the cast (ops/blockwise.py):
there is no amax history, no scale update and no collective. In a multi-rank run nothing needs
reducing: each rank quantises the blocks of the tensors it holds, and no two ranks share a
block's scale (a tensor sharded across ranks would need its blocks aligned to the shards, which
row sharding of activations gives for 1x128 tiles).

GEMMs (a [M, K] @ b [N, K]^T, both operands quantised along their contraction dimension):
  fprop  out [M, N]  = x [M, K]      . w [N, K]
  dgrad  dx  [M, K]  = g [M, N]      . w^T [K, N]   (w^T quantised with its own blocks)
  wgrad  dw  [N, K]  = g^T [N, M]    . x^T [K, M]   (g^T and x^T likewise)
The transposes come from the high-precision tensors in the same quantize_blockwise call, so no
value is quantised twice. A norm or an activation feeding such a GEMM writes its output in high
precision, which is then quantised (a block's scale needs the block's amax first).
"""
from __future__ import annotations

import torch

from ..ops.blockwise import BLOCK, fp8_gemm_blockwise, quantize_blockwise
from .quantizer import Quantized, Quantizer


def _block_gemm(a, a_scale_inv, b, b_scale_inv, out_dtype, bias=None, fast_accum=False):
    # cuBLASLt's block-scaled GEMMs always accumulate in split mode (no fast accumulation).
    return fp8_gemm_blockwise(a, a_scale_inv, b, b_scale_inv, out_dtype, bias)


class BlockQuantizer(Quantizer):
    """Scales per block of one recipe dimension: 1 (1x128 tiles), 2 (128x128 blocks) or
    "rowwise" (one block per row, whatever the width)."""

    gemm = staticmethod(_block_gemm)

    def __init__(self, dim, dtype: torch.dtype, power_2_scale: bool):
        if dim not in (1, 2, "rowwise"):
            raise ValueError(f"block scaling dim must be 1, 2 or 'rowwise', got {dim!r}")
        self.dim, self.dtype, self.power_2_scale = dim, dtype, power_2_scale
        self.cache_key = ("block", dim, dtype, power_2_scale)

    def block_dims(self, cols: int) -> tuple:
        if self.dim == "rowwise":
            return 1, cols
        return (1, BLOCK) if self.dim == 1 else (BLOCK, BLOCK)

    def cast(self, x: torch.Tensor, with_transpose: bool = True) -> Quantized:
        # Row-wise as (1, -1): for a 128-column x, (1, 128) would mean 1x128 tiles (other
        # transposes).
        block_rows, block_cols = (1, -1) if self.dim == "rowwise" else self.block_dims(0)
        data, scale_inv, data_t, scale_inv_t = quantize_blockwise(
            x, block_rows, block_cols, self.dtype, self.power_2_scale, with_transpose)
        if not with_transpose:
            data_t = scale_inv_t = None
        return Quantized(data, data_t, scale_inv, scale_inv_t, None)

    def for_replay(self, used: Quantized) -> "BlockQuantizer":
        return self  # stateless: the same values give the same blocks and scales

    def __repr__(self) -> str:
        return f"BlockQuantizer(dim={self.dim!r}, dtype={self.dtype}, " \
               f"power_2_scale={self.power_2_scale})"


class ForwardOnlyBlockQuantizer(BlockQuantizer):
    """A BlockQuantizer that makes no transposes: the quantizers of a forward that torch.export
    traces without gradients (roles._block), whose program has no backward to read them. (The
    scales of a transposed activation, [cols, ceil(rows / 128)] column-major, made the trace
    specialise a dynamic batch on whether it had one block of rows.)"""

    def __init__(self, dim, dtype: torch.dtype, power_2_scale: bool):
        super().__init__(dim, dtype, power_2_scale)
        self.cache_key = (*self.cache_key, "forward only")  # (a kept weight has no transpose)

    def cast(self, x: torch.Tensor, with_transpose: bool = True) -> Quantized:
        return super().cast(x, with_transpose=False)
