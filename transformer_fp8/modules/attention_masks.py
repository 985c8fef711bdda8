"""Transformer Engine's attention masks for DotProductAttention, as SDPA's boolean mask.

attention_mask is boolean with True = masked out (the opposite of SDPA's attn_mask):
"padding" takes [b, 1, 1, s] (a tuple (query mask, key/value mask) when s_q != s_kv),
"arbitrary" anything broadcastable to [b, h, s_q, s_kv]; with "causal" or "no_mask" a mask is
ignored, as in Transformer Engine's fused backends. Causal masks are top-left aligned (query i
sees keys 0..i).
"""
from __future__ import annotations

import torch

_OWNER = "DotProductAttention"


def allowed_mask(mask_type, mask, batch, heads, seq_q, seq_kv, device):
    """(SDPA's boolean mask, True = may attend, broadcastable to [b, h, s_q, s_kv], or None;
    is_causal)."""
    owner = _OWNER
    if mask_type in ("no_mask", "causal"):
        # These types take no mask; one passed anyway is ignored, as Transformer Engine
        # ignores it (model code often passes its padding mask along regardless).
        return None, mask_type == "causal"
    if mask is None:
        raise ValueError(f"{owner}: attn_mask_type {mask_type!r} needs an attention_mask "
                         "(boolean, True = masked out), got None")
    if mask_type == "arbitrary":
        check_bool(mask, "attention_mask")
        # Broadcasting one way only: each of the mask's last (up to 4) dims is 1 or the
        # attention's own (a batch-3 mask on a batch-1 input is refused here).
        full = [batch, heads, seq_q, seq_kv]
        if mask.dim() > 4 or any(m not in (1, f) for m, f in
                                 zip(reversed(mask.shape), reversed(full))):
            raise ValueError(f"{owner}: an 'arbitrary' attention_mask must broadcast to "
                             f"[b, h, s_q, s_kv] = {full}, got shape {tuple(mask.shape)}")
        allowed = ~mask.to(device)
    else:  # padding, padding_causal: [b, 1, 1, s] per side, True = a padding token
        q_pad, kv_pad = padding_masks(mask, batch, seq_q, seq_kv, device)
        allowed = ~q_pad.reshape(batch, 1, seq_q, 1) & ~kv_pad
    if mask_type == "padding_causal":
        allowed = allowed & torch.ones(seq_q, seq_kv, dtype=torch.bool, device=device).tril()
    return allowed, False


def padding_masks(mask, batch, seq_q, seq_kv, device):
    """A padding attention_mask, checked, as (query [b, 1, 1, s_q], key/value [b, 1, 1, s_kv])
    on device (True = a padding token)."""
    owner = _OWNER
    if isinstance(mask, (tuple, list)):
        if len(mask) != 2:
            raise ValueError(f"{owner}: a padding attention_mask tuple must be (query mask, "
                             f"key/value mask), got {len(mask)} tensors")
        q_pad, kv_pad = mask
    elif seq_q == seq_kv:
        q_pad = kv_pad = mask
    else:
        raise ValueError(f"{owner}: with s_q ({seq_q}) != s_kv ({seq_kv}) a padding "
                         "attention_mask must be a tuple (query mask [b, 1, 1, s_q], "
                         "key/value mask [b, 1, 1, s_kv])")
    for name, m, s in (("query", q_pad, seq_q), ("key/value", kv_pad, seq_kv)):
        check_bool(m, f"attention_mask ({name})")
        if tuple(m.shape) != (batch, 1, 1, s):
            raise ValueError(f"{owner}: a padding attention_mask ({name}) must have shape "
                             f"[b, 1, 1, s] = [{batch}, 1, 1, {s}], got {tuple(m.shape)}")
    return q_pad.to(device), kv_pad.to(device)


def check_bool(mask, name):
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        got = mask.dtype if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise TypeError(f"DotProductAttention: {name} must be a bool tensor (True = masked "
                        f"out), got {got}")
