"""Transformer Engine's attention masks for DotProductAttention, as SDPA's boolean mask.

attention_mask is boolean with True = masked out (the opposite of SDPA's attn_mask):
"padding" types take [b, 1, 1, s] (a tuple (query mask, key/value mask) when s_q != s_kv, and
always for cross-attention),
"arbitrary" anything broadcastable to [b, h, s_q, s_kv]; with "no_mask" or a causal type
without "padding" a mask is ignored, as in Transformer Engine's fused backends.

Diagonals. Query i may attend key j when shift - left <= j - i <= shift + right:
  * causal types have right = 0 (left unbounded unless a window bounds it);
  * window_size (left, right), Transformer Engine's sliding window ((-1, -1) is no window,
    (-1, 0) the causal one; a causal type takes (-1, 0) or (>= 0, 0), the others (-1, -1) or
    (>= 0, >= 0); a value that contradicts the mask type is adjusted with a warning, as
    Transformer Engine does);
  * shift: 0 aligns the diagonal top-left ("causal", "padding_causal", and the others with
    bottom_right_diagonal=False); s_kv - s_q aligns it bottom-right ("*_bottom_right", and
    the others with bottom_right_diagonal True or None), with the "padding" types each
    sequence's own lengths (padding at the end).
bottom_right_diagonal follows Transformer Engine: forced False for "causal" and
"padding_causal", True for "*_bottom_right"; None means True for the other types.
"""
from __future__ import annotations

import warnings
from typing import Optional

import torch

_OWNER = "DotProductAttention"
TOP_LEFT_CAUSAL = ("causal", "padding_causal")


def resolve_bottom_right(owner: str, mask_type: str, bottom_right_diagonal) -> bool:
    """Whether the diagonal (causal or window) is aligned bottom-right for this mask type."""
    if bottom_right_diagonal is not None and not isinstance(bottom_right_diagonal, bool):
        raise ValueError(f"{owner}: bottom_right_diagonal must be None, True or False, got "
                         f"{bottom_right_diagonal!r}")
    if mask_type in TOP_LEFT_CAUSAL:
        return False
    if mask_type.endswith("_bottom_right") or bottom_right_diagonal is None:
        return True
    return bottom_right_diagonal


def allowed_mask(mask_type, mask, batch, heads, seq_q, seq_kv, device, window=None,
                 bottom_right=False, cross=False):
    """(SDPA's boolean mask, True = may attend, broadcastable to [b, h, s_q, s_kv], or None;
    is_causal: SDPA's own top-left causal mask). window: resolve_window's (left, right) or
    None; bottom_right: resolve_bottom_right's; cross: cross-attention (a padding mask is then
    a pair)."""
    owner = _OWNER
    causal = "causal" in mask_type
    if window is None and mask_type in ("no_mask", "causal", "causal_bottom_right"):
        # These types take no mask; one passed anyway is ignored, as Transformer Engine
        # ignores it (model code often passes its padding mask along regardless).
        if not causal or seq_q == 1 and bottom_right:  # (one query sees every key)
            return None, False
        if not bottom_right or seq_q == seq_kv:  # SDPA's own causal kernels
            return None, True
    pads = allowed = None
    if mask_type == "arbitrary":
        if mask is None:
            raise ValueError(f"{owner}: attn_mask_type 'arbitrary' needs an attention_mask "
                             "(boolean, True = masked out), got None")
        check_bool(mask, "attention_mask")
        # Broadcasting one way only: each of the mask's last (up to 4) dims is 1 or the
        # attention's own (a batch-3 mask on a batch-1 input is refused here).
        full = [batch, heads, seq_q, seq_kv]
        if mask.dim() > 4 or any(m not in (1, f) for m, f in
                                 zip(reversed(mask.shape), reversed(full))):
            raise ValueError(f"{owner}: an 'arbitrary' attention_mask must broadcast to "
                             f"[b, h, s_q, s_kv] = {full}, got shape {tuple(mask.shape)}")
        allowed = ~mask.to(device)
    elif "padding" in mask_type:  # [b, 1, 1, s] per side, True = a padding token
        if mask is None:
            raise ValueError(f"{owner}: attn_mask_type {mask_type!r} needs an attention_mask "
                             "(boolean, True = masked out), got None")
        pads = padding_masks(mask, batch, seq_q, seq_kv, device, cross)
        allowed = ~pads[0].reshape(batch, 1, seq_q, 1) & ~pads[1]
    if causal or window is not None:
        left, right = window if window is not None else (-1, 0)
        band = diagonal_band(left, 0 if causal else right, seq_q, seq_kv, device,
                             bottom_right, pads)
        allowed = band if allowed is None else allowed & band
    return allowed, False


