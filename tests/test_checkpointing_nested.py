"""Nested activation checkpoints (a checkpointed region inside another, in every combination of
torch's reentrant and non-reentrant modes): a layer of an inner region runs once more than the
others (its first forward, in the outer region's recomputation as a new inner region's first
forward, in that region's recomputation), and each run must cast as the very first forward did.
Losses, every gradient and the FP8 state are bit-identical to a run without checkpointing,
over steps whose scales change."""
from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from conftest import DEVICE_PARAMS
from integration_compare import assert_bit_identical, record_step, step_batches, train

import transformer_fp8 as tfp8
from transformer_fp8 import (DelayedScaling, Float8BlockScaling, Float8CurrentScaling,
                             Float8RowwiseScaling, fp8_autocast)

RECIPES = [DelayedScaling(amax_history_len=2), Float8CurrentScaling(), Float8BlockScaling(),
           Float8RowwiseScaling()]
RECIPE_IDS = ["delayed", "current", "block", "rowwise"]
MODES = ["reentrant", "non_reentrant"]
# (torch's warning for the inner reentrant region's first forward, under the outer reentrant
# region's no_grad: that region is never backpropagated)
pytestmark = pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad")


def checkpointed(function, *args, mode):
    if mode is None:
        return function(*args)
    return torch_checkpoint.checkpoint(function, *args, use_reentrant=mode == "reentrant")


class NestedModel(torch.nn.Module):
    """first -> [outer region: a -> [inner region: b -> c] -> d] -> last, each an FP8 Linear
    (``modes``: (outer, inner) checkpoint modes, None for no checkpointing)."""

    def __init__(self, width=32):
        super().__init__()
        self.layers = torch.nn.ModuleDict(
            {name: tfp8.Linear(width, width) for name in ("first", "a", "b", "c", "d", "last")})
        self.modes = (None, None)

    def inner(self, h):
        return self.layers["c"](torch.nn.functional.gelu(self.layers["b"](h)))

    def outer(self, h):
        h = self.layers["a"](h)
        h = h + checkpointed(self.inner, h, mode=self.modes[1])
        return self.layers["d"](h)

    def forward(self, x):
        h = self.layers["first"](x)
        h = checkpointed(self.outer, h, mode=self.modes[0])
        return self.layers["last"](h)


def _pending(model) -> bool:
    return any(m._replay_records for m in model.modules() if isinstance(m, tfp8.Linear))


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("recipe", RECIPES, ids=RECIPE_IDS)
@pytest.mark.parametrize("inner", MODES)
@pytest.mark.parametrize("outer", MODES)
def test_nested_checkpoints_are_bit_identical(outer, inner, recipe, device):
    torch.manual_seed(0)
    plain = NestedModel().to(device)
    nested = copy.deepcopy(plain)
    nested.modes = (outer, inner)
    batches = step_batches(torch.Generator().manual_seed(0), 4, 16, 32, device=device)
    expected = train(plain, plain, batches, recipe)
    got = train(nested, nested, batches, recipe)
    assert_bit_identical(got, expected)
    assert not _pending(nested), "every record was replayed"


class DeepNest(torch.nn.Module):
    """layers[0] -> [region: layers[1] -> [region: layers[2] -> [region: layers[3]]]], each
    region's output added to its input (``modes``: one checkpoint mode per region)."""

    def __init__(self, depth=4, width=32):
        super().__init__()
        self.layers = torch.nn.ModuleList(tfp8.Linear(width, width) for _ in range(depth))
        self.modes = (None,) * (depth - 1)

    def level(self, depth, h):
        h = self.layers[depth](h)
        if depth + 1 < len(self.layers):
            h = h + checkpointed(functools.partial(self.level, depth + 1), h,
                                 mode=self.modes[depth])
        return h

    def forward(self, x):
        return self.level(0, x)


@pytest.mark.parametrize("modes", [("reentrant", "non_reentrant", "reentrant"),
                                   ("non_reentrant", "reentrant", "non_reentrant"),
                                   ("reentrant",) * 3, ("non_reentrant",) * 3])
def test_three_levels_of_nesting_are_bit_identical(modes):
    """The innermost layer runs four times, each a replay of its first forward."""
    torch.manual_seed(0)
    plain = DeepNest()
    nested = copy.deepcopy(plain)
    nested.modes = modes
    recipe = DelayedScaling(amax_history_len=2)
    batches = step_batches(torch.Generator().manual_seed(1), 4, 16, 32)
    expected = train(plain, plain, batches, recipe)
    got = train(nested, nested, batches, recipe)
    assert_bit_identical(got, expected)
    assert not _pending(nested)


