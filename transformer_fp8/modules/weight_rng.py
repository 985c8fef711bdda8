"""Transformer Engine's get_rng_state_tracker and rng_tracker_name of the GEMM modules (Linear,
LayerNormLinear, LayerNormMLP, GroupedLinear): their weights are drawn inside
``get_rng_state_tracker().fork(rng_tracker_name)`` (the name "model-parallel-rng" where none is
given), at construction and in reset_parameters(), as Transformer Engine draws them, so that a
tensor-parallel shard gets its own rank's stream. Biases, norm weights and what the default
generator draws otherwise are unchanged.
"""
from __future__ import annotations

import contextlib
from typing import Optional

from .. import distributed


def weight_rng(owner: str, get_rng_state_tracker, rng_tracker_name: Optional[str]):
    """(the tracker getter, the state's name) for the module's weights, or None without a
    tracker (Transformer Engine ignores the name then)."""
    if rng_tracker_name is not None and not isinstance(rng_tracker_name, str):
        raise TypeError(f"{owner}: rng_tracker_name must be a string or None, got "
                        f"{type(rng_tracker_name).__name__}")
    getter = distributed.check_rng_state_tracker(owner, get_rng_state_tracker)
    if getter is None:
        return None
    return getter, rng_tracker_name or distributed.DEFAULT_RNG_TRACKER_NAME


def drawing_weights(module):
    """The context the module's weights are drawn in: its tracker's fork, or none."""
    rng = module.__dict__.get("_weight_rng")
    if rng is None:
        return contextlib.nullcontext()
    getter, name = rng
    return getter().fork(name)
