"""Transformer Engine's ``optimizers.FusedAdam``: Adam / AdamW with optional master weights.

Its arguments and defaults are Transformer Engine's; its arithmetic is torch.optim.AdamW's
(``adam_w_mode=True``) or torch.optim.Adam's (``adam_w_mode=False``: L2 weight decay added to
the gradient), operation for operation, one parameter at a time in torch ops (not one fused
kernel): for float32 parameters without master weights, bit for bit what
``torch.optim.AdamW(foreach=False)`` computes. Transformer Engine's kernel computes the same
formula in another order.

``master_weights=True`` keeps a float32 copy of each bfloat16, float16 or FP8 parameter
(float32 parameters are updated in place, as Transformer Engine does): each step updates the
master and writes it into the parameter once (``param.copy_``), which rounds it to the
parameter's dtype, or quantises an FP8 primary weight (``quantized_model_init``) with its
recipe's rule. A master starts from the parameter's value at its first step (one missing from
a loaded state is made then too); an FP8 weight's from its high-precision initial value
(``preserve_high_precision_init_val=True``) while the weight still holds that value's cast,
else from its dequantised value. Without master weights a low-precision or FP8 parameter is
updated in float32 and written back once.

``exp_avg_dtype`` / ``exp_avg_sq_dtype``: float32 or bfloat16 (stored in that dtype, updated in
float32). Refused, naming the argument: ``amsgrad``, ``capturable``, float16 or FP8
(``torch.uint8``) moments and a float16 ``master_weight_dtype`` (Transformer Engine stores
those with a scale of their own; without it small moments flush to zero), parameters that are
not float32, bfloat16, float16 or FP8 weights (complex, float64), sparse gradients.
``store_param_remainders`` is accepted and keeps the whole float32 master (the same numbers;
Transformer Engine stores 16 bits of it).
"""
from __future__ import annotations

import warnings
from itertools import chain
from typing import Optional

import torch

_MOMENT_DTYPES = (torch.float32, torch.bfloat16)
_MASTER_DTYPES = (torch.float32,)
_PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_dtype(name: str, value, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"FusedAdam: argument '{name}' must be one of "
                         f"{[str(d) for d in allowed]}, got {value}")


def _master_start(param) -> torch.Tensor:
    """A plain tensor of the parameter's value: an FP8 weight's high-precision initial value
    while the weight still holds its cast (nothing written since), else its dequantised value
    (its .float() / .to() would be FP8 weights)."""
    if not hasattr(param, "fp8_data"):
        return param.detach()
    init = param.get_high_precision_init_val()
    if init is not None and param.holds_cast_of(init):
        return init
    return param.dequantize()


