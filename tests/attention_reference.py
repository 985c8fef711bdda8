"""Float64 references for attention with Transformer Engine's options (tests only): an
explicit masked softmax with an optional sink, and the masks (causal top-left and
bottom-right, padding, sliding windows, bottom_right_diagonal) written from Transformer
Engine's definitions."""
from __future__ import annotations

import torch


def diagonal_shift(mask_type, s_q, s_kv, bottom_right=None, q_pad=None, kv_pad=None, b=0):
    """Where query i's diagonal meets the keys, from Transformer Engine's definitions: key
    i + shift. Top-left (0) for "causal" and "padding_causal" and, with bottom_right False,
    the others; bottom-right otherwise: s_kv - s_q, with a "padding" type sequence b's
    unpadded lengths."""
    if mask_type in ("causal", "padding_causal"):
        return 0
    if not mask_type.endswith("_bottom_right") and bottom_right is False:
        return 0
    if "padding" in mask_type:
        return int((~kv_pad[b]).sum()) - int((~q_pad[b]).sum())
    return s_kv - s_q


def window_blocked(s_q, s_kv, window, mask_type, q_pad=None, kv_pad=None, bottom_right=None):
    """True where the window (left, right) masks key j for query i: i attends
    [i + shift - left, i + shift + right] (diagonal_shift), left -1 unbounded.
    [b|1, 1, s_q, s_kv]"""
    left, right = window
    rows = []
    for b in range(q_pad.shape[0] if "padding" in mask_type and q_pad is not None else 1):
        shift = diagonal_shift(mask_type, s_q, s_kv, bottom_right, q_pad, kv_pad, b)
        rows.append([[not ((left < 0 or i + shift - left <= j) and j <= i + shift + right)
                      for j in range(s_kv)] for i in range(s_q)])
    return torch.tensor(rows, dtype=torch.bool).unsqueeze(1)


def blocked_mask(mask_type, s_q, s_kv, pads=None, window=None, bottom_right=None):
    """Everything masked out (True) for these mask type, padding masks, window and diagonal
    alignment (bottom_right: bottom_right_diagonal, None as Transformer Engine's default)."""
    q_pad, kv_pad = (p.cpu() for p in pads) if pads is not None else (None, None)
    blocked = torch.zeros(1, 1, s_q, s_kv, dtype=torch.bool)
    if "causal" in mask_type:  # the window (-1, 0) on the type's own diagonal
        blocked = blocked | window_blocked(s_q, s_kv, (-1, 0), mask_type, q_pad, kv_pad,
                                           bottom_right)
    if "padding" in mask_type:
        blocked = blocked | q_pad.transpose(-1, -2) | kv_pad
    if window is not None:
        blocked = blocked | window_blocked(s_q, s_kv, window, mask_type, q_pad, kv_pad,
                                           bottom_right)
    return blocked


def attention_ref(q, k, v, blocked, alpha=None, scale=None, fmt="sbhd"):
    """softmax(q k^T * scale) v in float64 with its gradients (q, k, v, alpha: float64
    tensors that may require grad). q [s, b, h, d] ("bshd": [b, s, h, d]), k, v with g heads
    (GQA: repeated); blocked: True = masked out, broadcastable to [b, h, s_q, s_kv]; alpha [h]:
    exp(alpha_h) joins each denominator (the sink). A row with no key left and no sink gives
    zeros. Returns [s, b, h * d] (or [b, s, h * d])."""
    perm = (1, 2, 0, 3) if fmt == "sbhd" else (0, 2, 1, 3)
    q, k, v = (t.permute(perm) for t in (q, k, v))
    h, g = q.shape[1], k.shape[1]
    k, v = k.repeat_interleave(h // g, dim=1), v.repeat_interleave(h // g, dim=1)
    scores = q @ k.transpose(-1, -2) * (scale if scale is not None else q.shape[-1] ** -0.5)
    blocked = blocked.to(scores.device)
    scores = scores.masked_fill(blocked, 0.0)
    top = scores.detach().amax(dim=-1, keepdim=True)  # (any constant: only for range)
    if alpha is not None:
        top = torch.maximum(top, alpha.detach().view(1, h, 1, 1))
    e = torch.exp(scores - top).masked_fill(blocked, 0.0)
    denominator = e.sum(dim=-1, keepdim=True)
    if alpha is not None:
        denominator = denominator + torch.exp(alpha.view(1, h, 1, 1) - top)
    out = (e / denominator.clamp_min(1e-300)) @ v
    b, _, s, d = out.shape
    if fmt == "sbhd":
        return out.permute(2, 0, 1, 3).reshape(s, b, h * d)
    return out.transpose(1, 2).reshape(b, s, h * d)


def leaf64(t):
    return t.detach().double().requires_grad_(True)


def padding(gen, b, s, device):
    """[b, 1, 1, s], True = padding at the end of each sequence (the first sequence whole)."""
    lengths = [s] + [int(x) for x in torch.randint(2, s, (b - 1,), generator=gen)]
    return torch.tensor([[j >= n for j in range(s)] for n in lengths],
                        device=device).view(b, 1, 1, s)


def assert_matches_reference(out, ref, pairs, grad):
    """``out`` and the gradients of its inputs against the float64 reference ``ref`` and its
    leaves: ``pairs`` is ((name, input, float64 leaf), ...), ``grad`` the output gradient."""
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    out.backward(grad)
    ref.backward(grad.double())
    for name, mine, expected in pairs:
        torch.testing.assert_close(mine.grad.double(), expected.grad, rtol=1e-5, atol=1e-5,
                                   msg=lambda m, name=name: f"d{name}: {m}")
