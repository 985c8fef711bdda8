"""The delayed-scaling update that a loaded FP8 state still owes: Transformer Engine up to 1.5
updated lazily (the forward state at the next forward, the backward state at the start of the
next backward), so its checkpoints hold the last step's amaxes in row 0 and scales not yet made
from them (modules/te_checkpoint.py, _pending_update, says which roles). The module runs that
update under the recipe it first runs with, before its first cast, as Transformer Engine
resuming from the checkpoint did."""
from __future__ import annotations

import torch

from .. import ops
from . import recipe_switch
from .scaling_state import forget_loaded_row
from .history import recipe_code, resized_history
from .recipe import DelayedScaling


def run_owed_update(module, recipe: DelayedScaling) -> None:
    """Update ``module``'s roles in ``module._te_pending_update`` ("fwd", "bwd") from their
    histories (row 0 included, then rolled), as every step's update does, and clear them. A
    history of another length than the recipe's is resized first, as Transformer Engine 1.5
    did, so the window is the recipe's length (its rows as history.resized_history keeps them:
    row 0 and the newest; Transformer Engine 1.5 kept the first rows)."""
    if torch.compiler.is_compiling():
        raise RuntimeError(
            f"{type(module).__name__}: the FP8 state loaded from a Transformer Engine <= 1.5 "
            "checkpoint still owes its delayed-scaling update, which cannot run under "
            "torch.compile; run one step eagerly first")
    roles = module._te_pending_update
    module._fp8_state_to_local()
    resized = False
    for role in roles:  # (first sized for the recipe, as Transformer Engine <= 1.5 did)
        history = getattr(module, f"fp8_{role}_amax_history")
        if history.shape[0] != recipe.amax_history_len:
            with torch.no_grad():
                history.data = resized_history(history, recipe.amax_history_len)
            resized = True
    if resized:
        module._bind_scaling_states()
    fmt = recipe.fp8_format
    with torch.no_grad():
        ops.update_delayed_scaling(
            [getattr(module, f"fp8_{role}_amax_history") for role in roles],
            [getattr(module, f"fp8_{role}_scale") for role in roles],
            [getattr(module, f"fp8_{role}_scale_inv") for role in roles],
            [fmt.max_fwd if role == "fwd" else fmt.max_bwd for role in roles],
            recipe.margin, recipe.amax_compute_algo, recipe.scaling_factor_compute_algo,
            recipe)
    recipe_switch.note_made_for(module, recipe_code(recipe), roles)
    for state in module._scaling_states:
        if state.role in roles:
            forget_loaded_row(state)  # (its row 0 is now this update's)
    module._te_pending_update = ()
