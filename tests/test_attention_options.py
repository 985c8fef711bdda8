"""Transformer Engine's DotProductAttention options: window_size (sliding windows) and
softmax_type (attention sinks: "off-by-one", "learnable").

Against the float64 reference of attention_reference.py (an explicit masked softmax): outputs
and every gradient (q, k, v, softmax_offset), sbhd and bshd, GQA, causal and padding masks,
windows with s_q != s_kv; Transformer Engine's adjustments of window_size; the errors."""
from __future__ import annotations

import re

import pytest
import torch
from attention_reference import (assert_matches_reference, attention_ref, blocked_mask, leaf64,
                                 padding, window_blocked)
from conftest import randn, sqnr

from transformer_fp8.modules.attention.dot_product import DotProductAttention
from transformer_fp8.modules.attention.sink import with_sink
from transformer_fp8.modules.attention.multi_head_attention import MultiheadAttention
from transformer_fp8.modules.transformer_layer import TransformerLayer

H, D = 4, 16


def check_attention(gen, device, mask_type, window, softmax_type, fmt, groups, s_q=9,
                    s_kv=None, b=3):
    s_kv = s_q if s_kv is None else s_kv
    shape = (lambda s, heads: (s, b, heads, D)) if fmt == "sbhd" else (
        lambda s, heads: (b, s, heads, D))
    q = randn(gen, *shape(s_q, H), device=device).requires_grad_(True)
    k = randn(gen, *shape(s_kv, groups), device=device).requires_grad_(True)
    v = randn(gen, *shape(s_kv, groups), device=device).requires_grad_(True)
    attn = DotProductAttention(H, D, num_gqa_groups=groups, qkv_format=fmt,
                               attn_mask_type=mask_type, window_size=window,
                               softmax_type=softmax_type,
                               attention_type="self" if s_q == s_kv else "cross").to(device)
    alpha = None
    if softmax_type == "learnable":
        with torch.no_grad():
            attn.softmax_offset.copy_(randn(gen, H, device=device))
        alpha = leaf64(attn.softmax_offset)
    elif softmax_type == "off-by-one":
        alpha = torch.zeros(H, dtype=torch.float64, device=device)
    pads = mask = None
    if "padding" in mask_type:
        pads = (padding(gen, b, s_q, device), padding(gen, b, s_kv, device))
        mask = pads if s_q != s_kv else pads[0]
        if s_q == s_kv:
            pads = (pads[0], pads[0])
    out = attn(q, k, v, attention_mask=mask)
    q64, k64, v64 = leaf64(q), leaf64(k), leaf64(v)
    ref = attention_ref(q64, k64, v64, blocked_mask(mask_type, s_q, s_kv, pads, window),
                        alpha, fmt=fmt)
    assert_matches_reference(out, ref, (("q", q, q64), ("k", k, k64), ("v", v, v64)),
                             randn(gen, *out.shape, device=device))
    if softmax_type == "learnable":
        torch.testing.assert_close(attn.softmax_offset.grad.double(), alpha.grad, rtol=1e-5,
                                   atol=1e-5)


# ---- DotProductAttention ------------------------------------------------------------------------

WINDOWS = {"causal": (3, 0), "padding_causal": (2, 0), "no_mask": (3, 1), "padding": (2, 2),
           "arbitrary": (1, 2)}


