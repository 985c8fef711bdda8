"""Per-layer and per-GEMM precision overrides by name pattern: run matching FP8 modules in high
precision (Transformer Engine's DisableFP8Layer), some of their GEMMs only (DisableFP8GEMM:
fprop, dgrad, wgrad, optionally of one GEMM of the module, e.g. "fc2.wgrad"), or under
another, stateless recipe (current scaling, 1x128 blocks, row-wise) whatever recipe the
surrounding fp8_autocast uses.

    tfp8.debug.override(model, "blocks.3.*", fp8=False)
    tfp8.debug.override(model, "blocks.*.mlp", fp8=False, gemms=["fc2.wgrad"])
    tfp8.debug.override(model, "blocks.3.mlp", recipe=tfp8.Float8BlockScaling())
    tfp8.debug.clear_overrides(model)

The override is an attribute set once on each matching module (``_fp8_override``), read by the
module's forward dispatch: no name is matched per forward.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..quantization import autocast as _autocast
from ..quantization.recipe import STATELESS_RECIPES, Format
from .collector import LayerFilter, no_fp8_module_error, select_layers
from .gemm_override import gemm_list, parse_gemms, with_high_precision_gemms
from .observer import gemm_names


@dataclass(frozen=True)
class PrecisionOverride:
    """What a module runs with inside an enabled fp8_autocast: high precision (recipe None,
    no gemms), some GEMMs in high precision (gemms: (GEMM index, kind) pairs, e.g.
    {(1, "wgrad")}), or ``recipe`` instead of the context's. Immutable and hashable (the
    stateless recipes are frozen too): a module's override changes only through override()."""

    recipe: Optional[object]
    gemms: frozenset = frozenset()

    def __post_init__(self):
        gemms = frozenset(self.gemms)
        if not all(isinstance(p, tuple) and len(p) == 2 for p in gemms):
            raise TypeError(f"gemms must be (GEMM index, kind) pairs, got {self.gemms!r}")
        object.__setattr__(self, "gemms", gemms)  # (a frozen dataclass sets it so)

    def state_for(self, state):
        """The autocast state the module dispatches on, given the context's (None: high
        precision)."""
        if not state.enabled or self.gemms:
            return state
        if self.recipe is None:
            return None
        # (no group: the context's fp8_group is its delayed amax reduction's; the override's
        # current scaling reduces over a tensor-parallel weight's mesh, as the recipe alone)
        return _autocast._state_for(True, self.recipe, None)

    def wrap_quantizers(self, quantizers: list) -> list:
        """The module's quantizers with the chosen GEMMs in high precision."""
        if not self.gemms:
            return quantizers
        return with_high_precision_gemms(quantizers, self.gemms)


def override(model, layers: LayerFilter, *, fp8: bool = True, recipe=None, gemms=None) -> list:
    """Set the precision of the FP8 modules of ``model`` whose qualified names match
    ``layers`` (glob pattern(s) or a callable name -> bool): ``fp8=False`` runs them in high
    precision (exactly their computation outside fp8_autocast); with ``gemms`` (names among
    "fprop", "dgrad", "wgrad", each optionally after a GEMM name of the module and a dot, e.g.
    "fc2.wgrad"), only those GEMMs run in high precision (torch's matmul in the output dtype)
    and the others in FP8 as before; ``recipe=`` a Float8CurrentScaling, Float8BlockScaling or
    Float8RowwiseScaling runs them with that recipe. Returns the names of the modules changed."""
    if not isinstance(fp8, bool):
        raise TypeError(f"fp8 must be a bool, got {fp8!r}")
    if gemms is not None and (fp8 or recipe is not None):
        raise ValueError("gemms= chooses GEMMs to run in high precision: pass it with "
                         "fp8=False and no recipe")
    if fp8 and recipe is None:
        raise ValueError("override needs fp8=False (high precision) or a recipe")
    if not fp8 and recipe is not None:
        raise ValueError("pass either fp8=False or a recipe, not both")
    if isinstance(recipe, type):
        example = recipe.__name__ if issubclass(recipe, STATELESS_RECIPES) else \
            "Float8CurrentScaling"
        raise TypeError(f"recipe must be a recipe instance, got the class {recipe.__name__}: "
                        f"pass an instance, e.g. {example}()")
    if recipe is not None and not isinstance(recipe, STATELESS_RECIPES):
        raise TypeError("recipe must be a Float8CurrentScaling, Float8BlockScaling or "
                        "Float8RowwiseScaling (a recipe with no amax history), got "
                        f"{type(recipe).__name__}")
    if recipe is not None and recipe.fp8_format is Format.E5M2:  # (else: at the first forward)
        raise ValueError("recipe: Format.E5M2 cannot train (FP8 GEMMs take no E5M2 x E5M2 "
                         f"product); use Format.HYBRID or Format.E4M3, got {recipe!r}")
    if gemms is not None:
        gemms = gemm_list(gemms)
    selected = select_layers(model, layers)
    if not selected:
        raise no_fp8_module_error(model, layers)
    values = {module: PrecisionOverride(
        None if not fp8 else recipe,
        () if gemms is None else parse_gemms(gemms, gemm_names(module), name))
        for module, name in selected.items()}  # (all checked before any module changes)
    for module, value in values.items():
        module._fp8_override = value
    return sorted(selected.values())


def clear_overrides(model, layers: Optional[LayerFilter] = None) -> list:
    """Remove the overrides of the modules matching ``layers`` (None: of every module);
    returns the names of the modules whose override was removed. A ``layers`` that matches no
    FP8 module is refused, as override() refuses it (a typo would leave a layer overridden);
    one that matches FP8 modules without overrides clears nothing (a cleanup may run twice)."""
    selected = select_layers(model, "*" if layers is None else layers)
    cleared = {m: name for m, name in selected.items()
               if m.__dict__.get("_fp8_override") is not None}
    if layers is not None and not selected:
        raise ValueError(f"layers={layers!r} matches no FP8 module; the modules with an "
                         f"override: {', '.join(sorted(overrides(model))) or 'none'}")
    for module in cleared:
        del module.__dict__["_fp8_override"]
    return sorted(cleared.values())


def overrides(model) -> dict:
    """{name: PrecisionOverride} of the modules of ``model`` that have one (immutable values:
    nothing done to them or to the dict changes a module)."""
    return {name: m._fp8_override for m, name in select_layers(model, "*").items()
            if m.__dict__.get("_fp8_override") is not None}
