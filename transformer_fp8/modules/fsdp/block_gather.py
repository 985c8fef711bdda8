"""The FP8 all-gather of a weight under 128x128 block scaling (Float8BlockScaling with
w_block_scaling_dim=2) under FSDP2 (fsdp/all_gather.py).

FSDP2 cuts a weight [rows, cols] into row shards of ceil(rows / ranks) rows. Where that is a
multiple of 128, every 128x128 block of the weight lies in one rank's shard, so each rank
quantises its shard's blocks (BlockQuantizer.cast: each block's scale from its own amax) and the
blocks are exactly those of the full weight: the all-gather moves the FP8 data (1 byte per
element) and the blocks' scale_invs (4 bytes per block), and what arrives is bit for bit
BlockQuantizer(2, ...).cast of the full weight. The transpose (for dgrad) is the transposed data
with the transposed block scales, which under 128x128 blocks is bit for bit the cast of the
transposed weight (GatheredFp8Weight.fp8_operand).
"""
from __future__ import annotations

import math

import torch

from ...ops.blockwise import BLOCK
from ...quantization.blockwise import BlockQuantizer
from .gathered_weight import block_scales_laid_out


def shards_hold_whole_blocks(rows: int, ranks: int) -> bool:
    """Whether FSDP2's row shards of a [rows, cols] weight over ``ranks`` ranks cut no 128x128
    block (the same answer on every rank: it depends on the full size only)."""
    return ranks == 1 or math.ceil(rows / ranks) % BLOCK == 0


def block_shard_inputs(x: torch.Tensor, quantizer: BlockQuantizer) -> tuple:
    """(FP8 data as uint8 [shard rows, cols], block scale_invs as uint8 [shard row blocks,
    4 * column blocks]) of one rank's shard ``x``."""
    rows, cols = x.shape
    if rows == 0:  # an empty shard (the last ranks of a small weight)
        return (x.new_zeros((0, cols), dtype=torch.uint8),
                x.new_zeros((0, 4 * math.ceil(cols / BLOCK)), dtype=torch.uint8))
    q = quantizer.cast(x, with_transpose=False)
    return q.data.view(torch.uint8), q.scale_inv.contiguous().view(torch.uint8)


def gathered_block_weight(data: torch.Tensor, scales: torch.Tensor, rows: int,
                          fp8_dtype: torch.dtype) -> tuple:
    """(FP8 data [rows, cols], block scale_invs in quantize_blockwise's layout) from the
    all-gathered uint8 data and scales (each rank's piece padded to equal size)."""
    row_blocks = math.ceil(rows / BLOCK)
    return (data.view(fp8_dtype)[:rows],
            block_scales_laid_out(scales.view(torch.float32)[:row_blocks]))
