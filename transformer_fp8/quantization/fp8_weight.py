"""FP8 primary weights: a GEMM weight held only in FP8 (1 byte per element, with the scale it was
cast with), as the modules built inside ``quantized_model_init`` hold them.

``Fp8Weight`` is a torch.Tensor subclass whose dtype is the weight's nominal high-precision dtype
(its gradient's). Its module's FP8 GEMMs take the FP8 data as their weight operand, with no cast
(``fp8_operand``, read by quantizer.Fp8Plan.quantize_weight). Every other use sees the dequantised
value ``data * scale_inv``: printing, torch ops, ``clone()`` and the high-precision forward get
plain tensors. Writing into it (``copy_``, an optimizer's in-place update, a load) quantises the
new value again, with the rule of the recipe it was built for (``WeightCast``). Its views
(``w[0]``, ``w.t()``) read as the dequantised values and write through to it
(fp8_weight_view.py); detach/alias are Fp8Weights sharing its FP8 data.
"""
from __future__ import annotations

import weakref
from typing import Optional

import torch
from torch.utils import _pytree as pytree

from .. import ops
from .fp8_weight_view import (Fp8WeightView, is_view_op, makes_views, views_of,
                              written_arguments)
from .fp8_weight_view import dispatch as view_dispatch
from .fp8_weight_view import refuse_collective
from .quantizer import Quantized, TensorQuantizer, power_2_floor
from .recipe import DelayedScaling, Float8CurrentScaling

aten = torch.ops.aten
HIGH_PRECISION = (torch.float32, torch.bfloat16, torch.float16)


