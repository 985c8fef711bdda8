"""Turning the FP8 weight all-gather under FSDP2 on: ``enable_fp8_all_gather(model)`` makes the
GEMM weights of the model's FP8 modules ShardedWeights (fsdp/weight.py), whose all-gathers
fsdp/all_gather.py runs; their state_dict holds the plain high-precision weights.
"""
from __future__ import annotations

import warnings

import torch

from ..base import Fp8StateMixin
from .weight import ShardedWeight


def _plain_weights_in_state_dict(module, state_dict, prefix, local_metadata) -> None:
    """state_dict hook: the weights as plain high-precision tensors (a DTensor of the plain
    shard under FSDP2), sharing their storage, so checkpoints hold no tensor subclass and a
    load (torch.distributed.checkpoint loads in place) writes into the weights."""
    for name, param in module._parameters.items():
        key = prefix + name
        value = state_dict.get(key)
        if value is None or not isinstance(param, ShardedWeight) and not _is_sharded_dtensor(
                value):
            continue
        state_dict[key] = _plain(value)


def _is_sharded_dtensor(value) -> bool:
    return isinstance(getattr(value, "_local_tensor", None), ShardedWeight)


def _plain(value: torch.Tensor) -> torch.Tensor:
    if isinstance(value, ShardedWeight):
        return value._data
    if _is_sharded_dtensor(value):
        from torch.distributed.tensor import DTensor
        return DTensor.from_local(value._local_tensor._data, value.device_mesh,
                                  value.placements, run_check=False, shape=value.shape,
                                  stride=value.stride())
    return value


def _weight_parameter_names(module) -> list:
    """(GEMM index, Parameter name) of each GEMM weight of an FP8 module that is a Parameter of
    its own (not split into parts, not stored transposed)."""
    names = []
    for gemm, weight in enumerate(module.fp8_weights()):
        for name, param in module._parameters.items():
            if param is weight:
                names.append((gemm, name))
    return names


def check_fp8_all_gather(owner: str, fp8_all_gather, **options) -> None:
    """A module's fp8_all_gather argument: a bool, and not with the options (name -> value)
    that keep its weight from being gathered in FP8."""
    if not isinstance(fp8_all_gather, bool):
        raise TypeError(f"{owner}: fp8_all_gather must be True or False, got {fp8_all_gather!r}")
    if fp8_all_gather:
        given = [name for name, value in options.items() if value]
        if given:
            raise ValueError(f"{owner}: fp8_all_gather=True cannot be combined with {given} "
                             "(the weight must be one Parameter, with no gradient routing)")


def held_outside_fp8_modules(model: torch.nn.Module) -> dict:
    """{id(parameter): the qualified name of a module that is not an FP8 module and holds it}
    over ``model``: weights tied to an embedding, which must not become ShardedWeights (FSDP2
    may take the embedding as their owner, and it would get the FP8 gather)."""
    return {id(p): q or type(m).__name__ for q, m in model.named_modules()
            if not isinstance(m, Fp8StateMixin) for p in m._parameters.values()
            if p is not None}


def enable_fp8_all_gather(model: torch.nn.Module) -> list:
    """Make the GEMM weights of every FP8 module in ``model`` all-gather in FP8 under FSDP2
    (see the module docstring). Call it before ``fully_shard`` and before building the
    optimizer: each weight Parameter becomes a ShardedWeight (the same object where
    torch.utils.swap_tensors can change it in place). Returns the qualified names of the
    weights changed; the FP8 modules whose weights cannot be (parameters_split, a weight stored
    transposed, fuse_wgrad_accumulation or delay_wgrad_compute) are named in an error. A weight
    that a module of ``model`` that is not an FP8 one holds too (an lm_head tied to the
    embedding) is left a plain Parameter, gathered in high precision, with a warning."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"enable_fp8_all_gather: model must be a torch.nn.Module, got "
                        f"{type(model).__name__}")
    modules = [(q, m) for q, m in model.named_modules() if isinstance(m, Fp8StateMixin)]
    refused = [q or type(m).__name__ for q, m in modules
               if len(_weight_parameter_names(m)) != len(m.fp8_weights())
               or getattr(m, "_wgrad", None) is not None]
    if refused:  # checked before anything changes
        raise ValueError(
            "fp8_all_gather: the weights of these FP8 modules cannot be all-gathered in FP8 "
            "(parameters_split, a weight stored transposed such as Conv1D's, "
            f"fuse_wgrad_accumulation or delay_wgrad_compute): {refused}")
    for qualified, module in modules:
        for gemm, name in _weight_parameter_names(module):
            param = module._parameters[name]
            if type(param) is not torch.nn.Parameter and not isinstance(param, ShardedWeight):
                raise TypeError(f"enable_fp8_all_gather: {qualified}.{name} is a "
                                f"{type(param).__name__}; call it before fully_shard")
    # A weight that a module other than an FP8 one holds too (an lm_head tied to the
    # embedding) stays a plain Parameter: gathered in high precision, for both of them.
    shared = held_outside_fp8_modules(model)
    tied = []
    changed = []
    for qualified, module in modules:
        for gemm, name in _weight_parameter_names(module):
            param = module._parameters[name]
            if isinstance(param, ShardedWeight):
                continue
            if id(param) in shared:
                tied.append(f"{qualified}.{name} (also {shared[id(param)]}'s)")
                continue
            new = torch.nn.Parameter(ShardedWeight(param.data, gemm),
                                     requires_grad=param.requires_grad)
            try:
                torch.utils.swap_tensors(param, new)
            except RuntimeError:
                module._parameters[name] = new
            changed.append(f"{qualified}.{name}" if qualified else name)
        if not getattr(module, "_fp8_all_gather_hook", False):
            module._register_state_dict_hook(_plain_weights_in_state_dict)
            module._fp8_all_gather_hook = True
    if tied:
        warnings.warn("fp8_all_gather: weights tied to a module that is not an FP8 module are "
                      f"all-gathered in high precision: {tied}", stacklevel=2)
    return changed
