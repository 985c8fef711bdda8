"""The FP8 state of a module with one or more FP8 GEMMs, and how its tensors get cast.

A module with G FP8 GEMMs (Linear: 1; LayerNormMLP: 2) keeps, as plain float32 tensors in its
state_dict (kept float32 by .half() and the like):
  fp8_fwd_amax_history [L, 2G]  amaxes of (input, weight) of each GEMM, row 0 = this step
  fp8_fwd_scale [2G], fp8_fwd_scale_inv [2G]
  fp8_bwd_amax_history [L, G]   amax of each GEMM's grad_output
  fp8_bwd_scale [G], fp8_bwd_scale_inv [G]
  fp8_recipe_fields [4] int64   the recipe in use, as a record: margin, format,
                                amax_history_len, amax algo (-1: never used)
Fp8State owns these buffers (their names: state_layout.py) and everything that keeps them
valid (meta init, with state_materialisation.py; device moves; checkpoints, with
state_loading.py; copies; recipe changes). The step machinery (quantization/amax_step.py,
backward_step.py) reads and updates them through two ScalingStates (_scaling_states: forward,
backward), which it binds again whenever its buffers are replaced; the forward that casts with
them is modules/base.py's.
"""
from __future__ import annotations

import copy
import itertools
from typing import Optional

import torch

from .. import _param_marks as param_marks
from .._dtensor import is_dtensor
from . import adoption_undo, amax_step, recipe_switch
from . import replay
from . import scaling_state
from .scaling_state import ScalingState, forget_loaded_row
from .transforms import outside_inference_mode, refuse_functorch_transform
from .history import DEFAULT_HISTORY_LEN, recipe_code, resized_history
from .owed_update import run_owed_update
from .recipe import RECIPE_TYPES, DelayedScaling, Recipe
from .state_layout import FP8_FLOAT_STATE, FP8_STATE_KEYS, HISTORIES
from .state_loading import Fp8StateLoading
from .state_materialisation import (fresh_state_off_meta, materialised_by_assignment,
                                    meta_state_device, state_off_meta)

_FLOAT_STATE_NAMES = frozenset(FP8_FLOAT_STATE)
_STATE_NAMES = frozenset(FP8_STATE_KEYS)
# Creation order of FP8 modules: the same on every rank that builds the same model, so it lays
# out the cross-rank amax reduction identically everywhere.
_creation_index = itertools.count()


