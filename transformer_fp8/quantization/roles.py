"""Which quantizer each recipe gives each tensor role, per GEMM of a module: the one place that
knows the recipes apart. Adding a recipe means adding its quantizer (a Quantizer subclass) and a
function here, registered in QUANTIZERS.

A function takes (recipe, module state, autocast state) and returns, per GEMM of the module, the
(input, weight, grad_output) quantizers, and the backward step that updates grad_output scales
(delayed scaling only; else None).
"""
from __future__ import annotations

import operator
from typing import Callable, Optional

import torch

from . import amax_step
from . import autocast as _autocast
from .._dtensor import is_dtensor
from .blockwise import BlockQuantizer, ForwardOnlyBlockQuantizer
from .quantizer import TensorQuantizer
from .recipe import (DelayedScaling, Float8BlockScaling, Float8CurrentScaling,
                     Float8RowwiseScaling, Format)
from .state_layout import FP8_FLOAT_STATE
from .transforms import exporting


def _delayed(recipe: DelayedScaling, fp8_state, autocast_state):
    """The stored scales of the module's state, its amaxes recorded into its histories; the
    forward registers the state for the update at the context's exit."""
    fp8_state._adopt_recipe(recipe)
    compiling = torch.compiler.is_compiling()
    if compiling and exporting():
        # torch.export: the program runs with no fp8_autocast around it (no update, no discard
        # of an evaluation's amaxes) and shares the model's buffers in process, so it writes
        # no FP8 state: the casts read the current scales and record no amax. Nothing noted
        # as compiled either (no step needs to cover what the program never records).
        return delayed_quantizers(fp8_state, recipe.fp8_format, compiling, record=False), None
    quantizers = delayed_quantizers(fp8_state, recipe.fp8_format, compiling)
    if compiling:
        # A traced forward registers nothing (a side effect would be refused inside a
        # checkpointed region): its class noted once as compiled (a graph traced for one
        # instance serves every other instance of the class, with no guard on which), every
        # module of that class is covered by every step of its recipe, and its backward's
        # update runs at the next outermost fp8_autocast.
        amax_step.note_compiled(type(fp8_state))
        return quantizers, None
    backward_step = _autocast.record_forward(autocast_state, *fp8_state._scaling_states)
    return quantizers, backward_step


# The module's six FP8 state buffers, in FP8_FLOAT_STATE's order, from its _buffers.
float_state_buffers = operator.itemgetter(*FP8_FLOAT_STATE)


def delayed_quantizers(fp8_state, fmt: Format, compiling: Optional[bool] = None,
                       record: bool = True) -> list:
    """Per GEMM, the (input, weight, grad_output) quantizers of delayed scaling: views of the
    state's scales, scale_invs and history row 0. Made once and reused while the state buffers
    are the same tensors (slicing them on every forward costs more host time than the cast).
    ``compiling``: torch.compiler.is_compiling(), where the caller has asked already.
    ``record``: False only while compiling (torch.export's trace): casts that record no
    amax."""
    if compiling is None:
        compiling = torch.compiler.is_compiling()
    if compiling:  # (dynamo traces no itemgetter call)
        buffers = tuple(fp8_state._buffers[name] for name in FP8_FLOAT_STATE)
    else:
        buffers = float_state_buffers(fp8_state._buffers)
    fwd_h, fwd_s, fwd_si, bwd_h, bwd_s, bwd_si = buffers

    def make():
        return [(TensorQuantizer.delayed(fmt.fwd_dtype, fwd_h, fwd_s, fwd_si, 2 * gemm, record,
                                         in_forward=True),
                 TensorQuantizer.delayed(fmt.fwd_dtype, fwd_h, fwd_s, fwd_si, 2 * gemm + 1,
                                         record, in_forward=True),
                 TensorQuantizer.delayed(fmt.bwd_dtype, bwd_h, bwd_s, bwd_si, gemm, record))
                for gemm in range(fp8_state._num_gemms)]

    if compiling:
        return make()  # traced once: the slicing is part of the graph
    cached = fp8_state._delayed_cast_cache
    if cached is not None and cached[0] is fmt and all(map(operator.is_, cached[1], buffers)):
        return cached[2]
    fwd, bwd = fp8_state._scaling_states
    bound = (fwd.history, fwd.scale, fwd.scale_inv, bwd.history, bwd.scale, bwd.scale_inv)
    if any(held is not buffer for held, buffer in zip(bound, buffers)):
        # A buffer replaced behind the module's back (module._buffers[name] = t): the update
        # would write the old tensors while the casts read the new ones.
        fp8_state._bind_scaling_states()
    quantizers = make()
    fp8_state._delayed_cast_cache = (fmt, buffers, quantizers)
    return quantizers


