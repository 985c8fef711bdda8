"""Checks of an FP8 state before it is loaded: a checkpoint's scales are used as they are by the
next FP8 step, so a NaN, infinite, zero or negative scale, or a scale that is not the inverse of
its scale_inv, would give a first step of NaN or wrong numbers without any error."""
from __future__ import annotations

from typing import Optional

import torch

from .._dtensor import local_tensor
from .recipe import MAX_MARGIN

# scale_inv is 1/scale rounded to float32 (subnormal when scale is near FLT_MAX): their product
# is 1 to within a few float32 ulps, far tighter than any scale that was paired by mistake.
_PAIR_TOLERANCE = 1e-5


def _values(t: torch.Tensor) -> Optional[torch.Tensor]:
    """The values a loaded tensor gives the float32 state (a float64 scale of 1e-50 is 0 there,
    one of 1e50 inf), as float64 CPU values; None when there are none to check."""
    if not isinstance(t, torch.Tensor) or t.is_meta or not t.is_floating_point():
        return None
    return t.detach().to("cpu", torch.float32).to(torch.float64)


def _not_loadable(incoming, current: torch.Tensor) -> Optional[str]:
    """Why ``incoming`` cannot become the float32 FP8 state ``current`` (copy_ would cast an
    integer silently, and a meta tensor has no values), or None."""
    if not isinstance(incoming, torch.Tensor):
        return f"an FP8 state entry must be a tensor, got {type(incoming).__name__}"
    if not incoming.is_floating_point():
        return f"an FP8 state entry must be a floating-point tensor, got {incoming.dtype}"
    if incoming.is_meta and not current.is_meta:
        return ("a meta tensor has no values to load (the model that saved it was never "
                "materialised)")
    return None


def _first_bad(mask: torch.Tensor, values: torch.Tensor) -> str:
    index = int(mask.nonzero()[0][0]) if values.dim() else 0
    return f"element {index} is {values.reshape(-1)[index].item()!r}"


def fp8_state_error(module: torch.nn.Module, state_dict: dict, prefix: str) -> Optional[str]:
    """Why the FP8 state that ``state_dict`` would give ``module`` is invalid, naming the key;
    None when it is valid. A key absent from state_dict keeps the module's current tensor (as
    load_state_dict(strict=False) does), so the pair checked is the one the module would hold."""
    for key in ("fp8_fwd_amax_history", "fp8_fwd_scale", "fp8_fwd_scale_inv",
                "fp8_bwd_amax_history", "fp8_bwd_scale", "fp8_bwd_scale_inv"):
        if prefix + key in state_dict:
            problem = _not_loadable(state_dict[prefix + key], module._buffers[key])
            if problem is not None:
                return f"{prefix}{key}: {problem}; refusing to load it"
    for role in ("fwd", "bwd"):
        scale_key, inv_key = f"fp8_{role}_scale", f"fp8_{role}_scale_inv"
        if prefix + scale_key not in state_dict and prefix + inv_key not in state_dict:
            continue
        pair = {}
        for key in (scale_key, inv_key):
            current = module._buffers[key]
            incoming = state_dict.get(prefix + key, current)
            values = _values(incoming)
            if values is None or values.shape != current.shape:
                break  # (meta on meta, or a shape load_state_dict refuses naming the key)
            bad = ~(torch.isfinite(values) & (values > 0))
            if bad.any():
                return (f"{prefix}{key}: an FP8 scale must be finite and positive, "
                        f"{_first_bad(bad, values)}; refusing to load a corrupt FP8 state")
            pair[key] = values
        if len(pair) < 2:
            continue
        mismatch = (pair[scale_key] * pair[inv_key] - 1.0).abs() > _PAIR_TOLERANCE
        if mismatch.any():
            missing = [prefix + k for k in (scale_key, inv_key) if prefix + k not in state_dict]
            note = (f" ({', '.join(missing)} not in the checkpoint: the module's own was kept)"
                    if missing else "")
            index = int(mismatch.nonzero()[0][0])
            return (f"{prefix}{scale_key} and {prefix}{inv_key} do not match: element {index} "
                    f"is {pair[scale_key][index].item()!r} and {pair[inv_key][index].item()!r}, "
                    f"whose product is not 1{note}; refusing to load an FP8 state whose scale "
                    "and scale_inv disagree")
    for key in ("fp8_fwd_amax_history", "fp8_bwd_amax_history"):
        incoming = state_dict.get(prefix + key)
        if isinstance(incoming, torch.Tensor) and incoming.dim() == 2 and incoming.shape[0] < 1:
            return (f"{prefix}{key}: an amax history needs at least one row (amax_history_len "
                    f">= 1), got shape {tuple(incoming.shape)}; refusing to load it")
        values = _values(incoming)
        if values is not None and (values < 0).any():
            return (f"{prefix}{key}: amaxes are never negative, {_first_bad(values < 0, values)}; "
                    "refusing to load a corrupt FP8 state")
    return _recipe_record_error(state_dict.get(prefix + "fp8_recipe_fields"), prefix)


def _recipe_record_error(fields, prefix: str) -> Optional[str]:
    """Why a loaded fp8_recipe_fields (margin, format, amax_history_len, algo; all -1 for a
    state never used) is not a recipe record, or None."""
    if fields is None or not isinstance(fields, torch.Tensor) or fields.is_meta:
        return None  # (absent: the module's own is kept; meta: nothing to check)
    fields = local_tensor(fields)  # (a replicated DTensor: set_model_state_dict makes one)
    key = prefix + "fp8_recipe_fields"
    if fields.is_floating_point() or fields.is_complex() or fields.dtype == torch.bool \
            or fields.shape != (4,):
        return (f"{key}: the recipe record must be 4 integers (margin, format, "
                f"amax_history_len, algo), got {fields.dtype} of shape {tuple(fields.shape)}; "
                "refusing to load it")
    margin, fmt, length, algo = fields.tolist()
    if [margin, fmt, length, algo] == [-1] * 4:
        return None
    if not (0 <= margin <= MAX_MARGIN and fmt in (0, 1, 2) and length >= 1 and algo in (0, 1, 2)):
        return (f"{key}: {[margin, fmt, length, algo]} is not a recipe record (margin in [0, "
                f"{MAX_MARGIN}], format 0-2, amax_history_len >= 1, algo 0-2, or all -1); "
                "refusing to load a corrupt FP8 state")
    return None


def assigned_state_made_usable(module, keys, float_names) -> None:
    """After load_state_dict(assign=True), which takes the checkpoint's tensors as they are:
    the float state (``float_names`` among the FP8 state ``keys``) contiguous float32, and, for a
    module
    built on "meta" given no FP8 state, buffers on its parameters' device (reset to a fresh
    state by the caller). (Part of Fp8State's loading: quantization/state_loading.py.)"""
    param = next((p for p in module._parameters.values() if p is not None), None)
    device = None if param is None or param.is_meta else param.device
    for key in keys:
        buffer = module._buffers[key]
        if buffer.is_meta and device is not None:
            module._buffers[key] = torch.empty_like(buffer, device=device)
        elif key in float_names and (buffer.dtype != torch.float32
                                     or not buffer.is_contiguous()):
            # (the operators take contiguous float32 state: a column view of a wider tensor
            # loaded, then every step refused it)
            module._buffers[key] = buffer.float().contiguous()
