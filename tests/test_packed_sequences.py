"""Transformer Engine's packed sequences (qkv_format "thd", cu_seqlens): DotProductAttention
and apply_rotary_pos_emb against the same sequences run one by one in "bshd" and against a
float64 reference, outputs and gradients; rows between sequences (cu_seqlens_padded) give
zeros and get no gradient; refusals naming the argument."""
from __future__ import annotations

import pytest
import torch
from attention_reference import attention_ref, blocked_mask

import transformer_fp8 as tfp8
from transformer_fp8.modules.attention import apply_rotary_pos_emb

H, G, D = 4, 2, 8
CU = torch.tensor([0, 3, 5, 9], dtype=torch.int32)          # lengths 3, 2, 4
CU_KV = torch.tensor([0, 4, 5, 11], dtype=torch.int32)      # lengths 4, 1, 6
CU_PADDED = torch.tensor([0, 4, 8, 13], dtype=torch.int32)  # one or two rows between them


def _spans(cu):
    cu = cu.tolist()
    return list(zip(cu, cu[1:]))


def _leaves(gen, rows, heads, dtype=torch.float64):
    return torch.randn(rows, heads, D, generator=gen, dtype=dtype).requires_grad_(True)


@pytest.mark.parametrize("mask_type", ["padding", "padding_causal", "padding_causal_bottom_right"])
@pytest.mark.parametrize("softmax_type", ["vanilla", "learnable"])
def test_packed_attention_is_each_sequence_alone(mask_type, softmax_type):
    """Queries and keys of different lengths per sequence (cross-attention), grouped heads:
    each sequence's rows are what attention of that sequence alone gives, in float64 against
    the explicit reference, gradients included."""
    gen = torch.Generator().manual_seed(0)
    attn = tfp8.DotProductAttention(H, D, num_gqa_groups=G, qkv_format="thd",
                                    attn_mask_type=mask_type, attention_type="cross",
                                    softmax_type=softmax_type).double()
    if softmax_type == "learnable":
        with torch.no_grad():
            attn.softmax_offset.copy_(torch.tensor([0.5, -1.0, 2.0, 0.0]))
    q, k, v = _leaves(gen, 9, H), _leaves(gen, 11, G), _leaves(gen, 11, G)
    out = attn(q, k, v, cu_seqlens_q=CU, cu_seqlens_kv=CU_KV, max_seqlen_q=4, max_seqlen_kv=6)
    assert out.shape == (9, H * D)
    alpha = attn.softmax_offset if softmax_type == "learnable" else None
    ref = []
    for (a, b), (c, d) in zip(_spans(CU), _spans(CU_KV)):
        kind = mask_type.replace("padding_", "").replace("padding", "no_mask")
        blocked = blocked_mask(kind, b - a, d - c)
        ref.append(attention_ref(q[a:b].unsqueeze(1), k[c:d].unsqueeze(1), v[c:d].unsqueeze(1),
                                 blocked, alpha=alpha, scale=D ** -0.5)[:, 0])
    ref = torch.cat(ref)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    grad = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    leaves = [q, k, v] + ([attn.softmax_offset] if alpha is not None else [])
    for got, expected in zip(torch.autograd.grad(out, leaves, grad),
                             torch.autograd.grad(ref, leaves, grad)):
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)


