"""The common cases of an FP8 Linear step run as one C++ operator with its autograd in C++
(csrc/linear_step.cpp): DelayedScaling (``fp8_linear_delayed``) and Float8CurrentScaling in one
process (``fp8_linear_current``), with a plain weight; the same for LayerNormLinear's norm
and GEMM (``fp8_norm_linear_delayed``, ``fp8_norm_linear_current``) and for LayerNormMLP's
norm, two GEMMs and activation (csrc/norm_mlp_step.cpp: ``fp8_norm_mlp_delayed``,
``fp8_norm_mlp_current``). Each makes the same operator calls, with the same arguments, as the
Python path (linear.py's _Fp8LinearFunction, layernorm_linear.py's _LayerNormLinearFunction,
layernorm_mlp.py's _LayerNormMLPFunction, with the quantizers of roles.py), so the same bits,
for a fraction of the host work: no Python autograd function, plan or quantizer call per step.

Everything else takes the Python path: block recipes, torch.compile's traces (the compiled
path keeps its own form), weights that are DTensors, FP8 weights or FSDP2 FP8 all-gathers,
weights kept across microbatches (is_first_microbatch), layers whose casts debug statistics
observe on this step or debug overrides change,
LayerNormLinear and LayerNormMLP with return_layernorm_output, and current scaling under
torch.utils.checkpoint. (A checkpointed delayed-scaling forward runs here and keeps the replay
record its recomputation, on the Python path, repeats.)
"""
from __future__ import annotations

import operator
from typing import Optional

import torch

from .. import _C, _fp8_hooks
from ..quantization import autocast as _autocast
from ..quantization import checkpoint_stack
from ..quantization.gemm_params import DEFAULT_FAST_ACCUM, fast_accum_of
from ..quantization.quantizer import Fp8Plan, Quantized
from ..quantization.recipe import DelayedScaling, Float8CurrentScaling, Format
from ..quantization.roles import (_REGISTERED, QUANTIZERS, delayed_quantizers,
                                  float_state_buffers, registered_quantizers)
from ..quantization.torch_autocast import output_dtype
from .activations import KERNEL_ACTIVATIONS

# The operators' functions called without the dispatcher (csrc/linear_step.cpp's Python entry:
# converting a dozen arguments for torch.ops costs several times what pybind11 does). None in
# a library built before they existed.
_delayed_step = getattr(_C, "linear_delayed", None)
_current_step = getattr(_C, "linear_current", None)
_norm_delayed_step = getattr(_C, "norm_linear_delayed", None)
_norm_current_step = getattr(_C, "norm_linear_current", None)
_norm_mlp_step = getattr(_C, "norm_mlp", None)
_LinearTicket = getattr(_C, "LinearTicket", None)

# False: every step takes the Python path (tests compare the two).
ENABLED = _current_step is not None
NORM_ENABLED = _norm_current_step is not None
NORM_MLP_ENABLED = _norm_mlp_step is not None

_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)
_is_compiling = torch.compiler.is_compiling
_is_any_autocast_enabled = torch._C._is_any_autocast_enabled
# (fwd_dtype, bwd_dtype) of each format: two property calls less per step.
_FORMAT_DTYPES = {fmt: (fmt.fwd_dtype, fmt.bwd_dtype) for fmt in Format}
# The quantizers of the two recipes this step runs (a registered subclass's own are not).
_delayed_quantizers = QUANTIZERS[DelayedScaling]
_current_quantizers = QUANTIZERS[Float8CurrentScaling]


def fused_linear_step(layer, inp: torch.Tensor, state, is_first_microbatch
                      ) -> Optional[torch.Tensor]:
    """The Linear layer's FP8 output through fp8_linear_delayed or fp8_linear_current, or None
    where the Python path must run. Called by base.py's _dispatch inside an enabled
    fp8_autocast, after its checks (Linear._fused_step). (Every forward runs this: its checks
    are ordered cheapest first.)"""
    if not ENABLED:
        return None
    delayed = _runs_fused(layer, state, is_first_microbatch)
    if delayed is None:
        return None
    weight = layer.weight_nk(routed=True)
    bias = layer._gemm_bias()
    step = _prepare(layer, inp, state, delayed, (weight, bias), _state_slices)
    if step is None:
        return None
    (fwd_dtype, bwd_dtype), out_dtype, state_slices, backward_step = step
    _keep_ticket(layer, inp, state, weight, bias, state_slices, backward_step)
    if state_slices is None:
        return _current_step(inp, weight, bias, fwd_dtype, bwd_dtype, out_dtype)
    # backward_step.on_backward() is called before the node runs: it queues the grad_output
    # update for the end of the backward pass (backward_step.BackwardStep).
    return _delayed_step(inp, weight, bias, *state_slices, fwd_dtype, bwd_dtype, out_dtype,
                         backward_step)


