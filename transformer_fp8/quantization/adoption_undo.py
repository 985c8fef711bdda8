"""Recipe adoptions made during a step that fails are undone.

A module takes a DelayedScaling recipe when it first runs under it (or when a context under it
is entered while the module has none): its amax histories are resized to the recipe's length
and its recipe record written (state.py, _adopt_new_recipe). If the step then fails (an
exception leaves the outermost fp8_autocast), its amaxes are discarded; so is the adoption
here, so that a failed step leaves the FP8 state as it found it (a failed first step under a
shorter history cut the histories for good). Only steps that adopt something record anything:
a steady-state step costs a truth test at its exit.
"""
from __future__ import annotations

import threading
import weakref

import torch

# What adopting a recipe may change besides the histories and the recipe record.
_ATTRIBUTES = ("_recipe_code", "_saved_recipe_code", "_saved_histories", "_built_for_stateless",
               "_adopted_recipe", "_te_pending_update", "_scale_codes")
_SCALES = ("fp8_fwd_scale", "fp8_fwd_scale_inv", "fp8_bwd_scale", "fp8_bwd_scale_inv")


class _Adoptions(threading.local):
    def __init__(self):
        # One entry per outermost context being run (an isolated one, make_graphed_callables',
        # may run inside another): None until something is adopted, then a list of
        # (module ref, what _adopt_new_recipe is about to change).
        self.frames: list = []


_LOCAL = _Adoptions()
THREAD_LOCAL = _LOCAL  # (fp8_autocast pushes a frame, None, at each outermost entry)


def note(module, history_names, scales: bool = False) -> None:
    """``module`` (an Fp8State) is about to adopt a recipe: keep what it holds now (the history
    tensors themselves: a resize puts new ones in their place; the scales too where ``scales``:
    the adoption rescales them, recipe_switch.py)."""
    frames = _LOCAL.frames
    if frames:
        if frames[-1] is None:
            frames[-1] = []
        snapshot = {"histories": {name: getattr(module, name).data for name in history_names},
                    "fields": module.fp8_recipe_fields.detach().clone(),
                    "attributes": {name: module.__dict__.get(name) for name in _ATTRIBUTES}}
        if module.__dict__.get("_te_pending_update") or scales:
            # (The update a loaded checkpoint owes runs in place when the module first runs,
            # after this adoption: undone with it, it runs again at the next step.)
            snapshot["histories"] = {name: data.clone()
                                     for name, data in snapshot["histories"].items()}
            snapshot["scales"] = {name: getattr(module, name).detach().clone()
                                  for name in _SCALES}
        frames[-1].append((weakref.ref(module), snapshot))


def forget(module) -> None:
    """A state was loaded into ``module``: what it held before is no longer what a failed step
    must leave (an adoption noted before the load, at the entry of the context the load ran
    in, would put back the state from before the load)."""
    for frame in _LOCAL.frames:
        if frame:
            frame[:] = [(ref, snapshot) for ref, snapshot in frame if ref() is not module]


def _restore(module, snapshot: dict) -> None:
    """Put ``snapshot`` back, and discard what the failed step recorded in the forward history
    put back (it may have run under its earlier recipe before adopting the failed one), as the
    step's discard does (update_plan.UpdatePlan.discard: FP8 primary weights' write-time
    amaxes, columns 2g + 1, stay). Its backward never ran: the backward history is as it was."""
    keep_weights = module.__dict__.get("_fp8_weights_record_on_write", False)
    # A module that still owed a loaded checkpoint's update had not run in the step (running
    # pays it first): its row 0 holds the checkpoint's amaxes, which the update owed needs.
    owed = snapshot["attributes"]["_te_pending_update"]
    with torch.no_grad():
        for name, data in snapshot["histories"].items():
            getattr(module, name).data = data
            if name == "fp8_fwd_amax_history" and not owed:
                (data[0, 0::2] if keep_weights else data[0]).zero_()
        module.fp8_recipe_fields.copy_(snapshot["fields"])
        for name, values in snapshot.get("scales", {}).items():
            getattr(module, name).copy_(values)
    for name, value in snapshot["attributes"].items():
        module.__dict__[name] = value
    module._delayed_cast_cache = module._fused_step_cache = None
    module._bind_scaling_states()
    if module._recipe_code is None:
        module._await_recipe()


def end(failed: bool) -> None:
    """The outermost fp8_autocast exits: on failure its step's adoptions are undone, newest
    first."""
    frames = _LOCAL.frames
    records = (frames.pop() if frames else None) or []
    if failed:
        for ref, snapshot in reversed(records):
            module = ref()
            if module is not None:
                _restore(module, snapshot)