class FusedAdam(torch.optim.Optimizer):
    """See the module docstring. ``step()`` reads ``param.grad`` (``param.decoupled_grad``
    with ``use_decoupled_grad=True``) and skips parameters without one."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, amsgrad: bool = False, *, bias_correction=True,
                 adam_w_mode=True, capturable=False, master_weights=False,
                 master_weight_dtype=torch.float32, exp_avg_dtype=torch.float32,
                 exp_avg_sq_dtype=torch.float32, use_decoupled_grad=False,
                 store_param_remainders=False, set_grad_none: Optional[bool] = None):
        if amsgrad:
            raise ValueError("FusedAdam: argument 'amsgrad' must be False (no AMSGrad variant, "
                             "as in Transformer Engine), got True")
        if capturable:
            raise ValueError("FusedAdam: argument 'capturable' must be False (the step reads "
                             "its step count on the host, so it cannot be captured in a CUDA "
                             "graph), got True")
        if master_weights:
            _check_dtype("master_weight_dtype", master_weight_dtype, _MASTER_DTYPES)
        _check_dtype("exp_avg_dtype", exp_avg_dtype, _MOMENT_DTYPES)
        _check_dtype("exp_avg_sq_dtype", exp_avg_sq_dtype, _MOMENT_DTYPES)
        if not 0.0 <= lr:
            raise ValueError(f"FusedAdam: argument 'lr' must be >= 0, got {lr}")
        if not 0.0 <= eps:
            raise ValueError(f"FusedAdam: argument 'eps' must be >= 0, got {eps}")
        for i, beta in enumerate(betas):
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"FusedAdam: argument 'betas[{i}]' must be in [0, 1), got {beta}")
        defaults = dict(lr=lr, bias_correction=bool(bias_correction), betas=tuple(betas),
                        eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.adam_w_mode = bool(adam_w_mode)
        self.master_weights = bool(master_weights)
        self.master_weight_dtype = master_weight_dtype
        self.exp_avg_dtype, self.exp_avg_sq_dtype = exp_avg_dtype, exp_avg_sq_dtype
        self.use_decoupled_grad = bool(use_decoupled_grad)
        self.store_param_remainders = bool(store_param_remainders)
        self.set_grad_none = set_grad_none
        if set_grad_none is not None:
            warnings.warn("FusedAdam: 'set_grad_none' is deprecated (as in Transformer Engine): "
                          "pass set_to_none to zero_grad", DeprecationWarning, stacklevel=2)

    def _state_dtypes(self) -> dict:
        return {"exp_avg": self.exp_avg_dtype, "exp_avg_sq": self.exp_avg_sq_dtype,
                "master_param": self.master_weight_dtype}

    def zero_grad(self, set_to_none: Optional[bool] = None) -> None:
        if self.set_grad_none is not None:
            if set_to_none is not None and set_to_none != self.set_grad_none:
                raise ValueError(f"FusedAdam.zero_grad: set_to_none={set_to_none}, but the "
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
            raise ValueError("FusedAdam: sparse gradients are not supported (use "
                             "torch.optim.SparseAdam)")
        return grad

    def add_param_group(self, param_group: dict) -> None:
        params = param_group["params"]
        for p in [params] if isinstance(params, torch.Tensor) else list(params):
            if p.dtype not in _PARAM_DTYPES:
                raise ValueError(f"FusedAdam: parameters must be float32, bfloat16, float16 or "
                                 f"FP8 weights, got one of dtype {p.dtype} and shape "
                                 f"{tuple(p.shape)}")
        super().add_param_group(param_group)

    def _needs_master(self, param) -> bool:
        return self.master_weights and (param.dtype != torch.float32 or hasattr(param, "fp8_data"))

    def _init_state(self, param) -> dict:
        state = self.state[param]
        state["step"] = torch.tensor(0.0)
        # (zeros_like keeps a DTensor's layout; of an FP8 weight it would be an FP8 weight)
        like = param.dequantize() if hasattr(param, "fp8_data") else param
        state["exp_avg"] = torch.zeros_like(like, dtype=self.exp_avg_dtype)
        state["exp_avg_sq"] = torch.zeros_like(like, dtype=self.exp_avg_sq_dtype)
        return state

    def _master(self, param, state) -> Optional[torch.Tensor]:
        """The parameter's master (made at its first step, or the first after a load without
        one), or None."""
        if not self._needs_master(param):
            return None
        if "master_param" not in state:
            state["master_param"] = _master_start(param).to(
                device=param.device, dtype=self.master_weight_dtype, copy=True)
        return state["master_param"]

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for param in group["params"]:
                grad = self._grad(param)
                if grad is not None:
                    state = self.state[param] if self.state[param] else self._init_state(param)
                    self._update(param, grad, state, group)
        return loss

    def _update(self, param, grad, state, group) -> None:
        """One parameter's Adam step in float32, in torch.optim's single-tensor order."""
        lr, eps, weight_decay = group["lr"], group["eps"], group["weight_decay"]
        beta1, beta2 = group["betas"]
        master = self._master(param, state)
        # The value updated: the master, or the parameter itself where it is float32 (then in
        # place, as torch.optim does), else a float32 copy written back once at the end.
        stored = master if master is not None else param
        in_place = stored.dtype == torch.float32 and not hasattr(stored, "fp8_data")
        if in_place:
            value = stored
        else:  # a float32 copy (an FP8 weight: of its dequantised value)
            value = (stored.dequantize() if hasattr(stored, "fp8_data") else stored).float()
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        m = exp_avg if exp_avg.dtype == torch.float32 else exp_avg.float()
        v = exp_avg_sq if exp_avg_sq.dtype == torch.float32 else exp_avg_sq.float()
        grad = grad.float()

        state["step"] += 1
        step = state["step"].item()
        if weight_decay != 0:
            if self.adam_w_mode:
                value.mul_(1 - lr * weight_decay)
            else:
                grad = grad.add(value, alpha=weight_decay)
        m.lerp_(grad, 1 - beta1)
        v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        if group["bias_correction"]:
            bias_correction1, bias_correction2 = 1 - beta1 ** step, 1 - beta2 ** step
        else:
            bias_correction1 = bias_correction2 = 1.0
        denom = (v.sqrt() / bias_correction2 ** 0.5).add_(eps)
        value.addcdiv_(m, denom, value=-(lr / bias_correction1))

        if m is not exp_avg:
            exp_avg.copy_(m)
        if v is not exp_avg_sq:
            exp_avg_sq.copy_(v)
        if value is not stored:
            stored.copy_(value)
        if master is not None:
            param.copy_(value)  # rounded to the parameter's dtype, or quantised (FP8 weights)

    def load_state_dict(self, state_dict: dict) -> None:
        """torch.optim casts every floating state to its parameter's dtype at a load; the
        moments and the master keep their own dtypes here. A group saved by another optimizer
        (torch.optim.AdamW) takes this one's defaults for what it lacks (bias_correction)."""
        saved = {key: {name: value for name, value in entry.items()
                       if name in ("step", "exp_avg", "exp_avg_sq", "master_param")}
                 for key, entry in state_dict["state"].items()}
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            for name, default in self.defaults.items():
                group.setdefault(name, default)
        ids = chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        params = chain.from_iterable(g["params"] for g in self.param_groups)
        dtypes = self._state_dtypes()
        for key, param in zip(ids, params):  # (copies: nothing shared with the state given)
            for name, value in saved.get(key, {}).items():
                if name == "step":
                    self.state[param][name] = torch.tensor(float(value), dtype=torch.float32)
                else:
                    self.state[param][name] = value.to(device=param.device, dtype=dtypes[name],
                                                       copy=True)
