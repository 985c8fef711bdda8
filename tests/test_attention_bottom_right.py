"""Bottom-right diagonals: attn_mask_type "causal_bottom_right" / "padding_causal_bottom_right"
and bottom_right_diagonal (the sliding window's alignment for the other types), in
DotProductAttention, MultiheadAttention and TransformerLayer.

Against the float64 reference of attention_reference.py (masks written from Transformer
Engine's definitions): outputs and gradients, s_q == s_kv and s_q != s_kv both ways, with
windows, GQA, both layouts; Transformer Engine's forcing rules; the errors."""
from __future__ import annotations

import pytest
import torch
from attention_reference import (assert_matches_reference, attention_ref, blocked_mask, leaf64,
                                 padding)
from conftest import randn

from transformer_fp8.modules.attention import DotProductAttention
from transformer_fp8.modules.attention import MultiheadAttention
from transformer_fp8.modules.transformer_layer import TransformerLayer

H, D = 4, 16


def check(gen, device, mask_type, s_q, s_kv, window=None, bottom_right=None, fmt="sbhd",
          groups=2, b=3, where="forward"):
    """DotProductAttention against the float64 reference; bottom_right given to the
    constructor or to forward (where)."""
    shape = (lambda s, h: (s, b, h, D)) if fmt == "sbhd" else (lambda s, h: (b, s, h, D))
    q = randn(gen, *shape(s_q, H), device=device).requires_grad_(True)
    k = randn(gen, *shape(s_kv, groups), device=device).requires_grad_(True)
    v = randn(gen, *shape(s_kv, groups), device=device).requires_grad_(True)
    built = {"bottom_right_diagonal": bottom_right} if where == "constructor" else {}
    attn = DotProductAttention(H, D, num_gqa_groups=groups, qkv_format=fmt,
                               attn_mask_type=mask_type, window_size=window,
                               attention_type="self" if s_q == s_kv else "cross", **built)
    pads = mask = None
    if "padding" in mask_type:
        pads = (pad_of(gen, b, s_q, device), pad_of(gen, b, s_kv, device))
        if s_q == s_kv:
            pads = (pads[0], pads[0])
        mask = pads if s_q != s_kv else pads[0]
    if mask_type == "arbitrary":
        mask = torch.rand(b, 1, s_q, s_kv, generator=gen).lt(0.2).to(device)
    given = {"bottom_right_diagonal": bottom_right} if where == "forward" else {}
    out = attn(q, k, v, attention_mask=mask, **given)
    blocked = blocked_mask(mask_type, s_q, s_kv, pads, window, bottom_right)
    if mask_type == "arbitrary":
        blocked = blocked | mask.cpu()
    q64, k64, v64 = leaf64(q), leaf64(k), leaf64(v)
    ref = attention_ref(q64, k64, v64, blocked, fmt=fmt)
    assert_matches_reference(out, ref, (("q", q, q64), ("k", k, k64), ("v", v, v64)),
                             randn(gen, *out.shape, device=device))
    return out


def pad_of(gen, b, s, device):
    """A padding mask (True = padding, at the end); none for a single token."""
    return padding(gen, b, s, device) if s > 2 else torch.zeros(b, 1, 1, s, dtype=torch.bool,
                                                                device=device)


LENGTHS = [(9, 9), (5, 11), (11, 5), (1, 8)]


@pytest.mark.parametrize("window", [None, (3, 0)], ids=["", "window"])
@pytest.mark.parametrize("s_q,s_kv", LENGTHS)
@pytest.mark.parametrize("mask_type", ["causal_bottom_right", "padding_causal_bottom_right"])
@pytest.mark.parametrize("fmt", ["sbhd", "bshd"])
def test_bottom_right_causal_matches_the_reference(gen, device, fmt, mask_type, s_q, s_kv,
                                                   window):
    check(gen, device, mask_type, s_q, s_kv, window, fmt=fmt)


@pytest.mark.parametrize("where", ["forward", "constructor"])
@pytest.mark.parametrize("bottom_right", [False, True, None])
@pytest.mark.parametrize("s_q,s_kv", [(5, 11), (11, 5), (7, 7)])
@pytest.mark.parametrize("mask_type", ["no_mask", "padding", "arbitrary"])
def test_bottom_right_diagonal_aligns_the_window(gen, device, mask_type, s_q, s_kv,
                                                 bottom_right, where):
    check(gen, device, mask_type, s_q, s_kv, (2, 1), bottom_right, where=where)