def backward_twice(loss) -> None:
    loss.backward(retain_graph=True)
    (loss * 3).backward()


@pytest.mark.parametrize("inner", MODES)
@pytest.mark.parametrize("outer", MODES)
def test_nested_retained_graph_backpropagated_twice(outer, inner):
    """backward(retain_graph=True), then backward again: every region is recomputed twice (the
    reentrant ones; torch's non-reentrant ones once per backward pass too) and each
    recomputation replays the first forward's casts."""
    torch.manual_seed(0)
    plain = NestedModel()
    nested = copy.deepcopy(plain)
    nested.modes = (outer, inner)
    recipe = DelayedScaling(amax_history_len=2)
    batches = step_batches(torch.Generator().manual_seed(2), 3, 16, 32)
    assert_bit_identical(train(nested, nested, batches, recipe, backward=backward_twice),
                         train(plain, plain, batches, recipe, backward=backward_twice))


class SharedAcrossRegions(torch.nn.Module):
    """``shared`` runs in an inner region of an outer one, then again in a region of its own."""

    def __init__(self, mode=None):
        super().__init__()
        self.first, self.shared = tfp8.Linear(32, 32), tfp8.Linear(32, 32)
        self.mode = mode

    def outer(self, h):
        return checkpointed(self.shared, self.first(h), mode=self.mode)

    def forward(self, x):
        y = checkpointed(self.outer, x, mode=self.mode)
        return checkpointed(self.shared, y, mode=self.mode)


@pytest.mark.parametrize("mode", MODES)
def test_a_layer_in_a_nested_region_and_in_a_region_of_its_own(mode):
    """Each of the layer's two calls replays its own first forward in every recomputation, also
    while the graphs of earlier steps (and their regions' records) are kept alive."""
    torch.manual_seed(0)
    plain = SharedAcrossRegions()
    nested = copy.deepcopy(plain)
    nested.mode = mode
    recipe = DelayedScaling(amax_history_len=1)  # (each call's scales its own step's amax)
    batches = step_batches(torch.Generator().manual_seed(3), 4, 8, 32)
    kept = []  # (the graphs stay referenced, and with them the regions' records)
    assert_bit_identical(train(nested, nested, batches, recipe, outputs=kept),
                         train(plain, plain, batches, recipe, outputs=kept))


class NestedFusedModel(torch.nn.Module):
    """A LayerNormMLP in an inner region, a LayerNormLinear in the outer one."""

    def __init__(self, modes=(None, None)):
        super().__init__()
        self.norm_linear = tfp8.LayerNormLinear(32, 32)
        self.mlp = tfp8.LayerNormMLP(32, 64)
        self.modes = modes

    def outer(self, h):
        h = self.norm_linear(h)
        return h + checkpointed(self.mlp, h, mode=self.modes[1])

    def forward(self, x):
        return checkpointed(self.outer, x, mode=self.modes[0])


@pytest.mark.parametrize("recipe", RECIPES[:2], ids=RECIPE_IDS[:2])
@pytest.mark.parametrize("modes", [("reentrant", "reentrant"), ("non_reentrant", "reentrant"),
                                   ("reentrant", "non_reentrant")])
def test_nested_fused_modules_are_bit_identical(modes, recipe):
    torch.manual_seed(0)
    plain = NestedFusedModel()
    nested = copy.deepcopy(plain)
    nested.modes = modes
    batches = step_batches(torch.Generator().manual_seed(4), 3, 16, 32)
    assert_bit_identical(train(nested, nested, batches, recipe),
                         train(plain, plain, batches, recipe))


@pytest.mark.parametrize("modes", [("reentrant", "reentrant"), ("non_reentrant", "reentrant"),
                                   ("reentrant", "non_reentrant"),
                                   ("non_reentrant", "non_reentrant")])
def test_an_evaluation_forward_through_nested_regions_keeps_nothing(modes):
    """Under no_grad no backward will recompute a region: nothing is kept, and the training
    steps around it stay bit-identical."""
    torch.manual_seed(0)
    plain = NestedModel()
    nested = copy.deepcopy(plain)
    nested.modes = modes
    recipe = DelayedScaling(amax_history_len=2)
    batches = step_batches(torch.Generator().manual_seed(5), 2, 16, 32)
    evaluation = torch.randn(16, 32) * 3
    runs = []
    for model in (plain, nested):
        steps = train(model, model, batches, recipe)
        with torch.no_grad(), fp8_autocast(fp8_recipe=recipe):
            steps.append(model(evaluation))
            assert not _pending(model)
        steps += train(model, model, batches, recipe)
        runs.append(steps)
    for got, expected in zip(*runs):
        if isinstance(got, torch.Tensor):
            assert torch.equal(got, expected)
    assert_bit_identical([r for r in runs[1] if not isinstance(r, torch.Tensor)],
                         [r for r in runs[0] if not isinstance(r, torch.Tensor)])


