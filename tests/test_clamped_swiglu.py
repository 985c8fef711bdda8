"""LayerNormMLP(activation="clamped_swiglu", activation_params=...) and TransformerLayer's, as
Transformer Engine's (GPT-OSS's MLP): the activation against Transformer Engine's formula
written out (its ONNX-export composition, float64, differentiated by autograd), the module
outside fp8_autocast against its torch composition, inside against its FP8 composition for
every recipe, and under torch.compile bit for bit eager."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import randn, sqnr

import transformer_fp8 as tfp8
from transformer_fp8 import (DelayedScaling, Float8BlockScaling, Float8CurrentScaling,
                             fp8_autocast)
from transformer_fp8.modules.activations import ClampedSwiGLU

PARAMS = [None, {"limit": 1.5}, {"limit": 0.75, "alpha": 1.0, "glu_linear_offset": 0.5}]
IDS = ["defaults", "limit", "all"]


def te_clamped_swiglu(x, limit=7.0, alpha=1.702, glu_linear_offset=1.0):
    """Transformer Engine's composition (module/layernorm_mlp.py, its ONNX path)."""
    x_glu, x_linear = x.chunk(2, dim=-1)
    x_glu = x_glu.clamp(min=None, max=limit)
    x_linear = x_linear.clamp(min=-limit, max=limit)
    return x_glu * torch.sigmoid(alpha * x_glu) * (x_linear + glu_linear_offset)


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(7_0_1702)


@pytest.mark.parametrize("params", PARAMS, ids=IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_activation_and_its_derivative_are_transformer_engines(gen, params, dtype):
    """Values on both sides of the clamps and on them: forward and backward against the
    formula in float64 (autograd: zero derivative where a clamp holds, as the kernels' masks)."""
    act = ClampedSwiGLU(**(params or {}))
    x = randn(gen, 64, 2 * 96, scale=3.0)
    x[0, :4] = torch.tensor([act.limit, -act.limit, act.limit + 1, 0.0])
    x[0, 96:100] = torch.tensor([act.limit, -act.limit, -act.limit - 1, act.limit + 1])
    x = x.to(dtype)
    dy = randn(gen, 64, 96).to(dtype)
    x64 = x.double().requires_grad_(True)
    expected = te_clamped_swiglu(x64, **(params or {}))
    expected.backward(dy.double())
    got, got_dx = act.forward(x), act.backward(dy, x)
    assert got.dtype == got_dx.dtype == dtype
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=8e-3, atol=8e-3)
    torch.testing.assert_close(got.double(), expected.detach(), **tol)
    torch.testing.assert_close(got_dx.double(), x64.grad, **tol)
    assert (got_dx[0, [2, 98, 99]] == 0).all()  # past the limits: no gradient


def _reference(mlp, x):
    ln = F.layer_norm(x, (x.shape[-1],), mlp.layer_norm_weight, mlp.layer_norm_bias, mlp.eps)
    hidden = te_clamped_swiglu(F.linear(ln, mlp.fc1_weight, mlp.fc1_bias),
                               **(mlp.activation_params or {}))
    return F.linear(hidden, mlp.fc2_weight, mlp.fc2_bias)


def _grads(module, forward, x, grad):
    module.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    out = forward(x)
    out.backward(grad)
    return [out.detach(), x.grad] + [p.grad for p in module.parameters()]


def _mlp(gen, params):
    mlp = tfp8.LayerNormMLP(128, 192, activation="clamped_swiglu", activation_params=params)
    with torch.no_grad():
        for p in mlp.parameters():
            p.add_(randn(gen, *p.shape, scale=0.3))
    return mlp


@pytest.mark.parametrize("params", PARAMS, ids=IDS)
def test_layernorm_mlp_outside_fp8_is_the_composition(gen, params):
    mlp = _mlp(gen, params)
    x, grad = randn(gen, 3, 10, 128), randn(gen, 3, 10, 128)
    got = _grads(mlp, mlp, x, grad)
    expected = _grads(mlp, lambda t: _reference(mlp, t), x, grad)
    for a, e in zip(got, expected):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("params", PARAMS, ids=IDS)
