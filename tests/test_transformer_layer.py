"""Transformer Engine's DotProductAttention, RotaryPositionEmbedding and TransformerLayer.

Attention against a float64 reference (masks, GQA, layouts, rotary embeddings) and its errors;
TransformerLayer outside fp8_autocast bit-identical to its torch composition, inside it within
SQNR bounds of float32; a small GPT of TransformerLayers trains in FP8 as in bf16; activation
checkpointing and state_dict round trips."""
from __future__ import annotations

import functools

import copy
import importlib.util
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_bitwise_equal, randn, sqnr
from fused_step_checks import every_step_path  # noqa: F401 (the fixture below)
from integration_compare import assert_bit_identical, step_batches, train

from transformer_fp8 import DelayedScaling, Float8CurrentScaling, fp8_autocast
from transformer_fp8.modules.activations import activation_hp
from transformer_fp8.modules.attention import (DotProductAttention, RotaryPositionEmbedding,
                                              apply_rotary_pos_emb)
from transformer_fp8.modules.transformer_layer import TransformerLayer

# Every test runs with the modules' C++ steps and with the Python path they replace.
pytestmark = pytest.mark.usefixtures("every_step_path")

RECIPES = [DelayedScaling(amax_history_len=4), Float8CurrentScaling()]
RECIPE_IDS = ["delayed", "current"]
# The FP8 paths of LayerNormLinear and LayerNormMLP run the fused norm/activation operators.
NEEDS_FUSED_OPS = pytest.mark.skipif(
    importlib.util.find_spec("transformer_fp8.ops.fused") is None,
    reason="transformer_fp8.ops.fused (the FP8 path of LayerNormLinear/LayerNormMLP) is not "
           "in this tree yet")
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


# ---- references ---------------------------------------------------------------------------------

def attention_ref(q, k, v, masked=None, causal=False, scale=None):
    """softmax(q k^T * scale) v in float64 from [s, b, heads, d] inputs, key/value groups
    repeated for GQA; masked: bool broadcastable to [b, h, s_q, s_kv], True = masked out. A
    row with every key masked gives zeros. Returns [s, b, h * d] float64."""
    s_q, b, h, d = q.shape
    g = k.shape[2]
    q64, k64, v64 = (t.detach().double().permute(1, 2, 0, 3) for t in (q, k, v))
    k64, v64 = k64.repeat_interleave(h // g, dim=1), v64.repeat_interleave(h // g, dim=1)
    scores = q64 @ k64.transpose(-1, -2) * (scale if scale is not None else d ** -0.5)
    blocked = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device)
    if masked is not None:
        blocked = blocked | masked.to(scores.device)
    if causal:
        blocked = blocked | torch.ones(s_q, k.shape[0], dtype=torch.bool,
                                       device=scores.device).triu(1)
    probs = torch.softmax(scores.masked_fill(blocked, -math.inf), dim=-1).nan_to_num(0.0)
    return (probs @ v64).permute(2, 0, 1, 3).reshape(s_q, b, -1)  # (v's head size)


def qkv(gen, s, b, h, g, d, device, dtype=torch.float32, s_kv=None):
    s_kv = s if s_kv is None else s_kv
    return (randn(gen, s, b, h, d, device=device, dtype=dtype),
            randn(gen, s_kv, b, g, d, device=device, dtype=dtype),
            randn(gen, s_kv, b, g, d, device=device, dtype=dtype))


def norm_ref(x, kind, weight, bias, eps, zero_centered_gamma):
    gamma = weight.float() + 1 if zero_centered_gamma else weight.float()
    if kind == "LayerNorm":
        return F.layer_norm(x.float(), (x.shape[-1],), gamma, bias.float(), eps).to(x.dtype)
    return F.rms_norm(x.float(), (x.shape[-1],), gamma, eps).to(x.dtype)


def rotate(t, freqs, fmt):
    """Rotary embedding written as complex multiplication: feature pairs (j, j + d/2) form
    x_j + i x_{j+d/2}, turned by the angle freqs[..., j]."""
    half = freqs.shape[-1] // 2
    angles = freqs[:t.shape[0] if fmt == "sbhd" else t.shape[1], ..., :half].double()
    if fmt == "bshd":
        angles = angles.transpose(0, 1)
    rot, rest = t[..., :2 * half].double(), t[..., 2 * half:].double()
    z = torch.complex(rot[..., :half], rot[..., half:]) * torch.polar(torch.ones_like(angles),
                                                                      angles)
    return torch.cat((z.real, z.imag, rest), dim=-1)


def qkv_param(module, kind):
    """The QKV projection's weight or bias: Transformer Engine's query/key/value Parameters
    joined (rows: queries, keys, values), or the one Parameter with fuse_qkv_params."""
    parts = [getattr(module, f"{name}_{kind}", None) for name in ("query", "key", "value")]
    if all(p is None for p in parts):
        return getattr(module, kind, None)
    return torch.cat(parts)


def layer_ref(layer, x, mask=None, mask_type="causal", rotary=None):
    """TransformerLayer's high-precision composition, written with torch ops from its
    parameters (dropout 0)."""
    att, mlp = layer.self_attention, layer.layernorm_mlp
    lnl = att.layernorm_qkv
    fmt = layer.attn_input_format
    ln1 = norm_ref(x, lnl.normalization, lnl.layer_norm_weight, lnl.layer_norm_bias, lnl.eps,
                   lnl.zero_centered_gamma)
    mixed = F.linear(ln1, qkv_param(lnl, "weight"), qkv_param(lnl, "bias"))
    h, g, d = att.num_attention_heads, att.num_gqa_groups, att.kv_channels
    q, k, v = mixed.split([h * d, g * d, g * d], dim=-1)
    q, k, v = (t.reshape(*t.shape[:2], -1, d) for t in (q, k, v))
    if rotary is not None:
        q, k = (apply_rotary_pos_emb(t, rotary, fmt) for t in (q, k))
    perm = (1, 2, 0, 3) if fmt == "sbhd" else (0, 2, 1, 3)
    q, k, v = (t.permute(perm) for t in (q, k, v))
    gqa = {"enable_gqa": True} if g != h else {}
    if mask is None:
        ctx = F.scaled_dot_product_attention(q, k, v, is_causal=mask_type == "causal", **gqa)
    else:  # padding, True = a padding token: padded queries give zeros
        k, v = k.repeat_interleave(h // g, dim=1), v.repeat_interleave(h // g, dim=1)
        pad = mask.reshape(mask.shape[0], 1, 1, -1)
        allowed = ~pad.transpose(-1, -2) & ~pad
        dead = ~allowed.any(-1, keepdim=True)
        ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed | dead)
        ctx = ctx.masked_fill(dead, 0.0)
    bsz, heads, s, _ = ctx.shape
    ctx = (ctx.permute(2, 0, 1, 3) if fmt == "sbhd" else ctx.transpose(1, 2)).reshape(
        *x.shape[:2], heads * d)
    residual = ln1 if layer.apply_residual_connection_post_layernorm else x
    hidden = residual + F.linear(ctx, att.proj.weight, att.proj.bias)
    ln2 = norm_ref(hidden, mlp.normalization, mlp.layer_norm_weight, mlp.layer_norm_bias,
                   mlp.eps, mlp.zero_centered_gamma)
    act = activation_hp(F.linear(ln2, mlp.fc1_weight, mlp.fc1_bias), mlp.activation)
    residual = ln2 if layer.apply_residual_connection_post_layernorm else hidden
    return residual + F.linear(act, mlp.fc2_weight, mlp.fc2_bias)


