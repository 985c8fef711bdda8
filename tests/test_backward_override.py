"""Transformer Engine's backward_override (quantization/backward_override.py): the forward GEMMs in
FP8, the backward GEMMs in high precision, from the operands before their casts
("high_precision") or from the forward's FP8 operands dequantised ("dequantized").

Each module against a torch composition whose forward takes the FP8 forward's values and whose
backward is the override's by construction (straight-through values): the operand each backward
GEMM must read, given explicitly. The forward is the FP8 forward without an override, bit for
bit."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import sqnr

import transformer_fp8 as tfp8
from transformer_fp8 import Float8BlockScaling, Float8CurrentScaling, fp8_autocast
from transformer_fp8.reference import (cast_from_fp8_reference, cast_to_fp8_reference,
                                       compute_scale_from_amax_reference,
                                       dequantize_blockwise_reference,
                                       quantize_blockwise_reference)

OVERRIDES = ["high_precision", "dequantized"]
RECIPES = {"current": Float8CurrentScaling, "block": Float8BlockScaling}
E4M3 = torch.float8_e4m3fn


def _dequantized(x: torch.Tensor, kind: str, block_rows: int) -> torch.Tensor:
    """x cast to E4M3 as the recipe's forward casts it (current: one scale from the amax;
    block: 1x128 tiles or 128x128 blocks, power-of-two scales), dequantised in float32."""
    x = x.detach().float()
    if kind == "current":
        scale = compute_scale_from_amax_reference(x.abs().amax().reshape(1),
                                                  torch.finfo(E4M3).max)
        return cast_from_fp8_reference(cast_to_fp8_reference(x, scale, E4M3), 1 / scale,
                                       torch.float32)
    data, scale_inv, _, _ = quantize_blockwise_reference(x, block_rows, 128, E4M3, True)
    return dequantize_blockwise_reference(data, scale_inv).float()


def _through(value: torch.Tensor, backward_operand: torch.Tensor) -> torch.Tensor:
    """backward_operand's value with value's gradient path (straight-through)."""
    return value + (backward_operand - value).detach()


def _linear(inp, weight, bias, kind, override, x_blocks=1, w_blocks=2):
    """F.linear with the backward GEMMs of ``override``: the FP8 forward's value (the product of
    the dequantised operands), the gradients of the high-precision or dequantised operands."""
    x_dq = _dequantized(inp.reshape(-1, inp.shape[-1]), kind, x_blocks).view(inp.shape)
    w_dq = _dequantized(weight, kind, 128 if w_blocks == 2 else 1)
    if override == "dequantized":
        return F.linear(_through(inp, x_dq), _through(weight, w_dq), bias)
    return _through(F.linear(inp, weight, bias), F.linear(x_dq, w_dq, bias))


def _run(module, x, grad, recipe):
    module.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    with fp8_autocast(enabled=recipe is not None, fp8_recipe=recipe):
        out = module(x)
    out.backward(grad)
    return [out.detach(), x.grad] + [p.grad for p in module.parameters()]


def _compared(module, x, grad, kind, override, reference):
    """The module's step without and with the override (their forwards bit for bit the same)
    and the reference composition's (``reference(module copy, input)``) gradients: (got, plain,
    expected), each [output, input gradient, parameter gradients...] (expected without the
    output)."""
    recipe = RECIPES[kind]
    plain = _run(module, x, grad, recipe())
    got = _run(module, x, grad, recipe(backward_override=override))
    torch.testing.assert_close(got[0], plain[0], rtol=0, atol=0)
    ref = copy.deepcopy(module)
    ref.zero_grad(set_to_none=True)
    xr = x.clone().requires_grad_()
    reference(ref, xr).backward(grad)
    return got, plain, [xr.grad] + [p.grad for p in ref.parameters()]


def _random_parameters(module, gen):
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=gen))


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(20261128)


# ---- the recipes --------------------------------------------------------------------------------

@pytest.mark.parametrize("recipe", [Float8CurrentScaling, Float8BlockScaling])
def test_the_recipes_take_transformer_engines_values(recipe, monkeypatch):
    for value in (None, "high_precision", "dequantized"):
        assert recipe(backward_override=value).backward_override == value
    monkeypatch.setenv("NVTE_BACKWARD_OVERRIDE", "dequantized")
    assert recipe().backward_override == "dequantized"
    monkeypatch.setenv("NVTE_BACKWARD_OVERRIDE", "fp16")
    with pytest.raises(ValueError, match="backward_override must be None, 'high_precision' or "
                                         "'dequantized', got 'fp16' .*NVTE_BACKWARD_OVERRIDE"):
        recipe()
    monkeypatch.delenv("NVTE_BACKWARD_OVERRIDE")
    for bad in ("High_Precision", 1, True):
        with pytest.raises(ValueError, match="backward_override must be"):
            recipe(backward_override=bad)


def test_delayed_scaling_refuses_an_override_as_transformer_engine(monkeypatch):
    with pytest.raises(ValueError, match="not supported with delayed scaling"):
        tfp8.DelayedScaling(backward_override="high_precision")
    monkeypatch.setenv("NVTE_BACKWARD_OVERRIDE", "dequantized")
    with pytest.raises(ValueError, match="from the environment variable NVTE_BACKWARD_OVERRIDE"):
        tfp8.DelayedScaling()


# ---- Linear -------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", sorted(RECIPES))
@pytest.mark.parametrize("override", OVERRIDES)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
def test_linear_backward_gemms_read_the_overrides_operands(gen, kind, override, bias):
    """Rows not a multiple of 16 (the FP8 rows are padded), a 3-D input. The forward: the FP8
    forward without the override, bit for bit; every gradient: the reference's within float32
    rounding (>= 100 dB), where the FP8 backward is 20-30 dB from it."""
    layer = tfp8.Linear(256, 128, bias=bias)
    _random_parameters(layer, gen)
    x = torch.randn(3, 7, 256, generator=gen)
    grad = torch.randn(3, 7, 128, generator=gen)
    got, plain, expected = _compared(
        layer, x, grad, kind, override,
        lambda ref, xr: _linear(xr, ref.weight, ref.bias, kind, override))
    for name, a, e, p in zip(["input", "weight", "bias"], got[1:], expected, plain[1:]):
        assert sqnr(a, e) >= 100, (name, sqnr(a, e))
        if name != "bias":  # (grad_output's column sums in every case)
            assert sqnr(p, e) < 60, (name, "the FP8 backward is as close: the test is blind")


@pytest.mark.parametrize("kind", sorted(RECIPES))
def test_high_precision_gives_torch_linears_gradients_bit_for_bit(gen, kind):
    """The backward of "high_precision" is torch.nn.Linear's: the same matmuls on the same
    operands, float32 and under torch.autocast (bfloat16) alike."""
    layer = tfp8.Linear(128, 64)
    _random_parameters(layer, gen)
    ref = torch.nn.Linear(128, 64)
    ref.load_state_dict(layer.state_dict(), strict=False)
    x = torch.randn(40, 128, generator=gen)
    grad = torch.randn(40, 64, generator=gen)
    recipe = RECIPES[kind](backward_override="high_precision")
    for autocast in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            got = _run(layer, x, grad.to(torch.bfloat16 if autocast else torch.float32),
                       recipe)
            expected = _run(ref, x, grad.to(torch.bfloat16 if autocast else torch.float32),
                            None)
        for a, e in zip(got[1:], expected[1:]):
            assert a.dtype == e.dtype == torch.float32
            torch.testing.assert_close(a, e, rtol=0, atol=0)


@pytest.mark.parametrize("override", OVERRIDES)
def test_grouped_linear_is_its_loop_of_linears(gen, override):
    """GroupedLinear runs Linear's function per expert, an empty expert among them."""
    recipe = Float8CurrentScaling(backward_override=override)
    grouped = tfp8.GroupedLinear(3, 64, 32)
    _random_parameters(grouped, gen)
    experts = [tfp8.Linear(64, 32) for _ in range(3)]
    for i, expert in enumerate(experts):
        expert.weight.data.copy_(getattr(grouped, f"weight{i}"))
        expert.bias.data.copy_(getattr(grouped, f"bias{i}"))
    splits = [20, 0, 13]
    x = torch.randn(33, 64, generator=gen)
    grad = torch.randn(33, 32, generator=gen)
    xg = x.clone().requires_grad_()
    with fp8_autocast(fp8_recipe=recipe):
        grouped(xg, splits).backward(grad)
    xl = x.clone().requires_grad_()
    with fp8_autocast(fp8_recipe=recipe):
        outs = [e(part) for e, part in zip(experts, torch.split(xl, splits)) if part.shape[0]]
    torch.cat(outs).backward(grad)
    torch.testing.assert_close(xg.grad, xl.grad, rtol=0, atol=0)
    for i in (0, 2):
        torch.testing.assert_close(getattr(grouped, f"weight{i}").grad, experts[i].weight.grad,
                                   rtol=0, atol=0)


