"""The activations of LayerNormMLP, with Transformer Engine's names.

gelu is the tanh approximation (as Transformer Engine's); qgelu the quick one, x sigmoid(1.702 x);
srelu the squared relu, relu(x)^2. Gated ones (swiglu, geglu, qgeglu, reglu, sreglu, and glu:
sigmoid gating) take
[..., 2F] and return [..., F]: act(first half) * second half, so fc1 has 2F outputs.
A NaN input stays NaN through relu, srelu, reglu and sreglu here (torch's convention, in the
kernels too: reference.py), where Transformer Engine's kernels give 0 (fmaxf(x, 0)); the other
activations propagate NaN in both.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def _gelu(x):
    return F.gelu(x, approximate="tanh")


def _qgelu(x):
    return x * torch.sigmoid(1.702 * x)


def _srelu(x):
    return F.relu(x).square()


_PLAIN = {"gelu": _gelu, "relu": F.relu, "silu": F.silu, "qgelu": _qgelu, "srelu": _srelu}
_GATED = {"swiglu": F.silu, "geglu": _gelu, "reglu": F.relu, "qgeglu": _qgelu, "sreglu": _srelu,
          "glu": torch.sigmoid}
ACTIVATIONS = tuple(_PLAIN) + tuple(_GATED)


def check_activation(activation) -> str:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    return activation


def is_gated(activation: str) -> bool:
    return activation in _GATED


def activation_hp(x: torch.Tensor, activation: str) -> torch.Tensor:
    """The activation in torch ops: float32 math, the result in x's dtype."""
    xf = x.float()
    if activation in _PLAIN:
        return _PLAIN[activation](xf).to(x.dtype)
    gate, linear = xf.chunk(2, dim=-1)
    return (_GATED[activation](gate) * linear).to(x.dtype)