def randomize_norms(module, gen, scale=0.1):
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "layer_norm" in name or name.endswith("bias"):
                base = 0.0 if name.endswith("bias") or "weight" not in name else 1.0
                p.copy_(randn(gen, *p.shape, device=p.device) * scale + base)


def small_layer(device, **kwargs):
    options = dict(hidden_dropout=0.0, attention_dropout=0.0, device=device)
    options.update(kwargs)
    return TransformerLayer(64, 128, 4, **options)


# ---- DotProductAttention ------------------------------------------------------------------------

@pytest.mark.parametrize("mask_type", ["causal", "no_mask"])
@pytest.mark.parametrize("groups", [4, 2, 1], ids=["mha", "gqa", "mqa"])
def test_attention_against_float64(gen, device, mask_type, groups):
    q, k, v = qkv(gen, 12, 3, 4, groups, 16, device)
    attn = DotProductAttention(4, 16, num_gqa_groups=groups, attn_mask_type=mask_type)
    out = attn(q, k, v)
    assert out.shape == (12, 3, 64) and out.dtype == torch.float32
    ref = attention_ref(q, k, v, causal=mask_type == "causal")
    torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=2e-5)


@pytest.mark.parametrize("softmax_type", ["vanilla", "off-by-one"])
@pytest.mark.parametrize("mask_type", ["causal", "no_mask"])
def test_attention_with_another_value_head_size(gen, device, mask_type, softmax_type):
    """kv_channels=(16, 24): query and key heads of 16, value heads of 24 (Transformer
    Engine's tuple; MLA-style models): the output [s, b, h * 24] and the gradients of q, k and
    v those of float64 attention, the softmax scale 1 / sqrt(16)."""
    q, k, _ = qkv(gen, 12, 3, 4, 2, 16, device)
    v = randn(gen, 12, 3, 2, 24, device=device)
    attn = DotProductAttention(4, (16, 24), num_gqa_groups=2, attn_mask_type=mask_type,
                               softmax_type=softmax_type)
    assert (attn.hidden_size_per_attention_head_k,
            attn.hidden_size_per_attention_head_v) == (16, 24)
    inputs = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = attn(*inputs)
    assert out.shape == (12, 3, 96)
    grad = randn(gen, 12, 3, 96, device=device)
    out.backward(grad)
    ref_inputs = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    q64, k64, v64 = (t.permute(1, 2, 0, 3) for t in ref_inputs)
    k64, v64 = k64.repeat_interleave(2, dim=1), v64.repeat_interleave(2, dim=1)
    scores = q64 @ k64.transpose(-1, -2) / 4.0
    if mask_type == "causal":
        scores = scores.masked_fill(torch.ones(12, 12, dtype=torch.bool,
                                               device=scores.device).triu(1), -math.inf)
    if softmax_type == "off-by-one":  # (a sink: one more score of 0, with a zero value)
        scores = torch.cat((scores, scores.new_zeros(*scores.shape[:-1], 1)), dim=-1)
        v64 = torch.cat((v64, v64.new_zeros(*v64.shape[:2], 1, 24)), dim=2)
    ref = (torch.softmax(scores, dim=-1) @ v64).permute(2, 0, 1, 3).reshape(12, 3, 96)
    ref.backward(grad.double())
    torch.testing.assert_close(out.double(), ref.detach(), atol=2e-6, rtol=2e-5)
    for name, got, want in zip("qkv", inputs, ref_inputs):
        torch.testing.assert_close(got.grad.double(), want.grad, atol=1e-5, rtol=1e-4,
                                   msg=f"d{name}")
    with pytest.raises(ValueError, match=r"value_layer must have shape \[s, b, 2, 24\]"):
        attn(q, k, q[:, :, :2])


def test_attention_bshd_is_sbhd_transposed(gen, device):
    q, k, v = qkv(gen, 10, 2, 4, 2, 16, device)
    sbhd = DotProductAttention(4, 16, num_gqa_groups=2)(q, k, v)
    bshd = DotProductAttention(4, 16, num_gqa_groups=2, qkv_format="bshd")(
        *(t.transpose(0, 1) for t in (q, k, v)))
    assert bshd.shape == (2, 10, 64)
    torch.testing.assert_close(bshd.transpose(0, 1), sbhd, atol=1e-6, rtol=1e-6)
    # The per-call qkv_format overrides the module's.
    again = DotProductAttention(4, 16, num_gqa_groups=2)(
        *(t.transpose(0, 1) for t in (q, k, v)), qkv_format="bshd")
    assert_bitwise_equal(again, bshd, "qkv_format in forward")


@pytest.mark.parametrize("mask_type", ["padding", "padding_causal"])
def test_padding_masks_true_means_masked_out(gen, device, mask_type):
    s, b = 9, 3
    lengths = [9, 5, 1]
    pad = torch.arange(s)[None, :] >= torch.tensor(lengths)[:, None]  # True: padding token
    mask = pad.reshape(b, 1, 1, s).to(device)
    q, k, v = qkv(gen, s, b, 4, 4, 16, device)
    q.requires_grad_(True)
    out = DotProductAttention(4, 16, attn_mask_type=mask_type)(q, k, v, attention_mask=mask)
    both = pad[:, None, :, None] | pad[:, None, None, :]
    ref = attention_ref(q, k, v, masked=both, causal=mask_type == "padding_causal")
    torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=2e-5)
    # Padded queries give zeros, not NaN, and so do their gradients.
    assert (out.transpose(0, 1)[pad.to(device)] == 0).all()
    out.sum().backward()
    assert torch.isfinite(q.grad).all()
    assert (q.grad.transpose(0, 1)[pad.to(device)] == 0).all()
    # Padding keys change nothing: the valid outputs ignore whatever the padded keys hold.
    k2 = k.clone()
    k2.transpose(0, 1)[pad.to(device)] = 1e3
    out2 = DotProductAttention(4, 16, attn_mask_type=mask_type)(q, k2, v, attention_mask=mask)
    torch.testing.assert_close(out2, out)


