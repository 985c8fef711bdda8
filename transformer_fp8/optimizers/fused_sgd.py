"""Transformer Engine's ``optimizers.FusedSGD``: SGD with momentum, dampening, weight decay and
Nesterov momentum, with optional master weights.

Its arguments and defaults are Transformer Engine's (``lr`` has no default); its arithmetic is
torch.optim.SGD's, operation for operation, one parameter at a time in torch ops (not one
fused kernel): for float32 parameters, bit for bit what ``torch.optim.SGD(foreach=False)``
computes, momentum buffers included (a parameter's buffer starts as its first gradient, weight
decay included). Transformer Engine's kernel computes the same formula in another order.

``wd_after_momentum=True`` (Transformer Engine's option; torch.optim.SGD has no such order)
adds the weight decay to the update after momentum, so the momentum buffer holds gradients
only::

    buf = grad                                   (first step)
    buf = momentum * buf + (1 - dampening) * grad
    d = grad + momentum * buf   (nesterov)   or   d = buf
    d = d + weight_decay * param
    param = param - lr * d

``master_weights=True`` (this package's keyword: Transformer Engine's FusedSGD keeps masters
only through apex amp's ``_amp_stash``) keeps a float32 copy of each bfloat16, float16 or FP8
parameter, as FusedAdam does (float32 parameters are updated in place): each step updates the
master and writes it into the parameter once (``param.copy_``), which rounds it to the
parameter's dtype or quantises an FP8 primary weight (``quantized_model_init``) with its
recipe's rule. Without master weights a low-precision or FP8 parameter is updated in float32
and written back once. Momentum buffers are float32 for every parameter.

``materialize_master_grads`` is accepted and changes nothing (it picks which gradients apex
amp's master copies read; the gradient is read once here, in float32). ``set_grad_none`` is
deprecated as in Transformer Engine. Refused, naming the argument: a negative or NaN ``lr``,
``momentum`` or ``weight_decay``, ``nesterov`` without a positive momentum and zero dampening
(torch.optim.SGD's rule), a loaded param group with ``maximize=True``, parameters that are not
float32, bfloat16, float16 or FP8 weights, sparse gradients.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.optim.optimizer import required

from ._base import MasterWeightOptimizer


class FusedSGD(MasterWeightOptimizer):
    """See the module docstring. ``step()`` reads ``param.grad`` and skips parameters without
    one."""

    _NAME = "FusedSGD"
    _SPARSE_HINT = " (use torch.optim.SGD)"

    def __init__(self, params, lr=required, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False, *,
                 wd_after_momentum: bool = False, materialize_master_grads: bool = True,
                 set_grad_none: Optional[bool] = None, master_weights: bool = False):
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening,
                        weight_decay=weight_decay, nesterov=bool(nesterov))
        self.wd_after_momentum = bool(wd_after_momentum)
        self.materialize_master_grads = bool(materialize_master_grads)
        self.master_weights = bool(master_weights)
        super().__init__(params, defaults)
        self._set_grad_none(set_grad_none)

    def __setstate__(self, state):
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("nesterov", False)

    def _state_dtypes(self) -> dict:
        return {"momentum_buffer": torch.float32, "master_param": self.master_weight_dtype}

    def _check_group(self, group: dict) -> None:
        lr = group["lr"]
        if lr is not required:  # (torch.optim refuses a group without one)
            if isinstance(lr, torch.Tensor) and lr.numel() != 1:
                raise ValueError(f"FusedSGD: argument 'lr' must be a number or a 1-element "
                                 f"tensor, got a tensor of shape {tuple(lr.shape)}")
            if not 0.0 <= lr:
                raise ValueError(f"FusedSGD: argument 'lr' must be >= 0, got {lr}")
        for name in ("momentum", "weight_decay"):
            if not 0.0 <= group[name]:
                raise ValueError(f"FusedSGD: argument '{name}' must be >= 0, got {group[name]}")
        if group["nesterov"] and (group["momentum"] <= 0 or group["dampening"] != 0):
            raise ValueError(f"FusedSGD: argument 'nesterov' requires momentum > 0 and "
                             f"dampening == 0 (as torch.optim.SGD), got "
                             f"momentum={group['momentum']}, dampening={group['dampening']}")
        if group.get("maximize", False):
            raise ValueError("FusedSGD: argument 'maximize' must be False (Transformer "
                             "Engine's FusedSGD has none), got True")

    def _update(self, param, grad, state, group) -> None:
        """One parameter's SGD step in float32, in torch.optim.SGD's single-tensor order."""
        lr, momentum = group["lr"], group["momentum"]
        weight_decay, dampening = group["weight_decay"], group["dampening"]
        if isinstance(lr, torch.Tensor):
            lr = lr.item()
        master = self._master(param, state)
        stored = master if master is not None else param
        value = self._float32_value(stored)  # (stored itself where float32: in place)
        grad = grad.float()  # (never written into: every op below on it is out of place)

        if weight_decay != 0 and not self.wd_after_momentum:
            grad = grad.add(value, alpha=weight_decay)
        if momentum != 0:
            buf = state.get("momentum_buffer")
            if buf is None:
                buf = state["momentum_buffer"] = grad.detach().clone()
            else:
                buf.mul_(momentum).add_(grad, alpha=1 - dampening)
            grad = grad.add(buf, alpha=momentum) if group["nesterov"] else buf
        if weight_decay != 0 and self.wd_after_momentum:
            grad = grad.add(value, alpha=weight_decay)  # (out of place: grad may be buf)
        value.add_(grad, alpha=-lr)

        self._write_back(param, master, stored, value)
