"""Views of an FP8 primary weight (``w[0]``, ``w[:, :4]``, ``w.t()``, ``w.view(-1)``,
``w.chunk(2)``): tensors that read as the dequantised values of that part of the weight and
write through to it, as a view of a plain tensor does.

A view holds no data of its own: the weight it was taken from and the view operations that led
to it (``chain``). Any use of it dequantises the weight and replays the chain. Views are made
only where a write through one could happen: with gradients on, a view of a weight that
requires them cannot be written (autograd refuses an in-place write into a view of a leaf), so
there, and inside torch.compile, a view is the dequantised copy it always was (the forward's
``w.t()`` costs one dequantisation and compiles into one graph). A write into it
(``w[0] = 0``, ``w[:1].zero_()``, ``w.t().mul_(2)``) runs on a view of the whole weight's
dequantised value and then writes that whole value into the weight, which quantises it with the
weight's rule (fp8_weight.WeightCast), as ``w.copy_(value)`` does. Elements outside the view
keep their values where the weight's scale is unchanged (a dequantised FP8 value cast again with
its own scale is exact); a new scale (the layer's delayed weight scale, or the written value's
own under Float8CurrentScaling) re-rounds them, as any write of the whole weight does.
"""
from __future__ import annotations

import weakref

import torch
from torch.utils import _pytree as pytree

aten = torch.ops.aten
# In-place operations that change a tensor's own shape or strides rather than its values.
_RESHAPING_IN_PLACE = {aten.t_, aten.transpose_, aten.squeeze_, aten.unsqueeze_, aten.resize_,
                       aten.as_strided_, aten.swapdims_, aten.swapaxes_, aten.detach_}


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
    def __new__(cls, weight, chain: tuple, like: torch.Tensor):  # (like: on "meta")
        return torch.Tensor._make_wrapper_subclass(
            cls, like.shape, strides=like.stride(), storage_offset=like.storage_offset(),
            dtype=like.dtype, device=weight.device, requires_grad=False)

    def __init__(self, weight, chain: tuple, like: torch.Tensor):
        self._weight = weight  # (an Fp8Weight: its FP8 data is shared by all its aliases)
        self._chain = chain    # ((func, args after the first, kwargs, index or None), ...)

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __repr__(self) -> str:
        return f"Fp8WeightView({self.dequantize()!r})"

    def __reduce_ex__(self, protocol):  # (a pickle holds the values, as a clone would)
        return self.dequantize().__reduce_ex__(protocol)

    # Host-side reads that torch refuses for tensor subclasses: the values, as a plain tensor's.
    def __deepcopy__(self, memo):
        return self.dequantize()

    def __format__(self, spec):
        return self.dequantize().__format__(spec)

    def tolist(self):
        return self.dequantize().tolist()

    def numpy(self, *, force: bool = False):
        return self.dequantize().detach().numpy(force=force)

    def __array__(self, dtype=None, copy=None):
        return self.numpy() if dtype is None else self.numpy().astype(dtype)

    @staticmethod
    def replay(base: torch.Tensor, chain: tuple) -> torch.Tensor:
        for func, args, kwargs, index in chain:
            base = func(base, *args, **kwargs)
            if index is not None:
                base = base[index]
        return base

    def dequantize(self) -> torch.Tensor:
        """The values it stands for now, a plain tensor of its own."""
        return self.value().clone()

    def value(self) -> torch.Tensor:
        """The values it stands for now, read only: a view of the weight's dequantised value,
        which every view of the weight's data shares while that data is unchanged (iterating
        over the rows of a weight dequantises it once, not once per row)."""
        self._whole = shared_dequantized(self._weight)  # (kept alive while the view is)
        return self.replay(self._whole, self._chain)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        refuse_collective(func)
        return dispatch(func, args, kwargs or {})


# The operator namespaces of torch.distributed's collectives.
_COLLECTIVES = frozenset({"c10d", "_c10d_functional", "c10d_functional",
                          "_c10d_functional_autograd"})


def refuse_collective(func) -> None:
    """An FP8 weight, or a view of one, in a collective: refused by name. (A wrapper has no
    storage of its own: gloo read and wrote through a null pointer, and parallelize_module's
    scatter of such a weight crashed the process.)"""
    if func.namespace in _COLLECTIVES:
        raise RuntimeError(
            f"an FP8 weight (quantized_model_init) cannot take part in a collective ({func}): "
            "tensor parallelism (parallelize_module, distribute_tensor) and collectives on FP8 "
            "weights are not supported; build the model without quantized_model_init for them")