class WeightCast:
    """How one GEMM weight of ``module`` is quantised whenever a value is written into it.

    DelayedScaling: with the layer's current delayed weight scale (the weight's column of its
    forward state), the value's amax recorded into that column's history row 0, as every weight
    cast records it (the next update makes the next scale from it). While that column holds no
    amax at all and the scale of 1 (a fresh or reset state) the value's own scale is used,
    ``fp8_max / amax / 2**margin`` (what an update of that amax gives), and becomes the layer's
    weight scale, so that the first forward casts nothing with the fresh state's scale of 1.
    So is it for a value that the layer's scale would clip (amax * scale > fp8_max: an
    initialisation written after construction, weights that grew): no written value saturates.
    Float8CurrentScaling: the value's own scale (its amax), no state. A weight copied on its
    own (deepcopy of the tensor alone): its own scale, no module's state.
    """

    def __init__(self, module: Optional[torch.nn.Module], gemm: int, recipe):
        # None: a weight copied on its own (deepcopy of the tensor, not of its module), which
        # casts new values with their own scale and touches no module's state.
        self._module = weakref.ref(module) if module is not None else None
        self.gemm = gemm
        self.recipe = recipe
        self.fp8_dtype = recipe.fp8_format.fwd_dtype
        self.margin = recipe.margin if isinstance(recipe, DelayedScaling) else 0

    def __deepcopy__(self, memo):
        # A module being copied is in memo before its parameters: the copy's weight quantises
        # into the copy's state.
        module = self._module() if self._module is not None else None
        return WeightCast(memo.get(id(module)), self.gemm, self.recipe)

    def __reduce__(self):
        # A pickle of the module (torch.save(model)) holds the module itself, which pickle
        # makes before its parameters: the loaded weight quantises into the loaded state.
        module = self._module() if self._module is not None else None
        return WeightCast, (module, self.gemm, self.recipe)

    def has_state(self) -> bool:
        """Whether the rule can be applied now: its module's FP8 state is in place (not while
        the module's _apply sets it aside)."""
        if isinstance(self.recipe, Float8CurrentScaling) or self._module is None:
            return True
        module = self._module()
        return module is not None and "fp8_fwd_amax_history" in module._buffers

    def own_scale(self, hp: torch.Tensor):
        """(amax [1], scale [1]) of the value itself."""
        amax = ops.amax(hp).reshape(1)
        scale = ops.compute_scale_from_amax(amax, torch.finfo(self.fp8_dtype).max, self.margin)
        if getattr(self.recipe, "use_power_2_scales", False):  # (as the quantizer casts)
            scale = power_2_floor(scale)
        return amax, scale

    def scales_for(self, hp: torch.Tensor):
        """(scale, scale_inv) to cast ``hp`` with, as new tensors (the layer's buffers change
        in place at every update)."""
        amax, own = self.own_scale(hp)
        if isinstance(self.recipe, Float8CurrentScaling) or self._module is None:
            return own, ops.scale_inverse(own)
        module = self._module()
        if module is None:
            raise RuntimeError("Fp8Weight: the module this FP8 weight belongs to no longer "
                               "exists, so its delayed weight scale is unknown")
        col = 2 * self.gemm + 1
        history = module.fp8_fwd_amax_history
        layer_scale = module.fp8_fwd_scale[col:col + 1]
        layer_scale_inv = module.fp8_fwd_scale_inv[col:col + 1]
        # Fresh: no amax in the history and the scale of a fresh state (with a history of
        # length 1 every update leaves the history empty: the scale tells). On the device.
        fresh = ~(history[:, col] > 0).any() & (layer_scale == 1).all()
        # (a value past the layer scale's range: its own scale, smaller, so that none clips)
        # (not an infinite or NaN value, whose own scale is the fallback 1: the layer's kept)
        clipped = (amax * layer_scale > torch.finfo(self.fp8_dtype).max) & amax.isfinite()
        use_own = fresh | clipped
        scale = torch.where(use_own, own, layer_scale)
        scale_inv = torch.where(use_own, ops.scale_inverse(own), layer_scale_inv)
        layer_scale.copy_(scale)
        layer_scale_inv.copy_(scale_inv)
        slot = history[0, col:col + 1]
        slot.copy_(torch.maximum(slot, amax))  # NaN propagates, as the cast kernels' amax
        return scale, scale_inv

    def quantize(self, value: torch.Tensor, device, scales=None) -> "Fp8Data":
        """The FP8 form of ``value`` on ``device``, with ``scales`` (scale, scale_inv) if given
        (nothing recorded), else with this rule's."""
        hp = value.detach().to(device)
        if hp.dtype not in HIGH_PRECISION:
            hp = hp.float()
        scale, scale_inv = scales if scales is not None else self.scales_for(hp)
        return Fp8Data(ops.cast_to_fp8(hp, scale, self.fp8_dtype), scale, scale_inv, self)


class Fp8Data:
    """What an Fp8Weight holds, shared by its aliases (detach, the Parameter): the FP8 data, the
    scale it was cast with and its inverse, the rule that casts new values, and the
    high-precision initial value where quantized_model_init was asked to keep it."""

    def __init__(self, data, scale, scale_inv, cast: WeightCast, hp_init=None):
        self.data, self.scale, self.scale_inv = data, scale, scale_inv
        self.cast = cast
        self.hp_init = hp_init
        # Bumped at each take (inside __torch_dispatch__ the tensors' own version counters do
        # not move): what fp8_weight_view.shared_dequantized keys its value on.
        self.version = 0

    def take(self, other: "Fp8Data") -> None:
        """Hold ``other``'s data and scales: copied into this object's tensors where they are
        alike (same shape, dtype, device), so that their addresses stay those a captured CUDA
        graph reads (each optimizer step replaced them: replays read freed memory), else the
        tensors taken."""
        self.version += 1
        mine = (self.data, self.scale, self.scale_inv)
        theirs = (other.data, other.scale, other.scale_inv)
        if all(a.shape == b.shape and a.dtype == b.dtype and a.device == b.device
               for a, b in zip(mine, theirs)):
            with torch.no_grad():
                for a, b in zip(mine, theirs):
                    if a is not b:
                        a.copy_(b)
            return
        self.data, self.scale, self.scale_inv = theirs

    def on_its_own(self) -> "Fp8Data":
        """This data with a rule bound to no module (a copy made outside the module)."""
        self.cast = WeightCast(None, self.cast.gemm, self.cast.recipe)
        return self

    def moved(self, device, copy: bool = False) -> "Fp8Data":
        """Its tensors on ``device`` (the same ones where they are there already, unless
        ``copy``)."""
        return Fp8Data(self.data.to(device, copy=copy), self.scale.to(device, copy=copy),
                       self.scale_inv.to(device, copy=copy), self.cast, self.hp_init)


