"""The two tensor types of the FP8 weight all-gather under FSDP2 (``fully_shard``).

``ShardedWeight`` wraps a GEMM's high-precision weight. FSDP2 shards it as it shards any
Parameter (every operation runs on the wrapped tensor; the layout-keeping ones return the wrapper
again, so each rank's shard is a ShardedWeight) and, because it defines
``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``, asks it what to all-gather and how to
rebuild the full weight from what arrived (fsdp_all_gather.py decides: the shard cast to FP8,
1 byte per element, or the high-precision shard).

``GatheredFp8Weight`` is the full weight as gathered in FP8: the FP8 data and the scale it was
cast with. The module's GEMMs take it as their weight operand as it is (``fp8_operand``);
any other use sees its dequantised value.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.utils import _pytree as pytree

from .. import ops
from ..ops.blockwise import BLOCK, scale_shape_and_strides
from ..quantization.autocast import forward_pass_id
from ..quantization.quantizer import Quantized, TensorQuantizer

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


def _wrapper(cls, like: torch.Tensor, dtype: torch.dtype, requires_grad: bool):
    return torch.Tensor._make_wrapper_subclass(
        cls, like.shape, strides=like.stride(), storage_offset=like.storage_offset(),
        dtype=dtype, layout=like.layout, device=like.device, requires_grad=requires_grad)


def block_scales_laid_out(values: torch.Tensor) -> torch.Tensor:
    """128x128 block scale_invs [row blocks, column blocks] in the layout quantize_blockwise
    gives them (rows padded to 4 elements; ops/blockwise.py)."""
    shape, strides = scale_shape_and_strides("128x128", values.shape[0] * BLOCK,
                                             values.shape[1] * BLOCK)
    storage = values.new_zeros(shape[0] * strides[0])  # the padding is zero, as the op's
    return storage.as_strided(shape, strides).copy_(values)


class ShardedWeight(torch.Tensor):
    """A high-precision GEMM weight (``data``) that FSDP2 all-gathers in FP8 where it can.
    ``gemm``: the module's GEMM it is the weight of (its column in the FP8 state)."""

    @staticmethod
    def __new__(cls, data: torch.Tensor, gemm: int = 0):
        return _wrapper(cls, data, data.dtype, data.requires_grad)

    def __init__(self, data: torch.Tensor, gemm: int = 0):
        self._data = data
        self._gemm = gemm
        # The last forward's all-gather (fsdp_all_gather.GatherForm), repeated by the
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
        from .fsdp_all_gather import all_gather_inputs
        return all_gather_inputs(self, mesh, outer_size, module, mp_policy)

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        from .fsdp_all_gather import gathered_weight
        return gathered_weight(all_gather_outputs, metadata, param_dtype, out)


class GatheredFp8Weight(torch.Tensor):
    """The full weight as FSDP2 gathered it in FP8: ``data`` [out, in] (an FP8 dtype, a view of
    the all-gather buffer) and either one ``scale`` per tensor (``scale_inv`` its inverse) or,
    with ``block`` (the weight's BlockQuantizer, 128x128 blocks), no scale and the blocks'
    ``scale_inv`` [ceil(out/128), ceil(in/128)]; ``dtype`` is the weight's high-precision dtype
    (its gradient's)."""

    @staticmethod
    def __new__(cls, data, scale, scale_inv, dtype, requires_grad: bool = False, block=None):
        return _wrapper(cls, data, dtype, requires_grad)

    def __init__(self, data, scale, scale_inv, dtype, requires_grad: bool = False, block=None):
        self._fp8, self._scale, self._scale_inv = data, scale, scale_inv
        self._block = block
        # Set by fsdp_all_gather.gathered_weight: the forward pass whose delayed scale it was
        # cast with (None: not a delayed cast), and how to gather it again (gather_again).
        self._delayed_pass = None
        self._source = None

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __repr__(self) -> str:
        how = f"block={self._block}" if self._block is not None else f"scale={self._scale.item()}"
        return f"GatheredFp8Weight(shape={tuple(self.shape)}, fp8_dtype={self._fp8.dtype}, {how})"

    def _again(self) -> "GatheredFp8Weight":
        again = type(self)(self._fp8, self._scale, self._scale_inv, self.dtype, block=self._block)
        again._delayed_pass, again._source = self._delayed_pass, self._source
        return again

    def _refill(self, data, scale, scale_inv, block=None) -> None:
        """Point at this step's gathered data and scale(s) (FSDP2 keeps the Parameter object)."""
        self._fp8, self._scale, self._scale_inv, self._block = data, scale, scale_inv, block

    @property
    def fp8_cache_key(self) -> tuple:
        """The cache_key of the weight quantizers whose operand this is (Fp8Plan.quantize_weight
        takes it only for those)."""
        return self._block.cache_key if self._block is not None else TensorQuantizer.cache_key

    def fp8_operand(self, fp8_dtype: torch.dtype, with_transpose: bool) -> Optional[Quantized]:
        """The GEMM operand: the gathered data, and its transpose (for dgrad) made from it,
        which under one scale per tensor, and under 128x128 blocks with the transposed block
        scales, is bit for bit the cast of the transposed weight. None if it was gathered in
        another FP8 dtype than the GEMM asks for."""
        if fp8_dtype != self._fp8.dtype:
            return None
        if (self._delayed_pass is not None and self._delayed_pass != forward_pass_id()
                and torch._C._current_graph_task_id() == -1):
            # Cast with an earlier pass's delayed scale, its amax not recorded in this pass.
            # (Not in backward, a checkpoint's recomputation: FSDP2 gathered it in the
            # forward's form for it, and autograd's threads see no forward pass id.)
            from .fsdp_all_gather import gather_again
            gather_again(self)
        data_t = self._fp8.t().contiguous() if with_transpose else None
        if self._block is None:
            return Quantized(self._fp8, data_t, self._scale_inv, self._scale_inv, self._scale)
        scale_inv_t = block_scales_laid_out(self._scale_inv.t()) if with_transpose else None
        return Quantized(self._fp8, data_t, self._scale_inv, scale_inv_t, None)

    def dequantize(self) -> torch.Tensor:
        if self._block is None:
            return ops.cast_from_fp8(self._fp8, self._scale_inv, self.dtype)
        rows, cols = self._fp8.shape
        factor = self._scale_inv.repeat_interleave(BLOCK, 0)[:rows].repeat_interleave(BLOCK, 1)
        return (self._fp8.float() * factor[:, :cols]).to(self.dtype)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        this = args[0] if args and isinstance(args[0], cls) else None
        if this is not None and func in (aten.detach.default, aten.alias.default):
            return this._again()
        if (this is not None and func in (aten.as_strided.default, aten.view.default)
                and tuple(args[1]) == tuple(this.shape)
                and (func is aten.view.default or tuple(args[2]) == this.stride())):
            return this._again()
        if func._schema.is_mutable:
            raise RuntimeError(f"{func}: a weight all-gathered in FP8 by FSDP2 is read-only")
        # Any other use (a high-precision computation): the dequantised weight.
        unwrapped_args, unwrapped_kwargs = pytree.tree_map_only(
            cls, lambda t: t.dequantize(), (args, kwargs))
        return func(*unwrapped_args, **unwrapped_kwargs)
