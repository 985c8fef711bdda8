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
float32). Refused, naming the argument: a negative or NaN ``lr``, ``eps`` or
``weight_decay`` and ``betas`` outside [0, 1) (torch.optim.Adam's rule, in every param group),
``amsgrad``, ``capturable``, float16 or FP8
(``torch.uint8``) moments and a float16 ``master_weight_dtype`` (Transformer Engine stores
those with a scale of their own; without it small moments flush to zero), parameters that are
not float32, bfloat16, float16 or FP8 weights (complex, float64), sparse gradients.
``store_param_remainders`` is accepted and keeps the whole float32 master (the same numbers;
Transformer Engine stores 16 bits of it).

``load_state_dict`` also takes Transformer Engine's FusedAdam state dicts: the step count kept
per parameter group (``group["step"]``, given to each parameter's state), and with
``store_param_remainders`` a bfloat16 parameter's master as its int16 low 16 bits, from which
the float32 master is rebuilt with the parameter's bits at its next step (Transformer Engine's
rule: the bfloat16 value was rounded to nearest from the master; the model's weights may be
loaded before or after the optimizer). Checked before anything is loaded: a
state with moments and no step count anywhere, or an int16 master of a parameter that is not
bfloat16, is refused naming the parameter.
"""
from __future__ import annotations

from typing import Optional

import torch

from ._base import MASTER_DTYPES, MasterWeightOptimizer, is_fp8_weight

_MOMENT_DTYPES = (torch.float32, torch.bfloat16)


class FusedAdam(MasterWeightOptimizer):
    """See the module docstring. ``step()`` reads ``param.grad`` (``param.decoupled_grad``
    with ``use_decoupled_grad=True``) and skips parameters without one."""

    _NAME = "FusedAdam"
    _SPARSE_HINT = " (use torch.optim.SparseAdam)"

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
            self._check_dtype("master_weight_dtype", master_weight_dtype, MASTER_DTYPES)
        self._check_dtype("exp_avg_dtype", exp_avg_dtype, _MOMENT_DTYPES)
        self._check_dtype("exp_avg_sq_dtype", exp_avg_sq_dtype, _MOMENT_DTYPES)
        defaults = dict(lr=lr, bias_correction=bool(bias_correction), betas=tuple(betas),
                        eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.adam_w_mode = bool(adam_w_mode)
        self.master_weights = bool(master_weights)
        self.master_weight_dtype = master_weight_dtype
        self.exp_avg_dtype, self.exp_avg_sq_dtype = exp_avg_dtype, exp_avg_sq_dtype
        self.use_decoupled_grad = bool(use_decoupled_grad)
        self.store_param_remainders = bool(store_param_remainders)
        self._set_grad_none(set_grad_none)

    def _check_group(self, group: dict) -> None:
        # (each group's, as torch.optim.Adam: the constructor's and add_param_group's)
        for name in ("lr", "eps", "weight_decay"):
            if not 0.0 <= group[name]:
                raise ValueError(f"FusedAdam: argument '{name}' must be >= 0, got {group[name]}")
        for i, beta in enumerate(group["betas"]):
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"FusedAdam: argument 'betas[{i}]' must be in [0, 1), got {beta}")
        # (torch.optim.Adam's switches that a loaded or added group may carry: the step has
        # neither, and would ignore them silently)
        for name in ("amsgrad", "maximize"):
            if group.get(name, False):
                raise ValueError(f"FusedAdam: argument '{name}' must be False (no such "
                                 f"variant of the step), got {group[name]!r} in a parameter "
                                 "group")

    def _state_dtypes(self) -> dict:
        return {"exp_avg": self.exp_avg_dtype, "exp_avg_sq": self.exp_avg_sq_dtype,
                "master_param": self.master_weight_dtype}

    def _kept_states(self) -> tuple:
        return ("step",) + super()._kept_states()

    def _restored(self, name: str, value, param) -> Optional[torch.Tensor]:
        if name == "step":  # (on the host: the step reads it there)
            return torch.tensor(float(value), dtype=torch.float32)
        if name == "master_param" and value is not None and value.dtype == torch.int16:
            # Kept as it is: the master is rebuilt with the parameter's bits at its next step
            # (_base.master_from_remainder), when the parameter holds its loaded value too.
            return value.to(device=param.device, copy=True)
        return super()._restored(name, value, param)

    def load_state_dict(self, state_dict: dict) -> None:
        _check_loadable(state_dict, self.param_groups)
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            # Transformer Engine counts the steps per group: each parameter's state takes it.
            group_step = group.pop("step", None)
            for param in group["params"]:
                state = self.state.get(param)
                if state and "step" not in state:
                    state["step"] = torch.tensor(float(group_step), dtype=torch.float32)

    def _init_state(self, param) -> dict:
        state = self.state[param]
        state["step"] = torch.tensor(0.0)
        # (zeros_like keeps a DTensor's layout; of an FP8 weight it would be an FP8 weight)
        like = param.dequantize() if is_fp8_weight(param) else param
        state["exp_avg"] = torch.zeros_like(like, dtype=self.exp_avg_dtype)
        state["exp_avg_sq"] = torch.zeros_like(like, dtype=self.exp_avg_sq_dtype)
        return state

    def _update(self, param, grad, state, group) -> None:
        """One parameter's Adam step in float32, in torch.optim's single-tensor order."""
        if not state:
            state = self._init_state(param)
        lr, eps, weight_decay = group["lr"], group["eps"], group["weight_decay"]
        beta1, beta2 = group["betas"]
        master = self._master(param, state)
        # The value updated: the master, or the parameter itself where it is float32 (then in
        # place, as torch.optim does), else a float32 copy written back once at the end.
        stored = master if master is not None else param
        value = self._float32_value(stored)
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
        self._write_back(param, master, stored, value)


def _check_loadable(state_dict: dict, groups: list) -> None:
    """What a load of ``state_dict`` would need and lack, refused before anything is loaded:
    a step count for every state with moments (its own, or its group's, Transformer Engine's
    place for it), and a bfloat16 parameter for every int16 master (a remainder)."""
    saved_groups = state_dict.get("param_groups", [])
    states = state_dict.get("state", {})
    params = [p for g in groups for p in g["params"]]
    keys = [(k, g) for g in saved_groups for k in g.get("params", [])]
    for index, (key, group) in enumerate(keys):
        entry = states.get(key)
        if not entry:
            continue
        if ("exp_avg" in entry or "exp_avg_sq" in entry) and "step" not in entry \
                and "step" not in group:
            raise ValueError(f"FusedAdam.load_state_dict: the state of parameter {key} has "
                             "moments but no step count, neither its own ('step') nor its "
                             "group's (Transformer Engine's)")
        master = entry.get("master_param")
        if isinstance(master, torch.Tensor) and master.dtype == torch.int16 and (
                index >= len(params) or params[index].dtype != torch.bfloat16
                or tuple(params[index].shape) != tuple(master.shape)):
            got = "no parameter" if index >= len(params) else (
                f"a {params[index].dtype} parameter of shape {tuple(params[index].shape)}")
            raise ValueError(f"FusedAdam.load_state_dict: 'master_param' of parameter {key} is "
                             "int16 (Transformer Engine's store_param_remainders: the low 16 "
                             f"bits of a bfloat16 parameter's float32 master), of shape "
                             f"{tuple(master.shape)}, but it belongs to {got}")
