"""What FusedAdam and FusedSGD share: float32 master weights for bfloat16, float16 and FP8
parameters, the float32 copy a step computes on and its single write into the parameter,
gradients read (and sparse ones refused), the deprecated ``set_grad_none``, parameter dtypes
checked, and a ``load_state_dict`` that keeps the optimizer states' own dtypes.

A subclass names itself in ``_NAME`` (the prefix of its errors), lists the floating states a
load keeps with their dtypes (``_state_dtypes``) and does one parameter's step in ``_update``.
"""
from __future__ import annotations

import warnings
from itertools import chain
from typing import Optional

import torch

from .._dtensor import is_dtensor

MASTER_DTYPES = (torch.float32,)
PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def is_fp8_weight(param) -> bool:
    return hasattr(param, "fp8_data")


def master_start(param) -> torch.Tensor:
    """A plain tensor of the parameter's value: an FP8 weight's high-precision initial value
    while the weight still holds its cast (nothing written since), else its dequantised value
    (its .float() / .to() would be FP8 weights)."""
    if not is_fp8_weight(param):
        return param.detach()
    init = param.get_high_precision_init_val()
    if init is not None and param.holds_cast_of(init):
        return init
    return param.dequantize()


def master_from_remainder(param: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    """The float32 master of a bfloat16 parameter from Transformer Engine's int16 remainder (its
    low 16 bits): the high 16 bits are the parameter's, less one where the remainder is
    negative (the bfloat16 value was rounded up from the master). A DTensor parameter's from
    its local shard (bit operations on DTensors are not all sharded: ``<<`` returned its input),
    returned as a DTensor of the parameter's layout."""
    if is_dtensor(param):
        from torch.distributed.tensor import DTensor
        local_remainder = remainder.to_local() if is_dtensor(remainder) else remainder
        local = master_from_remainder(param.to_local(), local_remainder)
        return DTensor.from_local(local, param.device_mesh, param.placements,
                                  shape=param.size(), stride=param.stride())
    high = param.detach().view(torch.int16).to(torch.int64)
    low = remainder.to(device=param.device, dtype=torch.int64)
    high = (high - (low < 0).to(torch.int64)) & 0xFFFF
    bits = high * 65536 + (low & 0xFFFF)
    bits = bits - (bits >= 2 ** 31).to(torch.int64) * 2 ** 32  # (as a signed 32-bit word)
    return bits.to(torch.int32).view(torch.float32)


class MasterWeightOptimizer(torch.optim.Optimizer):
    """The shared part of the package's optimizers (see the module docstring)."""

    _NAME = "optimizer"
    _SPARSE_HINT = ""
    use_decoupled_grad = False
    master_weights = False
    master_weight_dtype = torch.float32

    def _check_dtype(self, name: str, value, allowed) -> None:
        if value not in allowed:
            raise ValueError(f"{self._NAME}: argument '{name}' must be one of "
                             f"{[str(d) for d in allowed]}, got {value}")

    def _set_grad_none(self, set_grad_none: Optional[bool]) -> None:
        self.set_grad_none = set_grad_none
        if set_grad_none is not None:
            warnings.warn(f"{self._NAME}: 'set_grad_none' is deprecated (as in Transformer "
                          f"Engine): pass set_to_none to zero_grad", DeprecationWarning,
                          stacklevel=3)

    def _state_dtypes(self) -> dict:
        """The floating states a load keeps, each with the dtype it is stored in."""
        return {"master_param": self.master_weight_dtype}

    def zero_grad(self, set_to_none: Optional[bool] = None) -> None:
        if self.set_grad_none is not None:
            if set_to_none is not None and set_to_none != self.set_grad_none:
                raise ValueError(f"{self._NAME}.zero_grad: set_to_none={set_to_none}, but the "
                                 f"optimizer was made with set_grad_none={self.set_grad_none}")
            set_to_none = self.set_grad_none
        set_to_none = True if set_to_none is None else set_to_none
        if not self.use_decoupled_grad:
            super().zero_grad(set_to_none=set_to_none)
            return
        for group in self.param_groups:
            for p in group["params"]:
                grad = getattr(p, "decoupled_grad", None)
                if grad is not None:
                    if set_to_none:
                        p.decoupled_grad = None
                    else:
                        grad.zero_()

    def _grad(self, param) -> Optional[torch.Tensor]:
        grad = getattr(param, "decoupled_grad", None) if self.use_decoupled_grad else param.grad
        if grad is not None and grad.is_sparse:
            raise ValueError(f"{self._NAME}: sparse gradients are not supported"
                             f"{self._SPARSE_HINT}")
        if grad is not None and grad.shape != param.shape:  # (decoupled_grad: set by hand)
            raise ValueError(f"{self._NAME}: a gradient of shape {tuple(grad.shape)} for a "
                             f"parameter of shape {tuple(param.shape)}")
        return grad

    def _check_group(self, group: dict) -> None:
        """Refuse a parameter group's bad hyperparameters (group: with the defaults filled)."""

    def add_param_group(self, param_group: dict) -> None:
        params = param_group["params"]
        if not isinstance(params, (torch.Tensor, set)):  # (a generator is read once, here)
            params = param_group["params"] = list(params)
        for p in [params] if isinstance(params, torch.Tensor) else params:
            if isinstance(p, tuple) and len(p) == 2:  # (name, parameter): named_parameters()
                p = p[1]
            if isinstance(p, torch.Tensor) and p.dtype not in PARAM_DTYPES:
                raise ValueError(f"{self._NAME}: parameters must be float32, bfloat16, float16 "
                                 f"or FP8 weights, got one of dtype {p.dtype} and shape "
                                 f"{tuple(p.shape)}")
        self._check_group({**self.defaults, **param_group})
        super().add_param_group(param_group)

    def _needs_master(self, param) -> bool:
        return self.master_weights and (param.dtype != torch.float32 or is_fp8_weight(param))

    def _master(self, param, state) -> Optional[torch.Tensor]:
        """The parameter's master (made at its first step, or the first after a load without
        one), or None."""
        if not self._needs_master(param):
            return None
        master = state.get("master_param")
        if master is not None and master.dtype == torch.int16:  # (a loaded remainder)
            state["master_param"] = master_from_remainder(param, master)
        if "master_param" not in state:
            state["master_param"] = master_start(param).to(
                device=param.device, dtype=self.master_weight_dtype, copy=True)
        return state["master_param"]

    @staticmethod
    def _float32_value(stored) -> torch.Tensor:
        """What a step updates: ``stored`` (the master, or the parameter) itself where it is a
        float32 tensor (then in place, as torch.optim does), else a float32 copy (of an FP8
        weight: of its dequantised value) that ``_write_back`` writes once."""
        if stored.dtype == torch.float32 and not is_fp8_weight(stored):
            return stored
        return (stored.dequantize() if is_fp8_weight(stored) else stored).float()

    @staticmethod
    def _write_back(param, master, stored, value) -> None:
        if value is not stored:
            stored.copy_(value)
        if master is not None:
            param.copy_(value)  # rounded to the parameter's dtype, or quantised (FP8 weights)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # Every gradient read and checked before any parameter changes: a refused one (sparse,
        # misshapen) leaves the whole step undone, not the parameters before it updated.
        updates = [(param, grad, group) for group in self.param_groups
                   for param in group["params"] for grad in (self._grad(param),)
                   if grad is not None]
        for param, grad, group in updates:
            self._update(param, grad, self.state[param], group)
        return loss

    def _update(self, param, grad, state, group) -> None:
        raise NotImplementedError

    def _restored(self, name: str, value, param) -> Optional[torch.Tensor]:
        """A loaded state as this optimizer keeps it (a copy: nothing shared with the state
        given), or None to drop it."""
        if value is None:
            return None
        return value.to(device=param.device, dtype=self._state_dtypes()[name], copy=True)

    def _kept_states(self) -> tuple:
        return tuple(self._state_dtypes())

    def load_state_dict(self, state_dict: dict) -> None:
        """torch.optim casts every floating state to its parameter's dtype at a load; the
        states named in ``_state_dtypes`` keep their own dtypes here. A group saved by another
        optimizer (torch.optim's) takes this one's defaults for what it lacks."""
        kept = self._kept_states()
        taken = {}

        def take(optimizer, hooked: dict) -> None:
            # Registered last, so it sees the dict torch loads, after the caller's pre-hooks
            # (torch's way to load a state saved over another parameter order): the groups
            # checked before anything is loaded, the kept states read from it.
            for group in hooked["param_groups"]:
                self._check_group({**self.defaults, **group})
            taken["groups"] = hooked["param_groups"]
            taken["saved"] = {key: {name: value for name, value in entry.items()
                                    if name in kept}
                              for key, entry in hooked["state"].items()}

        handle = self.register_load_state_dict_pre_hook(take)
        try:
            super().load_state_dict(state_dict)
        finally:
            handle.remove()
        saved = taken["saved"]
        for group in self.param_groups:
            for name, default in self.defaults.items():
                group.setdefault(name, default)
        ids = chain.from_iterable(g["params"] for g in taken["groups"])
        params = chain.from_iterable(g["params"] for g in self.param_groups)
        for key, param in zip(ids, params):
            for name, value in saved.get(key, {}).items():
                value = self._restored(name, value, param)
                if value is None:
                    self.state[param].pop(name, None)
                else:
                    self.state[param][name] = value
