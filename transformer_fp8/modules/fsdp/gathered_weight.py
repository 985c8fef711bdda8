"""The full weight as FSDP2 all-gathered it in FP8 (fsdp/all_gather.py): ``GatheredFp8Weight``
holds the FP8 data and the scale it was cast with. The module's GEMMs take it as their weight
operand as it is (``fp8_operand``); any other use sees its dequantised value.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.utils import _pytree as pytree

from ... import ops
from ...ops.blockwise import BLOCK, scale_shape_and_strides
from ...quantization.autocast import forward_pass_id
from ...quantization.quantizer import Quantized, TensorQuantizer

aten = torch.ops.aten


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


def _reads_high_precision_only(func, args, kwargs) -> bool:
    """Whether an operator that writes into some argument (an FP8 cast recording an amax)
    only reads the gathered weights it is given, each with its high-precision value (a
    checkpoint's replay: high_precision.replay_operands). Anything else is refused: a write
    into the weight, and a cast of the dequantised FP8 weight (a second rounding)."""
    for i, argument in enumerate(func._schema.arguments):
        value = args[i] if i < len(args) else kwargs.get(argument.name)
        if isinstance(value, GatheredFp8Weight) and (
                value._full_high_precision is None
                or (argument.alias_info is not None and argument.alias_info.is_write)):
            return False
    return True


class GatheredFp8Weight(torch.Tensor):
    """The full weight as FSDP2 gathered it in FP8: ``data`` [out, in] (an FP8 dtype, a view of
    the all-gather buffer) and either one ``scale`` per tensor (``scale_inv`` its inverse) or,
    with ``block`` (the weight's BlockQuantizer, 128x128 blocks), no scale and the blocks'
    ``scale_inv`` [ceil(out/128), ceil(in/128)]; ``dtype`` is the weight's high-precision dtype
    (its gradient's)."""

    @staticmethod
    def __new__(cls, data, scale, scale_inv, dtype, requires_grad: bool = False, block=None,
                power_2: bool = False):
        return _wrapper(cls, data, dtype, requires_grad)

    def __init__(self, data, scale, scale_inv, dtype, requires_grad: bool = False, block=None,
                 power_2: bool = False):
        self._fp8, self._scale, self._scale_inv = data, scale, scale_inv
        self._block = block
        self._power_2 = power_2  # (its scale a power of two: use_power_2_scales)
        # Set by all_gather.gathered_weight: the forward pass whose delayed scale it was
        # cast with (None: not a delayed cast), what it was gathered from (_source) and the
        # function that gathers it again from there (all_gather.gather_again).
        self._delayed_pass = None
        self._source = self._gather_again = None
        # The full high-precision weight, while its module computes in high precision with it
        # (high_precision.py): what dequantize() gives then.
        self._full_high_precision = None

    __torch_function__ = torch._C._disabled_torch_function_impl
    # Its data is FSDP2's all-gather buffer, freed after the forward: a backward that needs
    # the weight's value keeps it now (quantization/backward_override.py).
    gathered_for_forward_only = True

    def __repr__(self) -> str:
        how = f"block={self._block}" if self._block is not None else f"scale={self._scale.item()}"
        return f"GatheredFp8Weight(shape={tuple(self.shape)}, fp8_dtype={self._fp8.dtype}, {how})"

    def _again(self) -> "GatheredFp8Weight":
        again = type(self)(self._fp8, self._scale, self._scale_inv, self.dtype, block=self._block,
                           power_2=self._power_2)
        again._delayed_pass, again._source = self._delayed_pass, self._source
        again._gather_again = self._gather_again
        again._full_high_precision = self._full_high_precision
        return again

    def _refill(self, data, scale, scale_inv, block=None, power_2: bool = False) -> None:
        """Point at this step's gathered data and scale(s) (FSDP2 keeps the Parameter object)."""
        self._fp8, self._scale, self._scale_inv, self._block = data, scale, scale_inv, block
        self._power_2 = power_2

    @property
    def fp8_cache_key(self) -> tuple:
        """The cache_key of the weight quantizers whose operand this is (Fp8Plan.quantize_weight
        takes it only for those)."""
        if self._block is not None:
            return self._block.cache_key
        return ("tensor", "power_2") if self._power_2 else TensorQuantizer.cache_key

    def fp8_operand(self, fp8_dtype: torch.dtype, with_transpose: bool) -> Optional[Quantized]:
        """The GEMM operand: the gathered data, and its transpose (for dgrad) made from it,
        which under one scale per tensor, and under 128x128 blocks with the transposed block
        scales, is bit for bit the cast of the transposed weight. None if it was gathered in
        another FP8 dtype than the GEMM asks for, or while it has its high-precision value
        (high_precision.replay_operands)."""
        if fp8_dtype != self._fp8.dtype or self._full_high_precision is not None:
            return None  # (with its high-precision value: the quantizer casts that one)
        if (self._delayed_pass is not None and self._delayed_pass != forward_pass_id()
                and torch._C._current_graph_task_id() == -1):
            # Cast with an earlier pass's delayed scale, its amax not recorded in this pass.
            # (Not in backward, a checkpoint's recomputation: FSDP2 gathered it in the
            # forward's form for it, and autograd's threads see no forward pass id.)
            self._gather_again(self)
        data_t = self._fp8.t().contiguous() if with_transpose else None
        if self._block is None:
            return Quantized(self._fp8, data_t, self._scale_inv, self._scale_inv, self._scale)
        scale_inv_t = block_scales_laid_out(self._scale_inv.t()) if with_transpose else None
        return Quantized(self._fp8, data_t, self._scale_inv, scale_inv_t, None)

    def dequantize(self) -> torch.Tensor:
        if self._full_high_precision is not None:
            return self._full_high_precision
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
        if func._schema.is_mutable and not _reads_high_precision_only(func, args, kwargs):
            raise RuntimeError(f"{func}: a weight all-gathered in FP8 by FSDP2 is read-only")
        # Any other use (a high-precision computation): the dequantised weight.
        unwrapped_args, unwrapped_kwargs = pytree.tree_map_only(
            cls, lambda t: t.dequantize(), (args, kwargs))
        return func(*unwrapped_args, **unwrapped_kwargs)