@pytest.mark.parametrize("softmax_type", ["vanilla", "off-by-one", "learnable"])
@pytest.mark.parametrize("windowed", [False, True], ids=["", "window"])
@pytest.mark.parametrize("mask_type", ["no_mask", "causal", "padding", "padding_causal"])
@pytest.mark.parametrize("groups", [4, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("fmt", ["sbhd", "bshd"])
def test_attention_matches_the_reference(gen, device, fmt, groups, mask_type, windowed,
                                         softmax_type):
    check_attention(gen, device, mask_type, WINDOWS[mask_type] if windowed else None,
                    softmax_type, fmt, groups)


@pytest.mark.parametrize("softmax_type", ["vanilla", "learnable"])
@pytest.mark.parametrize("s_q,s_kv", [(5, 11), (11, 5)])
@pytest.mark.parametrize("mask_type", ["no_mask", "causal", "padding"])
def test_window_with_different_query_and_key_lengths(gen, device, mask_type, s_q, s_kv,
                                                     softmax_type):
    check_attention(gen, device, mask_type, WINDOWS[mask_type], softmax_type, "bshd", 2,
                    s_q=s_q, s_kv=s_kv)


def test_window_alignment_written_out():
    """s_q 3, s_kv 5, window (1, 0): bottom-right for "no_mask" (query i sees keys i+1, i+2),
    top-left for "causal" (query i sees keys i-1, i)."""
    expected = {"no_mask": [[0, 1, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 0, 1, 1]],
                "causal": [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 1, 1, 0, 0]]}
    for mask_type, rows in expected.items():
        assert (~window_blocked(3, 5, (1, 0), mask_type)).int()[0, 0].tolist() == rows
        attn = DotProductAttention(1, 5, attn_mask_type=mask_type, attention_type="cross",
                                   window_size=(1, 0))
        # Equal scores and values e_j (one-hot key index): row i holds query i's probabilities.
        q, k, v = torch.zeros(3, 1, 1, 5), torch.zeros(5, 1, 1, 5), torch.eye(5).view(5, 1, 1, 5)
        assert (attn(q, k, v)[:, 0] > 0).int().tolist() == rows, mask_type


def test_arbitrary_mask_with_window_and_sink(gen, device):
    b, s = 2, 7
    q, k, v = (randn(gen, s, b, H, D, device=device).requires_grad_(True) for _ in range(3))
    mask = torch.rand(b, 1, s, s, generator=gen).lt(0.3).to(device)
    attn = DotProductAttention(H, D, attn_mask_type="arbitrary", window_size=(1, 2),
                               softmax_type="off-by-one").to(device)
    out = attn(q, k, v, attention_mask=mask)
    q64, k64, v64 = leaf64(q), leaf64(k), leaf64(v)
    blocked = mask.cpu() | window_blocked(s, s, (1, 2), "arbitrary")
    ref = attention_ref(q64, k64, v64, blocked, torch.zeros(H, dtype=torch.float64,
                                                             device=device))
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    out.sum().backward()
    ref.sum().backward()
    for mine, expected in ((q, q64), (k, k64), (v, v64)):
        torch.testing.assert_close(mine.grad.double(), expected.grad, rtol=1e-5, atol=1e-5)


def test_forward_window_overrides_the_constructors(gen, device):
    q, k, v = (randn(gen, 8, 2, H, D, device=device) for _ in range(3))
    windowed = DotProductAttention(H, D, window_size=(2, 0)).to(device)
    plain = DotProductAttention(H, D).to(device)
    torch.testing.assert_close(windowed(q, k, v, window_size=(-1, 0)), plain(q, k, v))
    torch.testing.assert_close(plain(q, k, v, window_size=(2, 0)), windowed(q, k, v))
    assert not torch.allclose(windowed(q, k, v), plain(q, k, v))


def test_window_adjustments_follow_transformer_engine(gen):
    q, k, v = (randn(gen, 6, 1, H, D) for _ in range(3))
    causal = DotProductAttention(H, D, attn_mask_type="causal")
    no_mask = DotProductAttention(H, D, attn_mask_type="no_mask")
    with pytest.warns(UserWarning, match=r"window_size should be \(-1, 0\) or \(>=0, 0\)"):
        torch.testing.assert_close(causal(q, k, v, window_size=(2, 3)),
                                   causal(q, k, v, window_size=(2, 0)))
    with pytest.warns(UserWarning, match=r"using \(-1, -1\)"):
        torch.testing.assert_close(no_mask(q, k, v, window_size=(-1, 0)), no_mask(q, k, v))


def test_learnable_sink_in_bfloat16_keeps_its_score(gen, device):
    """The sink's score travels in the queries as three bfloat16 parts (each the remainder of
    the ones before): the score SDPA forms (float32 accumulation) is alpha to float32
    accuracy, where one bfloat16 part alone would be off by up to 2^-9 relative."""
    q, k, v = (randn(gen, 10, 2, H, D, device=device, dtype=torch.bfloat16) for _ in range(3))
    alpha = torch.tensor([3.1234567, -2.345678, 0.5, 7.77], device=device)
    scale = D ** -0.5
    q2, k2, *_ = with_sink(q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3),
                           v.permute(1, 2, 0, 3), None, False, alpha, scale)
    score = (q2.float() @ k2[:, :, -1:].float().transpose(-1, -2) * scale)[..., 0]
    torch.testing.assert_close(score, alpha.view(1, H, 1).expand_as(score), rtol=1e-6,
                               atol=1e-6)
    assert (q2[..., D].float() * scale - alpha.view(1, H, 1)).abs().max() > 1e-3
    attn = DotProductAttention(H, D, softmax_type="learnable").to(device)
    with torch.no_grad():
        attn.softmax_offset.copy_(alpha)
    ref = attention_ref(*(t.double() for t in (q, k, v)), blocked_mask("causal", 10, 10),
                        alpha.double())
    assert sqnr(ref, attn(q, k, v).double()) >= 40