def test_padding_for_cross_attention_takes_two_masks(gen, device):
    q, k, v = qkv(gen, 6, 2, 4, 4, 16, device, s_kv=8)
    q_pad = torch.zeros(2, 1, 1, 6, dtype=torch.bool, device=device)
    kv_pad = torch.zeros(2, 1, 1, 8, dtype=torch.bool, device=device)
    kv_pad[1, ..., 5:] = True
    attn = DotProductAttention(4, 16, attn_mask_type="padding", attention_type="cross")
    out = attn(q, k, v, attention_mask=(q_pad, kv_pad))
    ref = attention_ref(q, k, v, masked=kv_pad.cpu())
    torch.testing.assert_close(out.double(), ref.to(device), atol=2e-6, rtol=2e-5)
    with pytest.raises(ValueError, match="as a tuple"):
        attn(q, k, v, attention_mask=kv_pad)


def test_arbitrary_mask(gen, device):
    q, k, v = qkv(gen, 7, 2, 4, 2, 16, device)
    masked = torch.rand(2, 4, 7, 7, generator=gen) < 0.4
    masked[0, 1, 3] = True  # a row with nothing to attend to: zeros
    out = DotProductAttention(4, 16, num_gqa_groups=2, attn_mask_type="arbitrary")(
        q, k, v, attention_mask=masked.to(device))
    torch.testing.assert_close(out.double().cpu(), attention_ref(q, k, v, masked=masked).cpu(),
                               atol=2e-6, rtol=2e-5)
    assert (out[3, 0, 16:32] == 0).all()
    # Broadcastable masks: one [s_q, s_kv] mask for every batch and head.
    causal = torch.ones(7, 7, dtype=torch.bool).triu(1)
    out = DotProductAttention(4, 16, num_gqa_groups=2, attn_mask_type="arbitrary")(
        q, k, v, attention_mask=causal.to(device))
    torch.testing.assert_close(out, DotProductAttention(4, 16, num_gqa_groups=2)(q, k, v),
                               atol=1e-6, rtol=1e-5)


def test_softmax_scale_dropout_and_bfloat16(gen, device):
    q, k, v = qkv(gen, 8, 2, 4, 4, 16, device)
    out = DotProductAttention(4, 16, softmax_scale=0.5)(q, k, v)
    torch.testing.assert_close(out.double(), attention_ref(q, k, v, causal=True, scale=0.5),
                               atol=2e-6, rtol=2e-5)
    drop = DotProductAttention(4, 16, attention_dropout=0.5)
    plain = DotProductAttention(4, 16)(q, k, v)
    assert not torch.equal(drop(q, k, v), plain)  # training: dropout on the probabilities
    assert_bitwise_equal(drop.eval()(q, k, v), plain, "eval: no dropout")
    out = DotProductAttention(4, 16)(*(t.bfloat16() for t in (q, k, v)))
    assert out.dtype == torch.bfloat16
    assert sqnr(attention_ref(q, k, v, causal=True), out) > 35


def test_checkpoint_core_attention_gives_the_same_gradients(gen, device):
    q, k, v = (t.requires_grad_(True) for t in qkv(gen, 8, 2, 4, 2, 16, device))
    attn = DotProductAttention(4, 16, num_gqa_groups=2)
    grads = []
    for checkpointed in (False, True):
        out = attn(q, k, v, checkpoint_core_attention=checkpointed)
        grads.append(torch.autograd.grad(out.square().sum(), (q, k, v)))
    for a, b in zip(*grads):
        assert_bitwise_equal(a, b, "checkpoint_core_attention")


