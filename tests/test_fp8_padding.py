"""Fp8Padding / Fp8Unpadding (Transformer Engine's): each row block padded with zero rows to a
multiple of align_size, and the padding taken off again; around a GroupedLinear the real rows'
outputs, the input gradient and the FP8 state are those of the GroupedLinear on the unpadded
blocks."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import transformer_fp8 as tfp8
from transformer_fp8 import DelayedScaling, Float8CurrentScaling, fp8_autocast

SPLITS = [5, 0, 16, 33]


def test_padding_pads_each_block_with_zero_rows_and_unpadding_undoes_it():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(sum(SPLITS), 24, generator=gen)
    padded, padded_splits = tfp8.Fp8Padding(4)(x, SPLITS)
    assert padded_splits == [16, 0, 16, 48]
    start = pstart = 0
    for m, p in zip(SPLITS, padded_splits):
        assert torch.equal(padded[pstart:pstart + m], x[start:start + m])
        assert torch.equal(padded[pstart + m:pstart + p], torch.zeros(p - m, 24))
        start, pstart = start + m, pstart + p
    assert torch.equal(tfp8.Fp8Unpadding(4)(padded, SPLITS), x)


def test_aligned_blocks_are_returned_as_they_are():
    x = torch.randn(48, 8)
    out, splits = tfp8.Fp8Padding(3)(x, np.array([16, 0, 32]))
    assert out is x and splits == [16, 0, 32]
    assert tfp8.Fp8Unpadding(3)(x, [16, 0, 32]) is x


def test_zero_width_rows_are_padded_and_unpadded():
    x = torch.randn(sum(SPLITS), 0)
    padded, padded_splits = tfp8.Fp8Padding(4)(x, SPLITS)
    assert padded.shape == (sum(padded_splits), 0)
    assert tfp8.Fp8Unpadding(4)(padded, SPLITS).shape == x.shape


def test_align_size_and_leading_dimensions():
    x = torch.randn(2, 5, 8)  # [batch, seq, hidden]: 10 rows
    padded, splits = tfp8.Fp8Padding(2, align_size=4)(x, torch.tensor([3, 7]))
    assert splits == [4, 8] and padded.shape == (12, 8)
    assert torch.equal(tfp8.Fp8Unpadding(2, align_size=4)(padded, [3, 7]), x.reshape(10, 8))


@pytest.mark.parametrize("recipe", [DelayedScaling(amax_history_len=4), Float8CurrentScaling()],
                         ids=["delayed", "current"])
def test_padded_grouped_linear_matches_the_unpadded_one(recipe):
    """Zero rows add nothing to any amax, and their outputs are dropped: the real rows' outputs,
    the input gradient and the FP8 state equal the unpadded run's over steps whose scales
    change; the weight gradients within float32 rounding (the GEMM sums over more rows)."""
    torch.manual_seed(0)
    plain = tfp8.GroupedLinear(4, 32, 48, recipe=recipe)
    padded_experts = tfp8.GroupedLinear(4, 32, 48, recipe=recipe)
    padded_experts.load_state_dict(plain.state_dict())
    padding, unpadding = tfp8.Fp8Padding(4), tfp8.Fp8Unpadding(4)
    gen = torch.Generator().manual_seed(1)
    for step in range(3):
        x = (torch.randn(sum(SPLITS), 32, generator=gen) * (step + 1)).requires_grad_()
        x2 = x.detach().clone().requires_grad_()
        grad = torch.randn(sum(SPLITS), 48, generator=gen)
        with fp8_autocast(fp8_recipe=recipe):
            out = plain(x, SPLITS)
        out.backward(grad)
        with fp8_autocast(fp8_recipe=recipe):
            x_padded, padded_splits = padding(x2, SPLITS)
            out2 = unpadding(padded_experts(x_padded, padded_splits), SPLITS)
        out2.backward(grad)
        assert torch.equal(out2, out), step
        assert torch.equal(x2.grad, x.grad), step
        for (name, p), q in zip(plain.named_parameters(), padded_experts.parameters()):
            err = (q.grad - p.grad).norm() / p.grad.norm().clamp_min(1e-30)
            assert err < 1e-6, (step, name, err.item())  # (an empty block's: zeros, both)
        for key, value in plain.state_dict().items():
            assert torch.equal(padded_experts.state_dict()[key], value), (step, key)
        for p in list(plain.parameters()) + list(padded_experts.parameters()):
            p.grad = None


@pytest.mark.parametrize("module", [tfp8.Fp8Padding, tfp8.Fp8Unpadding])
def test_bad_arguments_are_refused_by_name(module):
    with pytest.raises(ValueError, match="num_gemms must be a positive int"):
        module(0)
    with pytest.raises(ValueError, match="align_size must be None or a positive int"):
        module(2, align_size=0)
    layer = module(2)
    with pytest.raises(ValueError, match="m_splits must hold 2 non-negative integers"):
        layer(torch.randn(32, 4), [16, 8, 8])
    with pytest.raises(ValueError, match="m_splits must hold 2 non-negative integers"):
        layer(torch.randn(32, 4), [40, -8])
    with pytest.raises(ValueError, match="rows"):
        layer(torch.randn(31, 4), [16, 16] if module is tfp8.Fp8Padding else [3, 3])
    with pytest.raises(TypeError, match="inp must be a tensor"):
        layer([1.0, 2.0], [1, 1])
