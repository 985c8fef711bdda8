"""Calibration: fp8_autocast(enabled=False, calibrating=True).

The modules run in high precision (their torch composition, unchanged) and record, for each
GEMM, the amax of its input and of its weight into row 0 of the forward amax history, as an FP8
forward records them in the cast. The module joins the step's forward update, so at the
outermost exit the histories roll and the scales are computed from those amaxes: the first FP8
step after calibration casts with them instead of unit scales. Only delayed scaling has state
to calibrate; under the other recipes a calibrating run is a plain high-precision run.

A calibrating forward with gradients also calibrates the backward (Transformer Engine calibrates
the forward only): each GEMM's output gets a gradient hook that records the amax of its
grad_output into row 0 of the backward history, and the first such hook of a backward pass
queues the grad_output update for the end of that pass, as an FP8 backward does. So a first
training step run under ``calibrating=True`` (a high-precision step) gives the FP8 steps after
it scales for every role, instead of unit scales, whose first E5M2 casts flush small gradients
to zero (docs/good-to-know.md, "DelayedScaling's first steps").
"""
from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from . import autocast as _autocast
from .. import ops
from .._dtensor import local_tensor
from .recipe import DelayedScaling
from .replay import HIGH_PRECISION


def recording_linear(module, state, regions: tuple = ()):
    """A stand-in for F.linear with which ``module._high_precision`` records each GEMM's input
    and weight amax (GEMMs numbered in call order, as fp8_weights() lists them), and, in a
    forward with gradients, its grad_output amax in backward. ``regions``: the checkpointed
    regions this forward is the first forward of (checkpoint_stack.regions_to_keep), which keep
    the record its recomputation runs by (a reentrant region's first forward has no
    gradients: its recomputation records the grad_output amaxes)."""
    if not isinstance(state.recipe, DelayedScaling):
        module._replay_records.keep(regions, HIGH_PRECISION)
        return F.linear
    module._adopt_recipe(state.recipe)
    backward_step = _autocast.record_forward(state, *module._scaling_states)
    recording = GradOutputRecording(backward_step)
    module._replay_records.keep(regions, recording)
    history = module.fp8_fwd_amax_history
    gemms = itertools.count()
    record_grad_output = recording.hook_adder(module)

    def linear(x, weight, bias=None):
        gemm = next(gemms)
        with torch.no_grad():
            # max(recorded, amax): several calls in one context keep the largest, as the
            # FP8 casts do.
            for column, tensor in ((2 * gemm, x), (2 * gemm + 1, weight)):
                slot = history[0, column:column + 1]
                # (A tensor-parallel shard's amax: the step's reduction makes it the full
                # tensor's where it covers the ranks.)
                amax = ops.amax(local_tensor(tensor).detach())
                torch.maximum(slot, amax.reshape(1), out=slot)
        return record_grad_output(F.linear(x, weight, bias), gemm)

    return linear


class GradOutputRecording:
    """The replay record of a calibrating forward under activation checkpointing, and what
    records its GEMMs' grad_output amaxes: its recomputation runs in high precision, records no
    forward amax a second time and records the grad_output amaxes (the only ones a reentrant
    region's backward gives: its first forward ran without gradients)."""

    def __init__(self, backward_step):
        self.backward_step = backward_step

    def linear(self, module):
        """F.linear for the recomputation (modules/base.py's _replay)."""
        gemms = itertools.count()
        record_grad_output = self.hook_adder(module)
        return lambda x, weight, bias=None: record_grad_output(F.linear(x, weight, bias),
                                                               next(gemms))

    def hook_adder(self, module):
        """add(out, gemm) -> out: GEMM ``gemm``'s output, with a hook that records its
        grad_output amax where the module's backward state is registered with this backward
        step (record_forward registers it in forwards with gradients and in checkpointed
        ones)."""
        backward_step, bwd_state = self.backward_step, module._scaling_states[1]
        bwd_history = module.fp8_bwd_amax_history

        def add(out: torch.Tensor, gemm: int) -> torch.Tensor:
            if out.requires_grad and bwd_state.step is backward_step.step:
                out.register_hook(_grad_output_recorder(bwd_history, gemm, backward_step))
            return out

        return add


def _grad_output_recorder(bwd_history: torch.Tensor, gemm: int, backward_step):
    """The hook that records a GEMM's grad_output amax into column ``gemm`` of row 0 of the
    backward history (the max over calls, as the FP8 casts keep it) and has the update run at
    the end of the backward pass, as an FP8 backward has it (BackwardStep.on_backward)."""

    def record(grad: torch.Tensor) -> None:
        backward_step.on_backward()  # (once per pass; later calls return at once)
        with torch.no_grad():
            slot = bwd_history[0, gemm:gemm + 1]
            amax = ops.amax(local_tensor(grad).detach())
            torch.maximum(slot, amax.reshape(1), out=slot)

    return record
