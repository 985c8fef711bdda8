"""What the GEMM modules (Linear, LayerNormLinear, LayerNormMLP, GroupedLinear) share to behave as
Transformer Engine's do, besides their FP8 state:

* parameters_split: a GEMM's weight (and bias) kept as several Parameters named
  ``<name>_weight`` / ``<name>_bias``, joined along the output features in forward
  (MultiheadAttention's query_weight, key_weight, value_weight);
* fuse_wgrad_accumulation and delay_wgrad_compute (wgrad.py), backward_dw();
* return_bias for a module built with bias=False: what Transformer Engine 2.x returns, None
  (Linear, LayerNormMLP) or an empty tensor (LayerNormLinear, GroupedLinear);
* loading Transformer Engine's checkpoints: its ``_extra_state`` entry (te_checkpoint.py).

The module names its GEMM parameters logically ("weight", "bias", "fc1_weight", "weight3");
``_param(logical)`` is the tensor its computation uses: the Parameter itself, or its parts
joined, each part passed through the wgrad route when one is set.
"""
from __future__ import annotations

from typing import Optional

import torch

from . import te_checkpoint
from ..quantization.state_layout import FP8_STATE_KEYS
from ..quantization.torch_autocast import autocast_dtype
from .fp8_primary_weights import SCALE_INV_SUFFIX

from . import wgrad
from .once_differentiable import joined_weight