# ---- the ticket: the next forwards of a Linear layer under the same context, with fewer checks

def _keep_ticket(layer, inp, state, weight, bias, state_slices, backward_step) -> None:
    """After a forward that fused_linear_step ran, what the layer's next forwards need to run
    the same step again (``ticketed_linear_step``): made only where the next forward's checks
    reduce to identities (the same context, parameters, state buffers and steps) and to the
    input's type, dtype and shape, which the ticket compares (_C.LinearTicket,
    csrc/linear_step.cpp, for those it can see); anything else (a checkpointed or
    gradient-free forward, torch.autocast, return_bias, routed or split weights, an input the
    layer would take in another dtype) takes the full path. The module drops the ticket
    whenever one of its attributes is set (quantization/state.py)."""
    params = layer._parameters
    if (_LinearTicket is None or layer._wgrad is not None or layer.return_bias
            or params.get("weight") is not weight or params.get("bias") is not bias
            or inp.dtype is not weight.dtype or _is_any_autocast_enabled()
            or checkpoint_stack.may_be_checkpointed()):
        return  # (a weight that is not the Parameter itself: split, or Conv1D's transpose)
    delayed, buffers = None, []
    if state_slices is not None:
        if not _adopted(layer, state.recipe):
            return  # (the next forward adopts again)
        fwd_state, bwd_state = layer._scaling_states
        delayed = (fwd_state, fwd_state.step, bwd_state, backward_step)
        buffers = list(float_state_buffers(layer._buffers))
    fwd_dtype, bwd_dtype = _FORMAT_DTYPES[state.recipe.fp8_format]
    ticket = _LinearTicket(weight, bias, buffers, list(state_slices or ()), fwd_dtype,
                           bwd_dtype, inp.dtype, inp.shape[-1], backward_step)
    recipe_type = type(state.recipe)
    # (The ticket borrows the weight, bias and buffers: the tuple holds them, where the
    # garbage collector sees them.)
    layer.__dict__["_fused_ticket"] = (state, ticket, recipe_type, _REGISTERED[recipe_type],
                                       delayed, (weight, bias, buffers))


def ticketed_linear_step(layer, inp: torch.Tensor) -> Optional[torch.Tensor]:
    """The Linear layer's FP8 output from its ticket (``_keep_ticket``), or None where its
    full path must run: the C++ step of its last forward, called again once every condition
    that forward was checked under is seen to hold still (here what only Python can see; the
    input, the parameters, the state buffers and checkpointing in _C.LinearTicket). Called by
    Linear.forward, for a forward without is_first_microbatch, fp8_output or fp8_grad, while
    the layer holds a ticket."""
    if not ENABLED:
        return None
    state, ticket, recipe_type, quantizers, delayed, _ = layer._fused_ticket
    stack = _autocast.LOCAL.stack
    if (not stack or stack[-1] is not state or _is_compiling() or _is_any_autocast_enabled()
            or _fp8_hooks.observer is not None or layer._fp8_override is not None
            or layer._replay_records.kept
            or _REGISTERED.get(recipe_type) is not quantizers):  # (the recipe's registration)
        return None
    if delayed is not None:
        # The states covered by this context's steps (as record_forward would see to): the
        # steps kept for this thread, recipe and group, which still hold them.
        fwd_state, forward_step, bwd_state, backward_step = delayed
        if (_autocast.LOCAL.backward_steps.get(state.step_key) is not backward_step
                or fwd_state.step is not forward_step
                or bwd_state.step is not backward_step.step):
            return None
    return ticket(inp, layer._parameters, layer._buffers)


def fused_norm_linear_step(layer, inp: torch.Tensor, state, is_first_microbatch
                           ) -> Optional[torch.Tensor]:
    """LayerNormLinear's FP8 output through fp8_norm_linear_delayed or _current, or None where
    the Python path must run (as fused_linear_step; also with return_layernorm_output)."""
    if not NORM_ENABLED or layer.return_layernorm_output:
        return None
    delayed = _runs_fused(layer, state, is_first_microbatch)
    if delayed is None:
        return None
    norm_weight, norm_bias = layer.layer_norm_weight, layer.layer_norm_bias
    weight = layer._param("weight")
    bias = layer._gemm_bias()
    step = _prepare(layer, inp, state, delayed, (weight, bias, norm_weight, norm_bias),
                    _state_slices)
    if step is None:
        return None
    (fwd_dtype, bwd_dtype), out_dtype, state_slices, backward_step = step
    norm = (inp, norm_weight, norm_bias, layer.normalization, layer.eps,
            layer.zero_centered_gamma, weight, bias)
    if state_slices is None:
        return _norm_current_step(*norm, fwd_dtype, bwd_dtype, out_dtype)
    return _norm_delayed_step(*norm, *state_slices, fwd_dtype, bwd_dtype, out_dtype,
                              backward_step)


