"""Quantizers: how one tensor role (a GEMM's input, weight or grad_output) becomes an FP8 GEMM
operand, and the plan one FP8 GEMM's forward and backward share.

Every recipe's quantizer returns the same operand type, ``Quantized`` (the FP8 data and its
scale_inv, and the transpose with its own scale_inv when a backward GEMM needs it), and names the
GEMM that multiplies such operands, so the modules' autograd functions never ask which recipe
runs. The per-tensor quantizer (DelayedScaling, Float8CurrentScaling) is here; the block-scaled
one (Float8BlockScaling, Float8RowwiseScaling) in blockwise.py; which recipe gives which
quantizer for each role, in roles.py.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional

import torch

from .. import ops
from ..ops import fused as fused_ops
from . import amax_step, backward_step
from .gemm_params import DEFAULT_FAST_ACCUM

ALIGN = ops.GEMM_ALIGN  # FP8 GEMM dimensions must be multiples of it
pad_rows = ops.pad_rows


class Quantized(NamedTuple):
    """An FP8 GEMM operand: data [rows, cols] (x ~= data * scale_inv) and, when asked, its
    transpose data_t [cols, rows] with scale_inv_t (the same tensor under per-tensor scaling,
    the transpose's own block scales under block scaling). scale: the per-tensor scale used
    (None for block scaling), kept for checkpoint replay and statistics."""

    data: torch.Tensor
    data_t: Optional[torch.Tensor]
    scale_inv: torch.Tensor
    scale_inv_t: Optional[torch.Tensor]
    scale: Optional[torch.Tensor]


class Quantizer:
    """The interface of a quantizer. A subclass provides ``cast``, ``gemm``, ``for_replay`` and
    ``block_dims``, and sets ``fuses_cast`` when it casts a kernel's output in that kernel
    (``_cast_in_kernel``)."""

    dtype: torch.dtype
    fuses_cast = False  # True: a norm / activation kernel can write its output straight to FP8
    cache_key: tuple = ()  # a quantised weight is reused only by a quantizer with the same key

    def cast(self, x: torch.Tensor, with_transpose: bool = True) -> Quantized:
        """x (2-D, rows a multiple of 16) quantised; the transpose only if with_transpose."""
        raise NotImplementedError

    @staticmethod
    def gemm(a, a_scale_inv, b, b_scale_inv, out_dtype, bias=None, fast_accum=False):
        """``out[M, N] = dequant(a [M, K]) @ dequant(b [N, K]).T (+ bias)`` of two operands of
        this quantizer's kind."""
        raise NotImplementedError

    def for_replay(self, used: Quantized) -> "Quantizer":
        """The quantizer that repeats the cast that gave ``used`` (activation checkpointing's
        recomputation), recording nothing."""
        raise NotImplementedError

    def block_dims(self, cols: int) -> tuple:
        """(block rows, block cols) of the scales, (0, 0) for one scale per tensor."""
        raise NotImplementedError

    def dequant_scale(self, q: Quantized) -> torch.Tensor:
        """The scale(s) that multiplied the tensor before the cast (statistics)."""
        return q.scale if q.scale is not None else q.scale_inv.reciprocal()

    def cast_fused(self, fused: Callable, unfused: Callable, with_transpose: bool):
        """The cast of a tensor that a kernel computes (a norm's or an activation's output):
        ``fused(scale, amax_slot, dtype) -> (x_fp8, x_t_fp8, extra)`` computes and casts it in
        one pass where this quantizer can (``fuses_cast``); else ``unfused() -> (x_hp with
        padded rows, extra)`` makes it in high precision and it is cast after.
        Returns (Quantized, extra)."""
        if self.fuses_cast:
            return self._cast_in_kernel(fused, with_transpose)
        x_hp, extra = unfused()
        return self.cast(x_hp, with_transpose), extra

    def _cast_in_kernel(self, fused: Callable, with_transpose: bool):
        raise NotImplementedError

    def cast_grad_output(self, g: torch.Tensor, with_transpose: bool, with_dbias: bool):
        """The cast of a 2-D grad_output (rows padded to 16) and, if with_dbias, the bias
        gradient (column sums, float32 accumulation, in g's dtype) from the same read of g where
        the quantizer fuses casts. Returns (Quantized, dbias or None)."""
        if not with_dbias:
            return self.cast(pad_rows(g), with_transpose), None

        def fused(scale, amax_slot, dtype):
            return fused_ops.cast_transpose_dbias(g, scale, dtype, amax_slot, ALIGN)

        def unfused():
            return pad_rows(g), g.sum(dim=0, dtype=torch.float32).to(g.dtype)

        return self.cast_fused(fused, unfused, with_transpose)


def _tensor_gemm(a, a_scale_inv, b, b_scale_inv, out_dtype, bias=None, fast_accum=False):
    return ops.fp8_gemm(a, a_scale_inv, b, b_scale_inv, out_dtype, bias=bias,
                        use_fast_accum=fast_accum)


class TensorQuantizer(Quantizer):
    """One scale per tensor: DelayedScaling's stored scale (the amax recorded into the history
    in the same pass) or Float8CurrentScaling's scale of the tensor's own amax."""

    gemm = staticmethod(_tensor_gemm)
    cache_key = ("tensor",)

    def __init__(self, dtype, scale=None, scale_inv=None, amax_slot=None, group=None,
                 fixed=False, history=None, column=0, in_forward=False, power_2=False):
        self.dtype = dtype
        self.power_2 = power_2  # (current scaling: scales rounded down to powers of two)
        if power_2:  # (another operand: a weight kept or gathered in FP8 with another scale
            self.cache_key = ("tensor", "power_2")  # is not taken for it)
        self.scale, self.scale_inv, self.amax_slot = scale, scale_inv, amax_slot
        self.group = group
        self.fixed = fixed
        self.history, self.column = history, column  # amax_slot is history[0, column]
        self.in_forward = in_forward  # casts in forward passes only (an input's, a weight's)
        self.fuses_cast = not self.is_current  # current scaling needs the amax first

    @classmethod
    def delayed(cls, dtype, history, scale, scale_inv, column, record: bool = True,
                in_forward: bool = False):
        """The stored scale; the amax goes to the history's row 0 in the same pass (unless not
        ``record``: a torch.export trace, whose program has no update to give it to).
        ``in_forward``: the role casts in forward passes only (input, weight)."""
        amax_slot = history[0, column:column + 1] if record else None
        return cls(dtype, scale[column:column + 1], scale_inv[column:column + 1], amax_slot,
                   history=history, column=column, in_forward=in_forward)

    @classmethod
    def current(cls, dtype, group=None, power_2: bool = False):
        """The scale of the tensor's own amax; with a group (the ranks that each hold a shard
        of the tensor: tensor parallelism), of the MAX of their amaxes; with power_2, rounded
        down to a power of two (Float8CurrentScaling's use_power_2_scales)."""
        return cls(dtype, group=group, power_2=power_2)

    @classmethod
    def replay(cls, dtype, scale, scale_inv):
        """Given scales that nothing else writes, recording no amax: the cast of an earlier
        forward, repeated (activation checkpointing)."""
        return cls(dtype, scale, scale_inv, fixed=True)

    @property
    def is_current(self) -> bool:
        return self.scale is None and not self.fixed

    def for_replay(self, used: Quantized) -> "TensorQuantizer":
        # The scale is copied: the delayed update changes it at the context's exit, before the
        # recomputation runs (scale_inv is already a copy, see _known_scale). The replay casts
        # as the original did: a current-scaling cast was not fused with the norm or the
        # activation (it cast their output rounded to its dtype), so neither is its replay.
        replay = TensorQuantizer.replay(self.dtype, used.scale.clone(), used.scale_inv)
        replay.fuses_cast = self.fuses_cast
        return replay

    def block_dims(self, cols: int) -> tuple:
        return 0, 0

    def _known_scale(self):
        """(scale, scale_inv, amax slot or None) of a cast whose scale is known beforehand."""
        if self.fixed:
            return self.scale, self.scale_inv, None
        # scale_inv as 1 / scale, a new tensor: the delayed update rewrites the state in place
        # before backward runs (under torch.compile an opaque operator's result, which the
        # compiler cannot drop or recompute: ops.scale_inverse), and a scale_inv buffer out of
        # step with its scale (an EMA that averages buffers) must not scale the output. The
        # update writes scale_inv = 1 / scale: in step the two agree bit for bit.
        return self.scale, ops.scale_inverse(self.scale), self.amax_slot

    def _run(self, kernel: Callable, scale, amax_slot):
        """kernel(scale, amax_slot) -> results, with the amax recorded into the history."""
        traced_amax = (amax_slot is not None and not self.in_forward
                       and torch.compiler.is_compiling())
        if traced_amax:
            # Under torch.compile a backward cast's amax goes to a fresh tensor and an operator
            # that declares its mutation folds it into the history (a mutated view of a module
            # buffer, made in a traced backward, is more than AOTAutograd can partition). Same
            # max, same bits. A forward cast writes its slot of the history as eagerly: a
            # mutation of a graph input, which inductor makes in place in the kernel's call
            # (no scratch slot to zero, no record_amax call at every step).
            amax_slot = torch.zeros(1, dtype=torch.float32, device=scale.device)
        results = kernel(scale, amax_slot)
        if traced_amax:
            ops.record_amax(self.history, amax_slot, self.column)
        return results

    def cast(self, x: torch.Tensor, with_transpose: bool = True) -> Quantized:
        """The transpose is produced in the same pass, only when a backward GEMM needs it."""
        if self.is_current:
            amax = ops.amax(x)
            if self.group is not None:
                amax_step.all_reduce_max(amax, self.group)
            scale = ops.compute_scale_from_amax(amax.reshape(1), torch.finfo(self.dtype).max)
            if self.power_2:
                scale = power_2_floor(scale)
            scale_inv, amax_slot = ops.scale_inverse(scale), None
        else:
            scale, scale_inv, amax_slot = self._known_scale()

        def kernel(scale, amax_slot):
            if with_transpose:
                return ops.cast_transpose_to_fp8(x, scale, self.dtype, amax_slot)
            return ops.cast_to_fp8(x, scale, self.dtype, amax_slot), None

        x_fp8, x_t_fp8 = self._run(kernel, scale, amax_slot)
        return Quantized(x_fp8, x_t_fp8, scale_inv, scale_inv, scale)

    def _cast_in_kernel(self, fused: Callable, with_transpose: bool):
        scale, scale_inv, amax_slot = self._known_scale()
        x_fp8, x_t_fp8, extra = self._run(lambda s, a: fused(s, a, self.dtype), scale, amax_slot)
        x_t_fp8 = x_t_fp8 if with_transpose else None
        return Quantized(x_fp8, x_t_fp8, scale_inv, scale_inv, scale), extra


def power_2_floor(scale: torch.Tensor) -> torch.Tensor:
    """Positive float32 scales rounded down to powers of two, exactly: the mantissa bits
    cleared, as Transformer Engine's current scaling does with use_power_2_scales (an infinite
    scale, which compute_scale_from_amax does not give, would stay infinite)."""
    return (scale.view(torch.int32) & 0x7F800000).view(torch.float32)


def _scales_of(q: Quantized) -> Quantized:
    return Quantized(None, None, q.scale_inv, None, q.scale)


@dataclass
class Fp8Plan:
    """Everything one FP8 GEMM's forward and backward need besides the tensors: a quantizer per
    role, the weight already quantised (kept across microbatches) if any, the backward step of
    delayed scaling (None otherwise) and the output dtype."""

    input_quantizer: Quantizer
    weight_quantizer: Quantizer
    grad_quantizer: Quantizer
    weight_fp8: Optional[Quantized]  # cached, or None: quantised in the call
    backward_step: Optional[backward_step.BackwardStep]  # None without delayed scaling
    out_dtype: torch.dtype
    # Set by the forward: the input and weight operands as quantised (their scales).
    used: Optional[tuple] = None
    # The recipe's backward_override: None (backward GEMMs in FP8), "high_precision" or
    # "dequantized" (in high precision: backward_override.py).
    backward_override: Optional[str] = None
    # Fast accumulation of (fprop, dgrad, wgrad): the recipe's MMParams (gemm_params.py).
    fast_accum: tuple = DEFAULT_FAST_ACCUM

    @property
    def gemm(self) -> Callable:
        return self.input_quantizer.gemm

    def transposes(self, needed: bool) -> bool:
        """Whether a forward cast makes the transpose a backward GEMM reads: where that GEMM
        runs (``needed``) in FP8 (no backward_override)."""
        return needed and self.backward_override is None

    def quantize_weight(self, weight: torch.Tensor, with_transpose: bool) -> Quantized:
        if self.weight_fp8 is not None:
            return self.weight_fp8
        gathered = getattr(weight, "fp8_operand", None)  # FSDP2's FP8 all-gather gave it
        if gathered is not None and weight.fp8_cache_key == self.weight_quantizer.cache_key:
            operand = gathered(self.weight_quantizer.dtype, with_transpose)
            if operand is not None:
                return operand
        return self.weight_quantizer.cast(weight, with_transpose)

    def on_backward(self) -> None:
        """Called first thing by the backward: queue the grad_output update for the end of
        this backward pass (see backward_step.BackwardStep)."""
        if self.backward_step is None:
            return
        if not torch.compiler.is_compiling():
            self.backward_step.on_backward()
        else:
            # Traced (compiled autograd, or torch.compile's backward): the compiled graph cannot
            # queue the update; it is held for the next outermost fp8_autocast from now on.
            backward_step.note_compiled_backward()

    def keep_used(self, x_q: Quantized, w_q: Quantized) -> None:
        """Keep the scales the forward's operands were cast with, for checkpoint replay (which
        runs eagerly). Not their FP8 data: the plan lives until backward, which keeps only
        the transposed copies it reads (holding the rest doubled the FP8 activations kept)."""
        if not torch.compiler.is_compiling():
            self.used = (_scales_of(x_q), _scales_of(w_q))

    def for_replay(self) -> "Fp8Plan":
        """The plan that repeats this forward exactly (activation checkpointing)."""
        x_q, w_q = self.used
        return Fp8Plan(self.input_quantizer.for_replay(x_q),
                       self.weight_quantizer.for_replay(w_q), self.grad_quantizer,
                       self.weight_fp8, self.backward_step, self.out_dtype,
                       backward_override=self.backward_override, fast_accum=self.fast_accum)
