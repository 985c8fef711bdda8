"""A delayed-scaling state's scales carried over to a recipe of another fp8_format.

A delayed scale is ``fp8_max / amax / 2**margin``, made by the last update for the recipe then
in force (or loaded with a checkpoint saved under it). Until the next update a recipe of
another format would cast with it: HYBRID -> E4M3 leaves grad_output's scale made for E5M2
(max 57344) where E4M3's max is 448, 128x too large, and the first backward saturated nearly
every gradient, silently. So when a module takes such a recipe, the scales are multiplied by
``new_max / old_max``: the scale the update would have made from the same amax for the new
format (exactly, the factor being a power of two: 448 / 57344 = 2**-7). A column no amax ever
made a scale for (history empty and scale 1, as built) keeps it. A new margin alone changes
nothing until the next update, as in Transformer Engine: the old scale cannot saturate under it.

Which format each direction's scales were made for is kept beside the module's recipe record
(``_scale_codes``: {"fwd", "bwd"} -> format code, as in history.recipe_code):
* a load sets both to the recipe the checkpoint records (unknown: None, nothing rescaled),
  whether by load_state_dict or by assignment of the whole state from "meta" (transformers'
  from_pretrained: state_materialisation.py);
* the update a Transformer Engine <= 1.5 checkpoint owes sets the roles it updates;
* an adoption rescales and sets the directions the module casts with from now on: both where
  it takes the recipe without running (a step's update will make both for it) or runs a
  training forward; the forward's only for an evaluation forward (no gradients, outside any
  checkpoint), whose backward scales still belong to a training forward's backward to come;
  a direction never set (a fresh state) is set without rescaling;
* a reset clears them.
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


def directions_in_use(running: bool) -> tuple:
    """The directions a module adopting a recipe casts with from now on: both for an adoption
    without a forward (a step's update will make both) and for a forward where a backward may
    follow (gradients on, or a checkpoint's first forward); the forward's for an evaluation."""
    if not running or torch.is_grad_enabled() or checkpoint_stack.regions_to_keep():
        return ("fwd", "bwd")
    return ("fwd",)


def _factor(direction: str, old_format: int, new_format: int) -> float:
    old_fmt, new_fmt = _FORMATS[old_format], _FORMATS[new_format]
    if direction == "fwd":
        return new_fmt.max_fwd / old_fmt.max_fwd
    return new_fmt.max_bwd / old_fmt.max_bwd


def _to_rescale(module, new_code, directions=("fwd", "bwd")) -> list:
    """The directions among ``directions`` whose scales were made for a format whose maximum
    differs from ``new_code``'s."""
    new = scale_code(new_code)
    codes = module.__dict__.get("_scale_codes") or {}
    return [d for d in directions if codes.get(d) is not None and new is not None
            and _factor(d, codes[d], new) != 1.0]


def needs_rescale(module, new_code, directions=("fwd", "bwd")) -> bool:
    return bool(_to_rescale(module, new_code, directions))


def adopt(module, new_code, directions) -> None:
    """Rescale ``directions``' scales to ``new_code``'s format and record them as made for it;
    a direction with no record yet (a fresh state) is recorded whatever ``directions``."""
    rescale(module, new_code, directions)
    codes = module.__dict__.get("_scale_codes") or {}
    note_made_for(module, new_code, [d for d in ("fwd", "bwd")
                                     if d in directions or codes.get(d) is None])


def rescale(module, new_code, directions) -> None:
    """Multiply ``directions``' scales (and recompute their inverses) from the format they were
    made for to ``new_code``'s; see the module docstring."""
    with torch.no_grad():
        for direction in _to_rescale(module, new_code, directions):
            scale = getattr(module, f"fp8_{direction}_scale")
            scale.copy_(rescaled_scale(module, direction, new_code))
            getattr(module, f"fp8_{direction}_scale_inv").copy_(scale.reciprocal())


def rescaled_scale(module, direction: str, new_code) -> torch.Tensor:
    """``direction``'s scale as made for ``new_code``'s format (a new tensor; the scale itself
    where no rescaling is due)."""
    scale = getattr(module, f"fp8_{direction}_scale")
    if direction not in _to_rescale(module, new_code, (direction,)):
        return scale
    factor = _factor(direction, module.__dict__["_scale_codes"][direction], scale_code(new_code))
    history = getattr(module, f"fp8_{direction}_amax_history")
    with torch.no_grad():
        # (made by an update: an amax in the window, or a scale other than the built 1; a
        # history of length 1 is empty again after every update)
        made = (torch.isfinite(history) & (history > 0)).any(0) | (scale != 1)
        rescaled = (scale.double() * factor).clamp(_FLT_MIN, _FLT_MAX).float()
        return torch.where(made, rescaled, scale)


def saved_as_recorded(module, destination: dict, prefix: str) -> None:
    """A state_dict holds one recipe record for both directions, and a load takes both as made
    for it. Where one direction's scales were made for another format (an evaluation forward
    under another fp8_format rescales the forward's only), the saved copy of that direction's
    scales is rescaled to the record's format (the module's own are left as they are), so the
    load, then the next adoption, gives back the scales the module holds (the factors are
    powers of two: exact)."""
    codes = module.__dict__.get("_scale_codes") or {}
    if len(set(codes.values())) < 2:
        return  # (the common case: both made for one format, or none known)
    fields = destination.get(prefix + "fp8_recipe_fields")
    if fields is None or fields.is_meta:
        return
    record = fields.tolist()
    for direction in ("fwd", "bwd"):
        if direction in _to_rescale(module, record, (direction,)):
            scale = rescaled_scale(module, direction, record)
            destination[prefix + f"fp8_{direction}_scale"] = scale
            destination[prefix + f"fp8_{direction}_scale_inv"] = scale.reciprocal()