def test_checkpoint_core_attention_with_a_learnable_sink(gen, device):
    q, k, v = (randn(gen, 8, 2, H, D, device=device) for _ in range(3))
    attn = DotProductAttention(H, D, softmax_type="learnable", window_size=(3, 0)).to(device)
    grads = []
    for checkpointed in (False, True):
        attn.zero_grad()
        attn(q, k, v, checkpoint_core_attention=checkpointed).square().sum().backward()
        grads.append(attn.softmax_offset.grad.clone())
    torch.testing.assert_close(grads[0], grads[1])


# ---- errors ---------------------------------------------------------------------------------

@pytest.mark.parametrize("cls", [DotProductAttention, MultiheadAttention, TransformerLayer])
def test_bad_values_are_refused_naming_the_argument(cls):
    sizes = {DotProductAttention: (4, 16), MultiheadAttention: (64, 4),
             TransformerLayer: (64, 128, 4)}[cls]
    with pytest.raises(ValueError, match=r"softmax_type must be one of \('vanilla', "
                                         r"'off-by-one', 'learnable'\), got 'sigmoid'"):
        cls(*sizes, softmax_type="sigmoid")
    for bad in ((-2, 0), (3,), "3,0", (1.5, 0), (True, 0)):
        expected = r"window_size must be None or a pair \(left, right\) of ints >= -1 .*got "
        with pytest.raises(ValueError, match=expected + re.escape(repr(bad))):
            cls(*sizes, window_size=bad)
    if cls is DotProductAttention:
        return
    with pytest.raises(ValueError, match=r"qk_norm_type must be None or one of \("
                                         r"'L2Normalization', 'RMSNorm', 'LayerNorm'\), got "
                                         r"'rmsnorm'"):
        cls(*sizes, qk_norm_type="rmsnorm")
    with pytest.raises(ValueError, match=r"qk_norm_eps must be a finite number >= 0, got -1"):
        cls(*sizes, qk_norm_type="RMSNorm", qk_norm_eps=-1)


def test_windows_the_mask_type_cannot_take_are_refused(gen):
    q, k, v = (randn(gen, 6, 1, H, D) for _ in range(3))
    with pytest.raises(ValueError, match=r"window_size must be \(-1, -1\) or \(>=0, >=0\) with "
                                         r"attn_mask_type 'no_mask', got \(3, -1\)"):
        DotProductAttention(H, D, attn_mask_type="no_mask")(q, k, v, window_size=(3, -1))
    with pytest.raises(ValueError, match=r"window_size must be \(-1, 0\) or \(>=0, 0\) with "
                                         r"attn_mask_type 'causal', got \(-1, 3\)"):
        DotProductAttention(H, D, window_size=(-1, 3))(q, k, v)
    with pytest.raises(ValueError, match=r"window_size must be None or a pair"):
        DotProductAttention(H, D)(q, k, v, window_size=[4, 0, 1])