@pytest.mark.parametrize("recipe", [DelayedScaling(), Float8CurrentScaling(),
                                    Float8BlockScaling()], ids=["delayed", "current", "block"])
def test_layernorm_mlp_in_fp8_is_its_fp8_composition(gen, params, recipe):
    """Over three steps (the scales change): the module against LayerNormLinear (fc1, the same
    fused norm and cast) -> Transformer Engine's formula (autograd) -> Linear (fc2), each in
    FP8 under the same recipe: the same outputs bit for bit, every gradient >= 40 dB (the
    activation's derivative in other float32 roundings may move an FP8 code of fc1's
    grad_output). A clamp left out or misplaced gives 10-20 dB. Against float32 the
    clamps' zero derivatives make the gradients sensitive to the FP8 forward (limit 0.75: 9
    dB): the composition is the reference that tells."""
    mlp = _mlp(gen, params)
    fc1 = tfp8.LayerNormLinear(128, 384)
    fc2 = tfp8.Linear(192, 128)
    with torch.no_grad():
        fc1.layer_norm_weight.copy_(mlp.layer_norm_weight)
        fc1.layer_norm_bias.copy_(mlp.layer_norm_bias)
        fc1.weight.copy_(mlp.fc1_weight)
        fc1.bias.copy_(mlp.fc1_bias)
        fc2.weight.copy_(mlp.fc2_weight)
        fc2.bias.copy_(mlp.fc2_bias)
    parts = torch.nn.ModuleList([fc1, fc2])
    for step in range(3):
        x, grad = randn(gen, 40, 128), randn(gen, 40, 128)
        with fp8_autocast(fp8_recipe=recipe):
            got = _grads(mlp, mlp, x, grad)
            expected = _grads(parts, lambda t: fc2(te_clamped_swiglu(fc1(t), **(params or {}))),
                              x, grad)
        torch.testing.assert_close(got[0], expected[0], rtol=0, atol=0)
        names = ["input", "layer_norm_weight", "layer_norm_bias", "fc1_weight", "fc1_bias",
                 "fc2_weight", "fc2_bias"]
        for name, a, e in zip(names, got[1:], expected[1:]):
            assert sqnr(a, e) >= 40, (step, name, sqnr(a, e))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("recipe", [DelayedScaling(), Float8CurrentScaling(),
                                    Float8BlockScaling()], ids=["delayed", "current", "block"])
def test_with_no_clamp_reached_it_is_swiglu(gen, dtype, recipe):
    """limit 1e30, alpha 1, offset 0 is swiglu (silu(a) * g): over three steps against
    activation="swiglu" (its fused kernels; their float32 silu may differ from torch's by an
    ulp, which may move an FP8 code): the forward FP8 state (fc2's input amax: the float32
    activation's, as the kernel records it) within float32 rounding, and all but a few outputs
    bit for bit, in bfloat16 too (where delayed scaling cast the activation rounded to bfloat16
    first: 85% of the outputs differed, amaxes 0.2% off); gradients >= 40 dB (30 dB in
    bfloat16: delayed scaling's swiglu kernel casts its float32 derivative to FP8, the torch
    derivative is rounded to bfloat16 first, as Transformer Engine's backward does for every
    gated activation), the backward state within bfloat16 rounding."""
    swiglu = tfp8.LayerNormMLP(128, 192, activation="swiglu", params_dtype=dtype)
    with torch.no_grad():
        for p in swiglu.parameters():
            p.add_(randn(gen, *p.shape, scale=0.3).to(dtype))
    clamped = tfp8.LayerNormMLP(128, 192, activation="clamped_swiglu", params_dtype=dtype,
                                activation_params={"limit": 1e30, "alpha": 1.0,
                                                   "glu_linear_offset": 0.0})
    clamped.load_state_dict(swiglu.state_dict())
    for step in range(3):
        x, grad = randn(gen, 40, 128).to(dtype), randn(gen, 40, 128).to(dtype)
        with fp8_autocast(fp8_recipe=recipe):
            expected = _grads(swiglu, swiglu, x, grad)
            got = _grads(clamped, clamped, x, grad)
        assert (got[0] != expected[0]).float().mean() < 0.02, step
        for i, (a, e) in enumerate(zip(clamped.fp8_state_tensors(),
                                       swiglu.fp8_state_tensors())):
            tol = 1e-6 if i < 3 else 1e-2  # (forward: history, scale, scale_inv)
            torch.testing.assert_close(a, e, rtol=tol, atol=0, msg=f"step {step}, state {i}")
        bound = 40 if dtype == torch.float32 else 30  # (see the docstring)
        for a, e in zip(got[1:], expected[1:]):
            assert sqnr(a.float(), e.float()) >= bound, (step, sqnr(a.float(), e.float()))


