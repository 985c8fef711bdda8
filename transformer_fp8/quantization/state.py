"""The FP8 state of a module with one or more FP8 GEMMs, and how its tensors get cast.

A module with G FP8 GEMMs (Linear: 1; LayerNormMLP: 2) keeps, as plain float32 tensors in its
state_dict (kept float32 by .half() and the like):
  fp8_fwd_amax_history [L, 2G]  amaxes of (input, weight) of each GEMM, row 0 = this step
  fp8_fwd_scale [2G], fp8_fwd_scale_inv [2G]
  fp8_bwd_amax_history [L, G]   amax of each GEMM's grad_output
  fp8_bwd_scale [G], fp8_bwd_scale_inv [G]
  fp8_recipe_fields [4] int64   the recipe in use, as a record: margin, format,
                                amax_history_len, amax algo (-1: never used)
Fp8StateMixin owns these buffers and everything that keeps them valid (meta init, device moves,
checkpoints, copies, recipe changes); Fp8Cast is one tensor role's cast; Fp8Plan is what one
GEMM's forward and backward need.
"""
from __future__ import annotations

import itertools
import warnings
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .. import _fp8_hooks, ops

from . import replay as checkpointing
from . import autocast as _autocast
from .blockwise import blockwise_linear, is_block_recipe, quantize_weight
from .recipe import BLOCK_RECIPES, DelayedScaling, Float8CurrentScaling, Format, Recipe
from .state_validation import fp8_state_error
from .torch_autocast import autocast_dtype

FP8_FLOAT_STATE = ("fp8_fwd_amax_history", "fp8_fwd_scale", "fp8_fwd_scale_inv",
                   "fp8_bwd_amax_history", "fp8_bwd_scale", "fp8_bwd_scale_inv")
FP8_STATE_KEYS = FP8_FLOAT_STATE + ("fp8_recipe_fields",)
HISTORIES = ("fp8_fwd_amax_history", "fp8_bwd_amax_history")
_FORMAT_CODES = {Format.E4M3: 0, Format.E5M2: 1, Format.HYBRID: 2}
_ALGO_CODES = {"max": 0, "most_recent": 1}
DEFAULT_HISTORY_LEN = DelayedScaling().amax_history_len
ALIGN = ops.GEMM_ALIGN  # FP8 GEMM dimensions must be multiples of it
pad_rows = ops.pad_rows
FP8_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Creation order of FP8 modules: the same on every rank that builds the same model, so it lays
# out the cross-rank amax reduction identically everywhere.
_creation_index = itertools.count()


def recipe_code(recipe: DelayedScaling) -> list[int]:
    algo = recipe.amax_compute_algo
    return [recipe.margin, _FORMAT_CODES[recipe.fp8_format], recipe.amax_history_len,
            _ALGO_CODES.get(algo, 2) if isinstance(algo, str) else 2]


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


