"""quantized_model_init (Transformer Engine 1.x's fp8_model_init): FP8 modules built inside it
are built for its recipe and hold their weights in FP8 (modules/fp8_primary_weights.py). The
modules' constructors ask init_recipe() / init_fp8_weights() what this thread's innermost
context says."""
from __future__ import annotations

import contextlib
import threading
from typing import Iterator, Optional

from .recipe import RECIPE_TYPES, DelayedScaling, Recipe


class _InitRecipe(threading.local):
    def __init__(self):
        self.stack: list = []  # (recipe, preserve_high_precision_init_val) or None (disabled)


_INIT = _InitRecipe()


def init_recipe() -> Optional[Recipe]:
    """The recipe of the innermost quantized_model_init of this thread, or None."""
    return _INIT.stack[-1][0] if _INIT.stack and _INIT.stack[-1] is not None else None


def init_fp8_weights() -> Optional[tuple]:
    """(recipe, preserve_high_precision_init_val) of the innermost enabled
    quantized_model_init of this thread, or None: the modules built now keep FP8 weights."""
    return _INIT.stack[-1] if _INIT.stack else None


@contextlib.contextmanager
def quantized_model_init(enabled: bool = True, recipe: Optional[Recipe] = None,
                         preserve_high_precision_init_val: bool = False) -> Iterator[None]:
    """FP8 modules built inside (transformer_fp8.Linear, LayerNormLinear, LayerNormMLP,
    GroupedLinear and the modules made of them) hold their GEMM weights in FP8 only, as
    Transformer Engine's do (modules/fp8_primary_weights.py): 1 byte per element and a scale,
    quantised with ``recipe`` (default DelayedScaling(); DelayedScaling or
    Float8CurrentScaling). Their FP8 state has the recipe's shapes from the start, as with
    their own ``recipe=`` argument, which takes precedence for the state.

    preserve_high_precision_init_val: keep each weight's initial high-precision value on the
    CPU, for ``param.get_high_precision_init_val()`` (a master copy's starting point) until
    ``param.clear_high_precision_init_val()``.
    enabled=False builds as outside. ``convert_to_fp8`` inside it sizes the FP8 state for the
    recipe and leaves the converted weights in high precision.
    """
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be True or False, got {type(enabled).__name__}")
    if not isinstance(preserve_high_precision_init_val, bool):
        raise TypeError("preserve_high_precision_init_val must be True or False, got "
                        f"{type(preserve_high_precision_init_val).__name__}")
    if recipe is not None and not isinstance(recipe, RECIPE_TYPES):
        raise TypeError("recipe must be None, a DelayedScaling, Float8CurrentScaling, "
                        "Float8BlockScaling or Float8RowwiseScaling, got "
                        f"{type(recipe).__name__}")
    _INIT.stack.append(((recipe or DelayedScaling()), preserve_high_precision_init_val)
                       if enabled else None)
    try:
        yield
    finally:
        _INIT.stack.pop()


fp8_model_init = quantized_model_init  # Transformer Engine 1.x's name
