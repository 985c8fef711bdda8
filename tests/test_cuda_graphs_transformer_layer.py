"""CUDA graphs of a whole TransformerLayer (grouped-key attention, fused LayerNormLinear /
LayerNormMLP with RMSNorm and SwiGLU): a training step reads no tensor value on the host (what
capture forbids;
checked on the CPU too), and tfp8.make_graphed_callables replays like eager steps."""
from __future__ import annotations

import copy

import pytest
import torch
from conftest import CUDA_SKIP, DEVICE_PARAMS
from integration_compare import STEP_SCALES
from test_cuda_graphs import (RECIPE_IDS, RECIPES, _HostReads, assert_graphed_steps_like_eager,
                              step)

import transformer_fp8 as tfp8

SEQ, BATCH, HIDDEN = 16, 2, 64


def make_layer(device, recipe):
    torch.manual_seed(0)
    return tfp8.TransformerLayer(HIDDEN, 128, 4, num_gqa_groups=2, normalization="RMSNorm",
                                 activation="swiglu", hidden_dropout=0.0, attention_dropout=0.0,
                                 recipe=recipe, device=device)


def step_inputs(seed, steps, device):
    """(x, grad_output) per step, x's magnitude changing from step to step (so do the amaxes)."""
    gen = torch.Generator().manual_seed(seed)
    return [((torch.randn(SEQ, BATCH, HIDDEN, generator=gen)
              * STEP_SCALES[i % len(STEP_SCALES)]).to(device),
             torch.randn(SEQ, BATCH, HIDDEN, generator=gen).to(device)) for i in range(steps)]


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("recipe", RECIPES, ids=RECIPE_IDS)
def test_transformer_layer_step_reads_no_tensor_value_on_the_host(device, recipe):
    layer = make_layer(device, recipe)
    (x, g), = step_inputs(0, 1, device)
    x.requires_grad_(True)
    step(layer, x, g, recipe)  # first step: recipe adoption and plans happen here
    with _HostReads() as mode:
        step(layer, x, g, recipe)
    assert mode.reads == [], f"host reads in a training step: {mode.reads}"


@CUDA_SKIP
@pytest.mark.parametrize("recipe", RECIPES, ids=RECIPE_IDS)
def test_make_graphed_callables_of_a_transformer_layer_replays_like_eager_steps(recipe):
    """Replays of the graphed layer against eager steps of a copy, an SGD step on both after
    each: outputs, the input's and every parameter's gradient and the FP8 state bit for bit."""
    layer = make_layer("cuda", recipe)
    reference = copy.deepcopy(layer)
    sample = (torch.randn(SEQ, BATCH, HIDDEN, device="cuda", requires_grad=True),)
    tfp8.make_graphed_callables(layer, sample, fp8_enabled=True, fp8_recipe=recipe)
    assert_graphed_steps_like_eager(layer, reference, recipe, 3, step_inputs(3, 4, "cuda"))
