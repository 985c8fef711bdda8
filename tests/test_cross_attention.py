"""Transformer Engine's cross-attention: MultiheadAttention(attention_type="cross") and
TransformerLayer(layer_type="decoder").

* MultiheadAttention: against a float64 reference written from the module's parameters (the
  queries' norm and projection, the encoder output's key/value projection in each weight
  layout, grouped heads, rotary angles per side, a padding mask per side), output and every
  gradient; inside fp8_autocast within SQNR bounds of it;
* TransformerLayer: exactly the composition of its submodules (self-attention, the
  cross-attention on encoder_output, the MLP) outside and inside fp8_autocast, with the
  encoder-decoder mask, post-norm residuals and an output norm;
* refusals naming the argument.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from attention_reference import attention_ref
from conftest import sqnr

import transformer_fp8 as tfp8
from transformer_fp8 import DelayedScaling, Float8CurrentScaling, fp8_autocast
from transformer_fp8.modules.attention import apply_rotary_pos_emb

H, G, D, HIDDEN, S_Q, S_KV, B = 4, 2, 16, 64, 6, 9, 2


def _norm64(x, module):
    x = x.double()
    w = module.layer_norm_weight.double()
    if module.normalization == "RMSNorm":
        return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + module.eps) * w
    return F.layer_norm(x, (x.shape[-1],), w, module.layer_norm_bias.double(), module.eps)


def _param64(module, logical):
    """A projection's weight or bias in float64: the Parameter, or its parts joined."""
    names = module._parts.get(logical, [logical])
    parts = [getattr(module, n) for n in names]
    return None if parts[0] is None else torch.cat([p.double() for p in parts])


def _reference(mha, x, enc, pads=None, rotary=None):
    """The cross-attention in float64 from the module's parameters."""
    query_module = mha.layernorm_query if mha.input_layernorm else mha.query_layer
    q_in = _norm64(x, query_module) if mha.input_layernorm else x.double()
    q = F.linear(q_in, _param64(query_module, "weight"), _param64(query_module, "bias"))
    kv = F.linear(enc.double(), _param64(mha.key_value, "weight"),
                  _param64(mha.key_value, "bias"))
    if mha.qkv_weight_interleaved:  # per group: its key, its value
        k, v = kv.view(*kv.shape[:-1], G, 2 * D).split([D, D], dim=-1)
    else:
        k, v = kv.view(*kv.shape[:-1], 2 * G, D).split([G, G], dim=-2)
    q = q.view(*q.shape[:-1], H, D)
    if rotary is not None:
        q = apply_rotary_pos_emb(q, rotary[0].double(), "sbhd")
        k = apply_rotary_pos_emb(k, rotary[1].double(), "sbhd")
    blocked = torch.zeros(1, 1, S_Q, S_KV, dtype=torch.bool)
    if pads is not None:
        blocked = pads[0].transpose(-1, -2) | pads[1]
    ctx = attention_ref(q, k, v, blocked)
    return F.linear(ctx, mha.proj.weight.double(), mha.proj.bias.double())


CONFIGS = {
    "layernorm-split": dict(input_layernorm=True),
    "fused-interleaved": dict(fuse_qkv_params=True),
    "fused-plain-layernorm": dict(fuse_qkv_params=True, qkv_weight_interleaved=False,
                                  input_layernorm=True, normalization="RMSNorm"),
}


def _module(config, mask_type="no_mask"):
    torch.manual_seed(0)
    mha = tfp8.MultiheadAttention(HIDDEN, H, num_gqa_groups=G, attention_type="cross",
                                  attention_dropout=0.0, attn_mask_type=mask_type,
                                  **CONFIGS[config])
    with torch.no_grad():  # (not the initial zeros and ones, which hide a wrong bias or norm)
        for name, p in mha.named_parameters():
            if "bias" in name or "layer_norm" in name:
                p.uniform_(0.5, 1.5)
    return mha


