"""Transformer Engine's query/key normalisation for MultiheadAttention (qk_norm_type).

q_norm and k_norm act over the head dimension of q [.., h, d] and k [.., g, d], after the
rotary embedding (before it with qk_norm_before_rope), as in Qwen3, OLMo2 or Llama 4:
  "RMSNorm" / "LayerNorm"  two norms with weights [d] (LayerNorm: and biases), ones at first:
                           q_norm.weight, k_norm.weight in the state_dict
  "L2Normalization"        x / sqrt(sum x^2 + eps) in float32 (float64 for float64 x),
                           returned in x's dtype;
                           parameter-free, one module serving as both
eps: qk_norm_eps (1e-6 by default).
"""
from __future__ import annotations

import torch

from ..normalization import LayerNorm, RMSNorm, check_eps
from ..torchscript import refuse_torchscript

QK_NORM_TYPES = ("L2Normalization", "RMSNorm", "LayerNorm")


class L2Normalization(torch.nn.Module):
    """Transformer Engine's L2Normalization over the last dimension (parameter-free)."""

    __prepare_scriptable__ = refuse_torchscript  # (torch.jit.script: a clear error)

    def __init__(self, eps: float = 1e-6):
        super().__init__()
        self.eps = check_eps(eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.to(torch.promote_types(x.dtype, torch.float32))  # (float64 stays float64)
        return (x32 * torch.rsqrt(x32.square().sum(-1, keepdim=True) + self.eps)).to(x.dtype)

    def _load_from_state_dict(self, state_dict, prefix, *args):
        from .. import te_checkpoint
        super()._load_from_state_dict(state_dict, prefix, *args)
        te_checkpoint.drop_extra_state(state_dict, prefix, args[3], "L2Normalization")

    def extra_repr(self) -> str:
        return f"eps={self.eps}"


def qk_norm_modules(owner: str, qk_norm_type, eps, head_dim: int, dtype, device):
    """(q_norm, k_norm) for qk_norm_type: (None, None), one L2Normalization twice, or two
    norms over head_dim."""
    if qk_norm_type is None:
        return None, None
    if qk_norm_type not in QK_NORM_TYPES:
        raise ValueError(f"{owner}: qk_norm_type must be None or one of {QK_NORM_TYPES}, got "
                         f"{qk_norm_type!r}")
    try:
        eps = check_eps(eps)
    except ValueError:
        raise ValueError(f"{owner}: qk_norm_eps must be a finite number >= 0, got "
                         f"{eps!r}") from None
    if qk_norm_type == "L2Normalization":
        shared = L2Normalization(eps)
        return shared, shared
    norm = RMSNorm if qk_norm_type == "RMSNorm" else LayerNorm
    return tuple(norm(head_dim, eps=eps, params_dtype=dtype, device=device) for _ in range(2))