class Fp8Cast:
    """How one tensor role (a GEMM's input, weight or grad_output) is cast to FP8."""

    def __init__(self, dtype, scale=None, scale_inv=None, amax_slot=None, group=None,
                 fixed=False, history=None, column=0):
        self.dtype = dtype
        self.scale, self.scale_inv, self.amax_slot = scale, scale_inv, amax_slot
        self.group = group
        self.fixed = fixed
        self.history, self.column = history, column  # amax_slot is history[0, column]

    @classmethod
    def delayed(cls, dtype, history, scale, scale_inv, column):
        """The stored scale; the amax goes to the history's row 0 in the same pass."""
        return cls(dtype, scale[column:column + 1], scale_inv[column:column + 1],
                   history[0, column:column + 1], history=history, column=column)

    @classmethod
    def current(cls, dtype, group):
        """The scale of the tensor's own amax, reduced across the group."""
        return cls(dtype, group=group)

    @classmethod
    def replay(cls, dtype, scale, scale_inv):
        """Given scales that nothing else writes, recording no amax: the cast of an earlier
        forward, repeated (activation checkpointing)."""
        return cls(dtype, scale, scale_inv, fixed=True)

    @property
    def is_current(self) -> bool:
        return self.scale is None and not self.fixed

    def _known_scale(self):
        """(scale, scale_inv, amax slot or None) of a cast whose scale is known beforehand."""
        if self.fixed:
            return self.scale, self.scale_inv, None
        # A copy of scale_inv: the delayed update rewrites it in place before backward runs
        # (under torch.compile an opaque copy, which the compiler cannot drop: ops.snapshot).
        copy = ops.snapshot if torch.compiler.is_compiling() else torch.Tensor.clone
        return self.scale, copy(self.scale_inv), self.amax_slot

    def _run(self, kernel: Callable, scale, amax_slot):
        """kernel(scale, amax_slot) -> results, with the amax recorded into the history."""
        traced_amax = amax_slot is not None and torch.compiler.is_compiling()
        if traced_amax:
            # Under torch.compile the amax goes to a fresh tensor and an operator that declares
            # its mutation folds it into the history (a mutated view of a module buffer, made in
            # a traced backward, is more than AOTAutograd can partition). Same max, same bits.
            amax_slot = torch.zeros(1, dtype=torch.float32, device=scale.device)
        results = kernel(scale, amax_slot)
        if traced_amax:
            ops.record_amax(self.history, amax_slot, self.column)
        return results

    def cast(self, x: torch.Tensor, with_transpose: bool = True):
        """(x_fp8, x_t_fp8 or None, scale_inv used, scale used). The transpose is produced in
        the same pass, only when a backward GEMM needs it."""
        if self.is_current:
            amax = ops.amax(x)
            _autocast.all_reduce_max(amax, self.group)
            scale = ops.compute_scale_from_amax(amax.reshape(1), torch.finfo(self.dtype).max)
            scale_inv, amax_slot = scale.reciprocal(), None
        else:
            scale, scale_inv, amax_slot = self._known_scale()

        def kernel(scale, amax_slot):
            if with_transpose:
                return ops.cast_transpose_to_fp8(x, scale, self.dtype, amax_slot)
            return ops.cast_to_fp8(x, scale, self.dtype, amax_slot), None

        x_fp8, x_t_fp8 = self._run(kernel, scale, amax_slot)
        return x_fp8, x_t_fp8, scale_inv, scale

    def cast_fused(self, fused: Callable, unfused: Callable, with_transpose: bool):
        """The cast of a tensor that a kernel computes and casts in one pass (a norm's or an
        activation's output): ``fused(scale, amax_slot, dtype) -> (x_fp8, x_t_fp8, extra)``.
        Current scaling needs the tensor's amax before its scale, so there the tensor is made
        in high precision first: ``unfused() -> (x_hp with padded rows, extra)``.
        Returns (x_fp8, x_t_fp8 or None, scale_inv, scale, extra)."""
        if self.is_current:
            x_hp, extra = unfused()
            x_fp8, x_t_fp8, scale_inv, scale = self.cast(x_hp, with_transpose)
            return x_fp8, x_t_fp8, scale_inv, scale, extra
        scale, scale_inv, amax_slot = self._known_scale()
        x_fp8, x_t_fp8, extra = self._run(lambda s, a: fused(s, a, self.dtype), scale, amax_slot)
        return x_fp8, (x_t_fp8 if with_transpose else None), scale_inv, scale, extra

    def cast_grad_output(self, g: torch.Tensor, with_transpose: bool, with_dbias: bool):
        """The cast of a 2-D grad_output (rows padded to 16) and, if with_dbias, the bias
        gradient (column sums, float32 accumulation, in g's dtype) from the same read of g.
        Returns (g_fp8, g_t_fp8 or None, scale_inv, dbias or None)."""
        if not with_dbias:
            g_fp8, g_t_fp8, scale_inv, _ = self.cast(pad_rows(g), with_transpose)
            return g_fp8, g_t_fp8, scale_inv, None
        from ..ops import fused as fused_ops

        def fused(scale, amax_slot, dtype):
            return fused_ops.cast_transpose_dbias(g, scale, dtype, amax_slot, ALIGN)

        def unfused():
            return pad_rows(g), g.sum(dim=0, dtype=torch.float32).to(g.dtype)

        g_fp8, g_t_fp8, scale_inv, _, dbias = self.cast_fused(fused, unfused, with_transpose)
        return g_fp8, g_t_fp8, scale_inv, dbias


