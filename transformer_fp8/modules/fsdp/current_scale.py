"""Float8CurrentScaling weight scales for the FP8 all-gather under FSDP2 (fsdp/all_gather.py).

Current scaling casts a weight with the scale of the FULL weight's amax, which no rank holds
alone. At the first FP8 all-gather of a step (one outermost fp8_autocast, autocast.
forward_pass_id) every rank takes the amax of each weight shard that FSDP2 shards over the same
process group, and ONE all_reduce(MAX) of the stacked amaxes over that group gives every rank
each full weight's amax (the max of the shards' maxima is exactly the full weight's). A weight's
scale is then computed from its amax as TensorQuantizer.current computes it, so each shard is
cast exactly as the full weight would be: the gathered FP8 weight equals, bit for bit, the cast
of the full weight. The amaxes are kept for the rest of the step (the later layers' all-gathers
need no collective; the backward's re-gathers repeat the forward's form, fsdp/all_gather.py),
until an optimizer steps or a weight Parameter is written in place: the next gather, whatever
calls it (the root's forward, a method registered with register_fsdp_forward_method, an
explicit unshard), reduces them again. Optimizer steps are counted by one global post-step
hook, for-loop, foreach and fused alike (foreach and fused steps move no version counter of a
DTensor Parameter); other writes through a Parameter (load_state_dict, copy_) by its version
counter. The weights reduced together are those of the FSDP2 tree the gathered weight belongs
to (its root's states), never another model's: a deleted model's state lives on in torch's
registry until a garbage collection, which the ranks run at different times (their
reductions would not match).
"""
from __future__ import annotations

import itertools
from typing import Optional

import torch

from ... import ops
from ..._dtensor import group_ranks
from ...quantization import autocast as _autocast
from ...quantization.amax_step import all_reduce_max


_serials = itertools.count()


class _OptimizerSteps:
    """Counts the steps of every torch.optim optimizer (one global post-step hook, registered
    at the first reduction). Every rank steps alike, so every rank sees the same count."""

    def __init__(self):
        self.count = 0
        self._handle = None

    def watch(self) -> None:
        if self._handle is None:
            from torch.optim.optimizer import register_optimizer_step_post_hook
            self._handle = register_optimizer_step_post_hook(_count_optimizer_step)


_OPTIMIZER_STEPS = _OptimizerSteps()


def _count_optimizer_step(optimizer, args, kwargs) -> None:
    _OPTIMIZER_STEPS.count += 1


class _StepAmaxes:
    """The full weights' amaxes of one reduction (``serial``) between two optimizer steps, in
    one step and one process group. ``params``: each shard's FSDP2 Parameter (a DTensor),
    whose version counter tells a write through it (load_state_dict, copy_), or None."""

    def __init__(self, pass_id: int, ranks: frozenset, shards: list, params: list,
                 amaxes: torch.Tensor):
        self.pass_id, self.ranks, self.serial = pass_id, ranks, next(_serials)
        self.optimizer_steps = _OPTIMIZER_STEPS.count
        self.index = {id(shard): i for i, shard in enumerate(shards)}
        self.shards = shards  # held for the step: the ids above stay theirs
        self.params = params
        self.versions = [None if p is None else p._version for p in params]
        self.amaxes = amaxes

    def amax_of(self, shard: torch.Tensor) -> Optional[torch.Tensor]:
        """The full weight's amax, or None where this reduction did not cover the shard, or an
        optimizer stepped since, or the weight changed since (every rank runs the same steps,
        so every rank reduces again at the same gather)."""
        i = self.index.get(id(shard))
        if (i is None or self.shards[i] is not shard
                or self.optimizer_steps != _OPTIMIZER_STEPS.count):
            return None
        param = self.params[i]
        if param is not None and param._version != self.versions[i]:
            return None
        return self.amaxes[i:i + 1]


_STEPS: dict = {}  # process group ranks -> _StepAmaxes of the latest step


