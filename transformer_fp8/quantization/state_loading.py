"""An FP8 state saved to and loaded from a state_dict: the state_dict half of Fp8State
(state.py), which inherits it and whose methods it calls (reset_fp8_state, _bind_scaling_states,
_await_recipe, _fp8_state_to_local). A loaded state is checked first (state_validation.py); a
load that fails on one of the module's own FP8 entries puts back its state as it was (a key
that torch reports missing or unexpected after every module loaded does not: the module cannot
tell, as torch leaves Parameters loaded then too); a checkpoint without FP8 state leaves a
fresh one.
"""
from __future__ import annotations

import itertools
import warnings

import torch

from .._dtensor import is_dtensor
from . import adoption_undo, amax_step, backward_step, recipe_switch
from .state_layout import FP8_FLOAT_STATE, FP8_STATE_KEYS, HISTORIES
from .scaling_state import note_loaded_row
from .state_materialisation import fresh_state_off_meta
from .state_validation import assigned_state_made_usable, fp8_state_error
from .transforms import outside_inference_mode


class Fp8StateLoading:
    """Fp8State's saving and loading (torch.nn.Module's _save_to_state_dict and
    _load_from_state_dict, which it overrides): put before the torch.nn base class through
    Fp8State."""

    def note_saved_recipe(self) -> None:
        """After a load: the recipe record the loaded state was saved under (see
        _saved_recipe_code), read once on the host."""
        self._fp8_state_to_local()  # (a DTensor's values: its local tensor's)
        fields = self.fp8_recipe_fields
        saved = None if fields.is_meta else fields.tolist()
        self._saved_recipe_code = saved if saved is not None and saved[0] >= 0 else None
        recipe_switch.note_made_for(self, self._saved_recipe_code)
        self._saved_histories = None
        self._te_pending_update = ()  # (te_checkpoint.apply_extra_state sets it after)

    def took_loaded_state(self, loaded=("fwd", "bwd"), record_loaded: bool = True) -> None:
        """After a whole FP8 state was loaded into the buffers (load_state_dict, or each buffer
        assigned its loaded value: transformers' from_pretrained, state_materialisation.py):
        its saved recipe noted, and the recipe adopted again at the next FP8 forward (its
        scales rescaled there if made for another format: recipe_switch.py). ``loaded``: the
        directions whose scales the load gave (strict=False may give one only); the other
        keeps the format its own scales were made for, not the checkpoint's record.
        ``record_loaded``: whether the load gave the recipe record (fp8_recipe_fields); without
        it the loaded scales' format is unknown (nothing rescaled), not the module's own."""
        own_codes = dict(self.__dict__.get("_scale_codes") or {})
        self.note_saved_recipe()
        if not record_loaded:
            recipe_switch.note_made_for(self, None, loaded)
        codes = self.__dict__["_scale_codes"]  # (note_saved_recipe set both)
        for direction in ("fwd", "bwd"):
            if direction not in loaded:
                codes[direction] = own_codes.get(direction)
        adoption_undo.forget(self)  # (a failed step leaves the loaded state, not the one before)
        self._recipe_code = None  # re-adopted from the active recipe on the next FP8 forward
        self._bind_scaling_states()  # (buffers replaced or re-sized: assign=True, a new length)
        # Covered by no step until it records again, as a freshly built module that loaded the
        # same checkpoint (a step kept from before the load would fold a row 0 saved mid-step
        # into an update of a step the module did not run in).
        for state in self._scaling_states:
            amax_step.AmaxStep.leave(state)
            if state.role == "bwd" and "bwd" in loaded:  # (see scaling_state.LOADED_ROWS)
                note_loaded_row(state)
        self._await_recipe()
        self._weight_cache = [None] * self._num_gemms
        self._delayed_cast_cache = None
        self._fused_step_cache = None

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        # A backward update held back by reentrant checkpointing (see backward_step.BackwardStep)
        # runs first, so that a checkpoint holds the state a run without it would hold.
        backward_step.discard_failed_backward_passes()
        if backward_step.has_pending_backward_updates():
            backward_step.flush_pending_backward_updates()
        self._fp8_state_to_local()
        if self._buffers["fp8_fwd_scale"].is_meta:
            fresh_state_off_meta(self)  # (real parameters: a fresh state, not meta tensors)
        super()._save_to_state_dict(destination, prefix, keep_vars)
        recipe_switch.saved_as_recorded(self, destination, prefix)
        if self.__dict__.get("_te_pending_update"):
            warnings.warn(
                f"{type(self).__name__} ({prefix[:-1] or 'the root module'}): its FP8 state, "
                "loaded from a Transformer Engine <= 1.5 checkpoint, still owes the "
                "delayed-scaling update that runs before its first FP8 cast; a state_dict has "
                "no record of it, so a run resumed from this one casts with the scales made "
                "before that checkpoint's last step. Run one FP8 step before saving.",
                stacklevel=3)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        if self._buffers["fp8_fwd_scale"].is_meta:
            fresh_state_off_meta(self)  # (real parameters: the state loads into real buffers)
        self.__dict__["_fp8_loading"] = True  # (assign=True's setattr: see _set_state_buffer)
        try:
            with outside_inference_mode():  # (a resized history must stay writable)
                self._load_fp8_state_dict(state_dict, prefix, local_metadata, strict,
                                          missing_keys, unexpected_keys, error_msgs)
        finally:
            del self.__dict__["_fp8_loading"]

    def _load_fp8_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                             unexpected_keys, error_msgs):
        if not (any(prefix + name in state_dict
                    for name in itertools.chain(self._parameters, self._buffers))
                or ("parametrizations" in self._modules  # (a parametrized weight's own keys)
                    and any(k.startswith(prefix + "parametrizations.") for k in state_dict))):
            # Nothing of this module (strict=False: a LoRA adapter, another module's weights):
            # it stays as it is, FP8 state included (its scales were reset to 1).
            super()._load_from_state_dict(state_dict, prefix, local_metadata, strict,
                                          missing_keys, unexpected_keys, error_msgs)
            return
        # A history of another length loads as it is. A checkpoint with no FP8 key at all (a
        # plain high-precision one) loads with strict=True and leaves a fresh FP8 state; one
        # with only some FP8 keys is reported as incomplete.
        self._fp8_state_to_local()
        distributed = [prefix + k for k in FP8_STATE_KEYS
                       if is_dtensor(state_dict.get(prefix + k))]
        if distributed:
            # Replicated DTensors (set_model_state_dict distributes the entries as the model's
            # buffers were after parallelize_module): their local values, as the buffers now.
            state_dict = dict(state_dict)
            for key in distributed:
                state_dict[key] = state_dict[key].to_local()
        present = [k for k in FP8_STATE_KEYS if prefix + k in state_dict]
        error = fp8_state_error(self, state_dict, prefix)
        if error is not None:
            error_msgs.append(error)  # load_state_dict raises; nothing of this module is loaded
            return
        # What the FP8 state was, put back if any of this module's entries fails to load (a
        # history re-sized for the checkpoint was left uninitialised, a scale loaded without
        # its scale_inv). (Parameters load as torch loads them.)
        saved = [(key, self._buffers[key], self._buffers[key].data,
                  self._buffers[key].detach().clone()) for key in FP8_STATE_KEYS]
        for key in HISTORIES:
            incoming, history = state_dict.get(prefix + key), getattr(self, key)
            if (isinstance(incoming, torch.Tensor) and incoming.dim() == 2
                    and incoming.shape[0] != history.shape[0]
                    and incoming.shape[1] == history.shape[1]):
                history.data = history.new_empty(incoming.shape)
        errors_before = len(error_msgs)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
        if not present:  # (a checkpoint without FP8 state is complete: not "missing")
            for key in FP8_STATE_KEYS:
                if prefix + key in missing_keys:
                    missing_keys.remove(prefix + key)
        # (A key missing with strict=True: load_state_dict raises after every module loaded,
        # and passes strict=True to each module whatever it was given, so a module cannot tell
        # that case from strict=False's, where what the checkpoint has loads.)
        if len(error_msgs) > errors_before:
            with torch.no_grad():
                for key, buffer, data, values in saved:
                    self._buffers[key] = buffer
                    if buffer.shape != data.shape:
                        buffer.data = data
                    buffer.copy_(values)
            return  # load_state_dict raises
        assigned_state_made_usable(self, FP8_STATE_KEYS, FP8_FLOAT_STATE)
        if not present:
            # A fresh state, the one the module was built with (its recipe kept, as a
            # directly built module's: reset_fp8_state).
            self.reset_fp8_state()
            return
        self.took_loaded_state(tuple(d for d in ("fwd", "bwd") if f"fp8_{d}_scale" in present),
                               record_loaded="fp8_recipe_fields" in present)
