"""The activations of LayerNormMLP, with Transformer Engine's names.

gelu is the tanh approximation (as Transformer Engine's). Gated ones (swiglu, geglu, reglu) take
[..., 2F] and return [..., F]: act(first half) * second half, so fc1 has 2F outputs.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def _gelu(x):
    return F.gelu(x, approximate="tanh")


_PLAIN = {"gelu": _gelu, "relu": F.relu, "silu": F.silu}
_GATED = {"swiglu": F.silu, "geglu": _gelu, "reglu": F.relu}
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