@pytest.mark.parametrize("bottom_right", [False, True])
@pytest.mark.parametrize("mask_type", ["causal", "padding_causal", "causal_bottom_right",
                                       "padding_causal_bottom_right"])
def test_causal_types_fix_their_own_alignment(gen, device, mask_type, bottom_right):
    """As Transformer Engine: bottom_right_diagonal is forced False for "causal" and
    "padding_causal", True for the "*_bottom_right" types."""
    out = check(gen, device, mask_type, 5, 8, (2, 0), bottom_right)
    assert out.shape[0] == 5


def test_bottom_right_causal_written_out():
    """s_q 3, s_kv 5: query i sees keys 0..i + 2 (bottom-right), 0..i (top-left); s_q 4,
    s_kv 2: the first two queries see no key and give zeros."""
    expected = {(3, 5, "causal_bottom_right"): [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0],
                                                [1, 1, 1, 1, 1]],
                (3, 5, "causal"): [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0]],
                (4, 2, "causal_bottom_right"): [[0, 0], [0, 0], [1, 0], [1, 1]]}
    for (s_q, s_kv, mask_type), rows in expected.items():
        assert (~blocked_mask(mask_type, s_q, s_kv)).int()[0, 0].tolist() == rows
        attn = DotProductAttention(1, s_kv, attn_mask_type=mask_type, attention_type="cross")
        # Equal scores and values e_j (one-hot key index): row i holds query i's probabilities.
        q, k = torch.zeros(s_q, 1, 1, s_kv), torch.zeros(s_kv, 1, 1, s_kv)
        out = attn(q, k, torch.eye(s_kv).view(s_kv, 1, 1, s_kv))[:, 0]
        assert (out > 0).int().tolist() == rows, mask_type


def test_modules_pass_bottom_right_on(gen, device):
    """MultiheadAttention and TransformerLayer take the types and bottom_right_diagonal (in
    the constructor and forward) and give DotProductAttention's result."""
    torch.manual_seed(int(torch.randint(2**31, (1,), generator=gen)))
    x = randn(gen, 6, 2, 32, device=device)
    mha = MultiheadAttention(32, 2, attention_dropout=0.0, window_size=(2, 2),
                             attn_mask_type="no_mask", bottom_right_diagonal=False,
                             device=device)
    assert mha.core_attention.bottom_right_diagonal is False
    layer = TransformerLayer(32, 64, 2, hidden_dropout=0.0, attention_dropout=0.0,
                             self_attn_mask_type="causal_bottom_right", window_size=(2, 0),
                             bottom_right_diagonal=False, device=device)
    assert layer.self_attention.core_attention.bottom_right_diagonal is False
    with torch.no_grad():
        top_left = mha(x)
        bottom_right = mha(x, bottom_right_diagonal=True)  # forward overrides
        # s_q == s_kv: the two alignments coincide.
        torch.testing.assert_close(top_left, bottom_right, rtol=0, atol=0)
        # A causal type without padding and equal lengths: bottom-right is top-left.
        torch.testing.assert_close(layer(x), layer(x, self_attn_mask_type="causal"),
                                   rtol=0, atol=0)


@pytest.mark.parametrize("cls,args", [(DotProductAttention, (2, 16)),
                                      (MultiheadAttention, (32, 2)),
                                      (TransformerLayer, (32, 64, 2))])
def test_bad_bottom_right_diagonal_is_refused(cls, args):
    with pytest.raises(ValueError, match="bottom_right_diagonal must be None, True or False"):
        cls(*args, bottom_right_diagonal="yes")
    attn = DotProductAttention(2, 16)
    q = torch.zeros(4, 1, 2, 16)
    with pytest.raises(ValueError, match="bottom_right_diagonal must be None, True or False"):
        attn(q, q, q, bottom_right_diagonal=1)
    with pytest.raises(ValueError, match="attn_mask_type must be one of"):
        attn(q, q, q, attn_mask_type="bottom_right")
