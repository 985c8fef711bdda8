"""The base of every FP8 module: one forward dispatch (shape and dtype checks, the
high-precision fallback, FP8 under any recipe through the quantizers it gives each GEMM), the
FP8 weights kept across microbatches, and activation checkpointing's replay of a forward.
"""
from __future__ import annotations

import functools
import warnings

import torch
from torch.nn.utils import parametrize

from .. import _fp8_hooks
from .._dtensor import is_dtensor, local_tensor
from ..quantization import autocast as _autocast
from ..quantization import checkpoint_stack
from ..quantization.calibration import GradOutputRecording, recording_linear
from ..quantization.gemm_params import fast_accum_of
from ..quantization.fp8_weight import Fp8Weight
from ..quantization.quantizer import ALIGN, Fp8Plan
from ..quantization.replay import HIGH_PRECISION
from ..quantization.roles import quantizers_for_step
from ..quantization.state import Fp8State
from ..quantization.torch_autocast import autocast_dtype
from ..quantization.transforms import exporting, outside_inference_mode
from .fsdp.gathered_weight import GatheredFp8Weight
from .fsdp.high_precision import (high_precision_weights, mismatched_forms,
                                  release_high_precision, replay_operands)
from . import tensor_parallel
from .torchscript import refuse_torchscript

FP8_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


_FIT, _EMPTY, _UNALIGNED = "fit", "empty", "unaligned"


@functools.lru_cache(maxsize=1024)
def _gemm_dims_fit(gemm_dims: tuple) -> str:
    """Whether GEMMs of these (out, in) sizes run in FP8: _EMPTY (a zero size: nothing to
    multiply), _UNALIGNED (a size not a multiple of ALIGN) or _FIT. (Cached: every forward
    asks, with the same few shapes.)"""
    sizes = [size for dims in gemm_dims for size in dims]
    if 0 in sizes:
        return _EMPTY
    return _UNALIGNED if any(size % ALIGN for size in sizes) else _FIT


