"""torch.compile of models of FP8 layers, with fullgraph=True: no graph break, no recompilation
from step to step, and (with the aot_eager backend, which runs the same kernels) losses,
gradients and FP8 state bit-identical to eager, for both recipes."""
from __future__ import annotations

import copy

import pytest
import torch
from conftest import DEVICE_PARAMS, assert_same_training, counting_aot_eager

import transformer_fp8 as tfp8
from transformer_fp8 import DelayedScaling, Float8CurrentScaling, fp8_autocast

STEPS = 4


def make_model(recipe, device):
    torch.manual_seed(0)
    return tfp8.convert_to_fp8(torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 16)),
        recipe=recipe).to(device)


def train(model, fn, recipe, device):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(0)
    record = []
    for step in range(STEPS):
        x = (torch.randn(24, 32, generator=gen) * (step + 1)).to(device).requires_grad_(True)
        with fp8_autocast(fp8_recipe=recipe):
            loss = fn(x).square().mean()
        loss.backward()
        grads = [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]
        opt.step()
        opt.zero_grad()
        # state_dict() first runs the backward update that a compiled backward holds back
        state = [t.clone() for k, t in model.state_dict().items() if "fp8_" in k]
        record.append((loss.detach(), grads, state))
    return record


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("recipe", [DelayedScaling(amax_history_len=4), Float8CurrentScaling()],
                         ids=["delayed", "current"])
def test_fullgraph_compile_is_bit_identical_to_eager(device, recipe):
    eager = make_model(recipe, device)
    compiled = copy.deepcopy(eager)
    backend, graphs = counting_aot_eager()
    torch._dynamo.reset()
    compiled_fn = torch.compile(compiled, fullgraph=True, backend=backend)
    expected = train(eager, eager, recipe, device)
    got = train(compiled, compiled_fn, recipe, device)
    assert len(graphs) == 1, f"compiled {len(graphs)} times: recompiled between steps"
    assert_same_training(got, expected)
    if isinstance(recipe, DelayedScaling):
        assert compiled[0].fp8_fwd_amax_history[-3:].all(), "amaxes recorded in the graph"


def test_compile_refuses_a_layer_built_for_another_recipe():
    """Resizing the amax history is not traceable: a layer built for one history length and
    run compiled under another gets an error that says how to build it. (A layer built without
    a recipe adopts the one of fp8_autocast at its entry: test_no_silent_errors.py.)"""
    model = tfp8.convert_to_fp8(torch.nn.Sequential(torch.nn.Linear(32, 16)),
                                recipe=DelayedScaling(amax_history_len=1024))
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    torch._dynamo.reset()
    with pytest.raises(Exception, match="build the module for its recipe"):
        with fp8_autocast(fp8_recipe=DelayedScaling(amax_history_len=8)):
            compiled(torch.randn(4, 32))


INDUCTOR_RECIPES = [DelayedScaling(amax_history_len=4), Float8CurrentScaling(),
                    tfp8.Float8BlockScaling(), tfp8.Float8RowwiseScaling()]
INDUCTOR_IDS = ["delayed", "current", "block", "rowwise"]


def assert_close_per_tensor(got, expected, what, max_rel=1e-3):
    """Each tensor within max_rel relative error (norm of the difference over the norm): inductor
    may fuse the elementwise ops around the FP8 casts differently (an FP8 code can move by one
    step), but a wrong scale is off by a power of two or more."""
    for i, (g, e) in enumerate(zip(got, expected)):
        assert torch.isfinite(g).all(), f"{what} {i}: not finite"
        rel = ((g.double() - e.double()).norm() / e.double().norm().clamp_min(1e-30)).item()
        assert rel <= max_rel, f"{what} {i}: relative error {rel:.3g} > {max_rel}"


@pytest.mark.parametrize("input_requires_grad", [True, False], ids=["x_grad", "no_x_grad"])
@pytest.mark.parametrize("recipe", INDUCTOR_RECIPES, ids=INDUCTOR_IDS)
def test_inductor_matches_eager_over_steps_where_scales_change(recipe, input_requires_grad):
    """The default backend against eager over STEPS steps whose inputs grow (so the delayed
    scales change every step): loss, every parameter gradient, the input gradient and every FP8
    state tensor. (The compiled backward once read the scale_inv that the update had just
    rewritten: dW 109x and dx 3584x too small at the first step; and Float8CurrentScaling did not
    compile without an input gradient.)"""
    eager = make_model(recipe, "cpu")
    compiled = copy.deepcopy(eager)
    torch._dynamo.reset()
    compiled_fn = torch.compile(compiled, fullgraph=True)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager, compiled)]
    gen = torch.Generator().manual_seed(0)
    for step in range(STEPS):
        x = torch.randn(24, 32, generator=gen) * 4.0 ** step
        records = []
        for model, fn, opt in ((eager, eager, opts[0]), (compiled, compiled_fn, opts[1])):
            xi = x.clone().requires_grad_(input_requires_grad)
            with fp8_autocast(fp8_recipe=recipe):
                loss = fn(xi).square().mean()
            loss.backward()
            grads = [p.grad.clone() for p in model.parameters()]
            grads += [xi.grad.clone()] if input_requires_grad else []
            opt.step()
            opt.zero_grad()
            state = [t.clone() for k, t in model.state_dict().items() if "fp8_" in k]
            records.append((loss.detach().reshape(1), grads, state))
        (loss_c, grads_c, state_c), (loss_e, grads_e, state_e) = records[1], records[0]
        assert_close_per_tensor([loss_c], [loss_e], f"step {step} loss")
        assert_close_per_tensor(grads_c, grads_e, f"step {step} gradient")
        assert len(state_c) == len(state_e)
        assert_close_per_tensor(state_c, state_e, f"step {step} FP8 state", max_rel=1e-6)
    if isinstance(recipe, DelayedScaling):
        scales = compiled[0].fp8_fwd_scale
        assert not torch.equal(scales, torch.ones_like(scales)), "the scales changed"
