"""Transformer Engine's ``backward_override`` (a recipe field, default from NVTE_BACKWARD_OVERRIDE):
the forward GEMMs run in FP8 as the recipe says, the backward GEMMs in high precision.

  None              the backward GEMMs in FP8 (the FP8 transposes the forward made, grad_output
                    cast by its quantizer);
  "high_precision"  they multiply grad_output (not quantised) by the forward's operands as they
                    were before their casts: the input (or the norm's / activation's output) and
                    the weight, kept in high precision for the backward;
  "dequantized"     they multiply it by the forward's FP8 operands dequantised: what the forward
                    GEMM computed with (the FP8 data kept, no transposes made).

The backward GEMMs then run as torch's matmul with operands in the forward's output dtype (the
activation dtype: torch.autocast's, or the input's), as Transformer Engine runs them in its
activation dtype. No grad_output is quantised and no grad_output amax is recorded, which is why
delayed scaling refuses an override (as Transformer Engine).
"""
from __future__ import annotations

from typing import Optional

import torch

from .. import ops
from ..ops.blockwise import BLOCK

def kept_operand(override: Optional[str], q, high_precision: Optional[torch.Tensor],
                 needed: bool = True) -> tuple:
    """(tensor, scale_inv) a forward keeps of one GEMM operand for the backward: its FP8
    transpose (no override: the cast's data_t and scale_inv_t as made, whatever ``needed``:
    a checkpointed forward that a C++ step ran, which saves both always, is recomputed on this
    Python path, and torch.utils.checkpoint refuses another number of saved tensors; with
    (None, None) where not ``needed`` a 3-rank FSDP2 test raised CheckpointError), its FP8
    data ("dequantized") or
    the tensor before the cast ("high_precision"; scale_inv None); under an override (None,
    None) where no backward GEMM reads it (not ``needed``).

    A weight held in FP8 (an FP8 primary weight, or one FSDP2 all-gathered in FP8: it has
    ``fp8_operand``) gives its own tensors as the operand, which an optimizer step writes in
    place, or FSDP2 frees, before the backward: "dequantized" keeps copies (as the transpose
    the FP8 backward keeps is one). Under "high_precision" a weight FSDP2 gathered keeps its
    value now (``gathered_for_forward_only``: the gathered buffer is freed after the forward);
    an FP8 primary weight is kept itself (a write before the backward raises, as torch's
    in-place check does for any weight) and dequantised there."""
    if override is None:
        return q.data_t, q.scale_inv_t
    if not needed:
        return None, None
    held_in_fp8 = getattr(high_precision, "fp8_operand", None) is not None
    if override == "dequantized":
        if held_in_fp8:
            return q.data.clone(), q.scale_inv.clone()
        return q.data, q.scale_inv
    if getattr(high_precision, "gathered_for_forward_only", False):
        return high_precision.dequantize(), None
    return high_precision, None


def operand(kept: tuple, rows: int, dtype: torch.dtype) -> torch.Tensor:
    """A kept operand (``kept_operand`` under an override) in high precision ``dtype``, its
    first ``rows`` rows (the FP8 data has rows padded to 16)."""
    data, scale_inv = kept
    if scale_inv is None or data.element_size() != 1:
        # (the tensor before its cast; or a debug override's high-precision operand)
        return data[:rows].to(dtype)
    return dequantize(data, scale_inv, dtype)[:rows]  # (block scales cover the padded rows)


def dequantize(data: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """FP8 data [rows, cols] times its scale_inv, in float32, rounded to dtype: one scale for
    the tensor ([1]) or block scales (ops/blockwise.py's layouts, told apart by their shape:
    [rows, ceil(cols / 128)] for 1x128 tiles, [ceil(rows / 128), ceil(cols / 128)] for
    128x128 blocks, [rows, 1] row-wise)."""
    if scale_inv.dim() < 2:
        return ops.cast_from_fp8(data.contiguous(), scale_inv, dtype)
    rows, cols = data.shape
    s = scale_inv.float()
    if s.shape[0] != rows:  # 128x128 blocks
        s = s.repeat_interleave(BLOCK, dim=0)[:rows]
    if s.shape[1] != 1:
        s = s.repeat_interleave(BLOCK, dim=1)[:, :cols]
    return (data.float() * s).to(dtype)


def dgrad(grad: torch.Tensor, weight: torch.Tensor, compute_dtype: torch.dtype,
          out_dtype: torch.dtype) -> torch.Tensor:
    """grad [M, N] @ weight [N, K] in compute_dtype, rounded to out_dtype."""
    return torch.mm(grad.to(compute_dtype), weight.to(compute_dtype)).to(out_dtype)


def wgrad(grad: torch.Tensor, inp: torch.Tensor, compute_dtype: torch.dtype,
          out_dtype: torch.dtype) -> torch.Tensor:
    """grad^T [N, M] @ inp [M, K] in compute_dtype, rounded to out_dtype."""
    return torch.mm(grad.to(compute_dtype).t(), inp.to(compute_dtype)).to(out_dtype)


def bias_grad(grad: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The bias gradient: grad's column sums in grad's dtype (as torch's Linear), in dtype."""
    return grad.sum(dim=0).to(dtype)
