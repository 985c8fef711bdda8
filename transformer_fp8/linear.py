"""transformer_fp8.Linear: a drop-in torch.nn.Linear whose GEMMs run in FP8 inside fp8_autocast.

FP8 state per layer (plain float32 tensors in state_dict, kept float32 by .half() and the like):
  fp8_fwd_amax_history [L, 2]  amaxes of (input, weight), row 0 = this step
  fp8_fwd_scale [2], fp8_fwd_scale_inv [2]
  fp8_bwd_amax_history [L, 1]  amax of grad_output
  fp8_bwd_scale [1], fp8_bwd_scale_inv [1]
  fp8_recipe_fields [4] int64  the recipe in use, as a record: margin, format, amax_history_len,
                               amax algo (-1: never used)
"""
from __future__ import annotations

import itertools
import warnings
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from . import fp8_context as _autocast
from . import checkpointing, ops
from .blockwise_linear import blockwise_linear, is_block_recipe
from .recipe import BLOCK_RECIPES, DelayedScaling, Float8CurrentScaling, Format, Recipe

INPUT, WEIGHT = 0, 1  # columns of the forward state
FP8_FLOAT_STATE = ("fp8_fwd_amax_history", "fp8_fwd_scale", "fp8_fwd_scale_inv",
                   "fp8_bwd_amax_history", "fp8_bwd_scale", "fp8_bwd_scale_inv")
FP8_STATE_KEYS = FP8_FLOAT_STATE + ("fp8_recipe_fields",)
_HISTORIES = ("fp8_fwd_amax_history", "fp8_bwd_amax_history")
_FORMAT_CODES = {Format.E4M3: 0, Format.E5M2: 1, Format.HYBRID: 2}
_ALGO_CODES = {"max": 0, "most_recent": 1}
_DEFAULT_HISTORY_LEN = DelayedScaling().amax_history_len
_ALIGN = 16  # FP8 GEMM dimensions must be multiples of 16
_FP8_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Creation order of FP8 layers: the same on every rank that builds the same model, so it lays
# out the cross-rank amax reduction identically everywhere.
_creation_index = itertools.count()


def _recipe_code(recipe: DelayedScaling) -> list[int]:
    algo = recipe.amax_compute_algo
    return [recipe.margin, _FORMAT_CODES[recipe.fp8_format], recipe.amax_history_len,
            _ALGO_CODES.get(algo, 2) if isinstance(algo, str) else 2]


class _Fp8Cast:
    """How one tensor role (input, weight, grad_output) is cast to FP8."""

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

    def cast(self, x: torch.Tensor, with_transpose: bool = True):
        """(x_fp8, x_t_fp8 or None, scale_inv used, scale used). The transpose is produced in
        the same pass, only when a backward GEMM needs it."""
        if self.fixed:
            scale, scale_inv, amax_slot = self.scale, self.scale_inv, None
        elif self.scale is None:  # current scaling
            amax = ops.amax(x)
            _autocast.all_reduce_max(amax, self.group)
            scale = ops.compute_scale_from_amax(amax.reshape(1), torch.finfo(self.dtype).max)
            scale_inv, amax_slot = scale.reciprocal(), None
        else:
            # A copy of scale_inv: the delayed update rewrites it in place before backward runs.
            scale, scale_inv, amax_slot = self.scale, self.scale_inv.clone(), self.amax_slot
        traced_amax = amax_slot is not None and torch.compiler.is_compiling()
        if traced_amax:
            # Under torch.compile the amax goes to a fresh tensor and an operator that declares
            # its mutation folds it into the history (a mutated view of a module buffer, made in
            # a traced backward, is more than AOTAutograd can partition). Same max, same bits.
            amax_slot = torch.zeros(1, dtype=torch.float32, device=x.device)
        if with_transpose:
            x_fp8, x_t_fp8 = ops.cast_transpose_to_fp8(x, scale, self.dtype, amax_slot)
        else:
            x_fp8, x_t_fp8 = ops.cast_to_fp8(x, scale, self.dtype, amax_slot), None
        if traced_amax:
            ops.record_amax(self.history, amax_slot, self.column)
        return x_fp8, x_t_fp8, scale_inv, scale


