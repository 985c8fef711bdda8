"""The amax history's length and the recipe record an FP8 state keeps (fp8_recipe_fields): what
a module built for a recipe starts with, and how a history is resized for another recipe."""
from __future__ import annotations

import torch

from .recipe import BLOCK_RECIPES, DelayedScaling, Float8CurrentScaling, Format

_FORMAT_CODES = {Format.E4M3: 0, Format.E5M2: 1, Format.HYBRID: 2}
_ALGO_CODES = {"max": 0, "most_recent": 1}
# (read from the field: a DelayedScaling made at import would refuse NVTE_BACKWARD_OVERRIDE, which
# a process training with Float8CurrentScaling may set)
DEFAULT_HISTORY_LEN = DelayedScaling.__dataclass_fields__["amax_history_len"].default


def recipe_code(recipe: DelayedScaling) -> list[int]:
    algo = recipe.amax_compute_algo
    return [recipe.margin, _FORMAT_CODES[recipe.fp8_format], recipe.amax_history_len,
            _ALGO_CODES.get(algo, 2) if isinstance(algo, str) else 2]


def resized_history(history: torch.Tensor, length: int) -> torch.Tensor:
    """The amax history [L, n] as a history of ``length`` rows that had always been that long:
    row 0 (this step's amaxes) kept, then the newest of the earlier amaxes that fit, oldest
    first, ending in the last row (the update rolls row 1 out: each amax leaves the window
    ``length`` steps after it was recorded). Lengthened, the window holds the same amaxes;
    shortened, the oldest leave (Transformer Engine keeps the first rows instead, its oldest
    amaxes)."""
    resized = history.new_zeros(length, history.shape[1])
    resized[0] = history[0]
    kept = min(length, history.shape[0]) - 1
    if kept > 0:
        resized[length - kept:] = history[history.shape[0] - kept:]
    return resized


def history_len_for(recipe) -> int:
    """The amax history length a module built for ``recipe`` starts with: the recipe's own for
    DelayedScaling, so that its state_dict has its final shapes from the start (a checkpoint of
    trained modules loads into freshly built ones, e.g. with torch.distributed.checkpoint)."""
    if recipe is None or isinstance(recipe, (Float8CurrentScaling,) + BLOCK_RECIPES):
        return DEFAULT_HISTORY_LEN
    if isinstance(recipe, DelayedScaling):
        return recipe.amax_history_len
    raise TypeError("recipe must be None, a DelayedScaling, Float8CurrentScaling, "
                    f"Float8BlockScaling or Float8RowwiseScaling, got {type(recipe).__name__}")