class Fp8Weight(torch.Tensor):
    """A GEMM weight held in FP8 (see the module docstring). ``dtype`` is its nominal
    high-precision dtype."""

    @staticmethod
    def __new__(cls, fp8: Fp8Data, dtype: torch.dtype, requires_grad: bool = False):
        data = fp8.data
        return torch.Tensor._make_wrapper_subclass(
            cls, data.shape, strides=data.stride(), dtype=dtype, device=data.device,
            requires_grad=requires_grad)

    def __init__(self, fp8: Fp8Data, dtype: torch.dtype, requires_grad: bool = False):
        self._fp8 = fp8

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __repr__(self) -> str:
        return (f"Fp8Weight({self.dequantize()!r}, fp8_dtype={self._fp8.data.dtype}, "
                f"scale_inv={self._fp8.scale_inv.item():.6g})")

    def __deepcopy__(self, memo):
        if id(self) in memo:
            return memo[id(self)]
        import copy
        fp8 = self._fp8
        new_fp8 = Fp8Data(fp8.data.clone(), fp8.scale.clone(), fp8.scale_inv.clone(),
                          copy.deepcopy(fp8.cast, memo),
                          None if fp8.hp_init is None else fp8.hp_init.clone())
        new = Fp8Weight(new_fp8, self.dtype, self.requires_grad)
        if getattr(self, "_is_param", False):
            new._is_param = True
        memo[id(self)] = new
        return new

    def __reduce_ex__(self, protocol):
        """A whole-module pickle (torch.save(model), torch.load(weights_only=False)): the FP8
        data and scales as they are, the rule, the nominal dtype. (A state_dict holds the
        dequantised value and scale_inv as plain tensors, for weights_only loads.)"""
        fp8 = self._fp8
        # (the tensor's own attributes too, as a Parameter's pickle keeps them: main_grad, ...)
        attributes = {k: v for k, v in self.__dict__.items() if k not in ("_fp8", "_is_param")}
        # The FP8 bytes as uint8 (pickle.dumps of a float8 tensor loads with an AttributeError
        # in torch 2.11; torch.save's pickler takes either).
        return _unpickled_fp8_weight, (fp8.data.view(torch.uint8), fp8.scale, fp8.scale_inv,
                                       fp8.cast, fp8.hp_init, self.dtype, self.requires_grad,
                                       getattr(self, "_is_param", False), attributes,
                                       fp8.data.dtype)

    # ---- what the FP8 GEMMs and the rest of the package read ---------------------------------

    @property
    def fp8_cache_key(self) -> tuple:
        return TensorQuantizer.cache_key

    def fp8_operand(self, fp8_dtype: torch.dtype, with_transpose: bool) -> Optional[Quantized]:
        """The GEMM operand: the FP8 data with its scale_inv, and its transpose for dgrad (one
        scale per tensor: the transpose of the data is the cast of the transposed weight).
        None if it is held in another FP8 dtype than the GEMM asks for."""
        fp8 = self._fp8
        if fp8_dtype != fp8.data.dtype:
            return None
        if not with_transpose:
            return Quantized(fp8.data, None, fp8.scale_inv, fp8.scale_inv, fp8.scale)
        # What the backward reads (dgrad), copied: a write between this forward and its
        # backward (an optimizer step) changes the weight's tensors in place (Fp8Data.take).
        return Quantized(fp8.data, fp8.data.t().contiguous(), fp8.scale_inv,
                         fp8.scale_inv.clone(), fp8.scale)

    def dequantize(self) -> torch.Tensor:
        """The value it stands for, a plain tensor of its nominal dtype."""
        return ops.cast_from_fp8(self._fp8.data, self._fp8.scale_inv, self.dtype)

    @property
    def fp8_data(self) -> torch.Tensor:
        return self._fp8.data

    @property
    def fp8_scale_inv(self) -> torch.Tensor:
        return self._fp8.scale_inv

    def held_tensors(self) -> tuple:
        """The tensors it holds: the FP8 data, its scale and scale_inv (this wrapper has no
        storage of its own: ``data_ptr()`` is 0)."""
        fp8 = self._fp8
        return fp8.data, fp8.scale, fp8.scale_inv

    def stored_bytes(self) -> int:
        """Bytes it holds: the FP8 data, its scale and scale_inv."""
        return sum(t.numel() * t.element_size() for t in self.held_tensors())

    def get_high_precision_init_val(self) -> Optional[torch.Tensor]:
        """The initial high-precision value (on the CPU) where the module was built inside
        ``quantized_model_init(preserve_high_precision_init_val=True)``, until cleared; else
        None."""
        return self._fp8.hp_init

    def clear_high_precision_init_val(self) -> None:
        self._fp8.hp_init = None

    def holds_cast_of(self, value: torch.Tensor) -> bool:
        """Whether the FP8 data is ``value`` cast with this weight's scale (nothing recorded):
        a kept initial value still stands for the weight only while nothing else was written."""
        cast = self._fp8.cast.quantize(value, self.device, (self._fp8.scale, self._fp8.scale_inv))
        return torch.equal(cast.data.view(torch.uint8), self._fp8.data.view(torch.uint8))

    # ---- torch operations --------------------------------------------------------------------

    def _alias(self, dtype=None, fp8: Optional[Fp8Data] = None) -> "Fp8Weight":
        return Fp8Weight(fp8 or self._fp8, dtype or self.dtype)

    def _write(self, value: torch.Tensor) -> None:
        """Hold ``value`` from now on: an Fp8Weight's FP8 data and scales as they are (exact),
        any other value quantised with this weight's rule."""
        if isinstance(value, Fp8Weight):  # (copies: another live weight's tensors are not shared)
            self._fp8.take(value._fp8.moved(self.device, copy=True))
            return
        if value.shape != self.shape:
            value = value.expand(self.shape)  # copy_ broadcasts its source
        self._fp8.take(self._fp8.cast.quantize(value, self.device))

    def _get_data(self) -> "Fp8Weight":
        return torch._C.TensorBase.data.__get__(self)

    def _set_data(self, value: torch.Tensor) -> None:
        """``weight.data = value`` (torch.nn.utils.vector_to_parameters, Module._apply): an
        Fp8Weight's FP8 data and scales are taken as they are; any other value of the same
        shape is quantised with this weight's rule, as copy_ does (inside the module's _apply,
        whose FP8 state is set aside, with the scale the weight holds, recording nothing), and
        its floating dtype becomes the nominal one (as assigning a tensor of another dtype
        does)."""
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"Fp8Weight.data must be set to a tensor, got {type(value).__name__}")
        if isinstance(value, Fp8Weight):
            self._fp8.take(value._fp8)
        else:
            if value.shape != self.shape:
                raise ValueError(f"Fp8Weight.data: a weight held in FP8 keeps its shape "
                                 f"{list(self.shape)}, got a value of shape {list(value.shape)}")
            with torch.no_grad():
                if self._fp8.cast.has_state():
                    self._write(value)
                else:  # (Module._apply: .double(), to_empty(); the module's state is aside)
                    self._fp8.take(self._fp8.cast.quantize(
                        value, self.device, (self._fp8.scale, self._fp8.scale_inv)))
            value = self._alias(value.dtype if value.dtype in HIGH_PRECISION else None)
        torch._C.TensorBase.data.__set__(self, value)  # (the nominal dtype, device)

    data = property(_get_data, _set_data)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        refuse_collective(func)
        this = args[0] if args and isinstance(args[0], cls) else None
        if this is not None:
            if func in (aten.detach.default, aten.alias.default):
                return this._alias()
            if is_view_op(func) and makes_views(this):  # (w[0], w.t(): written through)
                return views_of(this, func, args, kwargs)
        views = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, Fp8WeightView)]
        if views:
            if any(any(v is w for v in views) for w in written_arguments(func, args, kwargs)):
                return view_dispatch(func, args, kwargs)
            args, kwargs = pytree.tree_map_only(Fp8WeightView, Fp8WeightView.value,
                                                (args, kwargs))
        if this is not None:
            if func is aten.copy_.default:
                this._write(args[1])
                return this
            if func is aten._to_copy.default and _moves_only(this, kwargs):
                # .to(device) / .half(): the same FP8 values, on that device, of that dtype,
                # in tensors of its own (writes go into a weight's tensors in place: a shared
                # one would change the original too).
                # The copy casts new values with its own scale and writes into no module's
                # state (p.float() of a bfloat16 weight wrote the layer's amax history); the
                # module's own _apply keeps its weight object and its rule (_set_data).
                device = kwargs.get("device") or this.device
                return this._alias(kwargs.get("dtype"),
                                   this._fp8.moved(device, copy=True).on_its_own())
        if func._schema.is_mutable:
            return _mutate(func, args, kwargs)
        # Any other use (a high-precision computation, clone, a view): the dequantised value.
        plain_args, plain_kwargs = pytree.tree_map_only(
            cls, lambda t: t.dequantize(), (args, kwargs))
        return func(*plain_args, **plain_kwargs)


