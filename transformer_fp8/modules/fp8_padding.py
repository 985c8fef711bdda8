"""Fp8Padding and Fp8Unpadding (Transformer Engine's): pad each row block of a grouped input
to a multiple of ``align_size`` rows before a GroupedLinear, and take the padding off its
output.

    padding, unpadding = Fp8Padding(num_experts), Fp8Unpadding(num_experts)
    x_padded, padded_splits = padding(x, m_splits)      # zero rows after each block
    y = unpadding(experts(x_padded, padded_splits), m_splits)

The padding rows are zeros: they add nothing to any amax, and their outputs are dropped, so
their gradients are zeros too. Transformer Engine's grouped GEMMs need blocks of a multiple
of 16 rows; this library's FP8 layers take any number of rows, so the padding is only there for
models written for Transformer Engine. align_size: 16 for every recipe of this library
(Transformer Engine's default for its recipes other than MXFP8 and NVFP4).
"""
from __future__ import annotations

from typing import Optional, Sequence, Union

import math

import torch
import torch.nn.functional as F

from .grouped_linear import _as_int
from .torchscript import refuse_torchscript

DEFAULT_ALIGN_SIZE = 16


def _checked(owner: str, num_gemms: int, inp: torch.Tensor,
             m_splits: Union[Sequence[int], torch.Tensor], rows_of) -> list[int]:
    if not isinstance(inp, torch.Tensor) or inp.dim() < 1:
        raise TypeError(f"{owner}: inp must be a tensor of at least one dimension, got "
                        f"{type(inp).__name__ if not isinstance(inp, torch.Tensor) else inp.shape}")
    if isinstance(m_splits, torch.Tensor):
        m_splits = m_splits.tolist()
    splits = [_as_int(m) for m in m_splits]  # (numpy integers too)
    if len(splits) != num_gemms or not all(m is not None and m >= 0 for m in splits):
        raise ValueError(f"{owner}: m_splits must hold {num_gemms} non-negative integers (one "
                         f"per GEMM), got {m_splits!r}")
    rows = math.prod(inp.shape[:-1])
    expected = sum(rows_of(splits))
    if rows != expected:
        raise ValueError(f"{owner}: the input has {rows} rows, m_splits {splits} asks for "
                         f"{expected}")
    return splits


class _AlignedSplits(torch.nn.Module):
    __prepare_scriptable__ = refuse_torchscript  # (torch.jit.script: a clear error)

    def __init__(self, num_gemms: int, align_size: Optional[int] = None) -> None:
        super().__init__()
        if isinstance(num_gemms, bool) or not isinstance(num_gemms, int) or num_gemms < 1:
            raise ValueError(f"num_gemms must be a positive int, got {num_gemms!r}")
        if align_size is not None and (isinstance(align_size, bool)
                                       or not isinstance(align_size, int) or align_size < 1):
            raise ValueError(f"align_size must be None or a positive int, got {align_size!r}")
        self.num_gemms = num_gemms
        self.align_size = DEFAULT_ALIGN_SIZE if align_size is None else align_size

    def padded(self, m_splits: list[int]) -> list[int]:
        align = self.align_size
        return [(m + align - 1) // align * align for m in m_splits]

    def extra_repr(self) -> str:
        return f"num_gemms={self.num_gemms}, align_size={self.align_size}"


class Fp8Padding(_AlignedSplits):
    """forward(inp, m_splits) -> (padded input, padded m_splits): each block of m_splits[i]
    rows followed by zero rows up to a multiple of align_size. Returns inp itself where no
    block needs padding."""

    def forward(self, inp: torch.Tensor, m_splits) -> tuple[torch.Tensor, list[int]]:
        splits = _checked("Fp8Padding", self.num_gemms, inp, m_splits, lambda s: s)
        padded = self.padded(splits)
        if padded == splits:
            return inp, splits
        rows = inp.reshape(sum(splits), inp.shape[-1])  # (-1 fails on zero-width rows)
        blocks = [F.pad(block, (0, 0, 0, p - m))
                  for block, m, p in zip(rows.split(splits), splits, padded)]
        return torch.cat(blocks), padded


class Fp8Unpadding(_AlignedSplits):
    """forward(inp, m_splits) -> the rows of inp without the padding Fp8Padding added for
    these (unpadded) m_splits."""

    def forward(self, inp: torch.Tensor, m_splits) -> torch.Tensor:
        splits = _checked("Fp8Unpadding", self.num_gemms, inp, m_splits, self.padded)
        padded = self.padded(splits)
        if padded == splits:
            return inp
        rows = inp.reshape(sum(padded), inp.shape[-1])
        return torch.cat([block[:m] for block, m in zip(rows.split(padded), splits)])
