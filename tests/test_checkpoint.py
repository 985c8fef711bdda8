"""Checkpoints: FP8 state as plain tensors, exact resume, interchange with torch.nn.Linear."""
from __future__ import annotations

import io

import pytest
import torch
from conftest import randn

import transformer_fp8 as tfp8
from transformer_fp8 import DelayedScaling, fp8_autocast

RECIPE = DelayedScaling(amax_history_len=8)


def make_model(seed=0):
    torch.manual_seed(seed)
    return tfp8.convert_to_fp8(torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16)))


def train(model, opt, batches):
    losses = []
    for x, y in batches:
        with fp8_autocast(fp8_recipe=RECIPE):
            out = model(x)
        loss = torch.nn.functional.mse_loss(out, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def roundtrip(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def test_state_dict_is_plain_tensors():
    model = make_model()
    state = model.state_dict()
    fp8_keys = [k for k in state if "fp8_" in k]
    assert len(fp8_keys) == 2 * len(tfp8.linear.FP8_STATE_KEYS)
    assert all(type(v) is torch.Tensor for v in state.values())
    loaded = roundtrip(state)
    assert loaded.keys() == state.keys()


def test_resume_gives_bit_identical_losses(gen):
    teacher = randn(gen, 32, 16) * 0.2
    inputs = [randn(gen, 24, 32) for _ in range(10)]
    batches = [(x, x @ teacher) for x in inputs]
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    train(model, opt, batches[:4])
    checkpoint = roundtrip({"model": model.state_dict(), "opt": opt.state_dict()})
    expected = train(model, opt, batches[4:])

    resumed = make_model(seed=123)  # different initial weights: all must come from the file
    resumed_opt = torch.optim.Adam(resumed.parameters(), lr=1e-2)
    resumed.load_state_dict(checkpoint["model"], strict=True)
    resumed_opt.load_state_dict(checkpoint["opt"])
    assert train(resumed, resumed_opt, batches[4:]) == expected
    assert expected[-1] < expected[0], "and the model was learning"


def test_plain_linear_checkpoint_loads_strictly_with_fresh_fp8_state(gen):
    plain = torch.nn.Linear(32, 16)
    layer = tfp8.Linear(32, 16)
    with fp8_autocast(fp8_recipe=RECIPE):
        layer(randn(gen, 8, 32))  # some FP8 state to be replaced
    result = layer.load_state_dict(plain.state_dict(), strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    assert torch.equal(layer.weight, plain.weight)
    assert not layer.fp8_fwd_amax_history.any()
    assert torch.equal(layer.fp8_fwd_scale, torch.ones(2))


def test_fp8_checkpoint_loads_into_plain_linear(gen):
    layer = tfp8.Linear(32, 16)
    with fp8_autocast(fp8_recipe=RECIPE):
        layer(randn(gen, 8, 32))
    plain = torch.nn.Linear(32, 16)
    plain.load_state_dict(tfp8.strip_fp8_state(roundtrip(layer.state_dict())), strict=True)
    assert torch.equal(plain.weight, layer.weight) and torch.equal(plain.bias, layer.bias)


def test_history_of_another_length_loads(gen):
    source = tfp8.Linear(32, 16)
    with fp8_autocast(fp8_recipe=DelayedScaling(amax_history_len=3)):
        source(randn(gen, 8, 32))
    target = tfp8.Linear(32, 16)  # default length 1024
    target.load_state_dict(source.state_dict())
    assert torch.equal(target.fp8_fwd_amax_history, source.fp8_fwd_amax_history)
    assert torch.equal(target.fp8_fwd_scale, source.fp8_fwd_scale)


def test_partial_fp8_state_is_reported(gen):
    layer = tfp8.Linear(32, 16)
    with fp8_autocast(fp8_recipe=RECIPE):
        layer(randn(gen, 8, 32))
    state = layer.state_dict()
    del state["fp8_fwd_scale_inv"]
    with pytest.raises(RuntimeError, match="fp8_fwd_scale_inv"):
        tfp8.Linear(32, 16).load_state_dict(state, strict=True)


def test_wrong_fp8_state_shape_is_reported():
    state = tfp8.Linear(32, 16).state_dict()
    state["fp8_fwd_scale"] = torch.ones(5)
    with pytest.raises(RuntimeError, match="fp8_fwd_scale"):
        tfp8.Linear(32, 16).load_state_dict(state)