def _current(recipe: Float8CurrentScaling, fp8_state, autocast_state):
    """Each tensor's own amax, as Transformer Engine's: each rank casts with the amax of what
    it holds (data parallelism, experts that run on some ranks only). A tensor-parallel
    module's shards are parts of one tensor: their amaxes are all-reduced (MAX) across the
    context's fp8_group, by default the tensor-parallel ranks (the weight's device mesh, or
    Transformer Engine's tp_group; not the whole world, whose data-parallel replicas hold
    other tensors: their amaxes changed each replica's scales, and a cast one replica ran
    alone waited for the others), so every shard is cast as the whole tensor would be."""
    fmt, group = recipe.fp8_format, None
    weight = fp8_state._weight_for_checks()
    if is_dtensor(weight):
        group = autocast_state.group or weight.device_mesh.get_group()
    else:  # Transformer Engine's tp_group (modules/te_tensor_parallel.py), if the layer has one
        te_tp = getattr(fp8_state, "_te_tp", None)
        if te_tp is not None:
            group = autocast_state.group or te_tp.group
    return [tuple(TensorQuantizer.current(dtype, group, recipe.use_power_2_scales)
                  for dtype in (fmt.fwd_dtype, fmt.fwd_dtype, fmt.bwd_dtype))
            for _ in range(fp8_state._num_gemms)], None


def _block_roles(recipe, quantizer=BlockQuantizer) -> tuple:
    """(input, weight, grad_output) block quantizers of a block recipe."""
    fmt, pow2 = recipe.fp8_format, recipe.power_2_scale
    if isinstance(recipe, Float8RowwiseScaling):  # one scale per row of every operand
        dims = ("rowwise",) * 3
    else:
        dims = (recipe.x_block_scaling_dim, recipe.w_block_scaling_dim,
                recipe.grad_block_scaling_dim)
    dtypes = (fmt.fwd_dtype, fmt.fwd_dtype, fmt.bwd_dtype)
    return tuple(quantizer(dim, dtype, pow2) for dim, dtype in zip(dims, dtypes))


# Block quantizers hold no state: made once per recipe (in eager mode; a trace makes its own).
_BLOCK_ROLES: dict = {}


def _block(recipe, fp8_state, autocast_state):
    """Scales per block, each role with the recipe's block dimension."""
    if torch.compiler.is_compiling():
        # torch.export of a forward without gradients: no backward, so no transposes (see
        # ForwardOnlyBlockQuantizer: they kept a dynamic batch from exporting).
        forward_only = exporting() and not torch.is_grad_enabled()
        roles = _block_roles(recipe, ForwardOnlyBlockQuantizer if forward_only
                             else BlockQuantizer)
    else:
        roles = _BLOCK_ROLES.get(recipe)
        if roles is None:
            roles = _BLOCK_ROLES.setdefault(recipe, _block_roles(recipe))
    return [roles] * fp8_state._num_gemms, None


# registered_quantizers' answers by recipe type: asked at every forward, forgotten at every
# change of QUANTIZERS.
_REGISTERED: dict = {}


class _Registry(dict):
    """QUANTIZERS: a dict whose every change (an entry added, replaced or removed) forgets
    registered_quantizers' answers."""


def _forgetting(method_name: str):
    method = getattr(dict, method_name)

    def changed(self, *args, **kwargs):
        result = method(self, *args, **kwargs)
        _REGISTERED.clear()
        return result
    changed.__name__ = method_name
    return changed


for _name in ("__setitem__", "__delitem__", "__ior__", "clear", "pop", "popitem",
              "setdefault", "update"):
    setattr(_Registry, _name, _forgetting(_name))


QUANTIZERS: dict[type, Callable] = _Registry({
    DelayedScaling: _delayed,
    Float8CurrentScaling: _current,
    Float8BlockScaling: _block,
    Float8RowwiseScaling: _block,
})


def registered_quantizers(recipe) -> Optional[Callable]:
    """The function registered for the recipe's type (a subclass without one of its own gets
    its base's), or None."""
    key = type(recipe)
    found = _REGISTERED.get(key, _REGISTERED)  # (_REGISTERED itself: not looked up yet)
    if found is not _REGISTERED:
        return found
    found = next((QUANTIZERS[kind] for kind in type(recipe).__mro__ if kind in QUANTIZERS),
                 None)
    _REGISTERED[key] = found
    return found


def quantizers_for_step(recipe, fp8_state, autocast_state):
    """(per GEMM (input, weight, grad_output) quantizers, backward step or None) of a module
    with state ``fp8_state`` running under ``recipe`` in ``autocast_state``."""
    if recipe.fp8_format is Format.E5M2:
        raise ValueError(f"Format.E5M2 cannot train a {type(fp8_state).__name__}: FP8 GEMMs "
                         "take no E5M2 x E5M2 product; use Format.HYBRID or Format.E4M3")
    quantizers = registered_quantizers(recipe)
    if quantizers is None:
        raise TypeError(f"no quantizers for the recipe type {type(recipe).__name__}")
    return quantizers(recipe, fp8_state, autocast_state)