class OnlyNestedLayers(torch.nn.Module):
    """An outer region whose FP8 layers all run in an inner region (``mode`` for both)."""

    def __init__(self, mode=None):
        super().__init__()
        self.a, self.b = tfp8.Linear(32, 32), tfp8.Linear(32, 32)
        self.mode = mode

    def inner(self, h):
        return self.b(torch.nn.functional.gelu(self.a(h)))

    def outer(self, h):
        return 2 * checkpointed(self.inner, h, mode=self.mode)

    def forward(self, x):
        return checkpointed(self.outer, x, mode=self.mode)


@pytest.mark.parametrize("mode", MODES)
def test_nested_forward_passes_backpropagated_in_order_pipeline_style(mode):
    """Two forward passes, then their two backward passes: each pass updates the grad_output
    scales at its end, as without checkpointing, also where the outer region runs no FP8 layer
    of its own (the nested passes' updates waited for the next fp8_autocast: the second pass
    cast its grad_output with the scale from before the first)."""
    torch.manual_seed(0)
    plain = OnlyNestedLayers()
    nested = copy.deepcopy(plain)
    nested.mode = mode
    recipe = DelayedScaling(amax_history_len=1)
    batches = step_batches(torch.Generator().manual_seed(6), 6, 16, 32)
    records = []
    for model in (plain, nested):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        runs = []
        for step in range(3):
            xs, losses = [], []
            for x in batches[2 * step:2 * step + 2]:
                xs.append(x.clone().requires_grad_(True))
                with fp8_autocast(fp8_recipe=recipe):
                    losses.append(model(xs[-1]).square().mean())
            for loss in losses:
                loss.backward()
            runs.append(record_step(sum(losses), model, {"input0": xs[0], "input1": xs[1]}))
            opt.step()
            opt.zero_grad()
        records.append(runs)
    assert_bit_identical(records[1], records[0])


class NestedHighPrecision(NestedModel):
    """NestedModel with one region run in high precision: ``high_precision`` "inner" (the
    inner region under a nested fp8_autocast(enabled=False)) or "outer" (the outer region so,
    its inner region in FP8 again under a nested enabled fp8_autocast)."""

    def __init__(self, high_precision, recipe):
        super().__init__()
        self.high_precision, self.recipe = high_precision, recipe

    def outer(self, h):
        h = self.layers["a"](h)
        enabled = self.high_precision == "outer"
        with fp8_autocast(enabled=enabled, fp8_recipe=self.recipe if enabled else None):
            h = h + checkpointed(self.inner, h, mode=self.modes[1])
        return self.layers["d"](h)

    def forward(self, x):
        h = self.layers["first"](x)
        with fp8_autocast(enabled=self.high_precision != "outer"):
            h = checkpointed(self.outer, h, mode=self.modes[0])
        return self.layers["last"](h)


@pytest.mark.parametrize("high_precision", ["inner", "outer"])
@pytest.mark.parametrize("recipe", RECIPES[:3], ids=RECIPE_IDS[:3])
@pytest.mark.parametrize("inner", MODES)
@pytest.mark.parametrize("outer", MODES)
def test_nested_region_run_in_high_precision_is_recomputed_so(outer, inner, recipe,
                                                              high_precision):
    """Nested checkpoints where one region ran in high precision, backward inside the enabled
    fp8_autocast: each recomputation (the outer region's, which runs the inner region's first
    forward again, and the inner region's) runs each layer as its very first forward did, in
    high precision or FP8. Bit for bit the same steps without checkpointing."""
    torch.manual_seed(0)
    plain = NestedHighPrecision(high_precision, recipe)
    nested = copy.deepcopy(plain)
    nested.modes = (outer, inner)
    batches = step_batches(torch.Generator().manual_seed(0), 4, 16, 32)
    runs = []
    for model in (plain, nested):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        records = []
        for batch in batches:
            x = batch.clone().requires_grad_(True)
            with fp8_autocast(fp8_recipe=recipe):
                loss = model(x).square().mean()
                loss.backward()
            records.append(record_step(loss, model, {"input": x}))
            opt.step()
            opt.zero_grad(set_to_none=True)
        runs.append(records)
    assert_bit_identical(runs[1], runs[0])
    assert not _pending(nested), "every record was replayed"