def test_rows_between_sequences_take_part_in_nothing():
    """cu_seqlens_q_padded / cu_seqlens_kv_padded: the sequences start at the padded offsets;
    the rows between them give zeros, get no gradient, and what they hold changes nothing."""
    gen = torch.Generator().manual_seed(1)
    attn = tfp8.DotProductAttention(H, D, num_gqa_groups=G, qkv_format="thd",
                                    attn_mask_type="padding_causal").double()
    q, k, v = _leaves(gen, 13, H), _leaves(gen, 13, G), _leaves(gen, 13, G)
    kw = dict(cu_seqlens_q=CU, cu_seqlens_kv=CU, cu_seqlens_q_padded=CU_PADDED,
              cu_seqlens_kv_padded=CU_PADDED, pad_between_seqs=True)
    out = attn(q, k, v, **kw)
    gaps = [3, 6, 7, 12]  # (rows 0-2, 4-5, 8-11 hold the sequences)
    assert out[gaps].abs().sum() == 0
    dense = tfp8.DotProductAttention(H, D, num_gqa_groups=G, qkv_format="thd",
                                     attn_mask_type="padding_causal").double()
    keep = [i for i in range(13) if i not in gaps]
    expected = dense(q[keep], k[keep], v[keep], cu_seqlens_q=CU, cu_seqlens_kv=CU)
    torch.testing.assert_close(out[keep], expected, rtol=0, atol=1e-14)
    out.sum().backward()
    assert q.grad[gaps].abs().sum() == 0 and k.grad[gaps].abs().sum() == 0
    with torch.no_grad():
        q2, k2 = q.clone(), k.clone()
        q2[gaps], k2[gaps] = 1e3, -1e3
    torch.testing.assert_close(attn(q2, k2, v, **kw), out.detach(), rtol=0, atol=0)


@pytest.mark.parametrize("starts", [None, [2, 0, 5]])
def test_packed_rotary_embedding_restarts_at_each_sequence(starts):
    gen = torch.Generator().manual_seed(2)
    t = torch.randn(9, H, 16, generator=gen)
    freqs = tfp8.RotaryPositionEmbedding(16)(12)
    got = apply_rotary_pos_emb(t, freqs, "thd", cu_seqlens=CU,
                               start_positions=None if starts is None else torch.tensor(starts))
    expected = torch.cat([
        apply_rotary_pos_emb(t[a:b].unsqueeze(1), freqs, "sbhd",
                             start_positions=None if starts is None else [starts[i]])[:, 0]
        for i, (a, b) in enumerate(_spans(CU))])
    assert torch.equal(got, expected)