def _unpickled_fp8_weight(data, scale, scale_inv, cast, hp_init, dtype, requires_grad, is_param,
                          attributes=None, fp8_dtype=None):
    if fp8_dtype is not None:  # (the bytes as uint8; None: an older pickle, the FP8 tensor)
        data = data.view(fp8_dtype)
    weight = Fp8Weight(Fp8Data(data, scale, scale_inv, cast, hp_init), dtype)
    weight = (torch.nn.Parameter(weight, requires_grad=requires_grad) if is_param
              else weight.requires_grad_(requires_grad))
    weight.__dict__.update(attributes or {})
    return weight


def _moves_only(weight: Fp8Weight, kwargs: dict) -> bool:
    """Whether a _to_copy changes nothing but the device and the (floating) nominal dtype."""
    if set(kwargs) - {"dtype", "device", "non_blocking", "layout", "memory_format"}:
        return False
    dtype = kwargs.get("dtype")
    layout = kwargs.get("layout")
    return (dtype is None or dtype in HIGH_PRECISION) and layout in (None, torch.strided)


def _mutate(func, args, kwargs):
    """An in-place operation on Fp8Weights (an optimizer's update, an initialiser): run on their
    dequantised values, then each written one quantises its new value."""
    stand_ins: dict = {}

    def stand_in(t: Fp8Weight) -> torch.Tensor:
        if id(t) not in stand_ins:
            stand_ins[id(t)] = (t, t.dequantize())
        return stand_ins[id(t)][1]

    plain_args, plain_kwargs = pytree.tree_map_only(Fp8Weight, stand_in, (args, kwargs))
    out = func(*plain_args, **plain_kwargs)
    written = _written_weights(func, args, kwargs)
    for weight in written:
        weight._write(stand_ins[id(weight)][1])
    back = {id(stand_ins[id(w)][1]): w for w in written}
    return pytree.tree_map_only(torch.Tensor, lambda t: back.get(id(t), t), out)


def _written_weights(func, args, kwargs) -> list:
    """The Fp8Weights among the arguments that ``func``'s schema marks as written."""
    return [t for t in written_arguments(func, args, kwargs) if isinstance(t, Fp8Weight)]
