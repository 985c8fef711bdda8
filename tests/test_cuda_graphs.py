"""CUDA graphs: a whole FP8 training step (forward under fp8_autocast, backward, both scale
updates) captured in one torch.cuda.CUDAGraph replays like eager steps. On the CPU: a step
reads no tensor value on the host (what capture forbids), whatever the recipe."""
from __future__ import annotations

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from conftest import CUDA_SKIP, DEVICE_PARAMS, assert_bitwise_equal

import transformer_fp8 as tfp8
from transformer_fp8 import DelayedScaling, Float8CurrentScaling, fp8_autocast

RECIPES = [DelayedScaling(amax_history_len=4), Float8CurrentScaling()]
RECIPE_IDS = ["delayed", "current"]


def make_model(device, recipe):
    torch.manual_seed(0)
    return torch.nn.Sequential(tfp8.Linear(64, 128, recipe=recipe), torch.nn.GELU(),
                               tfp8.Linear(128, 64, recipe=recipe)).to(device)


def step(model, x, g, recipe):
    with fp8_autocast(fp8_recipe=recipe):
        out = model(x)
    out.backward(g)


class _HostReads(TorchDispatchMode):
    """Records the operators that copy a tensor's value to the host (.item(), bool(t), ...)."""

    def __init__(self):
        super().__init__()
        self.reads = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default):
            self.reads.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("recipe", RECIPES, ids=RECIPE_IDS)
def test_training_step_reads_no_tensor_value_on_the_host(device, recipe):
    model = make_model(device, recipe)
    x = torch.randn(32, 64, device=device, requires_grad=True)
    g = torch.randn(32, 64, device=device)
    step(model, x, g, recipe)  # first step: recipe adoption and plans happen here
    with _HostReads() as mode:
        step(model, x, g, recipe)
    assert mode.reads == [], f"host reads in a training step: {mode.reads}"


@CUDA_SKIP
@pytest.mark.parametrize("recipe", RECIPES, ids=RECIPE_IDS)
def test_whole_training_step_replays_in_a_cuda_graph(recipe):
    eager = make_model("cuda", recipe)
    graphed = copy.deepcopy(eager)
    gen = torch.Generator().manual_seed(0)
    inputs = [(torch.randn(32, 64, generator=gen).cuda(),
               torch.randn(32, 64, generator=gen).cuda()) for _ in range(6)]
    static_x = torch.zeros(32, 64, device="cuda", requires_grad=True)
    static_g = torch.zeros(32, 64, device="cuda")

    def run_eager(x, g):
        for p in eager.parameters():
            p.grad = None
        step(eager, x.clone().requires_grad_(True), g, recipe)

    # Warm-up on a side stream (plans, workspaces, recipe adoption), then capture one step.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for x, g in inputs[:3]:
            run_eager(x, g)
            with torch.no_grad():
                static_x.copy_(x)
                static_g.copy_(g)
            for p in graphed.parameters():
                p.grad = None
            static_x.grad = None
            step(graphed, static_x, static_g, recipe)
    torch.cuda.current_stream().wait_stream(side)
    for p in list(graphed.parameters()) + [static_x]:
        p.grad.zero_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(graphed, static_x, static_g, recipe)  # gradients accumulate into zeroed .grad

    for i, (x, g) in enumerate(inputs[3:]):
        run_eager(x, g)
        with torch.no_grad():
            static_x.copy_(x)
            static_g.copy_(g)
            for p in list(graphed.parameters()) + [static_x]:
                p.grad.zero_()
        graph.replay()
        torch.cuda.synchronize()
        for (name, p), q in zip(graphed.named_parameters(), eager.parameters()):
            assert_bitwise_equal(p.grad, q.grad, f"replay {i}: gradient of {name}")
        for (name, t), u in zip(graphed.state_dict().items(), eager.state_dict().values()):
            assert_bitwise_equal(t, u, f"replay {i}: {name}")
