"""Calibration: fp8_autocast(enabled=False, calibrating=True).

The modules run in high precision (their torch composition, unchanged) and record, for each
GEMM, the amax of its input and of its weight into row 0 of the forward amax history, as an FP8
forward records them in the cast. The module joins the step's forward update, so at the
outermost exit the histories roll and the scales are computed from those amaxes: the first FP8
step after calibration casts with them instead of unit scales. Only delayed scaling has state
to calibrate; under the other recipes a calibrating run is a plain high-precision run. The
backward (grad_output) state is not calibrated, as in Transformer Engine.
"""
from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from . import autocast as _autocast
from .. import ops
from .._dtensor import local_tensor
from .recipe import DelayedScaling


def recording_linear(module, state):
    """A stand-in for F.linear with which ``module._high_precision`` records each GEMM's input
    and weight amax (GEMMs numbered in call order, as fp8_weights() lists them)."""
    if not isinstance(state.recipe, DelayedScaling):
        return F.linear
    module._adopt_recipe(state.recipe)
    _autocast.record_forward(state, *module._scaling_states)
    history = module.fp8_fwd_amax_history
    gemms = itertools.count()

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
        return F.linear(x, weight, bias)

    return linear
