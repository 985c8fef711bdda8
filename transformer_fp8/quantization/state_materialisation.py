"""An FP8 state made real from "meta" by other means than to_empty() (which Fp8State._apply
handles): buffers assigned one by one (transformers' from_pretrained), or left on "meta" while
only the module's parameters were materialised (accelerate's
init_empty_weights(include_buffers=False)). Either way the state must end up as a directly
built module's (state.py's reset_fp8_state), never uninitialised memory."""
from __future__ import annotations

import warnings
from typing import Optional

import torch

from .state_layout import FP8_FLOAT_STATE, FP8_STATE_KEYS, HISTORIES
from .state_validation import fp8_state_error


def materialised_by_assignment(state, name: str, value: torch.Tensor) -> None:
    """``state``'s buffer ``name`` on "meta" was replaced by the real tensor ``value``.
    transformers' from_pretrained puts every key its checkpoint lacks there as
    ``setattr(module, name, torch.empty_like(...))`` (uninitialised memory) and marks those it
    loaded ``_is_hf_initialized``. An unmarked one starts fresh, as to_empty() starts the whole
    state; once no state buffer is left on "meta", a state that got any fresh buffer is reset
    as a whole (the state the module was built with), and one loaded whole, its recipe record
    included, is taken as load_state_dict takes it."""
    fresh = state.__dict__.setdefault("_fp8_fresh_off_meta", {})
    fresh[name] = not getattr(value, "_is_hf_initialized", False)
    if fresh[name]:
        with torch.no_grad():
            value.fill_(0 if name in HISTORIES else 1 if name in FP8_FLOAT_STATE else -1)
    if any(state._buffers[key].is_meta for key in FP8_STATE_KEYS):
        return  # (the others follow)
    del state.__dict__["_fp8_fresh_off_meta"]
    if not any(fresh.values()):
        # Every one of them loaded (a checkpoint with the FP8 state): checked as
        # load_state_dict checks it (a NaN scale loaded here gave a NaN first step), and the
        # recipe it was saved under noted (without it, a first step under another fp8_format
        # cast with scales made for the old one: recipe_switch.py).
        error = fp8_state_error(state, {key: state._buffers[key] for key in FP8_STATE_KEYS}, "")
        if error is not None:
            raise RuntimeError(f"{type(state).__name__}: its FP8 state as loaded from the "
                               f"checkpoint (buffers assigned: transformers' from_pretrained) "
                               f"is invalid: {error}")
        if "fp8_recipe_fields" in fresh:
            state.took_loaded_state()
        return
    loaded = [key for key in FP8_STATE_KEYS if not fresh.get(key, False)]
    if loaded:
        warnings.warn(f"{type(state).__name__}: its FP8 state was materialised from "
                      f"\"meta\" with {', '.join(loaded)} loaded and the rest missing (an "
                      "incomplete FP8 state): the whole FP8 state starts fresh",
                      stacklevel=4)
    state.reset_fp8_state()


def meta_state_device(state) -> Optional[torch.device]:
    """The device of the module's parameters where its FP8 state is on "meta" and they are
    not (accelerate's init_empty_weights(include_buffers=False) puts only the parameters
    there, and loaders then materialise the parameters alone), else None."""
    if not state._buffers["fp8_fwd_scale"].is_meta:
        return None
    param = next(state.parameters(), None)
    return None if param is None or param.is_meta else param.device


def state_off_meta(state) -> None:
    """Makes the state buffers left on "meta" under real parameters on the parameters' device
    (uninitialised: reset_fp8_state fills them)."""
    device = meta_state_device(state)
    if device is not None:
        for name in FP8_STATE_KEYS:
            if state._buffers[name].is_meta:
                state._buffers[name] = torch.empty_like(state._buffers[name], device=device)


def fresh_state_off_meta(state) -> None:
    """Before the FP8 state is used: a state left on "meta" under real parameters (see
    meta_state_device) starts fresh on their device, as a buffer made there would have."""
    device = meta_state_device(state)
    if device is None:
        return  # (all on "meta": nothing runs)
    if torch.compiler.is_compiling():
        raise RuntimeError(
            f"{type(state).__name__}: its FP8 state is on \"meta\" while its parameters are "
            f"on {device} (the parameters were materialised without the buffers: "
            "accelerate's init_empty_weights(include_buffers=False), or a loader that sets "
            "parameters only); call model.to(device) or run one step eagerly before "
            "torch.compile, which makes a fresh FP8 state on the parameters' device")
    state.reset_fp8_state()