def test_learnable_sink_offset_is_reset_after_meta_init():
    """Built on "meta" and materialised with to_empty(), the offset is uninitialised memory (here
    NaN, to be sure) until reset_parameters() gives it its start, zeros, as for torch's modules;
    the layer then computes what a layer built directly computes."""
    torch.manual_seed(0)
    built = TransformerLayer(32, 64, 4, softmax_type="learnable", hidden_dropout=0.0,
                             attention_dropout=0.0)
    torch.manual_seed(0)
    layer = TransformerLayer(32, 64, 4, softmax_type="learnable", hidden_dropout=0.0,
                             attention_dropout=0.0, device="meta")
    layer.to_empty(device="cpu")
    offset = layer.self_attention.core_attention.softmax_offset
    with torch.no_grad():
        offset.fill_(float("nan"))
    layer.self_attention.core_attention.reset_parameters()
    assert torch.equal(offset, torch.zeros(4))
    layer.load_state_dict({k: v for k, v in built.state_dict().items()
                           if not k.endswith("softmax_offset")}, strict=False)
    x = torch.randn(6, 2, 32)
    assert torch.equal(layer(x), built(x))


def test_apply_rotary_pos_emb_takes_transformer_engines_arguments():
    """TE's MultiheadAttention calls it with fused=True; the other arguments at their defaults
    change nothing, other values are refused by name."""
    from transformer_fp8.modules.attention import RotaryPositionEmbedding, apply_rotary_pos_emb
    t = torch.randn(5, 2, 3, 16)
    freqs = RotaryPositionEmbedding(16)(5)
    plain = apply_rotary_pos_emb(t, freqs, "sbhd")
    assert torch.equal(apply_rotary_pos_emb(t, freqs, "sbhd", None, interleaved=False,
                                            fused=True, cu_seqlens=None, cp_size=1, cp_rank=0),
                       plain)
    for name, value in (("interleaved", True), ("cp_size", 2), ("cp_rank", 1)):
        with pytest.raises(ValueError, match=f"apply_rotary_pos_emb: {name}=.* is not "
                                             "supported"):
            apply_rotary_pos_emb(t, freqs, "sbhd", **{name: value})
    with pytest.raises(ValueError, match="cu_seqlens is for tensor_format='thd'"):
        apply_rotary_pos_emb(t, freqs, "sbhd", cu_seqlens=torch.tensor([0, 5]))


def test_an_odd_rotary_dimension_follows_transformer_engine():
    """dim * rotary_percent = 9: Transformer Engine makes ceil(9 / 2) = 5 frequencies over 9
    and angles for 10 features (it was refused here)."""
    from transformer_fp8.modules.attention import RotaryPositionEmbedding
    rope = RotaryPositionEmbedding(12, rotary_percent=0.75)
    expected_inv = 1.0 / (10000.0 ** (torch.arange(0, 9, 2, dtype=torch.float32) / 9))
    assert torch.equal(rope.inv_freq, expected_inv) and rope.dim == 10
    angles = rope(4)
    assert angles.shape == (4, 1, 1, 10)
    positions = torch.arange(4, dtype=torch.float32)
    assert torch.equal(angles[:, 0, 0, :5], torch.outer(positions, expected_inv))
    assert torch.equal(angles[..., 5:], angles[..., :5])
    with pytest.raises(ValueError, match="the rotary dimension"):
        RotaryPositionEmbedding(3, rotary_percent=0.2)


def test_float64_sinks_and_l2_norms_keep_float64_accuracy():
    """The sink's logit and L2Normalization were formed in float32 (errors ~1e-8 in float64)."""
    import math
    torch.manual_seed(0)
    h, d, s = 4, 8, 6
    attn = DotProductAttention(h, d, qkv_format="bshd", attn_mask_type="no_mask",
                               softmax_type="learnable").double()
    with torch.no_grad():
        attn.softmax_offset.copy_(torch.tensor([0.3, -1.7, 2.9, 0.1]))
    q, k, v = (torch.randn(1, s, h, d, dtype=torch.float64) for _ in range(3))
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d)
    sink = attn.softmax_offset.detach().view(1, h, 1, 1).expand(1, h, s, 1)
    probs = torch.softmax(torch.cat((scores, sink), -1), -1)[..., :s]
    expected = torch.einsum("bhqk,bkhd->bqhd", probs, v).reshape(1, s, h * d)
    assert (attn(q, k, v) - expected).abs().max() < 1e-13
    from transformer_fp8.modules.attention.qk_norm import L2Normalization
    x = torch.randn(5, 8, dtype=torch.float64)
    ref = x / torch.sqrt(x.square().sum(-1, keepdim=True) + 1e-6)
    assert (L2Normalization(1e-6)(x) - ref).abs().max() < 1e-14