def test_packed_refusals_name_the_argument():
    attn = tfp8.DotProductAttention(H, D, qkv_format="thd", attn_mask_type="padding")
    q = torch.randn(9, H, D)
    with pytest.raises(ValueError, match="'thd' needs a 'padding' mask type"):
        attn(q, q, q, cu_seqlens_q=CU, cu_seqlens_kv=CU, attn_mask_type="causal")
    with pytest.raises(ValueError, match="needs cu_seqlens_q and cu_seqlens_kv"):
        attn(q, q, q)
    with pytest.raises(ValueError, match="leave attention_mask at None"):
        attn(q, q, q, cu_seqlens_q=CU, cu_seqlens_kv=CU,
             attention_mask=torch.zeros(3, 1, 1, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="cu_seqlens_q must start at 0 and never decrease"):
        attn(q, q, q, cu_seqlens_q=torch.tensor([0, 5, 3, 9]), cu_seqlens_kv=CU)
    with pytest.raises(ValueError, match="cu_seqlens_kv must be a 1-D integer tensor"):
        attn(q, q, q, cu_seqlens_q=CU, cu_seqlens_kv=CU.float())
    with pytest.raises(ValueError, match="cu_seqlens_q reaches row 12, past the 9 rows"):
        attn(q, q, q, cu_seqlens_q=torch.tensor([0, 3, 12]), cu_seqlens_kv=torch.tensor([0, 3, 9]))
    with pytest.raises(ValueError, match="query_layer must be 3-D"):
        attn(q.unsqueeze(0), q, q, cu_seqlens_q=CU, cu_seqlens_kv=CU)
    with pytest.raises(ValueError, match="cu_seqlens_q_padded must leave each sequence"):
        attn(q, q, q, cu_seqlens_q=CU, cu_seqlens_kv=CU,
             cu_seqlens_q_padded=torch.tensor([0, 2, 5, 9]))
    with pytest.raises(ValueError, match="tensor_format='thd' needs cu_seqlens"):
        apply_rotary_pos_emb(q, tfp8.RotaryPositionEmbedding(D)(9), "thd")
    with pytest.raises(ValueError, match="cu_seqlens reaches row 12, past the 9 rows"):
        apply_rotary_pos_emb(q, tfp8.RotaryPositionEmbedding(D)(9), "thd",
                             cu_seqlens=torch.tensor([0, 3, 12]))
    with pytest.raises(ValueError, match="cu_seqlens is for tensor_format='thd'"):
        apply_rotary_pos_emb(q.unsqueeze(1), tfp8.RotaryPositionEmbedding(D)(9), "sbhd",
                             cu_seqlens=CU)


@pytest.mark.parametrize("padded", [False, True], ids=["", "padded-apart"])
def test_packed_transformer_layer_is_each_sequence_alone(padded):
    """TransformerLayer(attn_input_format="thd") on [t, hidden] with cu_seqlens (rotary
    embeddings restarting per sequence): each sequence's rows are the bshd layer's on that
    sequence alone, with every gradient; in FP8 within SQNR bounds of that."""
    from conftest import sqnr
    torch.manual_seed(0)
    kw = dict(num_gqa_groups=2, hidden_dropout=0.0, attention_dropout=0.0)
    layer = tfp8.TransformerLayer(64, 64, 4, attn_input_format="thd",
                                  self_attn_mask_type="padding_causal", **kw)
    single = tfp8.TransformerLayer(64, 64, 4, attn_input_format="bshd",
                                   self_attn_mask_type="causal", **kw)
    single.load_state_dict(layer.state_dict())
    gen = torch.Generator().manual_seed(3)
    rows = 13 if padded else 9
    x = torch.randn(rows, 64, generator=gen, requires_grad=True)
    rope = tfp8.RotaryPositionEmbedding(16)(8)
    cu = dict(cu_seqlens_q=CU, cu_seqlens_kv=CU)
    if padded:
        cu.update(cu_seqlens_q_padded=CU_PADDED, cu_seqlens_kv_padded=CU_PADDED)
    out = layer(x, rotary_pos_emb=rope, **cu)
    starts = (CU_PADDED if padded else CU).tolist()
    spans = [(s, s + n) for s, n in zip(starts, (CU[1:] - CU[:-1]).tolist())]
    xs = [x.detach()[a:b].clone().requires_grad_(True) for a, b in spans]
    ref = [single(xi.unsqueeze(0), rotary_pos_emb=rope)[0] for xi in xs]
    rows_used = [i for a, b in spans for i in range(a, b)]
    torch.testing.assert_close(out[rows_used], torch.cat(ref), rtol=1e-5, atol=1e-5)
    grad = torch.randn(out.shape, generator=gen)
    # (rows between sequences still pass through the position-wise layers, the norms, proj's
    # bias and the MLP, as in Transformer Engine: no gradient from them here)
    gaps = [i for i in range(rows) if i not in rows_used]
    grad[gaps] = 0.0
    out.backward(grad)
    torch.autograd.backward(ref, [grad[a:b] for a, b in spans])
    torch.testing.assert_close(x.grad[rows_used], torch.cat([xi.grad for xi in xs]),
                               rtol=1e-4, atol=1e-5)
    for (name, p), q in zip(layer.named_parameters(), single.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)
    with tfp8.fp8_autocast(fp8_recipe=tfp8.Float8CurrentScaling()):
        fp8 = layer(x.detach(), rotary_pos_emb=rope, **cu)
    assert sqnr(fp8[rows_used], out.detach()[rows_used]) > 25


def test_packed_layer_takes_the_query_side_sequences_for_its_keys():
    """Transformer Engine's TransformerLayer gives its self-attention cu_seqlens_q (and
    cu_seqlens_q_padded, max_seqlen_q) for the keys too: the query side alone runs, and a
    caller's unpadded cu_seqlens_kv beside cu_seqlens_q_padded no longer reads keys at the
    unpadded offsets (0.054 off)."""
    torch.manual_seed(0)
    layer = tfp8.TransformerLayer(64, 64, 4, attn_input_format="thd", hidden_dropout=0.0,
                                  attention_dropout=0.0, self_attn_mask_type="padding_causal")
    x = torch.randn(13, 64, generator=torch.Generator().manual_seed(4))
    full = layer(x, cu_seqlens_q=CU, cu_seqlens_kv=CU, cu_seqlens_q_padded=CU_PADDED,
                 cu_seqlens_kv_padded=CU_PADDED)
    assert torch.equal(layer(x, cu_seqlens_q=CU, cu_seqlens_q_padded=CU_PADDED), full)
    assert torch.equal(layer(x, cu_seqlens_q=CU, cu_seqlens_kv=CU,
                             cu_seqlens_q_padded=CU_PADDED), full)


def test_packed_rotary_rows_outside_the_sequences_pass_through():
    """Rows past cu_seqlens[-1], and the rows between sequences padded apart, are left as they
    are; the angles need cover the longest real sequence only (not a padded span)."""
    from transformer_fp8.modules.attention.packed import layout
    from transformer_fp8.modules.attention.rotary import rotate_packed
    gen = torch.Generator().manual_seed(5)
    t = torch.randn(12, H, 16, generator=gen)
    freqs = tfp8.RotaryPositionEmbedding(16)(4)  # (the longest sequence: 4)
    out = apply_rotary_pos_emb(t, freqs, "thd", cu_seqlens=CU)
    assert torch.equal(out[9:], t[9:])
    assert torch.equal(out[:9], apply_rotary_pos_emb(t[:9], freqs, "thd", cu_seqlens=CU))
    padded = rotate_packed("test", t[:13 - 1], freqs, layout("test", "cu", CU,
                                                             torch.tensor([0, 4, 8, 12]), 12))
    for a, n in ((0, 3), (4, 2), (8, 4)):  # (each sequence from position 0 at its offset)
        alone = apply_rotary_pos_emb(t[a:a + n], freqs, "thd", cu_seqlens=torch.tensor([0, n]))
        assert torch.equal(padded[a:a + n], alone)
    assert torch.equal(padded[[3, 6, 7]], t[[3, 6, 7]])
    # The layer: trailing rows and angles for the longest real sequence run.
    torch.manual_seed(0)
    layer = tfp8.TransformerLayer(64, 64, 4, attn_input_format="thd", hidden_dropout=0.0,
                                  attention_dropout=0.0, self_attn_mask_type="padding_causal")
    rope = tfp8.RotaryPositionEmbedding(16)(4)
    x = torch.randn(16, 64, generator=gen)
    head = layer(x, rotary_pos_emb=rope, cu_seqlens_q=CU, cu_seqlens_q_padded=CU_PADDED)
    assert head.shape == (16, 64)


def test_packed_cross_attention_is_each_sequence_alone():
    """MultiheadAttention(attention_type="cross", qkv_format="thd"): queries and encoder
    tokens packed differently, rotary angles per side."""
    torch.manual_seed(0)
    kw = dict(num_gqa_groups=2, attention_type="cross", attention_dropout=0.0,
              input_layernorm=True)
    packed_mha = tfp8.MultiheadAttention(64, 4, qkv_format="thd", attn_mask_type="padding",
                                         **kw)
    single = tfp8.MultiheadAttention(64, 4, qkv_format="bshd", attn_mask_type="no_mask", **kw)
    single.load_state_dict(packed_mha.state_dict())
    gen = torch.Generator().manual_seed(6)
    x, enc = torch.randn(9, 64, generator=gen), torch.randn(11, 64, generator=gen)
    rope = tfp8.RotaryPositionEmbedding(16)(6)
    out = packed_mha(x, encoder_output=enc, rotary_pos_emb=(rope, rope), cu_seqlens_q=CU,
                     cu_seqlens_kv=CU_KV)
    ref = torch.cat([single(x[a:b][None], encoder_output=enc[c:d][None],
                            rotary_pos_emb=(rope, rope))[0]
                     for (a, b), (c, d) in zip(_spans(CU), _spans(CU_KV))])
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