# ---- LayerNormLinear and LayerNormMLP -----------------------------------------------------------

def _norm(module, x):
    gamma = module.layer_norm_weight
    if module.normalization == "RMSNorm":
        return F.rms_norm(x, (x.shape[-1],), gamma, module.eps)
    return F.layer_norm(x, (x.shape[-1],), gamma, module.layer_norm_bias, module.eps)


def _activation(name, h):
    if name == "swiglu":
        a, b = h.chunk(2, dim=-1)
        return F.silu(a) * b
    return F.gelu(h, approximate="tanh")


@pytest.mark.parametrize("kind", sorted(RECIPES))
@pytest.mark.parametrize("override", OVERRIDES)
@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_layernorm_linear(gen, kind, override, normalization):
    layer = tfp8.LayerNormLinear(256, 128, normalization=normalization)
    _random_parameters(layer, gen)
    x = torch.randn(2, 9, 256, generator=gen)
    grad = torch.randn(2, 9, 128, generator=gen)
    got, _, expected = _compared(
        layer, x, grad, kind, override,
        lambda ref, xr: _linear(_norm(ref, xr), ref.weight, ref.bias, kind, override))
    for (name, _), a, e in zip([("input", 0), *layer.named_parameters()], got[1:], expected):
        assert sqnr(a, e) >= 100, (name, sqnr(a, e))


