"""The activations of LayerNormMLP, with Transformer Engine's names.

gelu is the tanh approximation (as Transformer Engine's); qgelu the quick one, x sigmoid(1.702 x);
srelu the squared relu, relu(x)^2. Gated ones (swiglu, geglu, qgeglu, reglu, sreglu, glu:
sigmoid gating, and clamped_swiglu with its activation_params: ClampedSwiGLU) take
[..., 2F] and return [..., F]: act(first half) * second half, so fc1 has 2F outputs.
A NaN input stays NaN through relu, srelu, reglu, sreglu and clamped_swiglu's clamps here
(torch's convention, in the kernels too: reference.py), where Transformer Engine's kernels give
0 (fmaxf(x, 0)) or the limit (fminf); the other activations propagate NaN in both.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.nn.functional as F

from ..ops import fused as fused_ops


def _gelu(x):
    return F.gelu(x, approximate="tanh")


def _qgelu(x):
    return x * torch.sigmoid(1.702 * x)


def _srelu(x):
    return F.relu(x).square()


_PLAIN = {"gelu": _gelu, "relu": F.relu, "silu": F.silu, "qgelu": _qgelu, "srelu": _srelu}
_GATED = {"swiglu": F.silu, "geglu": _gelu, "reglu": F.relu, "qgeglu": _qgelu, "sreglu": _srelu,
          "glu": torch.sigmoid}
CLAMPED_SWIGLU = "clamped_swiglu"
KERNEL_ACTIVATIONS = tuple(_PLAIN) + tuple(_GATED)  # (the fused kernels': ops/fused.py)
ACTIVATIONS = KERNEL_ACTIVATIONS + (CLAMPED_SWIGLU,)


@dataclass(frozen=True)
class ClampedSwiGLU:
    """Transformer Engine's clamped_swiglu (GPT-OSS's MLP), with a the first half of x and g the
    second: y = qgelu(min(a, limit)) * (clamp(g, -limit, limit) + glu_linear_offset), qgelu(t) =
    t sigmoid(alpha t); float32 math, the result in x's dtype. Its derivative is zero where a
    clamp holds (a > limit; |g| > limit), as Transformer Engine's kernels. Computed with torch
    ops (no fused kernel): an FP8 cast of its output or gradient follows it."""

    limit: float = 7.0
    alpha: float = 1.702
    glu_linear_offset: float = 1.0

    def forward(self, x: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """The result in ``dtype`` (default x's; float32: unrounded, as a fused kernel casts
        to FP8 from it)."""
        a, g = x.float().chunk(2, dim=-1)
        a = a.clamp(max=self.limit)
        gate = g.clamp(-self.limit, self.limit) + self.glu_linear_offset
        return (a * torch.sigmoid(self.alpha * a) * gate).to(dtype or x.dtype)

    def backward(self, dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        a, g = x.float().chunk(2, dim=-1)
        dy = dy.float()
        clamped = a.clamp(max=self.limit)
        s = torch.sigmoid(self.alpha * clamped)
        act = clamped * s
        d_act = torch.where(a <= self.limit, s + self.alpha * clamped * s * (1.0 - s), 0.0)
        gate = g.clamp(-self.limit, self.limit) + self.glu_linear_offset
        d_gate = torch.where((g > self.limit) | (g < -self.limit), 0.0, dy * act)
        return torch.cat((dy * gate * d_act, d_gate), dim=-1).to(x.dtype)


Activation = Union[str, ClampedSwiGLU]  # a fused kernel's name, or a parametrised one


def check_activation(activation) -> str:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    return activation


def check_activation_params(activation: str, params) -> Optional[dict]:
    """Transformer Engine's activation_params: None or {} (none), or for clamped_swiglu a dict
    of limit (> 0), alpha and glu_linear_offset (finite numbers; the rest at their defaults,
    7.0, 1.702 and 1.0). Another key, or parameters for another activation (Transformer Engine
    ignores them), is refused. Returns the parameters as a dict of floats, or None."""
    if params is None or (isinstance(params, dict) and not params):
        return None
    if not isinstance(params, dict):
        raise TypeError(f"activation_params must be a dict or None, got "
                        f"{type(params).__name__}")
    if activation != CLAMPED_SWIGLU:
        raise ValueError(f"activation_params={params!r} is read by activation "
                         f"'{CLAMPED_SWIGLU}' only, got activation={activation!r}")
    known = ClampedSwiGLU.__dataclass_fields__
    unknown = sorted(set(params) - set(known))
    if unknown:
        raise ValueError(f"activation_params: unknown key(s) {unknown} for {CLAMPED_SWIGLU}; "
                         f"expected some of {sorted(known)}")
    out = {}
    for key, value in params.items():
        if isinstance(value, bool) or not isinstance(value, numbers.Real) \
                or not math.isfinite(value):
            raise ValueError(f"activation_params[{key!r}] must be a finite number, got "
                             f"{value!r}")
        out[key] = float(value)
    if out.get("limit", 1.0) <= 0:
        raise ValueError(f"activation_params['limit'] must be > 0, got {out['limit']}")
    return out


def activation_of(activation: str, params: Optional[dict]) -> Activation:
    """What the modules compute with: the kernel name, or a ClampedSwiGLU with the params."""
    if activation == CLAMPED_SWIGLU:
        return ClampedSwiGLU(**(params or {}))
    return activation


def is_gated(activation: str) -> bool:
    return activation in _GATED or activation == CLAMPED_SWIGLU


def has_kernel(activation: Activation) -> bool:
    """Whether the fused activation kernels (ops/fused.py) compute it."""
    return isinstance(activation, str)


def activation_forward(x: torch.Tensor, activation: Activation) -> torch.Tensor:
    """The activation of a 2-D x: its fused kernel, or torch ops for a parametrised one."""
    if has_kernel(activation):
        return fused_ops.activation_fwd(x, activation)
    return activation.forward(x)


def activation_backward(dy: torch.Tensor, x: torch.Tensor,
                        activation: Activation) -> torch.Tensor:
    """d(loss)/dx of activation_forward."""
    if has_kernel(activation):
        return fused_ops.activation_bwd(dy, x, activation)
    return activation.backward(dy, x)


def activation_hp(x: torch.Tensor, activation: Activation) -> torch.Tensor:
    """The activation in torch ops: float32 math, the result in x's dtype."""
    if activation == CLAMPED_SWIGLU:  # (by name: its default parameters)
        activation = ClampedSwiGLU()
    if not has_kernel(activation):
        return activation.forward(x)  # (autograd differentiates its torch ops)
    xf = x.float()
    if activation in _PLAIN:
        return _PLAIN[activation](xf).to(x.dtype)
    gate, linear = xf.chunk(2, dim=-1)
    return (_GATED[activation](gate) * linear).to(x.dtype)
