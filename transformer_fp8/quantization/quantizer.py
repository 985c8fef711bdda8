"""Per-tensor quantizers: how one tensor role (a GEMM's input, weight or grad_output) is cast to
FP8 under DelayedScaling (the stored scale, the amax recorded into the history in the same
pass) or Float8CurrentScaling (the scale of the tensor's own amax), and the plan one FP8 GEMM's
forward and backward share. (The block-scaled recipes quantise in quantization/blockwise.py.)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .. import ops
from ..ops import fused as fused_ops
from . import amax_step

ALIGN = ops.GEMM_ALIGN  # FP8 GEMM dimensions must be multiples of it
pad_rows = ops.pad_rows


class Fp8Cast:
    """How one tensor role (a GEMM's input, weight or grad_output) is cast to FP8."""

    def __init__(self, dtype, scale=None, scale_inv=None, amax_slot=None, group=None,
                 fixed=False, history=None, column=0):
        self.dtype = dtype
        self.scale, self.scale_inv, self.amax_slot = scale, scale_inv, amax_slot
        self.group = group
        self.fixed = fixed
        self.history, self.column = history, column  # amax_slot is history[0, column]

    @classmethod
    def delayed(cls, dtype, history, scale, scale_inv, column):
        """The stored scale; the amax goes to the history's row 0 in the same pass."""
        return cls(dtype, scale[column:column + 1], scale_inv[column:column + 1],
                   history[0, column:column + 1], history=history, column=column)

    @classmethod
    def current(cls, dtype, group):
        """The scale of the tensor's own amax, reduced across the group."""
        return cls(dtype, group=group)

    @classmethod
    def replay(cls, dtype, scale, scale_inv):
        """Given scales that nothing else writes, recording no amax: the cast of an earlier
        forward, repeated (activation checkpointing)."""
        return cls(dtype, scale, scale_inv, fixed=True)

    @property
    def is_current(self) -> bool:
        return self.scale is None and not self.fixed

    def _known_scale(self):
        """(scale, scale_inv, amax slot or None) of a cast whose scale is known beforehand."""
        if self.fixed:
            return self.scale, self.scale_inv, None
        # A copy of scale_inv: the delayed update rewrites it in place before backward runs
        # (under torch.compile an opaque copy, which the compiler cannot drop: ops.snapshot).
        copy = ops.snapshot if torch.compiler.is_compiling() else torch.Tensor.clone
        return self.scale, copy(self.scale_inv), self.amax_slot

    def _run(self, kernel: Callable, scale, amax_slot):
        """kernel(scale, amax_slot) -> results, with the amax recorded into the history."""
        traced_amax = amax_slot is not None and torch.compiler.is_compiling()
        if traced_amax:
            # Under torch.compile the amax goes to a fresh tensor and an operator that declares
            # its mutation folds it into the history (a mutated view of a module buffer, made in
            # a traced backward, is more than AOTAutograd can partition). Same max, same bits.
            amax_slot = torch.zeros(1, dtype=torch.float32, device=scale.device)
        results = kernel(scale, amax_slot)
        if traced_amax:
            ops.record_amax(self.history, amax_slot, self.column)
        return results

    def cast(self, x: torch.Tensor, with_transpose: bool = True):
        """(x_fp8, x_t_fp8 or None, scale_inv used, scale used). The transpose is produced in
        the same pass, only when a backward GEMM needs it."""
        if self.is_current:
            amax = ops.amax(x)
            amax_step.all_reduce_max(amax, self.group)
            scale = ops.compute_scale_from_amax(amax.reshape(1), torch.finfo(self.dtype).max)
            scale_inv, amax_slot = scale.reciprocal(), None
        else:
            scale, scale_inv, amax_slot = self._known_scale()

        def kernel(scale, amax_slot):
            if with_transpose:
                return ops.cast_transpose_to_fp8(x, scale, self.dtype, amax_slot)
            return ops.cast_to_fp8(x, scale, self.dtype, amax_slot), None

        x_fp8, x_t_fp8 = self._run(kernel, scale, amax_slot)
        return x_fp8, x_t_fp8, scale_inv, scale

    def cast_fused(self, fused: Callable, unfused: Callable, with_transpose: bool):
        """The cast of a tensor that a kernel computes and casts in one pass (a norm's or an
        activation's output): ``fused(scale, amax_slot, dtype) -> (x_fp8, x_t_fp8, extra)``.
        Current scaling needs the tensor's amax before its scale, so there the tensor is made
        in high precision first: ``unfused() -> (x_hp with padded rows, extra)``.
        Returns (x_fp8, x_t_fp8 or None, scale_inv, scale, extra)."""
        if self.is_current:
            x_hp, extra = unfused()
            x_fp8, x_t_fp8, scale_inv, scale = self.cast(x_hp, with_transpose)
            return x_fp8, x_t_fp8, scale_inv, scale, extra
        scale, scale_inv, amax_slot = self._known_scale()
        x_fp8, x_t_fp8, extra = self._run(lambda s, a: fused(s, a, self.dtype), scale, amax_slot)
        return x_fp8, (x_t_fp8 if with_transpose else None), scale_inv, scale, extra

    def cast_grad_output(self, g: torch.Tensor, with_transpose: bool, with_dbias: bool):
        """The cast of a 2-D grad_output (rows padded to 16) and, if with_dbias, the bias
        gradient (column sums, float32 accumulation, in g's dtype) from the same read of g.
        Returns (g_fp8, g_t_fp8 or None, scale_inv, dbias or None)."""
        if not with_dbias:
            g_fp8, g_t_fp8, scale_inv, _ = self.cast(pad_rows(g), with_transpose)
            return g_fp8, g_t_fp8, scale_inv, None
        def fused(scale, amax_slot, dtype):
            return fused_ops.cast_transpose_dbias(g, scale, dtype, amax_slot, ALIGN)

        def unfused():
            return pad_rows(g), g.sum(dim=0, dtype=torch.float32).to(g.dtype)

        g_fp8, g_t_fp8, scale_inv, _, dbias = self.cast_fused(fused, unfused, with_transpose)
        return g_fp8, g_t_fp8, scale_inv, dbias


@dataclass
class Fp8Plan:
    """Everything one FP8 GEMM's forward and backward need besides the tensors."""

    input_cast: Fp8Cast
    weight_cast: Fp8Cast
    grad_cast: Fp8Cast
    weight_fp8: Optional[tuple]  # cached (w_fp8, w_t_fp8, scale_inv, scale), or None
    backward_step: Optional[amax_step.BackwardStep]  # None with current scaling
    out_dtype: torch.dtype
    # Set by the forward: (input scale, input scale_inv, weight scale, weight scale_inv) used.
    scales_used: Optional[tuple] = None

    def on_backward(self) -> None:
        """Called first thing by the backward: queue the grad_output update for the end of
        this backward pass (see fp8_context.BackwardStep)."""
        if self.backward_step is not None and not torch.compiler.is_compiling():
            self.backward_step.on_backward()

    def keep_scales(self, x_scale, x_scale_inv, w_scale, w_scale_inv) -> None:
        if not torch.compiler.is_compiling():  # for checkpoint replay, which runs eagerly
            self.scales_used = (x_scale, x_scale_inv, w_scale, w_scale_inv)