def shared_dequantized(weight) -> torch.Tensor:
    """``weight.dequantize()``, the same tensor again while the FP8 data and scale_inv are
    unchanged (the key holds the weight's write count and their version counters, which an
    in-place write from outside bumps) and a view still holds it (only a weak reference is
    kept here). Read only: a write runs on a copy of its own."""
    fp8 = weight._fp8
    key = (fp8.version, id(fp8.data), fp8.data._version, id(fp8.scale_inv),
           fp8.scale_inv._version, weight.dtype)
    cached = getattr(fp8, "view_cache", None)
    if cached is not None and cached[0] == key:
        value = cached[1]()
        if value is not None:
            return value
    value = weight.dequantize()
    fp8.view_cache = (key, weakref.ref(value))
    return value


def makes_views(weight) -> bool:
    """Whether a view of ``weight`` (an Fp8Weight) can be written into, so is made an
    Fp8WeightView (see the module docstring)."""
    if torch.compiler.is_compiling():
        return False
    return not (torch.is_grad_enabled() and weight.requires_grad)


def views_of(weight, func, args, kwargs):
    """``func`` (a view operation) applied to ``weight`` (an Fp8Weight or a view of one): the
    view(s), as Fp8WeightViews."""
    if isinstance(weight, Fp8WeightView):
        base, chain = weight._weight, weight._chain
    else:
        base, chain = weight, ()
    rest = tuple(args[1:])
    # (the view's shape and strides, from a tensor on "meta" laid out as the weight)
    meta = torch.empty_strided(base.shape, base.stride(), dtype=base.dtype, device="meta")
    like = func(Fp8WeightView.replay(meta, chain), *rest, **kwargs)
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
    written = [t for t in written_arguments(func, args, kwargs) if isinstance(t, Fp8WeightView)]
    if not written:  # (a read; an Fp8Weight written, if any, takes it from here: _mutate)
        plain_args, plain_kwargs = pytree.tree_map_only(
            Fp8WeightView, Fp8WeightView.value, (args, kwargs))
        return func(*plain_args, **plain_kwargs)
    if func.overloadpacket in _RESHAPING_IN_PLACE:
        raise NotImplementedError(
            f"{func.overloadpacket.__name__}: a view of an FP8 weight cannot change its own "
            "shape in place; take a new view instead (w[0].unsqueeze(0), not "
            "w[0].unsqueeze_(0))")
    if func is aten.copy_.default and _same_view(args[0], args[1]):
        return args[0]  # (w[i] += x: Python writes the view into itself after the add)
    wholes: dict = {}  # id(Fp8Data) -> (weight, its dequantised value)

    def stand_in(t):
        if isinstance(t, Fp8WeightView) and any(t is w for w in written):
            key = id(t._weight._fp8)
            if key not in wholes:
                wholes[key] = (t._weight, t._weight.dequantize())
            return Fp8WeightView.replay(wholes[key][1], t._chain)
        return t.value() if isinstance(t, Fp8WeightView) else t.dequantize()

    from .fp8_weight import Fp8Weight
    if any(isinstance(w, Fp8Weight) for w in written_arguments(func, args, kwargs)):
        raise NotImplementedError(
            f"{func}: one operation writing into an FP8 weight and into a view of one")
    plain_args, plain_kwargs = pytree.tree_map_only(
        (Fp8WeightView, Fp8Weight), stand_in, (args, kwargs))
    out = func(*plain_args, **plain_kwargs)
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


def _same_view(a, b) -> bool:
    """Whether ``a`` and ``b`` are views of the same weight's data by the same operations."""
    if not (isinstance(a, Fp8WeightView) and isinstance(b, Fp8WeightView)):
        return False
    if a._weight._fp8 is not b._weight._fp8 or len(a._chain) != len(b._chain):
        return False
    return all(fa is fb and ia == ib and _same_arguments(xa, xb) and _same_arguments(ka, kb)
               for (fa, xa, ka, ia), (fb, xb, kb, ib) in zip(a._chain, b._chain))


def _same_arguments(a, b) -> bool:
    leaves_a, spec_a = pytree.tree_flatten(a)
    leaves_b, spec_b = pytree.tree_flatten(b)
    if spec_a != spec_b:
        return False
    return all(x is y if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor)
               else type(x) is type(y) and x == y for x, y in zip(leaves_a, leaves_b))