def split_sizes(owner: str, parameters_split, out_features: int,
                shards: int = 1) -> Optional[list]:
    """Transformer Engine's parameters_split as [(name, rows)], or None (one Parameter).
    A dict gives each part's rows; a sequence of names splits the rows evenly. ``shards``: the
    tensor-parallel ranks of a column-parallel layer (out_features is then the whole layer's):
    each part is cut into that many, and the rank holds one of each, as in Transformer Engine
    (a rank's weight is [its query rows | its key rows | its value rows])."""
    if parameters_split is None:
        return None
    if isinstance(parameters_split, dict):
        parts = [(str(name).rstrip("_"), size) for name, size in parameters_split.items()]
    elif isinstance(parameters_split, (list, tuple)) and all(isinstance(n, str)
                                                             for n in parameters_split):
        count = len(parameters_split)
        parts = [(name.rstrip("_"), out_features // count if count else 0)
                 for name in parameters_split]
    else:
        raise TypeError(f"{owner}: parameters_split must be None, a dict of name -> rows or a "
                        f"sequence of names, got {parameters_split!r}")
    if not parts:
        raise ValueError(f"{owner}: parameters_split must name at least one part, got "
                         f"{parameters_split!r}")
    if any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for _, s in parts) or \
            sum(s for _, s in parts) != out_features:
        raise ValueError(f"{owner}: parameters_split must split the {out_features} output "
                         f"features into positive parts, got {dict(parts)}")
    for name, size in parts:
        if size % shards:
            raise ValueError(f"{owner}: parameters_split part {name!r} ({size} rows) is not "
                             f"divisible by the {shards} tensor-parallel ranks "
                             "(parallel_mode='column' cuts every part)")
    return [(name, size // shards) for name, size in parts]


_NOT_A_PARAMETER = object()


class TeModuleMixin:
    """See the module docstring. Call ``_init_te_module`` before registering the GEMM
    parameters with ``_register_gemm_parameter``."""

    # return_bias without a bias: None, or an empty tensor (Transformer Engine differs by module)
    _NO_BIAS_RETURNS_NONE = False
    # How Transformer Engine laid out this module's FP8 state in its checkpoints
    # (te_checkpoint.py): one column set per GEMM unless the module names another.
    _TE_STATE_LAYOUT = "by_gemm"

    def _init_te_module(self, fuse_wgrad_accumulation: bool = False,
                        delay_wgrad_compute: bool = False) -> None:
        for name, value in (("fuse_wgrad_accumulation", fuse_wgrad_accumulation),
                            ("delay_wgrad_compute", delay_wgrad_compute)):
            if not isinstance(value, bool):
                raise TypeError(f"{type(self).__name__}: {name} must be True or False, got "
                                f"{value!r}")
        self._wgrad_options = (fuse_wgrad_accumulation, delay_wgrad_compute)
        self._wgrad = (wgrad.WgradRouting(fuse_wgrad_accumulation, delay_wgrad_compute)
                       if fuse_wgrad_accumulation or delay_wgrad_compute else None)
        self._parts: dict[str, list[str]] = {}  # logical name -> Parameter names
        self._wgrad_first: Optional[bool] = None  # is_first_microbatch of the running forward
        # Megatron-LM's gradient reduction, called after each backward_dw() (Transformer
        # Engine's attribute name)
        self.wgrad_accumulation_and_reduce_hooks: list = []

    # Set at construction: the gradient routing is built from them then (a later assignment
    # would change nothing, silently: main_grad never written), so changing them is refused.
    @property
    def fuse_wgrad_accumulation(self) -> bool:
        return self._wgrad_options[0]

    @fuse_wgrad_accumulation.setter
    def fuse_wgrad_accumulation(self, value) -> None:
        self._refuse_wgrad_change("fuse_wgrad_accumulation", self._wgrad_options[0], value)

    @property
    def delay_wgrad_compute(self) -> bool:
        return self._wgrad_options[1]

    @delay_wgrad_compute.setter
    def delay_wgrad_compute(self, value) -> None:
        self._refuse_wgrad_change("delay_wgrad_compute", self._wgrad_options[1], value)

    def __setstate__(self, state: dict) -> None:
        if "_wgrad_options" not in state and "fuse_wgrad_accumulation" in state:
            # (a module pickled whole before the options became properties)
            state["_wgrad_options"] = (state.pop("fuse_wgrad_accumulation"),
                                       state.pop("delay_wgrad_compute"))
        state.setdefault("wgrad_accumulation_and_reduce_hooks", [])
        super().__setstate__(state)

    def _refuse_wgrad_change(self, name: str, current: bool, value) -> None:
        if value != current:
            raise AttributeError(f"{type(self).__name__}.{name} is fixed at construction (the "
                                 f"module routes its gradients by it); it is {current}, got "
                                 f"{value!r}: build the module with {name}={value!r}")

    def _register_gemm_parameter(self, logical: str, tensor: Optional[torch.Tensor],
                                 parts: Optional[list] = None) -> None:
        """Register ``tensor`` (rows = output features) as Parameter ``logical``, or as one
        Parameter per part (``<part>_weight`` for a weight, ``<part>_bias`` for a bias). None:
        no such Parameter yet; one assigned later (``layer.bias = nn.Parameter(...)``, which
        torch.nn.Linear honours) is used (parts: a split bias cannot come later)."""
        if tensor is None:
            self.register_parameter(logical, None)
            self._parts[logical] = [logical] if parts is None else []
            return
        if parts is None:
            self.register_parameter(logical, torch.nn.Parameter(tensor))
            self._parts[logical] = [logical]
            return
        suffix = "_bias" if logical.endswith("bias") else "_weight"
        names, start = [], 0
        for part, rows in parts:
            name = part + suffix
            self.register_parameter(name, torch.nn.Parameter(tensor[start:start + rows].clone()))
            names.append(name)
            start += rows
        self._parts[logical] = names

    def _parameters_of(self, logical: str) -> list:
        """The Parameters of ``logical`` (an absent bias: [None])."""
        return [getattr(self, name) for name in self._parts.get(logical, [logical])]

    def _has(self, logical: str) -> bool:
        return any(p is not None for p in self._parameters_of(logical))

    def _weight_for_checks(self) -> torch.Tensor:
        """base.py's dispatch and the roles read the weight's dtype and type only: the first
        Parameter of a parameters_split weight will do (the parts share both), so no join (a
        copy of the whole weight) is made for them; the GEMM joins them once."""
        names = self._parts.get("weight")
        return getattr(self, names[0]) if names else self.fp8_weights()[0]

    def _weight_held(self, logical: str) -> bool:
        """Whether the FP8 forward holds weight ``logical`` under torch.compile: not when it
        is joined from parts, whose join holds one (once_differentiable.py)."""
        return len(self._parts.get(logical, ())) <= 1

    def _param(self, logical: str, routed: bool = True) -> Optional[torch.Tensor]:
        """The tensor the computation uses for ``logical`` (None for an absent bias)."""
        names = self._parts.get(logical)
        if names is not None and len(names) == 1 and (not routed or self._wgrad is None):
            param = self._parameters.get(names[0], _NOT_A_PARAMETER)
            if param is not _NOT_A_PARAMETER:
                return param  # one Parameter, nothing routed: the common case
            # (else a tensor computed from parameters: torch.nn.utils.parametrize, weight_norm,
            # prune; getattr below computes it)
        params = [p for p in self._parameters_of(logical) if p is not None]
        if not params:
            return None
        if routed and self._wgrad is not None:
            if any(not isinstance(p, torch.nn.Parameter) for p in params):
                raise RuntimeError(
                    f"{type(self).__name__}: fuse_wgrad_accumulation / delay_wgrad_compute "
                    f"route a Parameter's gradient, and '{logical}' is computed from others "
                    "(torch.nn.utils.parametrize, weight_norm, prune): build the module "
                    "without them")
            is_weight = "bias" not in logical
            params = [wgrad.route(p, self._wgrad, is_weight, self._wgrad_first) for p in params]
        if len(params) == 1:
            return params[0]
        device_type = params[0].device.type
        # (a weight's join holds a part under torch.compile: once_differentiable.py)
        join = torch.cat if "bias" in logical else joined_weight
        if autocast_dtype(device_type) is None:
            return join(params)
        # Joined as they are, as one Parameter would be (the GEMM casts): torch.autocast's cat
        # promotes, which raises for bfloat16 parts under float16 autocast and vice versa.
        with torch.autocast(device_type, enabled=False):
            return join(params)

    def _returned_bias(self, logical: str, like: torch.Tensor) -> Optional[torch.Tensor]:
        """The bias that return_bias returns (not added to the output): in the output's
        dtype; when the module has none, None or an empty tensor (_NO_BIAS_RETURNS_NONE)."""
        bias = self._param(logical)
        if bias is None:
            if self._NO_BIAS_RETURNS_NONE:
                return None
            weight = self._parameters_of(logical.replace("bias", "weight"))[0]
            return torch.empty(0, dtype=like.dtype, device=weight.device)
        return bias.to(like.dtype)

    def backward_dw(self) -> None:
        """With delay_wgrad_compute: hand the gradients left aside by the oldest backward pass
        to the parameters (main_grad with fuse_wgrad_accumulation, else .grad), then call the
        hooks of register_wgrad_accumulation_and_reduce_hooks. A no-op without
        delay_wgrad_compute, or when no parameter requires a gradient. Raises, as Transformer
        Engine does, when no backward pass has left gradients (called more often than backward:
        a schedule that would otherwise step without these gradients)."""
        if not self.need_backward_dw():
            return
        if not self._wgrad.pending:
            if not any(p is not None and p.requires_grad
                       for names in self._parts.values() for p in map(self._parameters.get, names)):
                return  # its GEMMs' parameters frozen: backward leaves nothing
            raise RuntimeError(f"{type(self).__name__}.backward_dw(): no backward pass has left "
                               "weight gradients to hand over (each backward pass leaves one "
                               "set; backward_dw() was called more often than backward)")
        self._wgrad.backward_dw()
        for hook in self.wgrad_accumulation_and_reduce_hooks:
            hook()

    def register_wgrad_accumulation_and_reduce_hooks(self, hook) -> None:
        """Call ``hook()`` after each backward_dw() has handed the gradients over (Megatron-LM
        reduces them there). Register before backward."""
        if not callable(hook):
            raise TypeError(f"{type(self).__name__}.register_wgrad_accumulation_and_reduce_hooks: "
                            f"hook must be callable, got {type(hook).__name__}")
        self.wgrad_accumulation_and_reduce_hooks.append(hook)

    def need_backward_dw(self) -> bool:
        return self._wgrad is not None and self._wgrad.delay

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        key = prefix + te_checkpoint.EXTRA_STATE
        te_state = None
        # Transformer Engine's FP8 state, read (and checked) first: a corrupt one loads nothing
        # of this module. Our own FP8 keys win when a checkpoint has both.
        if key in state_dict and prefix + "fp8_fwd_scale" not in state_dict:
            te_state, error = te_checkpoint.prepare_extra_state(
                self, state_dict[key], f"{type(self).__name__} '{prefix or '.'}'")
            if error is not None:
                error_msgs.append(error)  # load_state_dict raises
                return
        errors_before = len(error_msgs)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
        if len(error_msgs) > errors_before:
            te_state = None  # the module's load failed: its FP8 state stays as it was
        for name in self._parameters:  # a checkpoint of FP8 weights: its dequantised values load
            if prefix + name + SCALE_INV_SUFFIX in unexpected_keys:
                unexpected_keys.remove(prefix + name + SCALE_INV_SUFFIX)
        if key in unexpected_keys:
            unexpected_keys.remove(key)
        if te_state is not None:
            te_checkpoint.apply_extra_state(self, te_state)
            for name in FP8_STATE_KEYS:  # (given by Transformer Engine's state: not missing)
                if prefix + name in missing_keys:
                    missing_keys.remove(prefix + name)
