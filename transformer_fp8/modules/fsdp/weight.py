"""The high-precision GEMM weight that FSDP2 (``fully_shard``) all-gathers in FP8 where it can.

``ShardedWeight`` wraps a GEMM's high-precision weight. FSDP2 shards it as it shards any
Parameter (every operation runs on the wrapped tensor; the layout-keeping ones return the wrapper
again, so each rank's shard is a ShardedWeight) and, because it defines
``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``, asks it what to all-gather and how to
rebuild the full weight from what arrived (fsdp/all_gather.py decides: the shard cast to FP8,
1 byte per element, or the high-precision shard; fsdp/gathered_weight.py holds what an FP8
all-gather rebuilds). enable_fp8_all_gather (fsdp/enable.py) makes the weights ShardedWeights.
"""
from __future__ import annotations

import torch
from torch.utils import _pytree as pytree

from .all_gather import all_gather_inputs, gathered_weight
from .gathered_weight import _wrapper

aten = torch.ops.aten

# Operations whose result is the weight again (a view, a copy, a new tensor like it): it stays a
# ShardedWeight, so that FSDP2's sharding (split, new_zeros, narrow, view) keeps the type.
_KEEPS_TYPE = {
    aten.detach.default, aten.alias.default, aten.view.default, aten._unsafe_view.default,
    aten.as_strided.default, aten.slice.Tensor, aten.split.Tensor,
    aten.split_with_sizes.default, aten.new_zeros.default, aten.new_empty.default,
    aten.new_empty_strided.default, aten.empty_like.default,
    aten.clone.default, aten._to_copy.default, aten._pin_memory.default,
}



class ShardedWeight(torch.Tensor):
    """A high-precision GEMM weight (``data``) that FSDP2 all-gathers in FP8 where it can.
    ``gemm``: the module's GEMM it is the weight of (its column in the FP8 state)."""

    @staticmethod
    def __new__(cls, data: torch.Tensor, gemm: int = 0):
        return _wrapper(cls, data, data.dtype, data.requires_grad)

    def __init__(self, data: torch.Tensor, gemm: int = 0):
        self._data = data
        self._gemm = gemm
        # The last forward's all-gather (all_gather.GatherForm), repeated by the
        # backward's, and the layout of the last all-gather (FSDP2 keeps its buffers).
        self._forward_form = None
        self._forward_pass = None  # the forward pass of that form's delayed cast, if any
        self._last_layout = None

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __repr__(self) -> str:
        return f"ShardedWeight(gemm={self._gemm}, {self._data!r})"

    def __tensor_flatten__(self):
        return ["_data"], (self._gemm,)

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return ShardedWeight(inner["_data"], *meta)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        gemm = next(t._gemm for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, cls))
        unwrapped_args, unwrapped_kwargs = pytree.tree_map_only(
            cls, lambda t: t._data, (args, kwargs))
        out = func(*unwrapped_args, **unwrapped_kwargs)
        if isinstance(args[0], cls) and out is unwrapped_args[0]:
            return args[0]  # an in-place operation (the optimizer's update, a load)
        if func in _KEEPS_TYPE:
            return pytree.tree_map_only(torch.Tensor, lambda t: cls(t, gemm), out)
        return out

    # ---- FSDP2's all-gather extension (torch.distributed.fsdp.fully_shard) ------------------

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        return all_gather_inputs(self, mesh, outer_size, module, mp_policy)

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        return gathered_weight(all_gather_outputs, metadata, param_dtype, out)
