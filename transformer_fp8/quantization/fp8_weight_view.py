"""Views of an FP8 primary weight (``w[0]``, ``w[:, :4]``, ``w.t()``, ``w.view(-1)``,
``w.chunk(2)``): tensors that read as the dequantised values of that part of the weight and
write through to it, as a view of a plain tensor does.

A view holds no data of its own: the weight it was taken from and the view operations that led
to it (``chain``). Any use of it dequantises the weight and replays the chain. A write into it
(``w[0] = 0``, ``w[:1].zero_()``, ``w.t().mul_(2)``) runs on a view of the whole weight's
dequantised value and then writes that whole value into the weight, which quantises it with the
weight's rule (fp8_weight.WeightCast), as ``w.copy_(value)`` does. Elements outside the view
keep their values where the weight's scale is unchanged (a dequantised FP8 value cast again with
its own scale is exact); a new scale (the layer's delayed weight scale, or the written value's
own under Float8CurrentScaling) re-rounds them, as any write of the whole weight does.
"""
from __future__ import annotations

import torch
from torch.utils import _pytree as pytree


def is_view_op(func) -> bool:
    """Whether ``func`` returns aliases of its first argument without writing it (select,
    slice, t, view, expand, split, ...)."""
    schema = func._schema
    if schema.is_mutable or not schema.returns or not schema.arguments:
        return False
    first = schema.arguments[0].alias_info
    returned = schema.returns[0].alias_info
    return first is not None and returned is not None and not returned.is_write


class Fp8WeightView(torch.Tensor):
    """A view of an Fp8Weight (see the module docstring). ``dtype`` is the weight's nominal
    one."""

    @staticmethod
    def __new__(cls, weight, chain: tuple, like: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(
            cls, like.shape, strides=like.stride(), storage_offset=like.storage_offset(),
            dtype=like.dtype, device=like.device, requires_grad=False)

    def __init__(self, weight, chain: tuple, like: torch.Tensor):
        self._weight = weight  # (an Fp8Weight: its FP8 data is shared by all its aliases)
        self._chain = chain    # ((func, args after the first, kwargs, index or None), ...)

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __repr__(self) -> str:
        return f"Fp8WeightView({self.dequantize()!r})"

    def __reduce_ex__(self, protocol):  # (a pickle holds the values, as a clone would)
        return self.dequantize().__reduce_ex__(protocol)

    @staticmethod
    def replay(base: torch.Tensor, chain: tuple) -> torch.Tensor:
        for func, args, kwargs, index in chain:
            base = func(base, *args, **kwargs)
            if index is not None:
                base = base[index]
        return base

    def dequantize(self) -> torch.Tensor:
        """The values it stands for now, a plain tensor."""
        return self.replay(self._weight.dequantize(), self._chain)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return dispatch(func, args, kwargs or {})


def views_of(weight, func, args, kwargs):
    """``func`` (a view operation) applied to ``weight`` (an Fp8Weight or a view of one): the
    view(s), as Fp8WeightViews."""
    if isinstance(weight, Fp8WeightView):
        base, chain = weight._weight, weight._chain
    else:
        base, chain = weight, ()
    rest = tuple(args[1:])
    like = func(weight.dequantize(), *rest, **kwargs)
    if isinstance(like, torch.Tensor):
        return Fp8WeightView(base, chain + ((func, rest, kwargs, None),), like)
    return type(like)(Fp8WeightView(base, chain + ((func, rest, kwargs, i),), t)
                      for i, t in enumerate(like))


def dispatch(func, args, kwargs):
    """Any operation with an Fp8WeightView among its arguments. A view of it: a view again.
    A write into one or more: run on views of their weights' dequantised values, each weight
    then written whole. Anything else: run on the dequantised values."""
    first = args[0] if args else None
    if isinstance(first, Fp8WeightView) and is_view_op(func):
        return views_of(first, func, args, kwargs)
    written = written_arguments(func, args, kwargs)
    wholes: dict = {}  # id(Fp8Data) -> (weight, its dequantised value, written into)

    def stand_in(t):
        if isinstance(t, Fp8WeightView) and any(t is w for w in written):
            key = id(t._weight._fp8)
            if key not in wholes:
                wholes[key] = (t._weight, t._weight.dequantize())
            return Fp8WeightView.replay(wholes[key][1], t._chain)
        return t.dequantize()

    from .fp8_weight import Fp8Weight
    if any(isinstance(w, Fp8Weight) for w in written):
        raise NotImplementedError(  # (Fp8Weight.__torch_dispatch__ takes these: _mutate)
            f"{func}: a write into an FP8 weight and a view of one at once")
    plain_args, plain_kwargs = pytree.tree_map_only(
        (Fp8WeightView, Fp8Weight), stand_in, (args, kwargs))
    out = func(*plain_args, **plain_kwargs)
    if not written:
        return out
    for weight, whole in wholes.values():
        with torch.no_grad():
            weight._write(whole)
    # (an in-place operation returns its written argument: the view, not the stand-in)
    stand_ins = {id(plain): view for plain, view in zip(pytree.tree_leaves((plain_args,
                                                                            plain_kwargs)),
                                                       pytree.tree_leaves((args, kwargs)))
                 if isinstance(view, Fp8WeightView)}
    return pytree.tree_map_only(torch.Tensor, lambda t: stand_ins.get(id(t), t), out)


def written_arguments(func, args, kwargs) -> list:
    """The tensors among the arguments that ``func``'s schema marks as written."""
    written = []
    for i, argument in enumerate(func._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(argument.name)
        for leaf in pytree.tree_leaves(value):
            if isinstance(leaf, torch.Tensor) and all(leaf is not w for w in written):
                written.append(leaf)
    return written