def _mesh_ranks(mesh) -> frozenset:
    """The ranks of an FSDP shard mesh's group (empty for a single rank: nothing to reduce)."""
    return group_ranks(mesh.get_group()) if mesh.size() > 1 else frozenset()


def _fsdp_params(state) -> tuple:
    return tuple(getattr(getattr(state, "_fsdp_param_group", None), "fsdp_params", ()))


def _local(fsdp_param):
    return getattr(fsdp_param.sharded_param, "_local_tensor", None)


def _tree_states(shard: torch.Tensor) -> list:
    """The FSDP2 states of the tree that holds ``shard`` (its root's, in the order the root
    found them: the same on every rank), or [] where no state holds it."""
    from torch.distributed._composable_state import _module_state_mapping
    for state_ref in list(_module_state_mapping.values()):
        state = state_ref()
        if state is not None and any(_local(p) is shard for p in _fsdp_params(state)):
            return list(state._state_ctx.all_states) or [state]
    return []


def _shards_sharded_over(ranks: frozenset, kind: type, shard: torch.Tensor) -> tuple:
    """(shards, their Parameters): every shard of type ``kind`` (ShardedWeight) that
    ``shard``'s FSDP2 tree holds for a group with these ranks, in the tree's order (the same
    on every rank of the group)."""
    shards, params, seen = [], [], set()
    for state in _tree_states(shard):
        for fsdp_param in _fsdp_params(state):
            local = _local(fsdp_param)
            if (not isinstance(local, kind) or id(local) in seen
                    or _mesh_ranks(fsdp_param.shard_mesh_from_root) != ranks):
                continue
            seen.add(id(local))
            shards.append(local)
            params.append(fsdp_param.sharded_param)
    return shards, params


def _reduce_step_amaxes(ranks: frozenset, group, shard: torch.Tensor) -> _StepAmaxes:
    """The local amax of every weight shard of the group, one all_reduce(MAX) of them all."""
    _OPTIMIZER_STEPS.watch()
    shards, params = _shards_sharded_over(ranks, type(shard), shard)
    if not any(s is shard for s in shards):
        shards.append(shard)  # not found in FSDP2's state: still reduced with the others
        params.append(None)
    local = torch.stack([ops.amax(s._data).reshape(()) for s in shards])
    if group is not None:  # (None: a single-rank FSDP group, nothing to agree on)
        all_reduce_max(local, group)
    return _StepAmaxes(_autocast.forward_pass_id(), ranks, shards, params, local)


def current_weight_scale(shard: torch.Tensor, mesh, fp8_dtype: torch.dtype,
                         gather_dtype: torch.dtype) -> tuple:
    """(scale, serial): the current-scaling scale (1 element, float32) of the full weight
    ``shard`` belongs to, gathered in ``gather_dtype`` (FSDP2's param_dtype, or the shard's
    own): the same on every rank of ``mesh`` and equal to TensorQuantizer.current's for that
    weight in that dtype; and the serial of the reduction it came from (scales of one serial
    are of the same weights). The first call of a step reduces the amaxes of all weights of
    the group at once."""
    group = mesh.get_group() if mesh.size() > 1 else None
    ranks = _mesh_ranks(mesh)
    step = _STEPS.get(ranks)
    amax = None
    if step is not None and step.pass_id == _autocast.forward_pass_id():
        amax = step.amax_of(shard)
    if amax is None:  # a new step (or a weight the step's reduction did not cover)
        step = _STEPS[ranks] = _reduce_step_amaxes(ranks, group, shard)
        amax = step.amax_of(shard)
    if gather_dtype != amax.dtype:
        # Rounding is monotonic and symmetric: the amax of the rounded weight is the rounded
        # amax, so the scale is that of the weight in gather_dtype.
        amax = amax.to(gather_dtype).float()
    return ops.compute_scale_from_amax(amax, torch.finfo(fp8_dtype).max), step.serial