class Fp8StateMixin(Fp8State):
    """The base of an FP8 module: its FP8 state (Fp8State) and its forward. Put it before the
    torch.nn base class. The module provides:
      fp8_weights() -> the weight of each GEMM as [out_features, in_features];
      _gemm_dims() -> (out_features, in_features) of each GEMM;
      _high_precision(inp, linear=F.linear) -> its torch composition, GEMMs done by ``linear``;
      _fp8_apply(inp, plans, *args) -> the FP8 forward (an autograd.Function) given a plan
      per GEMM (quantizer.Fp8Plan); it calls plan.keep_used(x_q, w_q) in forward and
      plan.on_backward() first in backward, and multiplies operands with plan.gemm.
    """

    __prepare_scriptable__ = refuse_torchscript  # (torch.jit.script: a clear error)

    _fp8_override = None  # set per module by transformer_fp8.debug.override
    # fused_step(module, inp, autocast state, is_first_microbatch) -> output, or None where the
    # Python path (_fp8_run) must run: the module's C++ step (modules/linear_fused_step.py).
    _fused_step = None
    # What the module's next forward needs to run its last C++ step again, or None (set on the
    # instance by the step: linear_fused_step.py's _keep_ticket).
    _fused_ticket = None
    # Transformer Engine's tensor parallelism (tp_group, parallel_mode: te_tensor_parallel.py),
    # where the layer communicates; else None.
    _te_tp = None

    # ---- forward -----------------------------------------------------------------------------

    def _dispatch(self, inp: torch.Tensor, is_first_microbatch, in_features: int):
        """The module's output: FP8 inside an enabled fp8_autocast, else its high-precision
        form (``_high_precision(inp)``, exactly the torch composition)."""
        if "parametrizations" in self._modules:
            # A weight computed by torch.nn.utils.parametrize: once per forward, as nn.Linear
            # computes it (spectral_norm's power iteration advances at each computation).
            with parametrize.cached():
                return self._dispatch_now(inp, is_first_microbatch, in_features)
        return self._dispatch_now(inp, is_first_microbatch, in_features)

    def _dispatch_now(self, inp: torch.Tensor, is_first_microbatch, in_features: int):
        if not isinstance(inp, torch.Tensor):
            raise TypeError(f"{type(self).__name__}: input must be a tensor, got "
                            f"{type(inp).__name__}")
        if inp.shape[-1:] != (in_features,):
            raise ValueError(f"{type(self).__name__}: input must have shape "
                             f"[..., {in_features}], got {tuple(inp.shape)}")
        if is_first_microbatch is not None and is_first_microbatch not in (True, False):
            # (a truthy "no" or "False" would cast and keep the weight)
            raise TypeError(f"{type(self).__name__}: is_first_microbatch must be None, True or "
                            f"False, got {is_first_microbatch!r}")
        if self._replay_records.kept:  # (one attribute read on every forward)
            if torch.compiler.is_compiling():
                out = self._replay_if_recomputing(inp)  # (the frame walk runs eagerly)
                if out is not None:
                    return out
            else:
                replay = self._replay_records.for_recomputation()
                if replay is not None:
                    return self._replay(inp, *replay)
        stack = _autocast.LOCAL.stack  # (current_state(), inline: every forward asks)
        state = stack[-1] if stack else None
        if self._fp8_override is not None and state is not None:
            state = self._fp8_override.state_for(state)  # None: high precision
        weight = self._weight_for_checks()
        # tensor parallelism (tensor_parallel.py)
        sharded = type(weight) not in _PLAIN_TENSORS and is_dtensor(weight)
        if sharded:
            tensor_parallel.prepare(self, state, inp)
        elif type(inp) not in _PLAIN_TENSORS and is_dtensor(inp):
            # (torch.nn.Linear refuses it too; the FP8 operators would name no sharding rule)
            raise TypeError(f"{type(self).__name__}: the input is a DTensor and the weight a "
                            "plain tensor (a layer not parallelized, after one whose output "
                            "stays a DTensor: use_local_output=False); give it the local "
                            "tensor (input.to_local() or full_tensor()), or parallelize it too")
        if state is None or not state.enabled:
            regions = checkpoint_stack.regions_to_keep()
            if state is not None and state.calibrating:
                if torch.compiler.is_compiling():
                    if exporting():  # (an exported program records nothing: roles._delayed)
                        return self._high_precision(inp)
                    return self._calibrate_eagerly(inp, state)
                # (it keeps the replay record for the regions: calibration.py)
                return self._run_high_precision(inp, recording_linear(self, state, regions))
            if regions:  # (its recomputation runs in high precision too, in any context)
                self._replay_records.keep(regions, HIGH_PRECISION)
            return self._run_high_precision(inp)
        inp_dtype, weight_dtype = inp.dtype, weight.dtype
        if inp_dtype != weight_dtype and autocast_dtype(inp.device.type) is None:
            # torch.nn.Linear refuses this (F.linear: "expected m1 and m2 to have the same
            # dtype"); the FP8 path would accept it silently.
            raise RuntimeError(f"{type(self).__name__}: input dtype {inp_dtype} differs from "
                               f"the weight's {weight_dtype}, which torch.nn.Linear refuses "
                               "too; cast the input or the module, or run under torch.autocast")
        gemm_dims = tensor_parallel.local_gemm_dims(self) if sharded else self._gemm_dims()
        gemm_dims = tuple(gemm_dims)  # (Dynamo warns of lru_cache; traced once, no need)
        fit = (_gemm_dims_fit.__wrapped__(gemm_dims) if torch.compiler.is_compiling()
               else _gemm_dims_fit(gemm_dims))
        if fit is _EMPTY:
            return self._run_high_precision(inp)  # no features: nothing to multiply in FP8
        if fit is _UNALIGNED or inp_dtype not in FP8_INPUT_DTYPES:
            self._warn_high_precision(inp_dtype, gemm_dims if sharded else None)
            return self._run_high_precision(inp)
        fused_step = self._fused_step
        if fused_step is not None:  # the module's C++ step, where it applies
            out = fused_step(self, inp, state, is_first_microbatch)
            if out is not None:
                return out
        return self._fp8_run(inp, state, is_first_microbatch)

    def _weight_for_checks(self) -> torch.Tensor:
        """The (first) weight, for what the dispatch and the roles read of it: its dtype,
        whether it is a DTensor."""
        return self.fp8_weights()[0]

    def _run_high_precision(self, inp: torch.Tensor, *args):
        """``self._high_precision(inp, *args)``, with the high-precision value of any weight
        that FSDP2 all-gathered in FP8 (a prefetch, or a recomputation in the forward's form:
        see fsdp/high_precision.py), not its FP8-rounded one."""
        # (the module's own Parameters, where FSDP2 puts what it gathered: fp8_weights() would
        # join a parameters_split weight, which FSDP2's FP8 all-gather refuses anyway)
        if not any(type(w) is GatheredFp8Weight for w in self._parameters.values()):
            return self._high_precision(inp, *args)
        return self._high_precision_of_gathered(inp, *args)

    @torch.compiler.disable
    def _high_precision_of_gathered(self, inp: torch.Tensor, *args):
        weights = high_precision_weights(self)
        try:
            return self._high_precision(inp, *args)
        finally:
            release_high_precision(weights)

    def _warn_high_precision(self, dtype, local_dims=None) -> None:
        """``local_dims``: a sharded layer's local GEMM sizes (tensor_parallel.local_gemm_dims:
        an uneven shard counts as size 1, so that every rank decides alike)."""
        if not self._warned_high_precision:
            dims = (f"{self._gemm_dims()}" if local_dims is None else
                    f"{self._gemm_dims()}, local shards {list(local_dims)} (1: uneven shards)")
            warnings.warn(f"transformer_fp8.{type(self).__name__} with GEMMs (out, in) {dims} "
                          f"and {dtype} input runs in high precision: FP8 GEMMs need sizes "
                          "that are multiples of 16 and a float32, bfloat16 or float16 input.",
                          stacklevel=4)
            self._warned_high_precision = True

    # ---- one FP8 forward -------------------------------------------------------------------

    def _fp8_run(self, inp: torch.Tensor, state, is_first_microbatch, *args):
        """The FP8 forward under ``state`` (an active fp8_autocast): a plan per GEMM (the
        recipe's quantizers, see quantization/roles.py), then _fp8_apply; keeps a replay record
        when activation checkpointing will recompute it."""
        if torch.compiler.is_compiling():
            if any(isinstance(w, (GatheredFp8Weight, Fp8Weight)) for w in self.fp8_weights()):
                # A weight all-gathered in FP8 by FSDP2, or an FP8 primary weight (tensor
                # subclasses), cannot enter a traced autograd.Function (the trace takes the
                # subclass's inner tensors as inputs: the weight got no gradient): this layer's
                # FP8 step runs eagerly (a graph break).
                return self._fp8_run_eagerly(inp, state, is_first_microbatch, *args)
            if not torch.is_grad_enabled() and (self.training or inp.requires_grad) \
                    and not exporting():
                # Maybe the first forward of a reentrant torch.utils.checkpoint region (which
                # runs without gradients, on the region's input, which requires them, or in a
                # module in training mode): it must keep a replay record for the
                # recomputation (in backward, outside fp8_autocast, after the delayed update:
                # quantization/replay.py), so it runs eagerly, where the checkpoint's frames
                # can be looked for. Read while tracing: the compiled code guards on grad
                # mode, ``training`` and ``requires_grad``; the training forward (gradients
                # on) and an evaluation (model.eval() under no_grad) keep their graphs.
                return self._fp8_run_keeping_replay(inp, state, is_first_microbatch, *args)
        quantizers, backward_step = quantizers_for_step(state.recipe, self, state)
        if _fp8_hooks.observer is not None and not torch.compiler.is_compiling():
            quantizers = _fp8_hooks.observer.wrap_quantizers(self, quantizers)  # debug stats
        if self._fp8_override is not None:  # debug.override(..., gemms=...)
            quantizers = self._fp8_override.wrap_quantizers(quantizers)
        out_dtype = autocast_dtype(inp.device.type) or inp.dtype
        # (the weights only where a cast is kept: a parameters_split weight is joined, a copy)
        weights = self.fp8_weights() if is_first_microbatch is not None else None
        override = getattr(state.recipe, "backward_override", None)
        plans = tuple(
            Fp8Plan(input_q, weight_q, grad_q,
                    self._weight_for_step(gemm, weights and weights[gemm], weight_q,
                                          is_first_microbatch, override is None),
                    backward_step, out_dtype, backward_override=override,
                    fast_accum=fast_accum_of(state.recipe))
            for gemm, (input_q, weight_q, grad_q) in enumerate(quantizers))
        if any(type(w) is GatheredFp8Weight for w in self._parameters.values()):
            mismatched = mismatched_forms(self, plans)  # (FSDP2: gathered in another form)
            try:
                out = self._fp8_apply(inp, plans, *args)
            finally:
                release_high_precision(mismatched)
        else:
            out = self._fp8_apply(inp, plans, *args)
        regions = checkpoint_stack.regions_to_keep()
        if regions:
            # Runs under torch.utils.checkpoint: keep what its recomputations need to repeat
            # it exactly (the scales used: the update changes them before they run).
            self._replay_records.keep(regions, tuple(plan.for_replay() for plan in plans))
        return out

    @torch.compiler.disable
    def _fp8_run_eagerly(self, inp, state, is_first_microbatch, *args):
        return self._fp8_run(inp, state, is_first_microbatch, *args)

    @torch.compiler.disable(reason=(
        "transformer_fp8: an FP8 forward without gradients, in training mode or on an input "
        "that requires gradients, may be the first forward of a reentrant "
        "torch.utils.checkpoint, which keeps a replay record for its recomputation: it runs "
        "eagerly. Call model.eval() for a compiled evaluation under no_grad."))
    def _fp8_run_keeping_replay(self, inp, state, is_first_microbatch, *args):
        return self._fp8_run(inp, state, is_first_microbatch, *args)

    @torch.compiler.disable
    def _calibrate_eagerly(self, inp, state):
        # Calibration records amaxes into state the trace cannot hold (the recipe adopted, the
        # module joining the step's update): under torch.compile it runs eagerly (a graph break),
        # keeping the replay record of a checkpointed region (whose recomputation records the
        # grad_output amaxes), which the trace could not look for.
        regions = checkpoint_stack.regions_to_keep()
        return self._run_high_precision(inp, recording_linear(self, state, regions))

    @torch.compiler.disable
    def _replay_if_recomputing(self, inp):
        """Under torch.compile, for a module that holds replay records: the replay of its
        record if this call is a checkpoint's recomputation, else None (the walk up the stack
        runs eagerly: a graph break, only while records are held)."""
        replay = self._replay_records.for_recomputation()
        return None if replay is None else self._replay(inp, *replay)

    @torch.compiler.disable
    def _replay(self, inp, plans, regions):
        """The recomputation of a checkpointed forward. An FP8 one: the same casts with the
        same scales (``plans``, a replay record), no amax recorded; its backward casts and
        records grad_output as usual. A high-precision one (``plans`` is HIGH_PRECISION): the
        high-precision form, whatever fp8_autocast it runs in, no amax recorded (calibration
        included); a calibrating one's (GradOutputRecording) records its grad_output amaxes in
        backward, as the first forward's would have. ``regions``: the checkpointed regions whose
        first forward this
        recomputation runs (nested checkpoints), which keep the record for their own."""
        self._replay_records.keep(regions, plans)
        if plans is HIGH_PRECISION:
            return self._run_high_precision(inp)
        if type(plans) is GradOutputRecording:  # (a calibrating forward's)
            return self._run_high_precision(inp, plans.linear(self))
        if not any(type(w) is GatheredFp8Weight for w in self._parameters.values()):
            return self._fp8_apply(inp, plans)
        # A weight FSDP2 gathered for this backward in another form than the forward's (a
        # forward between them): cast from its high-precision value (replay_operands).
        weights = replay_operands(self, plans)
        try:
            return self._fp8_apply(inp, plans)
        finally:
            release_high_precision(weights)

    def _weight_for_step(self, gemm: int, weight, weight_quantizer, is_first_microbatch,
                         transposes: bool = True):
        """None: quantise the weight in this call. True: quantise it now and keep it. False:
        reuse the copy kept by the last True (gradient accumulation: the weight has not
        changed), unless it was quantised another way (another recipe, or without the
        transpose the FP8 dgrad reads: ``transposes`` False under a backward_override). An FP8
        weight (quantized_model_init, or one FSDP2 all-gathered in FP8) is its own operand:
        nothing to keep."""
        if is_first_microbatch is None or isinstance(weight, (Fp8Weight, GatheredFp8Weight)):
            if self._weight_cache[gemm] is not None:  # (no write when there is nothing to drop:
                self._weight_cache[gemm] = None       # torch.compile traces no side effect)
            return None
        cached = self._weight_cache[gemm]
        if (is_first_microbatch or cached is None or cached[0] != weight_quantizer.cache_key
                or (transposes and cached[1].data_t is None)):
            # (kept for training steps: made outside inference mode, also under it)
            with torch.no_grad(), outside_inference_mode():
                self._weight_cache[gemm] = (weight_quantizer.cache_key, weight_quantizer.cast(
                    local_tensor(weight), with_transpose=transposes))  # (a TP shard)
        return self._weight_cache[gemm][1]
