"""fp8_operand_stats: the statistics of one FP8 GEMM operand in two launches (csrc/operand_stats.h
holds the numerics shared by the CPU and CUDA kernels; transformer_fp8/debug/stats.py states the
fields and keeps the pure-torch reference, ``operand_stats_reference``)."""
from __future__ import annotations

import torch

from .. import _C  # noqa: F401  (loads the library and registers the operators)
from .checks import check_wrapper_arguments, register_fake

_ops = torch.ops.transformer_fp8

STATS_FIELDS = 12  # the length of debug/stats.py's FIELDS vector


def fp8_operand_stats(x: torch.Tensor, q: torch.Tensor, x_scale: torch.Tensor, fp8_max: float,
                      block_rows: int = 0, block_cols: int = 0) -> torch.Tensor:
    """The FIELDS vector (float64 [12], on x's device) of x [rows, cols] quantised to the FP8
    data q with ``x_scale``: 1 element (per-tensor scaling, block dims 0) or one scale per
    block_rows x block_cols block ([>= ceil(rows / br), >= ceil(cols / bc)], any strides). Rows
    past min(x rows, q rows) are ignored (a fused cast may pad q). Sums are float64, added in
    an order fixed by the shapes (not torch's): within a few ulps of the reference."""
    check_wrapper_arguments("fp8_operand_stats", tensors={"x": x, "q": q, "x_scale": x_scale},
                            ints={"block_rows": block_rows, "block_cols": block_cols})
    return _ops.fp8_operand_stats(x, q, x_scale, float(fp8_max), block_rows, block_cols)


@register_fake("transformer_fp8::fp8_operand_stats")
def _fp8_operand_stats_fake(x, q, x_scale, fp8_max, block_rows, block_cols):
    torch._check(x.dim() == 2 and q.dim() == 2,
                 lambda: f"fp8_operand_stats needs 2-D x and q, got {x.dim()}-D and {q.dim()}-D")
    return x.new_empty((STATS_FIELDS,), dtype=torch.float64)
