"""The base of every FP8 module: one forward dispatch (shape and dtype checks, the
high-precision fallback, the block-scaled recipes, FP8 under delayed or current scaling), the
FP8 weights kept across microbatches, and activation checkpointing's replay of a forward.
"""
from __future__ import annotations

import itertools
import warnings
from dataclasses import dataclass
from typing import Optional

import torch

from .. import _fp8_hooks
from ..quantization import amax_step
from ..quantization import autocast as _autocast
from ..quantization import replay as checkpointing
from ..quantization.blockwise import blockwise_linear, is_block_recipe, quantize_weight
from ..quantization.calibration import recording_linear
from ..quantization.quantizer import ALIGN, Fp8Cast, Fp8Plan
from ..quantization.recipe import Float8CurrentScaling, Format, Recipe
from ..quantization.state import FP8_FLOAT_STATE, Fp8State
from ..quantization.torch_autocast import autocast_dtype

FP8_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class BlockReplay:
    """What the recomputation of a checkpointed block-scaled forward repeats: its recipe and
    the quantised weight each GEMM used (None: quantised in the call, as it will be again)."""

    recipe: Recipe
    weights_q: tuple


class Fp8StateMixin(Fp8State):
    """The base of an FP8 module: its FP8 state (Fp8State) and its forward. Put it before the
    torch.nn base class. The module provides:
      fp8_weights() -> the weight of each GEMM as [out_features, in_features];
      _gemm_dims() -> (out_features, in_features) of each GEMM;
      _high_precision(inp, linear=F.linear) -> its torch composition, GEMMs done by ``linear``;
      _fp8_apply(inp, plans, *args) -> the FP8 forward (an autograd.Function) given a plan
      per GEMM; it calls plan.on_backward() first in backward and plan.keep_scales(...) in
      forward.
    """

    _fp8_override = None  # set per module by transformer_fp8.debug.override

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
                amax_step.note_compiled(self._fp8_index)
                backward_step = None
            else:
                backward_step = _autocast.record_forward(state, *self._scaling_states)
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