@dataclass
class Fp8Plan:
    """Everything one FP8 GEMM's forward and backward need besides the tensors."""

    input_cast: Fp8Cast
    weight_cast: Fp8Cast
    grad_cast: Fp8Cast
    weight_fp8: Optional[tuple]  # cached (w_fp8, w_t_fp8, scale_inv, scale), or None
    backward_step: Optional[_autocast.BackwardStep]  # None with current scaling
    out_dtype: torch.dtype
    # Set by the forward: (input scale, input scale_inv, weight scale, weight scale_inv) used.
    scales_used: Optional[tuple] = None

    def on_backward(self) -> None:
        """Called first thing by the backward: queue the grad_output update for the end of
        this backward pass (see fp8_context.BackwardStep)."""
        if self.backward_step is not None and not torch.compiler.is_compiling():
            self.backward_step.on_backward()

    def keep_scales(self, x_scale, x_scale_inv, w_scale, w_scale_inv) -> None:
        if not torch.compiler.is_compiling():  # for checkpoint replay, which runs eagerly
            self.scales_used = (x_scale, x_scale_inv, w_scale, w_scale_inv)


@dataclass(frozen=True)
class BlockReplay:
    """What the recomputation of a checkpointed block-scaled forward repeats: its recipe and
    the quantised weight each GEMM used (None: quantised in the call, as it will be again)."""

    recipe: Recipe
    weights_q: tuple


