"""A delayed-scaling state's scales carried over to a recipe of another fp8_format.

A delayed scale is ``fp8_max / amax / 2**margin``, made by the last update for the recipe then
in force (or loaded with a checkpoint saved under it). Until the next update a recipe of
another format would cast with it: HYBRID -> E4M3 leaves grad_output's scale made for E5M2
(max 57344) where E4M3's max is 448, 128x too large, and the first backward saturated nearly
every gradient, silently. So when a module first runs under such a recipe, the scales of the
directions it casts with are multiplied by ``new_max / old_max``: the scale the update would
have made from the same amax for the new format (exactly, the factor being a power of two:
448 / 57344 = 2**-7). A column whose history holds no finite positive amax keeps its scale (one
no amax made, 1 as built, is not rescaled). A new margin alone changes nothing until the next
update, as in Transformer Engine: the old scale cannot saturate under it.

The record of the format each direction's scales were made for (``_scale_codes``: {"fwd",
"bwd"} -> format code, as in history.recipe_code) is kept beside the module's recipe record:
set by a running adoption (for the directions it casts with), by a load (the recipe the
checkpoint records, if any) and by the update a Transformer Engine <= 1.5 checkpoint owes (for
the roles it updates), cleared by a reset.
"""
from __future__ import annotations

from typing import Optional

import torch

from . import checkpoint_stack
from .history import _FORMAT_CODES

_FORMATS = {code: fmt for fmt, code in _FORMAT_CODES.items()}
_FLT_MAX = torch.finfo(torch.float32).max
_FLT_MIN = torch.finfo(torch.float32).tiny


def scale_code(recipe_code) -> Optional[int]:
    """The format code of a recipe record, or None where there is none."""
    if recipe_code is None or recipe_code[0] < 0:
        return None
    return int(recipe_code[1])


def note_made_for(module, recipe_code, directions=("fwd", "bwd")) -> None:
    """Record that ``directions``' scales are now made for ``recipe_code`` (None: unknown)."""
    code = scale_code(recipe_code)
    codes = dict(module.__dict__.get("_scale_codes") or {})
    for direction in directions:
        codes[direction] = code
    module.__dict__["_scale_codes"] = codes


def directions_in_use() -> tuple:
    """The directions whose scales a forward running now casts with: the forward's, and the
    backward's where a backward may follow (gradients on, or a checkpoint's first forward).
    An evaluation forward leaves the backward scales, which a training forward's backward
    still to come casts with, as they are."""
    if torch.is_grad_enabled() or checkpoint_stack.regions_to_keep():
        return ("fwd", "bwd")
    return ("fwd",)


def _to_rescale(module, new_code, directions=("fwd", "bwd")) -> list:
    new = scale_code(new_code)
    codes = module.__dict__.get("_scale_codes") or {}
    return [d for d in directions if codes.get(d) is not None and codes[d] != new]


def needs_rescale(module, new_code, directions=("fwd", "bwd")) -> bool:
    return bool(_to_rescale(module, new_code, directions))


def rescale(module, new_code, directions) -> None:
    """Multiply the module's scales (and recompute their inverses) from the recipe they were
    made for to ``new_code``'s, for ``directions``; see the module docstring."""
    new_fmt = _FORMATS[scale_code(new_code)]
    with torch.no_grad():
        for direction in _to_rescale(module, new_code, directions):
            old_fmt = _FORMATS[module.__dict__["_scale_codes"][direction]]
            factor = (new_fmt.max_fwd / old_fmt.max_fwd if direction == "fwd"
                      else new_fmt.max_bwd / old_fmt.max_bwd)
            if factor == 1.0:
                continue
            history = getattr(module, f"fp8_{direction}_amax_history")
            scale = getattr(module, f"fp8_{direction}_scale")
            made_from_amax = (torch.isfinite(history) & (history > 0)).any(0)
            rescaled = (scale.double() * factor).clamp(_FLT_MIN, _FLT_MAX).float()
            scale.copy_(torch.where(made_from_amax, rescaled, scale))
            getattr(module, f"fp8_{direction}_scale_inv").copy_(scale.reciprocal())