def padding_masks(mask, batch, seq_q, seq_kv, device, cross=False):
    """A padding attention_mask, checked, as (query [b, 1, 1, s_q], key/value [b, 1, 1, s_kv])
    on device (True = a padding token). Self-attention may give one tensor for both sides
    where s_q == s_kv; cross-attention gives the pair, as Transformer Engine's does (one
    tensor there is ambiguous: an encoder's key mask would also mask the decoder's queries)."""
    owner = _OWNER
    if isinstance(mask, (tuple, list)):
        if len(mask) != 2:
            raise ValueError(f"{owner}: a padding attention_mask tuple must be (query mask, "
                             f"key/value mask), got {len(mask)} tensors")
        q_pad, kv_pad = mask
    elif cross:
        raise ValueError(f"{owner}: cross-attention with a padding mask type takes "
                         "attention_mask as a tuple (query mask [b, 1, 1, s_q], key/value mask "
                         "[b, 1, 1, s_kv]), got one tensor")
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


# ---- sliding windows -----------------------------------------------------------------------

def check_window_size(owner: str, window_size):
    """window_size as given (None or a pair of ints >= -1) as a tuple; ValueError otherwise."""
    if window_size is None:
        return None
    if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
            or any(isinstance(w, bool) or not isinstance(w, int) or w < -1
                   for w in window_size)):
        raise ValueError(f"{owner}: window_size must be None or a pair (left, right) of ints "
                         f">= -1 (-1 = unbounded), got {window_size!r}")
    return tuple(window_size)


def resolve_window(owner: str, mask_type: str, window_size) -> Optional[tuple]:
    """The window (left, right) to apply with this mask type, or None where it masks nothing
    beyond the mask type itself."""
    window = check_window_size(owner, window_size)
    if window is None:
        return None
    left, right = window
    causal = "causal" in mask_type
    expected = "(-1, 0) or (>=0, 0)" if causal else "(-1, -1) or (>=0, >=0)"
    if window == ((-1, 0) if causal else (-1, -1)):
        return None
    # Transformer Engine's adjustments: a causal type drops a right extent (and takes (-1, -1)
    # as causal); the others take (-1, 0) as no window.
    if causal and (window == (-1, -1) or (left >= 0 and right != 0)):
        _adjusted(owner, mask_type, window, expected, (left, 0))
        return None if left == -1 else (left, 0)
    if not causal and window == (-1, 0):
        _adjusted(owner, mask_type, window, expected, (-1, -1))
        return None
    if left >= 0 and right >= 0:
        return window
    raise ValueError(f"{owner}: window_size must be {expected} with attn_mask_type "
                     f"{mask_type!r}, got {window}")


def _adjusted(owner, mask_type, window, expected, used):
    warnings.warn(f"{owner}: window_size should be {expected} with attn_mask_type "
                  f"{mask_type!r}, got {window}; using {used}", stacklevel=4)


def diagonal_band(left, right, seq_q, seq_kv, device, bottom_right, pads=None):
    """True where query i may attend key j: shift - left <= j - i <= shift + right (left -1:
    unbounded). shift 0 (top-left) or, bottom-right, s_kv - s_q: [s_q, s_kv]; with padding
    masks (pads: query and key/value, True = padding) each sequence's real lengths:
    [b, 1, s_q, s_kv]."""
    offset = (torch.arange(seq_kv, device=device).view(1, seq_kv)
              - torch.arange(seq_q, device=device).view(seq_q, 1))  # j - i
    if not bottom_right:
        shift = 0
    elif pads is not None:
        q_len = (~pads[0]).sum(dim=-1, keepdim=True)  # [b, 1, 1, 1]
        shift = (~pads[1]).sum(dim=-1, keepdim=True) - q_len
    else:
        shift = seq_kv - seq_q
    band = offset <= shift + right
    return band if left < 0 else band & (offset >= shift - left)