def fused_norm_mlp_step(layer, inp: torch.Tensor, state, is_first_microbatch
                        ) -> Optional[torch.Tensor]:
    """LayerNormMLP's FP8 output through fp8_norm_mlp_delayed or _current, or None where the
    Python path must run (as fused_norm_linear_step)."""
    if not NORM_MLP_ENABLED or layer.return_layernorm_output \
            or layer.activation not in KERNEL_ACTIVATIONS:  # (clamped_swiglu: torch ops)
        return None
    delayed = _runs_fused(layer, state, is_first_microbatch)
    if delayed is None:
        return None
    norm_weight, norm_bias = layer.layer_norm_weight, layer.layer_norm_bias
    params = (layer._param("fc1_weight"), layer._param("fc1_bias"), layer._param("fc2_weight"),
              layer._fc2_gemm_bias())
    step = _prepare(layer, inp, state, delayed, (*params, norm_weight, norm_bias),
                    _mlp_state_slices)
    if step is None:
        return None
    (fwd_dtype, bwd_dtype), out_dtype, slots, backward_step = step
    fc1_weight, fc1_bias, fc2_weight, fc2_bias = params
    return _norm_mlp_step(inp, norm_weight, norm_bias, layer.normalization, layer.eps,
                          layer.zero_centered_gamma, fc1_weight, fc1_bias, fc2_weight, fc2_bias,
                          layer.activation, () if slots is None else slots, fwd_dtype,
                          bwd_dtype, out_dtype, backward_step)


def _runs_fused(layer, state, is_first_microbatch) -> Optional[bool]:
    """Whether a C++ step can run the layer's forward under this state's recipe, from what
    is known before its tensors are gathered: True (delayed scaling), False (current scaling
    in one process) or None (the Python path)."""
    if (is_first_microbatch is not None or layer._fp8_override is not None
            or _is_compiling()):
        return None
    observer = _fp8_hooks.observer  # debug statistics: the Python path casts observed layers
    if observer is not None and observer.observes(layer):
        return None
    recipe = state.recipe
    quantizers = _REGISTERED.get(type(recipe), _REGISTERED)  # (registered_quantizers, inline)
    if quantizers is _REGISTERED:
        quantizers = registered_quantizers(recipe)
    if quantizers is _delayed_quantizers:
        return True
    if (quantizers is _current_quantizers and recipe.fp8_format is not Format.E5M2
            and not recipe.use_power_2_scales  # (power-of-two scales: the Python path; so
            and recipe.backward_override is None  # do high-precision backward GEMMs, and
            and fast_accum_of(recipe) is DEFAULT_FAST_ACCUM):  # other MMParams)
        return False  # (each rank's own amax; a tensor-parallel layer's DTensors take Python)
    return None  # (E5M2: the Python path raises the error that names it)


def _prepare(layer, inp, state, delayed: bool, params, slices_of) -> Optional[tuple]:
    """What a C++ step needs, or None where the Python path must run: ((forward, backward FP8
    dtype), output dtype, delayed scaling's state slices (``slices_of(layer, fmt)``) or None
    for current scaling, the backward step or None). ``params``: the tensors the step takes
    besides the input (weights, biases, norm parameters; None for an absent one); a tensor
    subclass among them (a DTensor, an FP8 weight) takes the Python path. Does the bookkeeping
    of the forward: the weights kept by is_first_microbatch dropped; under delayed scaling, the
    recipe adopted, the states registered with the step and the replay record kept under
    torch.utils.checkpoint."""
    recipe = state.recipe
    if type(inp) not in _PLAIN_TENSORS:
        return None  # (a tensor subclass: its __torch_function__ sees the Python path)
    for param in params:
        if param is not None and type(param) not in _PLAIN_TENSORS:
            return None
    weight_cache = layer._weight_cache
    for gemm, kept in enumerate(weight_cache):
        if kept is not None:
            # As base.py's _weight_for_step: a call without is_first_microbatch drops the
            # weight kept by an earlier True, so that a later False cannot reuse a stale one.
            weight_cache[gemm] = None
    # Under torch.utils.checkpoint (the recomputation never gets here: _dispatch replays it)
    # the forward keeps a replay record: made here for delayed scaling, by the Python path for
    # current scaling (its scales exist only inside the operator).
    regions = checkpoint_stack.regions_to_keep()
    if regions and not delayed:
        return None
    fmt = recipe.fp8_format
    # (output_dtype(inp), its common case inline)
    out_dtype = output_dtype(inp) if _is_any_autocast_enabled() else inp.dtype
    if not delayed:
        return _FORMAT_DTYPES[fmt], out_dtype, None, None
    if fmt is Format.E5M2:
        return None  # (the Python path raises the error that names it)
    # What roles.py's delayed scaling does for a forward, without quantizer objects: the
    # history length matched to the recipe, the state slices, the states registered with the
    # step (for the update at the context's exit and at the end of the backward pass).
    state_slices = _delayed_state(layer, recipe, slices_of)
    backward_step = _autocast.record_forward(state, *layer._scaling_states)
    if regions:
        _keep_replay_record(layer, fmt, backward_step, out_dtype, regions)
    return _FORMAT_DTYPES[fmt], out_dtype, state_slices, backward_step


