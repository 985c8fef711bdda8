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


def test_compile_refuses_a_layer_not_built_for_its_recipe():
    """Resizing the amax history is not traceable: the error says how to build the layer."""
    model = tfp8.convert_to_fp8(torch.nn.Sequential(torch.nn.Linear(32, 16)))  # length 1024
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    torch._dynamo.reset()
    with pytest.raises(Exception, match="build the module for its recipe"):
        with fp8_autocast(fp8_recipe=DelayedScaling(amax_history_len=8)):
            compiled(torch.randn(4, 32))


def test_inductor_compiles_a_training_step():
    """The default backend (inductor) compiles the whole step; it may fuse the surrounding
    elementwise ops differently, so the check is on the FP8 numerics' closeness."""
    recipe = DelayedScaling(amax_history_len=4)
    eager = make_model(recipe, "cpu")
    compiled = copy.deepcopy(eager)
    torch._dynamo.reset()
    compiled_fn = torch.compile(compiled, fullgraph=True)
    x = torch.randn(24, 32)
    with fp8_autocast(fp8_recipe=recipe):
        out_e, out_c = eager(x), compiled_fn(x)
    out_c.square().mean().backward()
    assert torch.allclose(out_c, out_e, rtol=1e-2, atol=1e-2)
    assert compiled[2].weight.grad is not None