class Fp8StateMixin:
    """The FP8 state of a module with ``num_gemms`` FP8 GEMMs (see the module docstring). Put it
    before the torch.nn base class. The module provides:
      fp8_weights() -> the weight of each GEMM as [out_features, in_features];
      _gemm_dims() -> (out_features, in_features) of each GEMM;
      _high_precision(inp, linear=F.linear) -> its torch composition, GEMMs done by ``linear``;
      _fp8_apply(inp, plans, *args) -> the FP8 forward (an autograd.Function) given a plan
      per GEMM; it calls plan.on_backward() first in backward and plan.keep_scales(...) in
      forward.
    """

    _fp8_override = None  # set per module by transformer_fp8.debug.override

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
        self._fp8_index = next(_creation_index)
        _autocast.register_module(self._fp8_index, self)
        self._recipe_code: Optional[list[int]] = None
        _autocast.await_recipe(self._fp8_index, self)
        self._fp8_maxes = (Format.HYBRID.max_fwd, Format.HYBRID.max_bwd)
        self._weight_cache = [None] * num_gemms
        self._delayed_cast_cache = None  # see _delayed_casts
        self._replay_records = checkpointing.ReplayRecords()
        self._warned_high_precision = False

    def fp8_state_tensors(self) -> list[torch.Tensor]:
        """The float32 FP8 state (histories, scales, scale_invs), as the update writes it."""
        return [self._buffers[name] for name in FP8_FLOAT_STATE]

    def prepare_fp8_recipe(self, recipe: Recipe) -> None:
        """Size the FP8 state for ``recipe`` now, as the first FP8 forward under it would."""
        if isinstance(recipe, DelayedScaling):
            self._adopt_recipe(recipe)

    def reset_fp8_state(self) -> None:
        """Fresh FP8 state: empty histories, unit scales (keeps the history length)."""
        with torch.no_grad():
            for name in HISTORIES:
                getattr(self, name).zero_()
            for name in FP8_FLOAT_STATE:
                if name not in HISTORIES:
                    getattr(self, name).fill_(1.0)
            self.fp8_recipe_fields.fill_(-1)
        self._recipe_code = None
        _autocast.await_recipe(self._fp8_index, self)
        self._weight_cache = [None] * self._num_gemms
        self._delayed_cast_cache = None
        self._replay_records.clear()

    def __setstate__(self, state):
        # A copy (copy.deepcopy, unpickling) is a module of its own in the amax reduction.
        super().__setstate__(state)
        self._fp8_index = next(_creation_index)
        _autocast.register_module(self._fp8_index, self)
        if self._recipe_code is None:
            _autocast.await_recipe(self._fp8_index, self)
        self._delayed_cast_cache = None
        self._replay_records = checkpointing.ReplayRecords()

    def __getstate__(self):
        # Replay records hold autograd bookkeeping of a step in flight: never copied or pickled.
        state = dict(self.__dict__)
        state["_replay_records"] = None
        return state

    def _apply(self, fn, recurse=True):
        # Device moves apply to the FP8 state; dtype casts (.half(), .to(torch.bfloat16)) do
        # not: the operators need float32 scales and histories.
        was_meta = self.fp8_fwd_scale.is_meta
        order = list(self._buffers)
        fp8_state = {name: self._buffers.pop(name) for name in FP8_FLOAT_STATE}
        try:
            super()._apply(fn, recurse)
        finally:
            for name, buffer in fp8_state.items():
                self._buffers[name] = buffer
            self._buffers = type(self._buffers)((name, self._buffers[name]) for name in order)
        for name, buffer in fp8_state.items():
            moved = fn(buffer)
            self._buffers[name] = moved if moved.dtype == buffer.dtype else \
                buffer.to(device=moved.device)
        self._weight_cache = [None] * self._num_gemms
        self._delayed_cast_cache = None  # views of the old buffers
        if was_meta and not self.fp8_fwd_scale.is_meta:
            # Out of "meta" (to_empty, the FSDP2 / large-model pattern): the new buffers hold
            # uninitialised memory and nobody may call reset_parameters(): start a fresh state.
            self.reset_fp8_state()
        return self

    def _adopt_recipe(self, recipe: DelayedScaling) -> None:
        """Match the history length to the recipe (a new length starts a fresh history; the
        scales are kept), record the recipe fields and the format maxima the update uses. Host
        work only when the recipe changes."""
        code = recipe_code(recipe)
        if code == self._recipe_code:
            return
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
                history.data = history.new_zeros(recipe.amax_history_len, history.shape[1])
                self._delayed_cast_cache = None  # its views see the old storage
        self.fp8_recipe_fields.copy_(torch.tensor(code, dtype=torch.int64))
        self._fp8_maxes = (recipe.fp8_format.max_fwd, recipe.fp8_format.max_bwd)
        self._recipe_code = code
        _autocast.recipe_adopted(self._fp8_index)

    def _fwd_state(self):
        return (self.fp8_fwd_amax_history, self.fp8_fwd_scale, self.fp8_fwd_scale_inv,
                self._fp8_maxes[0])

    def _bwd_state(self):
        return (self.fp8_bwd_amax_history, self.fp8_bwd_scale, self.fp8_bwd_scale_inv,
                self._fp8_maxes[1])

    def _state_for_step(self, recipe: DelayedScaling, role: str):
        """The state getter with which a step under ``recipe`` that this module did not run in
        on this rank reduces and updates it (it may have run on another rank); None when the
        module trains with another recipe."""
        if self._recipe_code is not None and self._recipe_code != recipe_code(recipe):
            return None
        self._adopt_recipe(recipe)
        return self._fwd_state if role == "fwd" else self._bwd_state

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        # A backward update held back by reentrant checkpointing (see autocast.BackwardStep)
        # runs first, so that a checkpoint holds the state a run without it would hold.
        if _autocast.has_pending_backward_updates():
            _autocast.flush_pending_backward_updates()
        _autocast.discard_failed_backward_passes()
        super()._save_to_state_dict(destination, prefix, keep_vars)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        # A history of another length loads as it is. A checkpoint with no FP8 key at all (a
        # plain high-precision one) loads with strict=True and leaves a fresh FP8 state; one
        # with only some FP8 keys is reported as incomplete.
        present = [k for k in FP8_STATE_KEYS if prefix + k in state_dict]
        error = fp8_state_error(self, state_dict, prefix)
        if error is not None:
            error_msgs.append(error)  # load_state_dict raises; nothing of this module is loaded
            return
        for key in HISTORIES:
            incoming, history = state_dict.get(prefix + key), getattr(self, key)
            if (isinstance(incoming, torch.Tensor) and incoming.dim() == 2
                    and incoming.shape[0] != history.shape[0]
                    and incoming.shape[1] == history.shape[1]):
                history.data = history.new_empty(incoming.shape)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
        if not present:
            self.reset_fp8_state()
            for key in FP8_STATE_KEYS:
                if prefix + key in missing_keys:
                    missing_keys.remove(prefix + key)
        self._recipe_code = None  # re-adopted from the active recipe on the next FP8 forward
        _autocast.await_recipe(self._fp8_index, self)
        self._weight_cache = [None] * self._num_gemms
        self._delayed_cast_cache = None

    # ---- forward -----------------------------------------------------------------------------

    def _dispatch(self, inp: torch.Tensor, is_first_microbatch, in_features: int):
        """The module's output: FP8 inside an enabled fp8_autocast, else its high-precision
        form (``_high_precision(inp)``, exactly the torch composition)."""
        name = type(self).__name__
        if inp.shape[-1:] != (in_features,):
            raise ValueError(f"{name}: input must have shape [..., {in_features}], "
                             f"got {tuple(inp.shape)}")
        if self._in_recompute():
            return self._fp8_replay(inp)
        state = _autocast.current_state()
        if self._fp8_override is not None and state is not None:
            state = self._fp8_override.state_for(state)  # None: high precision
        if state is None or not state.enabled:
            if state is not None and state.calibrating:
                from .calibration import recording_linear
                return self._high_precision(inp, recording_linear(self, state))
            return self._high_precision(inp)
        weight_dtype = self.fp8_weights()[0].dtype
        if inp.dtype != weight_dtype and autocast_dtype(inp.device.type) is None:
            # torch.nn.Linear refuses this (F.linear: "expected m1 and m2 to have the same
            # dtype"); the FP8 path would accept it silently.
            raise RuntimeError(f"{name}: input dtype {inp.dtype} differs from the weight's "
                               f"{weight_dtype}, which torch.nn.Linear refuses too; cast the "
                               "input or the module, or run under torch.autocast")
        gemm_dims = [d for dims in self._gemm_dims() for d in dims]
        if 0 in gemm_dims:
            return self._high_precision(inp)  # no features: nothing to multiply in FP8
        if any(d % ALIGN for d in gemm_dims) or inp.dtype not in FP8_INPUT_DTYPES:
            self._warn_high_precision(inp.dtype)
            return self._high_precision(inp)
        if is_block_recipe(state.recipe):
            return self._block_run(inp, state.recipe, is_first_microbatch)
        return self._fp8_run(inp, state, is_first_microbatch)

    def _block_run(self, inp: torch.Tensor, recipe, is_first_microbatch,
                   replay: Optional["BlockReplay"] = None):
        """The forward under a block-scaled recipe: per-block scales come from each tensor as
        it is cast, so this is the high-precision form with its GEMMs block-scaled (no fused
        cast, no FP8 state). ``replay``: activation checkpointing's recomputation of such a
        forward, which runs outside fp8_autocast: the same recipe and the same cached weights."""
        gemms = itertools.count()
        weights_used = []

        def linear(x, weight, bias):
            gemm = next(gemms)
            if replay is not None:
                weight_q = replay.weights_q[gemm]
            else:
                weight_q = self._block_weight_for_step(gemm, weight, recipe, is_first_microbatch)
            weights_used.append(weight_q)
            return blockwise_linear(x, weight, bias, recipe, weight_q)

        if replay is None and _fp8_hooks.observer is not None and \
                not torch.compiler.is_compiling():
            linear = _fp8_hooks.observer.wrap_block_linear(self, linear, recipe)
        out = self._high_precision(inp, linear)
        if (replay is None and not torch.compiler.is_compiling()
                and checkpointing.may_be_checkpointed()
                and checkpointing.phase() is checkpointing.Phase.ORIGINAL):
            self._replay_records.keep(_autocast.forward_pass_id(),
                                      BlockReplay(recipe, tuple(weights_used)))
        return out

    def _warn_high_precision(self, dtype) -> None:
        if not self._warned_high_precision:
            warnings.warn(f"transformer_fp8.{type(self).__name__} with GEMMs (out, in) "
                          f"{self._gemm_dims()} and {dtype} input runs in high precision: FP8 "
                          "GEMMs need sizes that are multiples of 16 and a float32, bfloat16 "
                          "or float16 input.", stacklevel=4)
            self._warned_high_precision = True

    # ---- one FP8 forward -------------------------------------------------------------------

    def _fp8_run(self, inp: torch.Tensor, state, is_first_microbatch, *args):
        """The FP8 forward under ``state`` (an active fp8_autocast): a plan per GEMM, then
        _fp8_apply; keeps a replay record when activation checkpointing will recompute it."""
        recipe = state.recipe
        fmt = recipe.fp8_format
        if fmt is Format.E5M2:
            raise ValueError(f"Format.E5M2 cannot train a {type(self).__name__}: FP8 GEMMs take "
                             "no E5M2 x E5M2 product; use Format.HYBRID or Format.E4M3")
        out_dtype = autocast_dtype(inp.device.type) or inp.dtype
        if isinstance(recipe, Float8CurrentScaling):
            casts = [tuple(Fp8Cast.current(dtype, state.group)
                           for dtype in (fmt.fwd_dtype, fmt.fwd_dtype, fmt.bwd_dtype))
                     for _ in range(self._num_gemms)]
            backward_step = None
        else:
            self._adopt_recipe(recipe)
            casts = self._delayed_casts(fmt)
            if torch.compiler.is_compiling():
                # A traced forward registers nothing (a side effect would be refused inside a
                # checkpointed region): noted once as compiled, it is covered by every step of
                # its recipe, and its backward's update runs at the next outermost fp8_autocast.
                _autocast.note_compiled(self._fp8_index)
                backward_step = None
            else:
                backward_step = _autocast.record_forward(state, self._fp8_index,
                                                         self._fwd_state, self._bwd_state)
        if _fp8_hooks.observer is not None and not torch.compiler.is_compiling():
            casts = _fp8_hooks.observer.wrap_casts(self, casts)  # transformer_fp8.debug
        plans = tuple(
            Fp8Plan(input_cast, weight_cast, grad_cast,
                    self._weight_for_step(gemm, weight, weight_cast, is_first_microbatch),
                    backward_step, out_dtype)
            for gemm, (weight, (input_cast, weight_cast, grad_cast))
            in enumerate(zip(self.fp8_weights(), casts)))
        out = self._fp8_apply(inp, plans, *args)
        if (not torch.compiler.is_compiling() and checkpointing.may_be_checkpointed()
                and checkpointing.phase() is checkpointing.Phase.ORIGINAL):
            self._keep_replay_record(plans, fmt)
        return out

    def _in_recompute(self) -> bool:
        """Whether this forward is activation checkpointing's recomputation of an FP8 one."""
        # (An `if` on the records, not bool(): torch.compile traces the one, not the other.)
        if self._replay_records and checkpointing.phase() is checkpointing.Phase.RECOMPUTE:
            return True
        return False

    @torch.compiler.disable
    def _fp8_replay(self, inp, *args):
        """The recomputation of a checkpointed FP8 forward: the same casts with the same
        scales, no amax recorded; its backward casts and records grad_output as usual."""
        record = self._replay_records.take()
        if isinstance(record, BlockReplay):
            return self._block_run(inp, record.recipe, None, replay=record)
        return self._fp8_apply(inp, record, *args)

    def _keep_replay_record(self, plans: tuple, fmt: Format) -> None:
        """This forward runs under torch.utils.checkpoint: keep what its recomputation needs to
        repeat it exactly. The scales are copied: the delayed update changes them at the
        context's exit, before the recomputation runs."""
        replays = []
        for plan in plans:
            x_scale, x_scale_inv, w_scale, w_scale_inv = plan.scales_used
            replays.append(Fp8Plan(
                Fp8Cast.replay(fmt.fwd_dtype, x_scale.clone(), x_scale_inv),
                Fp8Cast.replay(fmt.fwd_dtype, w_scale.clone(), w_scale_inv),
                plan.grad_cast, plan.weight_fp8, plan.backward_step, plan.out_dtype))
        self._replay_records.keep(_autocast.forward_pass_id(), tuple(replays))

    def _delayed_casts(self, fmt: Format) -> list:
        """Per GEMM, the (input, weight, grad_output) casts of delayed scaling: views of this
        module's scales, scale_invs and history row 0. Made once and reused while the state
        buffers are the same tensors (slicing them on every forward costs more host time than
        the cast)."""
        buffers = tuple(self._buffers[name] for name in FP8_FLOAT_STATE)
        fwd_h, fwd_s, fwd_si, bwd_h, bwd_s, bwd_si = buffers

        def make():
            return [(Fp8Cast.delayed(fmt.fwd_dtype, fwd_h, fwd_s, fwd_si, 2 * gemm),
                     Fp8Cast.delayed(fmt.fwd_dtype, fwd_h, fwd_s, fwd_si, 2 * gemm + 1),
                     Fp8Cast.delayed(fmt.bwd_dtype, bwd_h, bwd_s, bwd_si, gemm))
                    for gemm in range(self._num_gemms)]

        if torch.compiler.is_compiling():
            return make()  # traced once: the slicing is part of the graph
        cached = self._delayed_cast_cache
        if (cached is not None and cached[0] is fmt
                and all(old is new for old, new in zip(cached[1], buffers))):
            return cached[2]
        casts = make()
        self._delayed_cast_cache = (fmt, buffers, casts)
        return casts

    def _block_weight_for_step(self, gemm: int, weight, recipe, is_first_microbatch):
        """_weight_for_step for the block-scaled recipes: the quantised weight to reuse, or
        None to quantise it in the call. A copy kept under another recipe is not reused."""
        if is_first_microbatch is None:
            if self._weight_cache[gemm] is not None:  # (no write when there is nothing to drop:
                self._weight_cache[gemm] = None       # torch.compile traces no side effect)
            return None
        cached = self._weight_cache[gemm]
        if is_first_microbatch or not (isinstance(cached, tuple) and len(cached) == 2
                                       and cached[0] == recipe):
            self._weight_cache[gemm] = (recipe, quantize_weight(weight, recipe))
        return self._weight_cache[gemm][1]

    def _weight_for_step(self, gemm: int, weight, weight_cast, is_first_microbatch):
        """None: cast the weight in this call. True: cast it now and keep it. False: reuse the
        copy kept by the last True (gradient accumulation: the weight has not changed)."""
        if is_first_microbatch is None:
            if self._weight_cache[gemm] is not None:  # (no write when there is nothing to drop:
                self._weight_cache[gemm] = None       # torch.compile traces no side effect)
            return None
        cached = self._weight_cache[gemm]
        if is_first_microbatch or cached is None or len(cached) != 4:  # (a block recipe's: 2)
            with torch.no_grad():
                self._weight_cache[gemm] = weight_cast.cast(weight, with_transpose=True)
        return self._weight_cache[gemm]