def _keep_replay_record(layer, fmt, backward_step, out_dtype, regions):
    """What the recomputation of this checkpointed forward replays (base.py's _replay),
    made by Fp8Plan.for_replay as on the Python path, one plan per GEMM: the scales this
    forward casts with and their scale_invs, 1 / scale as the operator takes them (the update at
    the context's exit changes both before the recomputation runs)."""
    scale_inv = layer._scaling_states[0].scale.reciprocal()  # [input, weight] per GEMM
    plans = []
    for gemm, (input_q, weight_q, grad_q) in enumerate(delayed_quantizers(layer, fmt)):
        plan = Fp8Plan(input_q, weight_q, grad_q, None, backward_step, out_dtype)
        plan.used = (Quantized(None, None, scale_inv[2 * gemm:2 * gemm + 1], None,
                               input_q.scale),
                     Quantized(None, None, scale_inv[2 * gemm + 1:2 * gemm + 2], None,
                               weight_q.scale))
        plans.append(plan.for_replay())
    layer._replay_records.keep(regions, tuple(plans))


def _delayed_state(layer, recipe, slices_of):
    """The layer's delayed-scaling state slices (``slices_of(layer, fmt)``) for ``recipe``,
    adopted first (the history length matched to it: state.py's _adopt_recipe). Made again
    when the recipe, the layer's record of it or a state buffer is another object than when
    they were made, else reused (slicing and adopting on every call would cost more host
    time than the C++ step saves)."""
    buffers = float_state_buffers(layer._buffers)
    cached = layer._fused_step_cache
    if (cached is not None and cached[0] is recipe and cached[1] is layer._recipe_code
            and _adopted(layer, recipe) and all(map(operator.is_, cached[2], buffers))):
        return cached[3]
    layer._adopt_recipe(recipe)
    fmt = recipe.fp8_format
    delayed_quantizers(layer, fmt)  # (binds the scaling states to the buffers if need be)
    slices = slices_of(layer, fmt)
    layer._fused_step_cache = (recipe, layer._recipe_code, float_state_buffers(layer._buffers),
                               slices)
    return slices


def _adopted(layer, recipe) -> bool:
    """Whether the layer's adoption of ``recipe`` is complete (state.py's _adopt_recipe): not
    where an evaluation forward under it left the backward scales to be rescaled to its format
    by the next training forward, which must adopt again (the C++ step then cast grad_output
    with scales made for another format: 128x too large from HYBRID to E4M3)."""
    adopted = layer.__dict__.get("_adopted_recipe")
    return adopted is not None and adopted[0] is recipe


def _state_slices(layer, fmt) -> tuple:
    """The delayed-scaling state of the layer's one GEMM as fp8_linear_delayed takes it: the
    input's and the weight's amax slot (history row 0) and scale, their scale_invs, and
    grad_output's amax slot, scale and scale_inv; views of its state buffers."""
    fwd, bwd = layer._scaling_states
    fwd_row = fwd.history[0]
    return (fwd_row[0:1], fwd_row[1:2], fwd.scale[0:1], fwd.scale[1:2], fwd.scale_inv,
            bwd.history[0], bwd.scale, bwd.scale_inv)


def _mlp_state_slices(layer, fmt) -> list:
    """LayerNormMLP's delayed-scaling state as fp8_norm_mlp_delayed's Python entry takes it
    (csrc/norm_mlp_step.cpp's Slot order): the forward amax slots (history row 0: fc1 input,
    fc1 weight, fc2 input, fc2 weight) and scales, the forward scale_invs [4], then fc1's and
    fc2's grad_output amax slots, scales and scale_invs."""
    fwd, bwd = layer._scaling_states
    fwd_row, bwd_row = fwd.history[0], bwd.history[0]
    return ([fwd_row[i:i + 1] for i in range(4)] + [fwd.scale[i:i + 1] for i in range(4)]
            + [fwd.scale_inv] + [bwd_row[i:i + 1] for i in range(2)]
            + [bwd.scale[i:i + 1] for i in range(2)] + [bwd.scale_inv[i:i + 1] for i in range(2)])