@dataclass
class _Fp8Plan:
    """Everything one FP8 forward/backward of a Linear needs besides the tensors."""

    input_cast: _Fp8Cast
    weight_cast: _Fp8Cast
    grad_cast: _Fp8Cast
    weight_fp8: Optional[tuple]  # cached (w_fp8, w_t_fp8, scale_inv, scale), or None
    backward_step: Optional[_autocast.BackwardStep]  # None with current scaling
    out_dtype: torch.dtype
    # Set by the forward: (input scale, input scale_inv, weight scale, weight scale_inv) used.
    scales_used: Optional[tuple] = None


def _pad_rows(x: torch.Tensor) -> torch.Tensor:
    """Zero rows up to a multiple of 16: they change neither amax nor any product row kept."""
    extra = (-x.shape[0]) % _ALIGN
    return F.pad(x, (0, 0, 0, extra)) if extra else x


class _Fp8LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, inp, weight, bias, plan: _Fp8Plan):
        needs_input_grad, needs_weight_grad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        out_features, in_features = weight.shape
        inp_2d = inp.reshape(-1, in_features)
        # The transposed copies feed wgrad (input^T) and dgrad (weight^T): made only if needed.
        x_fp8, x_t_fp8, x_scale_inv, x_scale = plan.input_cast.cast(
            _pad_rows(inp_2d), with_transpose=needs_weight_grad)
        w_fp8, w_t_fp8, w_scale_inv, w_scale = (
            plan.weight_fp8 if plan.weight_fp8 is not None else
            plan.weight_cast.cast(weight, needs_input_grad))
        if not torch.compiler.is_compiling():  # for checkpoint replay, which runs eagerly
            plan.scales_used = (x_scale, x_scale_inv, w_scale, w_scale_inv)
        out = ops.fp8_gemm(x_fp8, x_scale_inv, w_fp8, w_scale_inv, plan.out_dtype,
                           bias=None if bias is None else bias.to(plan.out_dtype),
                           use_fast_accum=True)
        # Backward needs only the FP8 copies: the high-precision input is not kept.
        ctx.save_for_backward(x_t_fp8, x_scale_inv, w_t_fp8, w_scale_inv)
        ctx.plan = plan
        ctx.rows, ctx.lead_shape = inp_2d.shape[0], inp.shape[:-1]
        ctx.in_features, ctx.out_features = in_features, out_features
        ctx.inp_dtype, ctx.weight_dtype = inp.dtype, weight.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        return out[:ctx.rows].reshape(*ctx.lead_shape, out_features)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        x_t_fp8, x_scale_inv, w_t_fp8, w_scale_inv = ctx.saved_tensors
        needs_input_grad, needs_weight_grad, needs_bias_grad = ctx.needs_input_grad[:3]
        plan = ctx.plan
        if plan.backward_step is not None and not torch.compiler.is_compiling():
            plan.backward_step.on_backward()  # the update runs when this backward pass ends
        g_2d = grad_out.reshape(-1, ctx.out_features)
        g_fp8, g_t_fp8, g_scale_inv, _ = plan.grad_cast.cast(_pad_rows(g_2d),
                                                             with_transpose=needs_weight_grad)
        grad_inp = grad_weight = grad_bias = None
        if needs_input_grad:
            # dgrad [M, K] = grad_out [M, N] @ weight [N, K]; the b operand is weight^T [K, N]
            grad_inp = ops.fp8_gemm(g_fp8, g_scale_inv, w_t_fp8, w_scale_inv, ctx.inp_dtype)
            grad_inp = grad_inp[:ctx.rows].reshape(*ctx.lead_shape, ctx.in_features)
        if needs_weight_grad:
            # wgrad [N, K] = grad_out^T [N, M] @ input [M, K]; the b operand is input^T [K, M]
            grad_weight = ops.fp8_gemm(g_t_fp8, g_scale_inv, x_t_fp8, x_scale_inv,
                                       ctx.weight_dtype)
        if needs_bias_grad:
            grad_bias = g_2d.sum(dim=0).to(ctx.bias_dtype)
        return grad_inp, grad_weight, grad_bias, None