def test_torch_compile_is_bit_identical_to_eager(gen):
    mlp = _mlp(gen, {"limit": 1.5})
    compiled = torch.compile(copy.deepcopy(mlp), backend="aot_eager", fullgraph=True)
    x, grad = randn(gen, 24, 128), randn(gen, 24, 128)
    for recipe in (Float8CurrentScaling(), DelayedScaling()):
        for _ in range(2):
            with fp8_autocast(fp8_recipe=recipe):
                expected = _grads(mlp, mlp, x, grad)
                got = _grads(compiled, compiled, x, grad)
            for a, e in zip(got, expected):
                torch.testing.assert_close(a, e, rtol=0, atol=0)


def test_transformer_layer_passes_the_parameters_on(gen):
    params = {"limit": 2.0, "alpha": 1.5}
    layer = tfp8.TransformerLayer(64, 128, 4, activation="clamped_swiglu",
                                  activation_params=params, hidden_dropout=0.0,
                                  attention_dropout=0.0)
    assert layer.layernorm_mlp.activation_params == params
    x = randn(gen, 6, 2, 64)
    out = layer(x)
    mlp = layer.layernorm_mlp
    ln_input = x + layer.self_attention(x)
    assert torch.allclose(out, ln_input + _reference(mlp, ln_input), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("activation, params, error, match", [
    ("clamped_swiglu", {"limt": 7.0}, ValueError, r"unknown key\(s\) \['limt'\]"),
    ("clamped_swiglu", {"limit": 0.0}, ValueError, r"'limit'\] must be > 0"),
    ("clamped_swiglu", {"alpha": float("nan")}, ValueError, "must be a finite number"),
    ("clamped_swiglu", {"alpha": "1.7"}, ValueError, "must be a finite number"),
    ("clamped_swiglu", {"limit": float("inf")}, ValueError, "must be a finite number"),
    ("clamped_swiglu", [("limit", 7.0)], TypeError, "must be a dict or None"),
    ("swiglu", {"limit": 7.0}, ValueError, "read by activation 'clamped_swiglu' only"),
])
def test_bad_activation_params_are_refused_by_name(activation, params, error, match):
    with pytest.raises(error, match=match):
        tfp8.LayerNormMLP(64, 64, activation=activation, activation_params=params)


def test_empty_or_no_parameters_are_transformer_engines_defaults():
    for params in (None, {}):
        mlp = tfp8.LayerNormMLP(64, 64, activation="clamped_swiglu", activation_params=params)
        assert mlp._activation == ClampedSwiGLU(7.0, 1.702, 1.0)
        assert mlp.fc1_weight.shape == (128, 64)  # (gated: two halves)
        tfp8.LayerNormMLP(64, 64, activation="gelu", activation_params=params)