@pytest.mark.parametrize("kind", sorted(RECIPES))
@pytest.mark.parametrize("override", OVERRIDES)
@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_layernorm_mlp(gen, kind, override, activation):
    """Two GEMMs: fc2's input is the activation of fc1's FP8 output. The reference rounds like
    the module up to float32 rounding, which may move an activation across an FP8 rounding
    boundary: compared at 40 dB (51.6 dB the lowest seen over random draws; the FP8 backward is
    20-30 dB away, the other override 25-31 dB)."""
    mlp = tfp8.LayerNormMLP(256, 256, activation=activation)
    _random_parameters(mlp, gen)
    x = torch.randn(2, 9, 256, generator=gen)
    grad = torch.randn(2, 9, 256, generator=gen)

    def reference(ref, xr):
        fc1 = _linear(_norm(ref, xr), ref.fc1_weight, ref.fc1_bias, kind, override)
        return _linear(_activation(activation, fc1), ref.fc2_weight, ref.fc2_bias, kind,
                       override)

    got, plain, expected = _compared(mlp, x, grad, kind, override, reference)
    for (name, _), a, e, p in zip([("input", 0), *mlp.named_parameters()], got[1:], expected,
                                  plain[1:]):
        assert sqnr(a, e) >= 40, (name, sqnr(a, e))
        if name != "fc2_bias":  # (grad_output's column sums in every case)
            assert sqnr(p, e) < 50, (name, "the FP8 backward is as close: the test is blind")


# ---- integrations -------------------------------------------------------------------------------

@pytest.mark.parametrize("override", OVERRIDES)
def test_activation_checkpointing_and_compile_are_bit_identical(gen, override):
    """A checkpointed LayerNormMLP (the recomputation repeats the forward's casts) and a
    torch.compile'd one (aot_eager) against the eager module over two steps."""
    recipe = Float8CurrentScaling(backward_override=override)
    mlp = tfp8.LayerNormMLP(128, 256, activation="swiglu")
    _random_parameters(mlp, gen)
    x = torch.randn(24, 128, generator=gen)
    grad = torch.randn(24, 128, generator=gen)
    eager = _run(mlp, x, grad, recipe)

    class Checkpointed(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, inp):
            return torch.utils.checkpoint.checkpoint(self.inner, inp, use_reentrant=False)

    compiled = torch.compile(copy.deepcopy(mlp), backend="aot_eager", fullgraph=True)
    for other in (Checkpointed(copy.deepcopy(mlp)), compiled):
        for _ in range(2):
            got = _run(other, x, grad, recipe)
            for a, e in zip(got, eager):
                torch.testing.assert_close(a, e, rtol=0, atol=0)