def _history_len_for(recipe) -> int:
    """The amax history length a layer built for ``recipe`` starts with: the recipe's own for
    DelayedScaling, so that its state_dict has its final shapes from the start (a checkpoint of
    trained layers loads into freshly built ones, e.g. with torch.distributed.checkpoint)."""
    if recipe is None or isinstance(recipe, (Float8CurrentScaling,) + BLOCK_RECIPES):
        return _DEFAULT_HISTORY_LEN
    if isinstance(recipe, DelayedScaling):
        return recipe.amax_history_len
    raise TypeError("recipe must be None, a DelayedScaling, Float8CurrentScaling, "
                    f"Float8BlockScaling or Float8RowwiseScaling, got {type(recipe).__name__}")


class Linear(torch.nn.Linear):
    """Drop-in for torch.nn.Linear (same parameters, initialisation and state_dict keys, plus the
    FP8 state). Outside fp8_autocast, or with enabled=False, it computes what nn.Linear does.

    Inside fp8_autocast: input and weight are cast to FP8 (E4M3 with HYBRID) and multiplied by a
    cuBLASLt FP8 GEMM; backward casts grad_output (E5M2 with HYBRID) and runs dgrad and wgrad in
    FP8. Any number of rows works. Layers whose in_features or out_features is not a multiple of
    16, and float64 inputs, run in high precision (with a one-time warning).

    Arguments as torch.nn.Linear's (in_features, out_features, bias, device, dtype), plus
    params_dtype (Transformer Engine's name for dtype) and recipe: the recipe the layer will
    train with, which sizes its amax histories now rather than at the first FP8 forward.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None,
                 dtype: Optional[torch.dtype] = None, *,
                 params_dtype: Optional[torch.dtype] = None, recipe: Optional[Recipe] = None):
        if isinstance(device, torch.dtype):
            raise TypeError(f"Linear: argument 'device' must be a device, got the dtype {device} "
                            "(the fourth argument is device, as in torch.nn.Linear; pass the "
                            "dtype as dtype= or params_dtype=)")
        if dtype is not None and params_dtype is not None and dtype != params_dtype:
            raise ValueError(f"Linear: 'dtype' ({dtype}) and 'params_dtype' ({params_dtype}) are "
                             "two names for the parameters' dtype and must agree; pass one")
        super().__init__(in_features, out_features, bias=bias, device=device,
                         dtype=dtype if dtype is not None else params_dtype)
        if recipe is None:
            recipe = _autocast.init_recipe()  # from quantized_model_init, if any
        self._register_fp8_state(self.weight.device, _history_len_for(recipe))
        if isinstance(recipe, DelayedScaling):
            self._adopt_recipe(recipe)

    def weight_nk(self) -> torch.Tensor:
        """The weight as [out_features, in_features] (the Parameter itself here; a view in
        Conv1D, which stores it transposed)."""
        return self.weight

    def _high_precision(self, inp: torch.Tensor) -> torch.Tensor:
        """What the layer computes outside fp8_autocast: torch.nn.Linear's forward."""
        return F.linear(inp, self.weight, self.bias)

    # ---- FP8 state ---------------------------------------------------------------------------

    def _register_fp8_state(self, device, history_len: int = _DEFAULT_HISTORY_LEN) -> None:
        f32 = dict(dtype=torch.float32, device=device)
        self.register_buffer("fp8_fwd_amax_history", torch.zeros(history_len, 2, **f32))
        self.register_buffer("fp8_fwd_scale", torch.ones(2, **f32))
        self.register_buffer("fp8_fwd_scale_inv", torch.ones(2, **f32))
        self.register_buffer("fp8_bwd_amax_history", torch.zeros(history_len, 1, **f32))
        self.register_buffer("fp8_bwd_scale", torch.ones(1, **f32))
        self.register_buffer("fp8_bwd_scale_inv", torch.ones(1, **f32))
        self.register_buffer("fp8_recipe_fields",
                             torch.full((4,), -1, dtype=torch.int64, device=device))
        self._fp8_index = next(_creation_index)
        _autocast.register_module(self._fp8_index, self)
        self._recipe_code: Optional[list[int]] = None
        self._fp8_maxes = (Format.HYBRID.max_fwd, Format.HYBRID.max_bwd)
        self._weight_cache = None
        self._delayed_cast_cache = None  # see _delayed_casts
        self._replay_records = checkpointing.ReplayRecords()
        self._warned_high_precision = False

    def reset_fp8_state(self) -> None:
        """Fresh FP8 state: empty histories, unit scales (keeps the history length)."""
        with torch.no_grad():
            for name in _HISTORIES:
                getattr(self, name).zero_()
            for name in FP8_FLOAT_STATE:
                if name not in _HISTORIES:
                    getattr(self, name).fill_(1.0)
            self.fp8_recipe_fields.fill_(-1)
        self._recipe_code = None
        self._weight_cache = None
        self._delayed_cast_cache = None
        self._replay_records.clear()

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if hasattr(self, "fp8_recipe_fields"):  # nn.Linear.__init__ calls this first
            self.reset_fp8_state()

    def __setstate__(self, state):
        # A copy (copy.deepcopy, unpickling) is a layer of its own in the amax reduction.
        super().__setstate__(state)
        self._fp8_index = next(_creation_index)
        _autocast.register_module(self._fp8_index, self)
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
        self._weight_cache = None
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
        code = _recipe_code(recipe)
        if code == self._recipe_code:
            return
        for name in _HISTORIES:
            history = getattr(self, name)
            if history.shape[0] != recipe.amax_history_len and torch.compiler.is_compiling():
                raise RuntimeError(
                    f"Linear: under torch.compile the amax history (length {history.shape[0]}) "
                    f"cannot be resized to the recipe's {recipe.amax_history_len}; build the "
                    "layer for its recipe (Linear(..., recipe=...) or convert_to_fp8(model, "
                    "recipe=...)) or run one step eagerly first")
            if history.shape[0] != recipe.amax_history_len:
                # .data keeps the buffer object, so references (e.g. DDP's) stay valid.
                history.data = history.new_zeros(recipe.amax_history_len, history.shape[1])
                self._delayed_cast_cache = None  # its views see the old storage
        self.fp8_recipe_fields.copy_(torch.tensor(code, dtype=torch.int64))
        self._fp8_maxes = (recipe.fp8_format.max_fwd, recipe.fp8_format.max_bwd)
        self._recipe_code = code

    def _fwd_state(self):
        return (self.fp8_fwd_amax_history, self.fp8_fwd_scale, self.fp8_fwd_scale_inv,
                self._fp8_maxes[0])

    def _state_for_step(self, recipe: DelayedScaling, role: str):
        """The state getter with which a step under ``recipe`` that this layer did not run in
        on this rank reduces and updates it (it may have run on another rank); None when the
        layer trains with another recipe."""
        if self._recipe_code is not None and self._recipe_code != _recipe_code(recipe):
            return None
        self._adopt_recipe(recipe)
        return self._fwd_state if role == "fwd" else self._bwd_state

    def _bwd_state(self):
        return (self.fp8_bwd_amax_history, self.fp8_bwd_scale, self.fp8_bwd_scale_inv,
                self._fp8_maxes[1])

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        # A backward update held back by reentrant checkpointing (see autocast.BackwardStep)
        # runs first, so that a checkpoint holds the state a run without it would hold.
        if _autocast.has_pending_backward_updates():
            _autocast.flush_pending_backward_updates()
        super()._save_to_state_dict(destination, prefix, keep_vars)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        # A history of another length loads as it is. A checkpoint with no FP8 key at all (a
        # plain nn.Linear one) loads with strict=True and leaves a fresh FP8 state; one with
        # only some FP8 keys is reported as incomplete.
        present = [k for k in FP8_STATE_KEYS if prefix + k in state_dict]
        for key in _HISTORIES:
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
        self._weight_cache = None
        self._delayed_cast_cache = None

    # ---- forward -------------------------------------------------------------------------------

    def forward(self, inp: torch.Tensor, is_first_microbatch: Optional[bool] = None) -> torch.Tensor:
        if inp.shape[-1:] != (self.in_features,):
            raise ValueError(f"Linear: input must have shape [..., {self.in_features}], "
                             f"got {tuple(inp.shape)}")
        if self._replay_records and checkpointing.phase() is checkpointing.Phase.RECOMPUTE:
            return self._fp8_replay(inp)
        state = _autocast.current_state()
        if state is None or not state.enabled:
            return self._high_precision(inp)
        if inp.dtype != self.weight.dtype and not torch.is_autocast_enabled(inp.device.type):
            # torch.nn.Linear refuses this (F.linear: "expected m1 and m2 to have the same
            # dtype"); the FP8 path would accept it silently.
            raise RuntimeError(f"Linear: input dtype {inp.dtype} differs from the weight's "
                               f"{self.weight.dtype}, which torch.nn.Linear refuses too; cast "
                               "the input or the module, or run under torch.autocast")
        if (self.in_features % _ALIGN or self.out_features % _ALIGN
                or inp.dtype not in _FP8_INPUT_DTYPES):
            self._warn_high_precision(inp.dtype)
            return self._high_precision(inp)
        return self._fp8_forward(inp, state, is_first_microbatch)

    def _warn_high_precision(self, dtype) -> None:
        if not self._warned_high_precision:
            warnings.warn(f"transformer_fp8.Linear({self.in_features}, {self.out_features}) with "
                          f"{dtype} input runs in high precision: FP8 GEMMs need in_features "
                          "and out_features to be multiples of 16 and a float32, bfloat16 or "
                          "float16 input.", stacklevel=3)
            self._warned_high_precision = True

    def _fp8_forward(self, inp, state, is_first_microbatch):
        recipe = state.recipe
        if is_block_recipe(recipe):  # per-block scales from the tensors: no FP8 state used
            return blockwise_linear(self, inp, recipe)
        fmt = recipe.fp8_format
        if fmt is Format.E5M2:
            raise ValueError("Format.E5M2 cannot train a Linear layer: FP8 GEMMs take no E5M2 x "
                             "E5M2 product; use Format.HYBRID or Format.E4M3")
        out_dtype = (torch.get_autocast_dtype(inp.device.type)
                     if torch.is_autocast_enabled(inp.device.type) else inp.dtype)
        if isinstance(recipe, Float8CurrentScaling):
            input_cast, weight_cast, grad_cast = (
                _Fp8Cast.current(dtype, state.group)
                for dtype in (fmt.fwd_dtype, fmt.fwd_dtype, fmt.bwd_dtype))
            backward_step = None
        else:
            self._adopt_recipe(recipe)
            input_cast, weight_cast, grad_cast = self._delayed_casts(fmt)
            backward_step = _autocast.record_forward(state, self._fp8_index, self._fwd_state,
                                                     self._bwd_state)
            if torch.compiler.is_compiling():
                # A compiled backward cannot queue the end-of-backward update: it runs at the
                # next outermost fp8_autocast (or state_dict) instead.
                _autocast.hold_backward_update(backward_step)
        plan = _Fp8Plan(input_cast, weight_cast, grad_cast,
                        self._weight_for_step(weight_cast, is_first_microbatch), backward_step,
                        out_dtype)
        out = _Fp8LinearFunction.apply(inp, self.weight_nk(), self.bias, plan)
        if (not torch.compiler.is_compiling() and checkpointing.may_be_checkpointed()
                and checkpointing.phase() is checkpointing.Phase.ORIGINAL):
            self._keep_replay_record(plan, fmt)
        return out

    def _keep_replay_record(self, plan: _Fp8Plan, fmt: Format) -> None:
        """This forward runs under torch.utils.checkpoint: keep what its recomputation needs to
        repeat it exactly. The scales are copied: the delayed update changes them at the
        context's exit, before the recomputation runs."""
        x_scale, x_scale_inv, w_scale, w_scale_inv = plan.scales_used
        self._replay_records.keep(_autocast.forward_pass_id(), _Fp8Plan(
            _Fp8Cast.replay(fmt.fwd_dtype, x_scale.clone(), x_scale_inv),
            _Fp8Cast.replay(fmt.fwd_dtype, w_scale.clone(), w_scale_inv),
            plan.grad_cast, plan.weight_fp8, plan.backward_step, plan.out_dtype))

    @torch.compiler.disable
    def _fp8_replay(self, inp):
        """The recomputation of a checkpointed FP8 forward: the same casts with the same
        scales, no amax recorded; its backward casts and records grad_output as usual."""
        return _Fp8LinearFunction.apply(inp, self.weight_nk(), self.bias,
                                        self._replay_records.take())

    def _delayed_casts(self, fmt: Format) -> tuple:
        """The (input, weight, grad_output) casts of delayed scaling: views of this layer's
        scales, scale_invs and history row 0. Made once and reused while the state buffers are
        the same tensors (slicing them on every forward costs more host time than the cast)."""
        buffers = tuple(self._buffers[name] for name in FP8_FLOAT_STATE)
        fwd_h, fwd_s, fwd_si, bwd_h, bwd_s, bwd_si = buffers

        def make():
            return (_Fp8Cast.delayed(fmt.fwd_dtype, fwd_h, fwd_s, fwd_si, INPUT),
                    _Fp8Cast.delayed(fmt.fwd_dtype, fwd_h, fwd_s, fwd_si, WEIGHT),
                    _Fp8Cast.delayed(fmt.bwd_dtype, bwd_h, bwd_s, bwd_si, 0))

        if torch.compiler.is_compiling():
            return make()  # traced once: the slicing is part of the graph
        cached = self._delayed_cast_cache
        if (cached is not None and cached[0] is fmt
                and all(old is new for old, new in zip(cached[1], buffers))):
            return cached[2]
        casts = make()
        self._delayed_cast_cache = (fmt, buffers, casts)
        return casts

    def _weight_for_step(self, weight_cast, is_first_microbatch):
        """None: cast the weight in this call. True: cast it now and keep it. False: reuse the
        copy kept by the last True (gradient accumulation: the weight has not changed)."""
        if is_first_microbatch is None:
            self._weight_cache = None
            return None
        if is_first_microbatch or self._weight_cache is None:
            with torch.no_grad():
                self._weight_cache = weight_cast.cast(self.weight_nk(), with_transpose=True)
        return self._weight_cache

    def extra_repr(self) -> str:
        return super().extra_repr() + ", fp8=True"


def strip_fp8_state(state_dict: dict) -> dict:
    """A copy of a state_dict without the FP8 state, loadable into plain torch.nn.Linear
    models with strict=True."""
    return {k: v for k, v in state_dict.items() if k.rsplit(".", 1)[-1] not in FP8_STATE_KEYS}
