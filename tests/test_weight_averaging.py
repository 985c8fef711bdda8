"""Weight averaging (EMA, SWA) of FP8 models under DelayedScaling. Tools that average buffers
(torch.optim.swa_utils.AveragedModel(use_buffers=True), an EMA that lerps every floating
state_dict entry) average each scale and its scale_inv apart, so the two no longer multiply to
1. The forward takes its scale_invs as 1 / scale of the scales it casts with, never from the
scale_inv buffer: the averaged model computes what its averaged weights and scales give (the
GEMM read the scale_inv buffer, and the output came out scaled by scale * scale_inv, 6.6x in
one case)."""
from __future__ import annotations

import copy

import pytest
import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import transformer_fp8 as tfp8
from conftest import assert_bitwise_equal, randn, sqnr
from fused_step_checks import python_path

RECIPE = tfp8.DelayedScaling(amax_history_len=1)

MODULES = {  # name -> (constructor, the C++ step's switch in linear_fused_step)
    "Linear": (lambda device: tfp8.Linear(32, 32, recipe=RECIPE, device=device), "ENABLED"),
    "LayerNormLinear": (lambda device: tfp8.LayerNormLinear(32, 32, recipe=RECIPE, device=device),
                        "NORM_ENABLED"),
    "LayerNormMLP": (lambda device: tfp8.LayerNormMLP(32, 64, recipe=RECIPE, device=device),
                     "NORM_MLP_ENABLED"),
}


def _train_step(model, x):
    with tfp8.fp8_autocast(fp8_recipe=RECIPE):
        model(x).square().mean().backward()
    model.zero_grad()


def _model_and_input(gen, monkeypatch, name, path, device):
    """The module ``name`` (on the C++ step or the Python path) and an input for it."""
    make, switch = MODULES[name]
    if path == "python_path":
        python_path(monkeypatch, switch)
    torch.manual_seed(0)
    return make(device), randn(gen, 16, 32, device=device)


def _high_precision(module, x):
    with tfp8.fp8_autocast(enabled=False):
        return module(x)


@pytest.mark.parametrize("path", ["cpp_step", "python_path"])
@pytest.mark.parametrize("name", list(MODULES))
def test_an_ema_of_the_buffers_computes_what_its_weights_and_scales_give(
        gen, monkeypatch, name, path, device):
    model, x = _model_and_input(gen, monkeypatch, name, path, device)
    _train_step(model, x)
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9), use_buffers=True)
    ema.update_parameters(model)
    norm_weight = getattr(model, "layer_norm_weight", None)
    with torch.no_grad():  # the activations grow: the input scale drops 64x
        if norm_weight is not None:
            norm_weight.mul_(64)  # (a norm's output does not grow with its input)
    for _ in range(2):
        _train_step(model, x if norm_weight is not None else x * 64)
    ema.update_parameters(model)
    averaged = ema.module
    product = averaged.fp8_fwd_scale * averaged.fp8_fwd_scale_inv
    assert not torch.allclose(product, torch.ones_like(product)), "the pair was averaged apart"

    with torch.no_grad(), tfp8.fp8_autocast(fp8_recipe=RECIPE):
        out = ema(x)
        # the same module with its scale_invs back in step: the same output, bit for bit
        averaged.fp8_fwd_scale_inv.copy_(averaged.fp8_fwd_scale.reciprocal())
        in_step = ema(x)
    assert_bitwise_equal(out, in_step, "with the averaged scale_inv buffer against 1 / scale")
    if norm_weight is None:  # (the norms' averaged weights outgrow their averaged scales: the
        # cast saturates, as the averaged state says it should)
        with torch.no_grad():
            expected = _high_precision(averaged, x)
        assert sqnr(expected, out) >= 20, "FP8 rounding only"


@pytest.mark.parametrize("path", ["cpp_step", "python_path"])
@pytest.mark.parametrize("name", list(MODULES))
def test_the_backward_of_a_model_whose_scale_invs_are_out_of_step(gen, monkeypatch, name, path,
                                                                  device):
    """grad_output's casts too take 1 / scale, not the scale_inv buffer: a module whose scale_inv
    buffers (forward and backward) are out of step with its scales gives, bit for bit, the
    outputs and every gradient of the module with them back in step (the C++ steps' backward
    read the buffer: gradients 360-1050x too large)."""
    model, x = _model_and_input(gen, monkeypatch, name, path, device)
    for _ in range(2):
        _train_step(model, x)
    in_step, out_of_step = copy.deepcopy(model), copy.deepcopy(model)
    with torch.no_grad():
        out_of_step.fp8_fwd_scale_inv.mul_(7)
        out_of_step.fp8_bwd_scale_inv.mul_(360)

    def step(module):
        inp = x.detach().clone().requires_grad_()
        with tfp8.fp8_autocast(fp8_recipe=RECIPE):
            out = module(inp)
        out.square().mean().backward()
        return [out.detach(), inp.grad] + [p.grad for p in module.parameters()]

    for got, expected in zip(step(out_of_step), step(in_step)):
        assert_bitwise_equal(got, expected)