def test_cross_attention_refuses_one_padding_mask_for_both_sides():
    """Cross-attention's padding mask is the pair (query mask, key/value mask), as in Transformer
    Engine: one tensor, where s_q == s_kv, was applied to both sides, so an encoder's key mask
    also zeroed the decoder's query rows (its outputs 0 where the pair gives attention)."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(4, 1, 1, 2, generator=gen) for _ in range(3))
    kv_pad = torch.tensor([False, False, True, True]).view(1, 1, 1, 4)
    cross = tfp8.DotProductAttention(1, 2, attn_mask_type="padding", attention_type="cross")
    with pytest.raises(ValueError, match="cross-attention with a padding mask type takes "
                                         "attention_mask as a tuple"):
        cross(q, k, v, attention_mask=kv_pad)
    out = cross(q, k, v, attention_mask=(torch.zeros_like(kv_pad), kv_pad))
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3),
        attn_mask=~kv_pad).permute(2, 0, 1, 3).reshape(4, 1, 2)
    torch.testing.assert_close(out, expected)
    # self-attention keeps taking one tensor for both sides
    selfattn = tfp8.DotProductAttention(1, 2, attn_mask_type="padding")
    assert torch.equal(selfattn(q, k, v, attention_mask=kv_pad)[2:], torch.zeros(2, 1, 2))


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("masked", [False, True], ids=["", "padding"])
def test_cross_attention_matches_the_float64_reference(config, masked):
    mha = _module(config, "padding" if masked else "no_mask")
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(S_Q, B, HIDDEN, generator=gen, requires_grad=True)
    enc = torch.randn(S_KV, B, HIDDEN, generator=gen, requires_grad=True)
    pads = None
    if masked:  # the second sequence: its last query and its last 3 encoder tokens padded
        q_pad = torch.zeros(B, 1, 1, S_Q, dtype=torch.bool)
        kv_pad = torch.zeros(B, 1, 1, S_KV, dtype=torch.bool)
        q_pad[1, ..., -1:] = True
        kv_pad[1, ..., -3:] = True
        pads = (q_pad, kv_pad)
    rope = tfp8.RotaryPositionEmbedding(D)
    rotary = (rope(S_Q), rope(S_KV))
    out = mha(x, encoder_output=enc, attention_mask=pads, rotary_pos_emb=rotary)
    assert out.shape == (S_Q, B, HIDDEN)
    ref = _reference(mha, x, enc, pads, rotary)
    if masked:  # (a padded query gives zeros before proj: its output is proj's bias)
        assert torch.equal(out[-1, 1], mha.proj.bias)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    grad = torch.randn(out.shape, generator=gen)
    params = dict(mha.named_parameters())
    leaves = [x, enc] + list(params.values())
    got = torch.autograd.grad(out, leaves, grad)
    expected = torch.autograd.grad(ref, leaves, grad.double())
    for name, a, e in zip(["x", "encoder_output"] + list(params), got, expected):
        torch.testing.assert_close(a.double(), e.double(), rtol=1e-4, atol=1e-5,
                                   msg=lambda m, name=name: f"{config} d{name}: {m}")


@pytest.mark.parametrize("recipe", [DelayedScaling(amax_history_len=4), Float8CurrentScaling()],
                         ids=["delayed", "current"])
def test_cross_attention_in_fp8_stays_close_to_high_precision(recipe):
    mha = _module("layernorm-split")
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(S_Q, B, HIDDEN, generator=gen)
    enc = torch.randn(S_KV, B, HIDDEN, generator=gen)
    expected = mha(x, encoder_output=enc)
    for _ in range(3):  # (delayed scaling: scales from the steps before)
        xi, ei = x.clone().requires_grad_(), enc.clone().requires_grad_()
        with fp8_autocast(fp8_recipe=recipe):
            out = mha(xi, encoder_output=ei)
        out.sum().backward()
    assert sqnr(expected, out) > 20
    assert ei.grad is not None and torch.isfinite(ei.grad).all() and ei.grad.abs().sum() > 0


DECODERS = {
    "pre-norm": dict(),
    "post-norm-residuals": dict(apply_residual_connection_post_layernorm=True),
    "output-layernorm-gqa": dict(output_layernorm=True, num_gqa_groups=2),
    "fused-bshd": dict(fuse_qkv_params=True, attn_input_format="bshd"),
}


def _decoder_composed(layer, x, enc, mask):
    """TransformerLayer(layer_type="decoder") from its submodules, as Transformer Engine's
    forward writes it (dropout 0)."""
    post_ln = layer.apply_residual_connection_post_layernorm
    attn = layer.self_attention(x)
    attn, residual = attn if post_ln and not layer.output_layernorm else (attn, x)
    hidden = residual + attn
    inter = layer.inter_attention(hidden, encoder_output=enc, attention_mask=mask)
    inter, residual = inter if post_ln else (inter, hidden)
    hidden = residual + inter
    mlp = layer.layernorm_mlp(hidden)
    mlp, residual = mlp if post_ln else (mlp, hidden)
    out = residual + mlp
    return layer.layernorm(out) if layer.output_layernorm else out


@pytest.mark.parametrize("config", list(DECODERS))
@pytest.mark.parametrize("recipe", [None, DelayedScaling(amax_history_len=4),
                                    Float8CurrentScaling()], ids=["high", "delayed", "current"])
def test_decoder_layer_is_exactly_its_composition(config, recipe):
    torch.manual_seed(3)
    layer = tfp8.TransformerLayer(HIDDEN, 64, H, layer_type="decoder", hidden_dropout=0.0,
                                  attention_dropout=0.0, enc_dec_attn_mask_type="padding",
                                  **DECODERS[config])
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if "bias" in name or "layer_norm" in name:
                p.uniform_(0.5, 1.5)
    assert layer.inter_attention.attention_type == "cross"
    bshd = layer.attn_input_format == "bshd"
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(*((B, S_Q) if bshd else (S_Q, B)), HIDDEN, generator=gen)
    enc = torch.randn(*((B, S_KV) if bshd else (S_KV, B)), HIDDEN, generator=gen)
    q_pad = torch.zeros(B, 1, 1, S_Q, dtype=torch.bool)
    kv_pad = torch.zeros(B, 1, 1, S_KV, dtype=torch.bool)
    kv_pad[0, ..., -2:] = True
    results = []
    for module, run in ((layer, lambda m, t, e: m(t, encoder_output=e,
                                                   enc_dec_attn_mask=(q_pad, kv_pad))),
                        (copy.deepcopy(layer),
                         lambda m, t, e: _decoder_composed(m, t, e, (q_pad, kv_pad)))):
        xi, ei = x.clone().requires_grad_(), enc.clone().requires_grad_()
        with fp8_autocast(enabled=recipe is not None, fp8_recipe=recipe):
            out = run(module, xi, ei)
        out.square().mean().backward()
        results.append([out, xi.grad, ei.grad] + [p.grad for p in module.parameters()]
                       + [v for k, v in module.state_dict().items() if "fp8_" in k])
    for i, (a, b) in enumerate(zip(*results)):
        assert a is not None and torch.equal(a, b), (config, i)


def test_cross_attention_refusals_name_the_argument():
    cross = tfp8.MultiheadAttention(HIDDEN, H, attention_type="cross")
    x = torch.randn(S_Q, B, HIDDEN)
    with pytest.raises(ValueError, match="attention_type='cross' needs encoder_output"):
        cross(x)
    with pytest.raises(ValueError, match="inference_params with attention_type='cross' is "
                                         "not supported"):
        cross(x, encoder_output=x, inference_params=tfp8.InferenceParams(
            2, 8, num_heads_kv=H, head_dim_k=D, dtype=torch.float32))
    with pytest.raises(ValueError, match="encoder_output is for attention_type='cross'"):
        tfp8.MultiheadAttention(HIDDEN, H)(x, encoder_output=x)
    with pytest.raises(ValueError, match="attention_type must be 'self' or 'cross', got 'x'"):
        tfp8.MultiheadAttention(HIDDEN, H, attention_type="x")
    with pytest.raises(ValueError, match="layer_type must be 'encoder' or 'decoder'"):
        tfp8.TransformerLayer(HIDDEN, 64, H, layer_type="encoder-decoder")
    with pytest.raises(ValueError, match="parallel_attention_mlp=True cannot be combined with "
                                         "layer_type='decoder'"):
        tfp8.TransformerLayer(HIDDEN, 64, H, layer_type="decoder", parallel_attention_mlp=True)
    decoder = tfp8.TransformerLayer(HIDDEN, 64, H, layer_type="decoder")
    with pytest.raises(ValueError, match="attention_type='cross' needs encoder_output"):
        decoder(x)
    encoder = tfp8.TransformerLayer(HIDDEN, 64, H)
    with pytest.raises(ValueError, match="encoder_output is for layer_type='decoder'"):
        encoder(x, encoder_output=x)
    with pytest.raises(ValueError, match="enc_dec_attn_mask_type='padding' is not supported"):
        tfp8.TransformerLayer(HIDDEN, 64, H, enc_dec_attn_mask_type="padding")
    # TE's names: layernorm_query (query_weight unless fused) / query_layer, key_value
    names = [n for n, _ in decoder.named_parameters() if n.startswith("inter_attention")]
    assert names[:4] == ["inter_attention.layernorm_query.layer_norm_weight",
                         "inter_attention.layernorm_query.layer_norm_bias",
                         "inter_attention.layernorm_query.query_weight",
                         "inter_attention.layernorm_query.query_bias"]
    assert "inter_attention.key_value.key_weight" in names