class Fp8State(Fp8StateLoading):
    """The FP8 state of a module with ``num_gemms`` FP8 GEMMs (see the module docstring): its
    buffers, and what keeps them valid; saving and loading them is Fp8StateLoading's
    (state_loading.py). Put before the torch.nn base class (through modules.base.Fp8StateMixin,
    which adds the forward)."""

    def _register_fp8_state(self, device, history_len: int = DEFAULT_HISTORY_LEN,
                            num_gemms: int = 1) -> None:
        f32 = dict(dtype=torch.float32, device=device)
        self.register_buffer("fp8_fwd_amax_history",
                             torch.zeros(history_len, 2 * num_gemms, **f32))
        self.register_buffer("fp8_fwd_scale", torch.ones(2 * num_gemms, **f32))
        self.register_buffer("fp8_fwd_scale_inv", torch.ones(2 * num_gemms, **f32))
        self.register_buffer("fp8_bwd_amax_history", torch.zeros(history_len, num_gemms, **f32))
        self.register_buffer("fp8_bwd_scale", torch.ones(num_gemms, **f32))
        self.register_buffer("fp8_bwd_scale_inv", torch.ones(num_gemms, **f32))
        self.register_buffer("fp8_recipe_fields",
                             torch.full((4,), -1, dtype=torch.int64, device=device))
        self._num_gemms = num_gemms
        self._recipe_code: Optional[list[int]] = None
        # The recipe record a loaded state was saved under (None: none, or never used), and
        # its histories as loaded, kept while another recipe is adopted for the module before
        # it runs (see _adopt_recipe).
        self._saved_recipe_code: Optional[list[int]] = None
        self._saved_histories: Optional[tuple] = None
        self._new_scaling_states()
        self._weight_cache = [None] * num_gemms
        self._delayed_cast_cache = None  # see _delayed_casts
        self._fused_step_cache = None  # see modules/linear_fused_step.py
        self._replay_records = replay.ReplayRecords()
        self._warned_high_precision = False

    def _new_scaling_states(self) -> None:
        """A creation index and the (forward, backward) ScalingStates of this module, registered
        with the step machinery."""
        self._fp8_index = next(_creation_index)
        takes_recipe = scaling_state.weak_method(self._takes_recipe)
        self._scaling_states = (ScalingState(self._fp8_index, "fwd", takes_recipe, type(self)),
                                ScalingState(self._fp8_index, "bwd", takes_recipe, type(self)))
        self._bind_scaling_states()
        for state in self._scaling_states:
            scaling_state.register(state)
        if self._recipe_code is None:
            self._await_recipe()

    def _await_recipe(self) -> None:
        """Wait for the next delayed fp8_autocast's recipe (amax_step._AWAITING_RECIPE), unless
        built for a stateless recipe, which only running under a delayed one adopts."""
        if not getattr(self, "_built_for_stateless", False):
            amax_step.await_recipe(self._scaling_states[0])

    def _bind_scaling_states(self) -> None:
        """The ScalingStates hold the current buffers (after any change of them)."""
        self._fp8_state_to_local()
        fwd, bwd = self._scaling_states
        b = self._buffers
        fwd.bind(b["fp8_fwd_amax_history"], b["fp8_fwd_scale"], b["fp8_fwd_scale_inv"],
                 self.__dict__.get("_fp8_weights_record_on_write", False))
        bwd.bind(b["fp8_bwd_amax_history"], b["fp8_bwd_scale"], b["fp8_bwd_scale_inv"])

    def _fp8_state_to_local(self) -> None:
        """Keep the FP8 state in plain tensors. Tensor parallelism's parallelize_module makes a
        replicated DTensor of every buffer of the module (a direct write into _buffers, which
        nothing here sees); the operators and the step machinery take plain tensors, so the
        buffers become their local tensors again (the same values on every rank) and are bound
        again. Called wherever the buffers are used, and by the tensor-parallel forward."""
        distributed = [name for name in FP8_STATE_KEYS if is_dtensor(self._buffers[name])]
        if not distributed:
            return
        for name in distributed:
            self._buffers[name] = self._buffers[name].to_local().detach()
        self._delayed_cast_cache = None  # (views of the DTensors)
        self._fused_step_cache = None
        self._bind_scaling_states()

    def __setattr__(self, name, value):
        if name in _STATE_NAMES and "_scaling_states" in self.__dict__:
            self._set_state_buffer(name, value)
            return
        super().__setattr__(name, value)
        # Any attribute set drops the ticket of the module's C++ step (it is made under the
        # module's attributes of the moment: modules/linear_fused_step.py's _keep_ticket).
        self.__dict__["_fused_ticket"] = None

    def _set_state_buffer(self, name, value) -> None:
        """A state buffer replaced by assignment (module.fp8_fwd_scale = t). One on "meta"
        replaced by a real tensor is being materialised: transformers' from_pretrained puts
        every key its checkpoint lacks there as ``setattr(module, name, torch.empty_like(...))``
        (uninitialised memory) and marks those it loaded ``_is_hf_initialized``. An unmarked
        one starts fresh, as to_empty() starts the whole state; once no state buffer is left on
        "meta", a state that got any fresh buffer is reset as a whole (the state the module
        was built with). Inside load_state_dict(assign=True) the loading decides."""
        old = self._buffers.get(name)
        super().__setattr__(name, value)
        self.__dict__["_fused_ticket"] = None
        if (old is not None and old.is_meta and isinstance(value, torch.Tensor)
                and not value.is_meta and not self.__dict__.get("_fp8_loading")):
            materialised_by_assignment(self, name, value)
        if name in _FLOAT_STATE_NAMES:
            self._bind_scaling_states()

    def fp8_state_tensors(self) -> list[torch.Tensor]:
        """The float32 FP8 state (histories, scales, scale_invs), as the update writes it."""
        return [self._buffers[name] for name in FP8_FLOAT_STATE]

    def prepare_fp8_recipe(self, recipe: Recipe) -> None:
        """Size the FP8 state for ``recipe`` now, as the first FP8 forward under it would."""
        if recipe is not None and not isinstance(recipe, RECIPE_TYPES):
            raise TypeError(f"{type(self).__name__}.prepare_fp8_recipe: recipe must be None, a "
                            "DelayedScaling, Float8CurrentScaling, Float8BlockScaling or "
                            f"Float8RowwiseScaling, got {type(recipe).__name__}")
        if isinstance(recipe, DelayedScaling):
            self._adopt_recipe(recipe)
            # What a fresh state is for (reset_fp8_state): this recipe's record. (Its code,
            # not the recipe: an amax_compute_algo callable need not pickle.)
            self._built_for = list(self._recipe_code)
        elif recipe is not None:  # built for a recipe without delayed state: see _takes_recipe
            self._built_for_stateless = True
            self._built_for = "stateless"
            amax_step.recipe_adopted(self._fp8_index)  # (waits for none: see _await_recipe)

    def reset_fp8_state(self) -> None:
        """Fresh FP8 state: empty histories, unit scales, and the recipe the module was built
        for (recipe=, convert_to_fp8(recipe=...), prepare_fp8_recipe: its history length and
        record, as at construction); built for none, it keeps the history length and takes
        the next delayed recipe. A state still on "meta" while the parameters are real (only
        the parameters were materialised) is made on their device."""
        self._fp8_state_to_local()
        state_off_meta(self)
        with torch.no_grad():
            for name in HISTORIES:
                getattr(self, name).zero_()
            for name in FP8_FLOAT_STATE:
                if name not in HISTORIES:
                    getattr(self, name).fill_(1.0)
            self.fp8_recipe_fields.fill_(-1)
        self._recipe_code = self._saved_recipe_code = self._saved_histories = None
        for state in self._scaling_states:
            forget_loaded_row(state)
        self.__dict__.pop("_adopted_recipe", None)
        self.__dict__.pop("_scale_codes", None)
        self.__dict__.pop("_fp8_fresh_off_meta", None)
        self._te_pending_update = ()
        self._weight_cache = [None] * self._num_gemms
        self._delayed_cast_cache = None
        self._fused_step_cache = None
        self._replay_records.clear()
        built = self.__dict__.get("_built_for")
        if isinstance(built, list):  # DelayedScaling: its history length and record
            self._built_for_stateless = False
            with torch.no_grad(), outside_inference_mode():
                for name in HISTORIES:
                    history = getattr(self, name)
                    if history.shape[0] != built[2]:
                        # .data keeps the buffer object, so references stay valid.
                        history.data = history.new_zeros(built[2], history.shape[1])
                self.fp8_recipe_fields.copy_(torch.tensor(built, dtype=torch.int64))
            self._recipe_code = list(built)
            amax_step.recipe_adopted(self._fp8_index)
        elif built == "stateless":
            self._built_for_stateless = True
            amax_step.recipe_adopted(self._fp8_index)
        self._bind_scaling_states()  # (which steps cover it may change with the recipe)
        if self._recipe_code is None:
            self._await_recipe()

    def __setstate__(self, state):
        # A copy (copy.deepcopy, unpickling) is a module of its own in the amax reduction.
        super().__setstate__(state)
        self._new_scaling_states()
        self._delayed_cast_cache = None
        self._fused_step_cache = None
        self._replay_records = replay.ReplayRecords()

    def __getstate__(self):
        # Replay records hold autograd bookkeeping of a step in flight: never copied or pickled.
        state = dict(self.__dict__)
        state["_replay_records"] = None
        state.pop("_scaling_states", None)  # the copy gets its own (__setstate__)
        # Caches (quantizers over the buffers, quantised weights) are made again on use: a
        # pickle holds no quantizer object, so it does not depend on where those classes live.
        state["_delayed_cast_cache"] = None
        state["_fused_step_cache"] = None
        state["_fused_ticket"] = None
        state["_weight_cache"] = [None] * self._num_gemms
        return state

    def __deepcopy__(self, memo):  # through the two above, also under torch parametrize, whose
        # default_deepcopy copies __dict__ (sharing _fp8_index) and whose __getstate__ raises
        replica = memo[id(self)] = type(self).__new__(type(self))
        replica.__setstate__(copy.deepcopy(Fp8State.__getstate__(self), memo))
        return replica

    def _apply(self, fn, recurse=True):
        # Device moves apply to the FP8 state; dtype casts (.half(), .to(torch.bfloat16),
        # .type(torch.bfloat16), which casts integers too) do not: the operators need float32
        # scales and histories, and the recipe record stays int64.
        was_meta = self.fp8_fwd_scale.is_meta
        order = list(self._buffers)
        fp8_state = {name: self._buffers.pop(name) for name in FP8_STATE_KEYS}
        try:
            super()._apply(fn, recurse)
        finally:
            for name, buffer in fp8_state.items():
                self._buffers[name] = buffer
            self._buffers = type(self._buffers)((name, self._buffers[name]) for name in order)
        # A state on "meta" under real parameters (only they were materialised: accelerate's
        # init_empty_weights(include_buffers=False)) has no values to move: it is made where
        # the parameters now are, and starts fresh below.
        device = meta_state_device(self) if was_meta else None
        for name, buffer in fp8_state.items():
            if device is not None and buffer.is_meta:
                self._buffers[name] = torch.empty_like(buffer, device=device)
                continue
            moved = fn(buffer)
            self._buffers[name] = moved if moved.dtype == buffer.dtype else \
                buffer.to(device=moved.device)
        self._weight_cache = [None] * self._num_gemms
        self._delayed_cast_cache = None  # views of the old buffers
        self._fused_step_cache = None
        self._bind_scaling_states()
        if was_meta and not self.fp8_fwd_scale.is_meta:
            # Out of "meta" (to_empty, the FSDP2 / large-model pattern): the new buffers hold
            # uninitialised memory and nobody may call reset_parameters(): start a fresh state.
            self.reset_fp8_state()
        param_marks.mark_again(self)  # (Megatron-LM's marks on Parameters made anew)
        return self

    def _adopt_recipe(self, recipe: DelayedScaling, running: bool = True) -> None:
        """Match the history length to the recipe (resized_history: the amaxes recorded are
        kept; so are the scales) and record the recipe fields. Host work only when the recipe
        changes. ``running``: False where the module is not running but an fp8_autocast entered
        under ``recipe`` (or its step) adopts it for a module that has none (_takes_recipe).

        A loaded state keeps its histories aside while a recipe other than the one it was saved
        under is adopted that way: when the module first runs, under the recipe it was saved
        under (a nested one, whose context is entered after the outer one), they come back
        exactly as loaded; once it has run, its state is its own."""
        adopted = self.__dict__.get("_adopted_recipe")
        if adopted is not None and adopted[0] is recipe and adopted[1] is self._recipe_code:
            return  # the same recipe object as last time, and nothing reset the record since
        if self._buffers["fp8_fwd_scale"].is_meta:  # (the first FP8 forward gets here)
            fresh_state_off_meta(self)
        with outside_inference_mode():  # (a resized history must stay writable by training)
            if running and self.__dict__.get("_te_pending_update"):
                # (First, on the loaded history: a failed step undoes the adoption below, not
                # this update, which Transformer Engine would have made all the same.)
                run_owed_update(self, recipe)
            self._adopt_new_recipe(recipe, running)

    def _adopt_new_recipe(self, recipe: DelayedScaling, running: bool) -> None:
        code = recipe_code(recipe)
        compiling = torch.compiler.is_compiling()
        # (the directions cast with from now on: backward too where a backward may follow)
        directions = recipe_switch.directions_in_use(running)
        rescaling = recipe_switch.needs_rescale(self, code, directions)
        if rescaling and compiling:
            raise RuntimeError(
                f"{type(self).__name__}: under torch.compile the scales cannot be carried over "
                "to a recipe of another fp8_format; run one step eagerly under it first")
        if not compiling:  # (undone if the step fails: adoption_undo.py)
            adoption_undo.note(self, HISTORIES, scales=rescaling)
        if running and getattr(self, "_built_for_stateless", False):
            self._built_for_stateless = False  # (it trains under this one now)
        if not compiling:  # (before anything is written)
            refuse_functorch_transform(f"{type(self).__name__}'s FP8 state set up for a recipe")
        restored = None
        if self._saved_recipe_code is not None and not compiling:
            if running:
                if code == self._saved_recipe_code:
                    restored = self._saved_histories
                self._saved_recipe_code = self._saved_histories = None
            elif code != self._saved_recipe_code and self._saved_histories is None:
                self._saved_histories = tuple(getattr(self, name).detach().clone()
                                              for name in HISTORIES)
        if restored is not None:
            self._fp8_state_to_local()
            for name, history in zip(HISTORIES, restored):
                # (kept where the state was then: the module may have moved since)
                getattr(self, name).data = history.to(getattr(self, name).device)
            self._delayed_cast_cache = self._fused_step_cache = None
        if not compiling:  # (the scales made for another format: recipe_switch.py)
            if rescaling:
                self._fp8_state_to_local()
            recipe_switch.adopt(self, code, directions)
        if code == self._recipe_code:
            if restored is not None:
                self._bind_scaling_states()
            if running and not compiling and not recipe_switch.needs_rescale(self, code):
                # (a traced forward writes no Python state; a backward scale still to be
                # rescaled keeps the adoption running until a training forward does it)
                self.__dict__["_adopted_recipe"] = (recipe, self._recipe_code)
            return
        self._fp8_state_to_local()
        for name in HISTORIES:
            history = getattr(self, name)
            if history.shape[0] != recipe.amax_history_len and torch.compiler.is_compiling():
                raise RuntimeError(
                    f"{type(self).__name__}: under torch.compile the amax history (length "
                    f"{history.shape[0]}) cannot be resized to the recipe's "
                    f"{recipe.amax_history_len}; build the module for its recipe (recipe=..., "
                    "convert_to_fp8(model, recipe=...) or quantized_model_init) or run one step "
                    "eagerly first")
            if history.shape[0] != recipe.amax_history_len:
                # .data keeps the buffer object, so references (e.g. DDP's) stay valid.
                history.data = resized_history(history, recipe.amax_history_len)
                self._delayed_cast_cache = None  # its views see the old storage
                self._fused_step_cache = None
        self.fp8_recipe_fields.copy_(torch.tensor(code, dtype=torch.int64))
        self._recipe_code = code
        amax_step.recipe_adopted(self._fp8_index)
        if torch.compiler.is_compiling():
            scaling_state.bump_generation()  # (no buffer was replaced: a resize is refused)
        else:
            self._bind_scaling_states()

    def _takes_recipe(self, recipe: DelayedScaling) -> bool:
        """Whether a step under ``recipe`` that this module did not run in on this rank reduces
        and updates its states (it may have run on another rank), or an fp8_autocast entered
        under it adopts it for the module: False when the module trains with another recipe;
        else the recipe is adopted (running=False: see _adopt_recipe). A module built for a
        recipe without delayed state (recipe= current, block or row-wise scaling) takes a
        delayed one only by running under it (its state stayed as built; a copy made on one
        rank joined the ranks' reductions there)."""
        if self._recipe_code is not None and self._recipe_code != recipe_code(recipe):
            return False
        if getattr(self, "_built_for_stateless", False):
            return False
        self._adopt_recipe(recipe, running=False)
        return True