def test_attention_errors_name_the_argument():
    attn = DotProductAttention(4, 16, num_gqa_groups=2)
    q, k, v = torch.randn(5, 2, 4, 16), torch.randn(5, 2, 2, 16), torch.randn(5, 2, 2, 16)
    with pytest.raises(ValueError, match=r"query_layer must have shape \[s, b, 4, 16\].*"
                                         r"got \(5, 2, 2, 16\)"):
        attn(k, k, v)
    with pytest.raises(ValueError, match=r"key_layer must have shape \[s, b, 2, 16\]"):
        attn(q, q, v)
    with pytest.raises(ValueError, match="same batch size"):
        attn(q, k[:, :1], v[:, :1])
    with pytest.raises(ValueError, match="same sequence length"):
        attn(q, k[:3], v[:3])
    with pytest.raises(TypeError, match="one dtype"):
        attn(q, k.double(), v)
    # 'causal' and 'no_mask' take no mask: one passed anyway is ignored (Transformer Engine's
    # behaviour; tests/test_te_compat.py compares the outputs).
    with pytest.raises(ValueError, match="'padding' needs an attention_mask"):
        attn(q, k, v, attn_mask_type="padding")
    with pytest.raises(TypeError, match=r"must be a bool tensor \(True = masked out\), got "
                                        "torch.float32"):
        attn(q, k, v, attn_mask_type="padding", attention_mask=torch.zeros(2, 1, 1, 5))
    with pytest.raises(ValueError, match=r"shape \[b, 1, 1, s\] = \[2, 1, 1, 5\], got \(2, 5\)"):
        attn(q, k, v, attn_mask_type="padding",
             attention_mask=torch.zeros(2, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"must broadcast to \[b, h, s_q, s_kv\]"):
        attn(q, k, v, attn_mask_type="arbitrary",
             attention_mask=torch.zeros(3, 1, 5, 5, dtype=torch.bool))
    q1, k1, v1 = q[:, :1], k[:, :1], v[:, :1]  # batch 1: a batch-2 mask does not broadcast to it
    for shape in [(2, 1, 5, 5), (1, 1, 1, 5, 5)]:
        with pytest.raises(ValueError, match=r"must broadcast to \[b, h, s_q, s_kv\]"):
            attn(q1, k1, v1, attn_mask_type="arbitrary",
                 attention_mask=torch.zeros(shape, dtype=torch.bool))
    with pytest.raises(ValueError, match="attn_mask_type must be one of"):
        attn(q, k, v, attn_mask_type="sliding")
    with pytest.raises(ValueError, match="qkv_format must be one of"):
        attn(q, k, v, qkv_format="tbhd")
    with pytest.raises(ValueError, match="qkv_format 'thd' needs a 'padding' mask type"):
        attn(q, k, v, qkv_format="thd")  # (packed sequences: test_packed_sequences.py)
    with pytest.raises(ValueError, match="core_attention_bias_type='post_scale_bias' is not "
                                         "supported"):
        attn(q, k, v, core_attention_bias_type="post_scale_bias")
    with pytest.raises(TypeError, match="unexpected keyword argument 'bogus'"):
        attn(q, k, v, bogus=1)
    # Arguments Transformer Engine reads for packed "thd" sequences only: no effect here.
    expected = attn(q, k, v)
    assert torch.equal(attn(q, k, v, fast_zero_fill=False, pad_between_seqs=False), expected)
    with pytest.raises(ValueError, match="pad_between_seqs=True is not supported"):
        attn(q, k, v, pad_between_seqs=True)
    with pytest.raises(ValueError, match=r"num_gqa_groups must divide num_attention_heads "
                                         r"\(4\), got 3"):
        DotProductAttention(4, 16, num_gqa_groups=3)
    with pytest.raises(ValueError, match="kv_channels must be a positive integer, got 0"):
        DotProductAttention(4, 0)
    with pytest.raises(ValueError, match=r"attention_dropout must be in \[0, 1\), got 1.5"):
        DotProductAttention(4, 16, attention_dropout=1.5)
    with pytest.raises(ValueError, match=r"num_attention_heads \(4\) must be divisible by the "
                                         "3 tensor-parallel ranks"):
        DotProductAttention(4, 16, tp_size=3)
    with pytest.raises(TypeError, match="sequence_parallel must be True or False"):
        DotProductAttention(4, 16, sequence_parallel="yes")
    with pytest.raises(ValueError, match="cp_group=.* is not supported"):
        DotProductAttention(4, 16, cp_group=object())
    with pytest.raises(TypeError, match="unexpected keyword argument 'bogus'"):
        DotProductAttention(4, 16, bogus=True)
    # Transformer Engine's parallelism options at their defaults are accepted.
    DotProductAttention(4, 16, sequence_parallel=False, tp_size=1, tp_group=None,
                        get_rng_state_tracker=None, cp_group=None, window_size=(-1, 0))


# ---- rotary position embeddings -----------------------------------------------------------------

def test_rotary_angles_follow_transformer_engine():
    rope = RotaryPositionEmbedding(16)
    freqs = rope(10)
    assert freqs.shape == (10, 1, 1, 16) and freqs.dtype == torch.float32
    j = torch.arange(8, dtype=torch.float64)
    expected = torch.arange(10, dtype=torch.float64)[:, None] * 10000.0 ** (-2 * j / 16)
    torch.testing.assert_close(freqs[:, 0, 0].double(), torch.cat((expected, expected), -1),
                               rtol=1e-6, atol=1e-6)
    # offset shifts the positions; interpolation divides them.
    torch.testing.assert_close(rope(4, offset=6), freqs[6:])
    interp = RotaryPositionEmbedding(16, seq_len_interpolation_factor=2,
                                     pretrained_max_position_embeddings=8)
    torch.testing.assert_close(interp(10)[:, 0, 0, 0], torch.arange(10.0) / 2)
    torch.testing.assert_close(interp(20)[:, 0, 0, 0], torch.arange(20.0) / (20 / 8))
    # rotary_percent rotates the first features only.
    assert RotaryPositionEmbedding(16, rotary_percent=0.5)(4).shape == (4, 1, 1, 8)
    assert "inv_freq" in rope.state_dict()
    # An odd dimension: ceil(15 / 2) frequencies over 15, angles for 16 features (as
    # Transformer Engine; test_attention_options.py).
    assert RotaryPositionEmbedding(15)(3).shape == (3, 1, 1, 16)
    with pytest.raises(ValueError, match="interleaved=True is not supported"):
        RotaryPositionEmbedding(16, interleaved=True)
    with pytest.raises(ValueError, match=r"rotary_percent must be in \(0, 1\]"):
        RotaryPositionEmbedding(16, rotary_percent=0)


@pytest.mark.parametrize("fmt", ["sbhd", "bshd"])
@pytest.mark.parametrize("percent", [1.0, 0.5])
def test_apply_rotary_is_a_rotation_of_half_pairs(gen, device, fmt, percent):
    freqs = RotaryPositionEmbedding(16, rotary_percent=percent)(12).to(device)
    t = randn(gen, 10, 3, 4, 16, device=device)  # shorter than the angle table: its start
    t = t if fmt == "sbhd" else t.transpose(0, 1)
    out = apply_rotary_pos_emb(t, freqs, fmt)
    torch.testing.assert_close(out.double(), rotate(t, freqs, fmt), atol=1e-5, rtol=1e-5)
    if percent < 1:
        assert_bitwise_equal(out[..., 8:], t[..., 8:], "features past the rotary dimension")


def test_rotary_scores_depend_on_relative_position_only(gen):
    freqs = RotaryPositionEmbedding(16)(40).double()
    q, k = randn(gen, 1, 1, 1, 16, dtype=torch.float64), randn(gen, 1, 1, 1, 16,
                                                                   dtype=torch.float64)

    def score(i, j):
        qi = apply_rotary_pos_emb(q, freqs[i:i + 1], "sbhd")
        kj = apply_rotary_pos_emb(k, freqs[j:j + 1], "sbhd")
        return (qi * kj).sum().item()

    # The angles are float32 (position * inverse frequency): equal up to their rounding,
    # measured against the scale of the score (|q| |k|), as a score near 0 has no precision
    # of its own.
    scale = (q.norm() * k.norm()).item()
    assert score(7, 3) == pytest.approx(score(30, 26), abs=1e-5 * scale)
    assert score(0, 0) == pytest.approx((q * k).sum().item(), rel=1e-12)


def test_rotary_errors():
    t = torch.randn(8, 2, 4, 16)
    with pytest.raises(ValueError, match=r"rotary_pos_emb must have shape \[s2, 1, 1, d2\] "
                                         r"with s2 >= 8.*got \(4, 1, 1, 16\)"):
        apply_rotary_pos_emb(t, torch.zeros(4, 1, 1, 16))
    with pytest.raises(ValueError, match=r"even d2 <= 16.*got \(8, 1, 1, 32\)"):
        apply_rotary_pos_emb(t, torch.zeros(8, 1, 1, 32))
    with pytest.raises(ValueError, match=r"got \(8, 16\)"):
        apply_rotary_pos_emb(t, torch.zeros(8, 16))


# ---- TransformerLayer: construction -------------------------------------------------------------

def test_names_shapes_and_options_follow_transformer_engine():
    layer = TransformerLayer(64, 96, 4, num_gqa_groups=2, normalization="RMSNorm",
                             activation="swiglu", bias=False)
    assert {n: tuple(p.shape) for n, p in layer.named_parameters()} == {
        "self_attention.layernorm_qkv.layer_norm_weight": (64,),
        # Transformer Engine's names without fuse_qkv_params (its default).
        "self_attention.layernorm_qkv.query_weight": (4 * 16, 64),
        "self_attention.layernorm_qkv.key_weight": (2 * 16, 64),
        "self_attention.layernorm_qkv.value_weight": (2 * 16, 64),
        "self_attention.proj.weight": (64, 64),
        "layernorm_mlp.layer_norm_weight": (64,),
        "layernorm_mlp.fc1_weight": (192, 64),
        "layernorm_mlp.fc2_weight": (64, 96)}
    sub = dict(layer.named_modules())
    assert type(sub["self_attention.core_attention"]).__name__ == "DotProductAttention"
    assert type(sub["self_attention.layernorm_qkv"]).__name__ == "LayerNormLinear"
    assert type(sub["self_attention.proj"]).__name__ == "Linear"
    assert type(sub["layernorm_mlp"]).__name__ == "LayerNormMLP"
    # kv_channels decouples the head size from hidden / heads.
    wide = TransformerLayer(64, 64, 2, kv_channels=48, fuse_qkv_params=True)
    assert wide.self_attention.layernorm_qkv.weight.shape == (6 * 48, 64)
    assert wide.self_attention.proj.weight.shape == (64, 96)
    # Transformer Engine's initialisation: normal(0, 0.023) weights, zero biases.
    big = TransformerLayer(512, 512, 8)
    for name, p in big.named_parameters():
        if name.endswith("bias") and "layer_norm" not in name:
            assert torch.equal(p, torch.zeros_like(p)), name
        elif "layer_norm" not in name:
            assert abs(p.std().item() - 0.023) < 0.002, name
    # init methods: init_method for QKV and fc1, output_layer_init_method for proj and fc2.
    layer = TransformerLayer(32, 32, 2, init_method=torch.nn.init.ones_,
                             output_layer_init_method=torch.nn.init.zeros_)
    assert all((layer.self_attention.layernorm_qkv.get_parameter(n) == 1).all()
               for n in ("query_weight", "key_weight", "value_weight"))
    assert (layer.layernorm_mlp.fc1_weight == 1).all()
    assert (layer.self_attention.proj.weight == 0).all()
    assert (layer.layernorm_mlp.fc2_weight == 0).all()


def test_dtype_device_and_recipe_reach_every_submodule():
    recipe = DelayedScaling(amax_history_len=8)
    layer = TransformerLayer(32, 64, 2, params_dtype=torch.bfloat16, recipe=recipe)
    assert {p.dtype for p in layer.parameters()} == {torch.bfloat16}
    fp8_modules = [layer.self_attention.layernorm_qkv, layer.self_attention.proj,
                   layer.layernorm_mlp]
    for module in fp8_modules:
        assert module.fp8_fwd_amax_history.shape[0] == 8
    assert TransformerLayer(32, 64, 2, dtype=torch.bfloat16).layernorm_mlp.fc1_weight.dtype \
        == torch.bfloat16
    with torch.device("meta"):
        meta = TransformerLayer(32, 64, 2)
    assert all(p.is_meta for p in meta.parameters())


def test_layer_errors_name_the_argument():
    with pytest.raises(ValueError, match="layer_type must be 'encoder' or 'decoder'"):
        TransformerLayer(32, 32, 2, layer_type="encdec")
    with pytest.raises(ValueError, match=r"drop_path_rate must be in \[0, 1\), got 1.0"):
        TransformerLayer(32, 32, 2, drop_path_rate=1.0)
    with pytest.raises(TypeError, match="output_layernorm must be True or False, got 'yes'"):
        TransformerLayer(32, 32, 2, output_layernorm="yes")
    with pytest.raises(ValueError, match="parallel_attention_mlp=True cannot be combined with "
                                         "apply_residual_connection_post_layernorm=True"):
        TransformerLayer(32, 32, 2, parallel_attention_mlp=True,
                         apply_residual_connection_post_layernorm=True)
    with pytest.raises(ValueError, match="parallel_attention_mlp=True cannot be combined with "
                                         "output_layernorm=True"):
        TransformerLayer(32, 32, 2, parallel_attention_mlp=True, output_layernorm=True)
    with pytest.raises(ValueError, match="'qkv_format'.*'attn_input_format'.*must agree"):
        TransformerLayer(32, 32, 2, qkv_format="sbhd", attn_input_format="bshd")
    with pytest.raises(ValueError, match="attn_input_format must be one of"):
        TransformerLayer(32, 32, 2, attn_input_format="tbhd")
    with pytest.raises(ValueError, match="'thd' .* with layer_type='decoder' is not supported"):
        TransformerLayer(32, 32, 2, attn_input_format="thd", layer_type="decoder")
    with pytest.raises(ValueError, match=r"hidden_size \(30\) must be a multiple of "
                                         r"num_attention_heads \(4\)"):
        TransformerLayer(30, 32, 4)
    with pytest.raises(ValueError, match=r"hidden_dropout must be in \[0, 1\), got -0.1"):
        TransformerLayer(32, 32, 2, hidden_dropout=-0.1)
    with pytest.raises(ValueError, match="self_attn_mask_type must be one of"):
        TransformerLayer(32, 32, 2, self_attn_mask_type="window")
    with pytest.raises(ValueError, match="activation must be one of"):
        TransformerLayer(32, 32, 2, activation="tanh")
    with pytest.raises(ValueError, match="TransformerLayer: tp_size=2 .* needs "
                                         "set_parallel_mode=True"):
        TransformerLayer(32, 32, 2, tp_size=2)
    with pytest.raises(ValueError, match="'dtype'.*'params_dtype'"):
        TransformerLayer(32, 32, 2, dtype=torch.float32, params_dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="unexpected keyword argument 'bogus'"):
        TransformerLayer(32, 32, 2, bogus=1)
    # Transformer Engine's defaults are accepted.
    layer = TransformerLayer(32, 32, 2, sequence_parallel=False, tp_group=None, tp_size=1,
                             set_parallel_mode=False, fuse_wgrad_accumulation=False,
                             seq_length=16, micro_batch_size=2, drop_path_rate=0.0,
                             ub_tp_comm_overlap=False, get_rng_state_tracker=None,
                             parallel_attention_mlp=False, name="layer0")
    with pytest.raises(ValueError, match=r"hidden_states must have shape \[s, b, 32\].*got "
                                         r"\(4, 2, 16\)"):
        layer(torch.randn(4, 2, 16))
    with pytest.raises(ValueError, match="encoder_output is for layer_type='decoder'"):
        layer(torch.randn(4, 2, 32), encoder_output=torch.randn(4, 2, 32))


def test_fused_qkv_layout_is_interleaved_per_group():
    """fuse_qkv_params with qkv_weight_interleaved: per group, its queries, key, value."""
    layer = TransformerLayer(64, 64, 4, num_gqa_groups=2, fuse_qkv_params=True)
    att = layer.self_attention
    d = 16
    # Label every output feature by its row block: block i holds the value i.
    mixed = torch.arange(8).repeat_interleave(d).float().reshape(1, 1, 8 * d)
    q, k, v = att.split_qkv(mixed)
    assert q[0, 0, :, 0].tolist() == [0, 1, 4, 5]
    assert k[0, 0, :, 0].tolist() == [2, 6] and v[0, 0, :, 0].tolist() == [3, 7]
    q, k, v = TransformerLayer(64, 64, 4, num_gqa_groups=2).self_attention.split_qkv(mixed)
    assert q[0, 0, :, 0].tolist() == [0, 1, 2, 3]
    assert k[0, 0, :, 0].tolist() == [4, 5] and v[0, 0, :, 0].tolist() == [6, 7]


# ---- TransformerLayer: high precision is exactly the composition --------------------------------

CONFIGS = {
    "layernorm-gelu": dict(normalization="LayerNorm", activation="gelu"),
    "rmsnorm-swiglu-gqa": dict(normalization="RMSNorm", activation="swiglu", num_gqa_groups=2,
                               zero_centered_gamma=True),
    "post-layernorm-bshd": dict(apply_residual_connection_post_layernorm=True,
                                attn_input_format="bshd", activation="geglu"),
}


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("rotary", [False, True], ids=["", "rotary"])
def test_high_precision_is_exactly_the_composition(gen, device, config, rotary):
    torch.manual_seed(0)
    layer = small_layer(device, **CONFIGS[config])
    randomize_norms(layer, gen)
    x = randn(gen, 10, 3, 64, device=device)
    freqs = RotaryPositionEmbedding(16)(10).to(device) if rotary else None
    for ctx in (torch.enable_grad(), fp8_autocast(enabled=False)):
        with ctx:
            out = layer(x, rotary_pos_emb=freqs)
        assert_bitwise_equal(out, layer_ref(layer, x, rotary=freqs), config)


@pytest.mark.parametrize("groups", [4, 2], ids=["mha", "gqa"])
def test_padding_mask_is_exactly_the_composition(gen, device, groups):
    layer = small_layer(device, self_attn_mask_type="padding", num_gqa_groups=groups)
    x = randn(gen, 8, 2, 64, device=device)
    pad = torch.zeros(2, 1, 1, 8, dtype=torch.bool, device=device)
    pad[1, ..., 6:] = True
    out = layer(x, attention_mask=pad)
    assert_bitwise_equal(out, layer_ref(layer, x, mask=pad), "padding")
    # self_attn_mask_type in forward overrides the layer's.
    out = layer(x, self_attn_mask_type="causal")
    assert_bitwise_equal(out, layer_ref(layer, x), "causal")


def test_bshd_is_sbhd_transposed(gen, device):
    torch.manual_seed(1)
    sbhd = small_layer(device, num_gqa_groups=2)
    bshd = small_layer(device, num_gqa_groups=2, attn_input_format="bshd")
    bshd.load_state_dict(sbhd.state_dict())
    x = randn(gen, 9, 2, 64, device=device)
    torch.testing.assert_close(bshd(x.transpose(0, 1)).transpose(0, 1), sbhd(x), atol=1e-6,
                               rtol=1e-5)


# ---- Transformer Engine's variants: parallel branches, output norm, stochastic depth -----------

def _composed(layer, x, rotary=None):
    """What TransformerLayer computes, from its submodules, as Transformer Engine's forward
    writes it (dropout 0): the parallel branches, the post-norm residuals, the output norm,
    DropPath on each branch (drawn attention branch first)."""
    attn = layer.self_attention(x, rotary_pos_emb=rotary)
    post_ln = layer.apply_residual_connection_post_layernorm
    drop = layer.drop_path if layer.drop_path is not None else (lambda t: t)
    if layer.parallel_attention_mlp:
        out = x + drop(attn + layer.layernorm_mlp(x))
    else:
        attn, residual = attn if post_ln and not layer.output_layernorm else (attn, x)
        hidden = residual + drop(attn)
        mlp = layer.layernorm_mlp(hidden)
        mlp, residual = mlp if post_ln else (mlp, hidden)
        out = residual + drop(mlp)
    return layer.layernorm(out) if layer.output_layernorm else out


VARIANTS = {
    "parallel": dict(parallel_attention_mlp=True),
    "output_layernorm": dict(output_layernorm=True),
    "output_rmsnorm-post_ln": dict(output_layernorm=True, normalization="RMSNorm",
                                   apply_residual_connection_post_layernorm=True),
    "parallel-bshd": dict(parallel_attention_mlp=True, attn_input_format="bshd"),
    "drop_path": dict(drop_path_rate=0.4),
    "drop_path-parallel": dict(drop_path_rate=0.4, parallel_attention_mlp=True),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("recipe", [None] + RECIPES, ids=["high"] + RECIPE_IDS)
def test_variants_are_exactly_their_composition(gen, variant, recipe):
    """Outside and inside fp8_autocast (one step each on copies with the same FP8 state):
    output, every gradient and the FP8 state bit for bit the composition of the submodules;
    DropPath's draws the same (the same seed before each)."""
    torch.manual_seed(4)
    layer = TransformerLayer(64, 64, 4, num_gqa_groups=2, hidden_dropout=0.0,
                             attention_dropout=0.0, **VARIANTS[variant])
    randomize_norms(layer, gen)
    if layer.output_layernorm:
        assert layer.self_attention.input_layernorm is False
        assert isinstance(layer.layernorm, torch.nn.Module)
    copy_ = copy.deepcopy(layer)
    x = randn(gen, 8, 2, 64)
    rotary = RotaryPositionEmbedding(16)(8)
    results = []
    for module, run in ((layer, lambda m, t: m(t, rotary_pos_emb=rotary)),
                        (copy_, lambda m, t: _composed(m, t, rotary))):
        xi = x.clone().requires_grad_()
        torch.manual_seed(7)
        with fp8_autocast(enabled=recipe is not None, fp8_recipe=recipe):
            out = run(module, xi)
        out.square().mean().backward()
        results.append([out, xi.grad] + [p.grad for p in module.parameters()]
                       + [v for k, v in module.state_dict().items() if "fp8_" in k])
    assert len(results[0]) == len(results[1])
    for i, (a, b) in enumerate(zip(*results)):
        assert a is not None and torch.equal(a, b), (variant, i)


def test_a_layer_pickled_before_the_variants_runs():
    """A whole-layer pickle made before parallel_attention_mlp, output_layernorm, drop_path
    and layer_type existed (their attributes absent) runs as the pre-norm encoder it was."""
    import pickle
    torch.manual_seed(6)
    layer = TransformerLayer(32, 32, 2, hidden_dropout=0.0, attention_dropout=0.0)
    x = torch.randn(5, 2, 32)
    expected = layer(x)
    state = pickle.loads(pickle.dumps(layer)).__dict__
    for name in ("layer_type", "output_layernorm", "parallel_attention_mlp", "drop_path"):
        state.pop(name, None)
        state["_modules"].pop(name, None)
    old = TransformerLayer.__new__(TransformerLayer)
    old.__setstate__(state)
    assert torch.equal(old(x), expected)
    # (and a copy keeps a DropPath submodule: drop_path lives in _modules then)
    assert copy.deepcopy(TransformerLayer(32, 32, 2, drop_path_rate=0.2)).drop_path is not None


def test_drop_path_draws_as_transformer_engine():
    """One draw per index of dim 0, the branch zeroed or scaled by 1 / keep; none in
    evaluation; the draws change the output in training."""
    from transformer_fp8.modules.transformer_layer import DropPath
    drop = DropPath(0.25)
    x = torch.ones(1000, 2, 3)
    torch.manual_seed(0)
    out = drop(x)
    torch.manual_seed(0)
    kept = (0.75 + torch.rand(1000, 1, 1)).floor_()
    assert torch.equal(out, x.div(0.75) * kept)
    per_row = out[:, 0, 0]
    assert set(per_row.unique().tolist()) == {0.0, torch.tensor(1 / 0.75).item()}
    assert (out == out[:, :1, :1]).all()  # (one draw per index of dim 0)
    assert 0.2 < (per_row == 0).float().mean() < 0.3
    assert torch.equal(drop.eval()(x), x)
    layer = TransformerLayer(32, 32, 2, hidden_dropout=0.0, attention_dropout=0.0,
                             drop_path_rate=0.5)
    y = torch.randn(6, 2, 32)
    assert not torch.equal(layer(y), layer(y))
    layer.eval()
    assert torch.equal(layer(y), layer(y))


def test_hidden_dropout_in_training_only(gen):
    torch.manual_seed(2)
    layer = TransformerLayer(32, 32, 2, hidden_dropout=0.5, attention_dropout=0.0)
    x = randn(gen, 6, 2, 32)
    assert not torch.equal(layer(x), layer(x))
    layer.eval()
    assert_bitwise_equal(layer(x), layer_ref(layer, x), "eval")


def test_checkpointing_gives_bit_identical_gradients(gen):
    """torch.utils.checkpoint of a layer (dropout on: the recomputation replays the RNG)."""
    torch.manual_seed(3)
    layer = TransformerLayer(64, 128, 4, num_gqa_groups=2, hidden_dropout=0.1,
                             attention_dropout=0.1)
    x = randn(gen, 8, 2, 64)
    freqs = RotaryPositionEmbedding(16)(8)
    results = []
    for mode in ("plain", "reentrant", "nonreentrant"):
        layer.zero_grad(set_to_none=True)
        x_in = x.clone().requires_grad_(True)
        torch.manual_seed(4)
        if mode == "plain":
            out = layer(x_in, rotary_pos_emb=freqs)
        else:
            # (rotary_pos_emb by keyword: Transformer Engine's forward has it 14th)
            out = torch.utils.checkpoint.checkpoint(
                functools.partial(layer, rotary_pos_emb=freqs), x_in,
                use_reentrant=mode == "reentrant")
        out.square().mean().backward()
        results.append([out.detach(), x_in.grad] + [p.grad for p in layer.parameters()])
    for mode, result in zip(("reentrant", "nonreentrant"), results[1:]):
        for i, (a, b) in enumerate(zip(result, results[0])):
            assert_bitwise_equal(a, b, f"{mode} tensor {i}")


def test_state_dict_round_trip(gen, device, tmp_path):
    torch.manual_seed(5)
    layer = small_layer(device, num_gqa_groups=2, normalization="RMSNorm")
    randomize_norms(layer, gen)
    state = layer.state_dict()
    torch.save(state, tmp_path / "layer.pt")
    loaded = torch.load(tmp_path / "layer.pt", weights_only=True)
    assert loaded.keys() == state.keys()
    with torch.device("meta"):
        fresh = TransformerLayer(64, 128, 4, num_gqa_groups=2, normalization="RMSNorm",
                                 hidden_dropout=0.0, attention_dropout=0.0)
    fresh.to_empty(device=device)
    fresh.load_state_dict(loaded)
    x = randn(gen, 6, 2, 64, device=device)
    assert_bitwise_equal(fresh(x), layer(x), "after load")


# ---- TransformerLayer in FP8 --------------------------------------------------------------------

FP8_CONFIGS = {
    "layernorm-gelu": dict(normalization="LayerNorm", activation="gelu"),
    "rmsnorm-swiglu-gqa": dict(normalization="RMSNorm", activation="swiglu", num_gqa_groups=2),
}


@NEEDS_FUSED_OPS
@pytest.mark.parametrize("recipe", RECIPES, ids=RECIPE_IDS)
@pytest.mark.parametrize("config", list(FP8_CONFIGS))
def test_fp8_sqnr_against_float32(gen, device, recipe, config):
    torch.manual_seed(6)
    layer = small_layer(device, recipe=recipe, **FP8_CONFIGS[config])
    randomize_norms(layer, gen)
    ref = copy.deepcopy(layer)
    x = randn(gen, 24, 3, 64, device=device)  # 72 tokens: padded to 80 rows inside
    g = randn(gen, 24, 3, 64, device=device)
    freqs = RotaryPositionEmbedding(16)(24).to(device)
    for _ in range(2):  # the second step runs with the scales of the first (delayed scaling)
        layer.zero_grad(set_to_none=True)
        x_in = x.clone().requires_grad_(True)
        with fp8_autocast(fp8_recipe=recipe):
            out = layer(x_in, rotary_pos_emb=freqs)
        out.backward(g)
    x_ref = x.clone().requires_grad_(True)
    out_ref = layer_ref(ref, x_ref, rotary=freqs)
    out_ref.backward(g)
    assert sqnr(out_ref, out) >= 20
    assert sqnr(x_ref.grad, x_in.grad) >= 17
    for (name, p), q in zip(layer.named_parameters(), ref.parameters()):
        # Weights >= 17 dB. Biases and norm parameters get sums over tokens that largely cancel
        # (the key bias most: its gradient is ~4% of the query bias's), so their SQNR has a
        # long tail: minimum over 600 seeds 14.9 dB (key_bias), 17.4 (norm bias); 13 dB still
        # fails a gradient off by a factor 1.25 (12 dB).
        # The key bias's gradient nearly cancels (zero without the rotary embedding: a bias
        # common to every key shifts each query's scores equally): alone it reached 9.5 dB
        # (seed 1854409619), so it is held to 6 dB alone and, with the query and value biases
        # (the bias gradient of one GEMM: min 18.9 dB over 150 seeds), to 13 dB.
        bound = 17 if name.endswith("weight") and "layer_norm" not in name else 13
        if name.endswith("key_bias"):
            bound = 6
        assert sqnr(q.grad, p.grad) >= bound, name
    qkv_biases = [(p.grad, q.grad) for (name, p), q in zip(layer.named_parameters(),
                                                           ref.parameters())
                  if name.startswith("self_attention.layernorm_qkv.")
                  and name.endswith(("query_bias", "key_bias", "value_bias"))]
    assert len(qkv_biases) == 3
    assert sqnr(torch.cat([r for _, r in qkv_biases]),
                torch.cat([f for f, _ in qkv_biases])) >= 13, "query, key and value biases"
    # Every GEMM ran in FP8 with its own scales: each module's forward history is filled.
    for module in (layer.self_attention.layernorm_qkv, layer.self_attention.proj,
                   layer.layernorm_mlp):
        if isinstance(recipe, DelayedScaling):
            assert (module.fp8_fwd_amax_history.amax(0) > 0).all()
            assert (module.fp8_bwd_amax_history.amax(0) > 0).all()


@NEEDS_FUSED_OPS
@pytest.mark.parametrize("reentrant", [False, True], ids=["nonreentrant", "reentrant"])
@pytest.mark.parametrize("recipe", RECIPES, ids=RECIPE_IDS)
def test_fp8_checkpointing_gives_bit_identical_gradients(device, recipe, reentrant):
    """Three SGD steps of a checkpointed layer: losses, gradients and FP8 state bit for bit
    those of the plain layer."""
    torch.manual_seed(7)
    layer = small_layer(device, recipe=recipe, num_gqa_groups=2, activation="swiglu",
                        normalization="RMSNorm")
    plain = copy.deepcopy(layer)
    batches = step_batches(torch.Generator().manual_seed(7), 3, 16, 2, 64, device=device)
    expected = train(plain, plain, batches, recipe)
    got = train(layer, lambda x: torch.utils.checkpoint.checkpoint(
        layer, x, use_reentrant=reentrant), batches, recipe)
    assert_bit_identical(got, expected)


@NEEDS_FUSED_OPS
def test_fp8_state_dict_round_trip(gen, device):
    recipe = DelayedScaling(amax_history_len=4)
    torch.manual_seed(8)
    layer = small_layer(device, recipe=recipe)
    x = randn(gen, 16, 2, 64, device=device)
    for _ in range(2):
        with fp8_autocast(fp8_recipe=recipe):
            out = layer(x.clone().requires_grad_(True))
        out.sum().backward()
    fresh = small_layer(device, recipe=recipe)
    fresh.load_state_dict(layer.state_dict())
    with fp8_autocast(fp8_recipe=recipe):
        assert_bitwise_equal(fresh(x), layer(x), "FP8 forward after load")


# ---- a small GPT of TransformerLayers trains in FP8 as in bf16 ----------------------------------

def _load_train_gpt():
    spec = importlib.util.spec_from_file_location("_example_train_gpt_te",
                                                  EXAMPLES / "train_gpt.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@NEEDS_FUSED_OPS
def test_gpt_of_transformer_layers_trains_in_fp8_as_in_bf16(tmp_path):
    """examples/train_gpt.py --te-layers on the shipped text: hidden 64, 2 layers, seq 32,
    fixed seeds; the final smoothed training loss (mean of the last 10% of steps) of the FP8
    run is within 2% of the bf16 run's."""
    train_gpt = _load_train_gpt()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        summary = train_gpt.main(["--te-layers", "--precision", "both", "--d-model", "64",
                                  "--layers", "2", "--heads", "4", "--seq-len", "32",
                                  "--batch-size", "8", "--steps", "60", "--sample", "0",
                                  "--tiny", "--no-progress", "--device", "cpu",
                                  "--out", str(tmp_path)])
    finally:
        torch.set_num_threads(threads)
    results = summary["results"]
    bf16, fp8 = results["bf16"]["final_train_loss"], results["fp8"]["final_train_loss"]
    for r in results.values():
        assert r["final_train_loss"] < 0.85 * r["train_losses"][0]  # it learnt
    # The FP8 modules are the three per layer, not converted nn.Linear layers.
    assert len(results["fp8"]["fp8_layers"]) == 3 * 2
    assert abs(fp8 - bf16) / bf16 < 0.02, (fp8, bf16)