def test_fp8_primary_weights_and_kept_weight_casts(gen):
    """A weight held in FP8 (quantized_model_init) is its own forward operand: "high_precision"
    takes it dequantised, as "dequantized" does (the input gradients agree; the weight
    gradients take the input, high-precision or dequantised). A weight cast kept across
    microbatches (is_first_microbatch) gives the gradients of a cast in the call."""
    recipe = Float8CurrentScaling(backward_override="high_precision")
    with tfp8.quantized_model_init(recipe=recipe):
        held = tfp8.Linear(64, 32)
    x = torch.randn(20, 64, generator=gen)
    grad = torch.randn(20, 32, generator=gen)
    got = _run(held, x, grad, recipe)
    dequantized = _run(held, x, grad, Float8CurrentScaling(backward_override="dequantized"))
    for a, e in zip(got[:2], dequantized[:2]):  # output, input gradient
        torch.testing.assert_close(a, e, rtol=0, atol=0)
    expected = grad @ held.weight.dequantize().float()
    torch.testing.assert_close(got[1], expected, rtol=1e-6, atol=1e-5)
    assert sqnr(got[2], grad.t() @ x) >= 100  # the high-precision input

    layer = tfp8.Linear(64, 32)
    for override in OVERRIDES:
        recipe = Float8CurrentScaling(backward_override=override)
        expected = _run(layer, x, grad, recipe)
        for first in (True, False):
            layer.zero_grad(set_to_none=True)
            xi = x.clone().requires_grad_()
            with fp8_autocast(fp8_recipe=recipe):
                layer(xi, is_first_microbatch=first).backward(grad)
            for a, e in zip([xi.grad, layer.weight.grad, layer.bias.grad], expected[1:]):
                torch.testing.assert_close(a, e, rtol=0, atol=0)


def test_a_weight_written_between_forward_and_backward(gen):
    """An FP8 primary weight written in place after the forward (an optimizer step before the
    backward): "dequantized" takes the forward's FP8 weight (its tensors copied; the live ones
    gave the new weight's gradient), "high_precision" raises torch's in-place error, as a plain
    weight does."""
    recipe = Float8CurrentScaling(backward_override="dequantized")
    with tfp8.quantized_model_init(recipe=recipe):
        layer = tfp8.Linear(64, 32)
    x = torch.randn(20, 64, generator=gen)
    grad = torch.randn(20, 32, generator=gen)
    forward_weight = layer.weight.dequantize().float()
    xi = x.clone().requires_grad_()
    with fp8_autocast(fp8_recipe=recipe):
        out = layer(xi)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(32, 64, generator=gen))
    out.backward(grad)
    torch.testing.assert_close(xi.grad, grad @ forward_weight, rtol=1e-6, atol=1e-5)

    high = Float8CurrentScaling(backward_override="high_precision")
    with fp8_autocast(fp8_recipe=high):
        out = layer(x.clone().requires_grad_())
    with torch.no_grad():
        layer.weight.copy_(torch.randn(32, 64, generator=gen))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.backward(grad)


def test_a_kept_weight_cast_makes_no_transpose_under_an_override(gen):
    """is_first_microbatch keeps the weight's cast across microbatches: under an override no
    backward GEMM reads its FP8 transpose, which is not made; a later step without the override
    casts again (with it) rather than reuse a cast without one."""
    layer = tfp8.Linear(64, 32)
    x = torch.randn(20, 64, generator=gen)
    grad = torch.randn(20, 32, generator=gen)
    with fp8_autocast(fp8_recipe=Float8CurrentScaling(backward_override="dequantized")):
        layer(x, is_first_microbatch=True).backward(grad)
    assert layer._weight_cache[0][1].data_t is None
    expected = _run(layer, x, grad, Float8CurrentScaling())
    layer.zero_grad(set_to_none=True)
    xi = x.clone().requires_grad_()
    with fp8_autocast(fp8_recipe=Float8CurrentScaling()):
        layer(xi, is_first_microbatch=False).backward(grad)
    assert layer._weight_cache[0][1].data_t is not None
    for a, e in zip([xi.grad, layer.weight.grad, layer.bias.grad], expected[1:]):
        torch.testing.assert_close(a, e, rtol=0, atol=0)


def test_fsdp2_fp8_all_gather_gives_the_overrides_gradients(tmp_path):
    """2 gloo ranks: b's input and weight gradients with fp8_all_gather equal those with
    high-precision all-gathers, for both overrides, current and block scaling, also where
    forward prefetch gathered b's weight in FP8 under the context before it ("high_precision"
    took that FP8 weight dequantised: 33 dB off), and where b is checkpointed (its
    recomputation did so again under block scaling: 35 dB off)."""
    from backward_override_cases import worker
    from multiprocess import rank_results
    for result in rank_results(worker, tmp_path, world=2, timeout_s=600):
        for (case, prefetch, fp8_all_gather, name), value in result.items():
            if fp8_all_gather:
                expected = result[(case, prefetch, False, name)]
                torch.testing.assert_close(value, expected, rtol=0, atol=0,
                                           msg=f"{case} prefetch={prefetch} {name}")
