"""FP8 weight all-gather under FSDP2 where a layer's weight is gathered in another fp8_autocast
context than the one its forward computes in, on two CPU processes (gloo):

* activation checkpointing: a region whose forward ran in high precision (a nested
  ``fp8_autocast(enabled=False)``, also calibrating) recomputed during a backward inside an
  enabled fp8_autocast, and FP8 regions recomputed during a backward outside any context (the
  usual ``loss.backward()``), with torch.utils.checkpoint in both modes;
* FSDP2's explicit forward prefetch, which gathers the next layer's weight in the current
  layer's pre-forward, before the next layer's forward opens its own context;
* a forward in another context (an evaluation under no_grad) between a checkpointed forward
  and its backward: in FP8, compared as below (xfail under DelayedScaling, a known
  difference); in high precision, where the all-gather switches form and the forward's
  weight gradients would be lost, refused with a RuntimeError.

Every run is compared, bit for bit (losses, every gradient, the FP8 state), over steps whose
scales change, with the same steps using high-precision all-gathers, no checkpointing and no
prefetch, under DelayedScaling and Float8CurrentScaling.
"""
from __future__ import annotations

import os
from dataclasses import asdict

import pytest
import torch
import torch.distributed as dist
from integration_compare import STEP_SCALES, StepRecord, assert_bit_identical, record_step
from multiprocess import WORLD, run_ranks

import transformer_fp8 as tfp8

try:
    from torch.distributed.fsdp import fully_shard
except ImportError:  # an older torch
    fully_shard = None

pytestmark = pytest.mark.skipif(
    fully_shard is None or not dist.is_available() or not dist.is_gloo_available(),
    reason="needs torch.distributed with gloo and FSDP2 (fully_shard)")

STEPS = 3
RECIPES = {"delayed": tfp8.DelayedScaling(amax_history_len=8, amax_compute_algo="most_recent"),
           "current": tfp8.Float8CurrentScaling()}


class Net(torch.nn.Module):
    """Three FP8 layers; the middle one runs in high precision (a nested disabled context, as
    for a layer kept out of FP8), optionally calibrating. ``checkpoint``: None, "reentrant" or
    "non_reentrant": each layer runs under torch.utils.checkpoint, the middle one inside its
    disabled context (so its recomputation runs in whatever context the backward has)."""

    def __init__(self, checkpoint, calibrating: bool):
        super().__init__()
        self.a = torch.nn.Linear(32, 64)
        self.b = torch.nn.Linear(64, 64)
        self.c = torch.nn.Linear(64, 16)
        self.checkpoint, self.calibrating = checkpoint, calibrating

    def _run(self, layer, x):
        if self.checkpoint is None:
            return layer(x)
        return torch.utils.checkpoint.checkpoint(
            layer, x, use_reentrant=self.checkpoint == "reentrant")

    def forward(self, x):
        h = torch.relu(self._run(self.a, x))
        with tfp8.fp8_autocast(enabled=False, calibrating=self.calibrating):
            h = torch.relu(self._run(self.b, h))
        return self._run(self.c, h)


def _model(recipe, fp8_all_gather: bool, checkpoint, calibrating: bool, prefetch: bool):
    torch.manual_seed(0)
    model = Net(checkpoint, calibrating)
    tfp8.convert_to_fp8(model, recipe=recipe, fp8_all_gather=fp8_all_gather)
    for layer in (model.a, model.b, model.c):
        fully_shard(layer)
    if prefetch:  # b's and c's weights gathered in the pre-forward of the layer before them
        model.a.set_modules_to_forward_prefetch([model.b])
        model.b.set_modules_to_forward_prefetch([model.c])
    return fully_shard(model)


def _batch(rank: int, step: int) -> torch.Tensor:
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(100 * step + rank))
    return x * STEP_SCALES[step % len(STEP_SCALES)]


def _train(rank, recipe, fp8_all_gather, checkpoint=None, calibrating=False, prefetch=False,
           backward_inside=False, evaluate_between=None) -> list:
    """STEPS SGD steps; ``backward_inside``: loss.backward() inside the enabled context;
    ``evaluate_between``: "inside" or "outside" an enabled context, an evaluation forward
    (no_grad, another batch) between each forward and its backward."""
    model = _model(recipe, fp8_all_gather, checkpoint, calibrating, prefetch)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    records = []
    for step in range(STEPS):
        x = _batch(rank, step).requires_grad_(True)  # (the reentrant mode needs it)
        with tfp8.fp8_autocast(fp8_recipe=recipe):
            loss = model(x).square().mean()
            if backward_inside:
                loss.backward()
        if evaluate_between is not None:
            with torch.no_grad(), tfp8.fp8_autocast(enabled=evaluate_between == "inside",
                                                    fp8_recipe=recipe):
                model(_batch(rank, step + 10))
        if not backward_inside:
            loss.backward()
        records.append(asdict(record_step(loss, model, {"input": x})))
        opt.step()
        opt.zero_grad()
    return records


# name -> the options of _train (the reference: the same without fp8_all_gather, checkpoint
# and prefetch)
CASES = {
    # a high-precision region recomputed inside the enabled context of the backward
    "hp_region_backward_inside_non_reentrant": dict(checkpoint="non_reentrant",
                                                    backward_inside=True),
    "hp_region_backward_inside_reentrant": dict(checkpoint="reentrant", backward_inside=True),
    "calibrating_region_backward_inside": dict(checkpoint="non_reentrant", calibrating=True,
                                               backward_inside=True),
    # FP8 regions recomputed outside any context (the usual loss.backward())
    "fp8_regions_backward_outside_non_reentrant": dict(checkpoint="non_reentrant"),
    "fp8_regions_backward_outside_reentrant": dict(checkpoint="reentrant"),
    # the middle layer's weight gathered by prefetch in the enabled context of the first
    "forward_prefetch": dict(prefetch=True),
    "forward_prefetch_checkpointed": dict(prefetch=True, checkpoint="non_reentrant",
                                          backward_inside=True),
    # an evaluation forward in FP8 (its delayed scales updated since the training forward)
    # between the forward and its recomputation
    "fp8_evaluation_before_backward": dict(checkpoint="non_reentrant",
                                           evaluate_between="inside"),
}


def _worker_refused(rank: int, out_dir: str, recipe_name: str) -> None:
    try:
        _train(rank, RECIPES[recipe_name], True, checkpoint="non_reentrant",
               evaluate_between="outside")
        message = None
    except RuntimeError as error:
        message = str(error)
    torch.save(message, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.parametrize("recipe_name", list(RECIPES))
def test_a_gather_switching_form_before_the_backward_is_refused(tmp_path, recipe_name):
    # The FP8 layers' weights gathered in FP8 for the forward, in high precision for an
    # evaluation outside fp8_autocast before the backward: FSDP2 makes new Parameters, and the
    # gradients of the forward's graph would reach the old ones, never reduced (they were lost
    # silently: the weights got no gradient).
    run_ranks(_worker_refused, (str(tmp_path), recipe_name), tmp_path)
    for rank in range(WORLD):
        message = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        assert message is not None and "switched between FP8 and high precision" in message


def _worker(rank: int, out_dir: str, recipe_name: str, case: str) -> None:
    recipe, options = RECIPES[recipe_name], CASES[case]
    reference_options = {k: v for k, v in options.items() if k not in ("checkpoint", "prefetch")}
    result = {"reference": _train(rank, recipe, False, **reference_options),
              "fp8": _train(rank, recipe, True, **options)}
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


def _marks(recipe_name: str, case: str):
    if recipe_name == "delayed" and case == "fp8_evaluation_before_backward":
        # Known: the backward's all-gather repeats the LAST forward's form, here the
        # evaluation's, whose delayed weight scale was updated at the training context's exit;
        # the recomputation takes that operand instead of the training forward's cast.
        # (FSDP2 all-gathers under no_grad: the gather cannot tell an evaluation forward.)
        return [pytest.mark.xfail(strict=True, reason="an FP8 evaluation between forward and "
                                  "backward changes the delayed scale the backward re-gathers")]
    return []


@pytest.mark.parametrize("recipe_name,case", [
    pytest.param(r, c, marks=_marks(r, c), id=f"{r}-{c}") for r in RECIPES for c in CASES])
def test_gather_follows_the_form_the_layer_computes_in(tmp_path, recipe_name, case):
    run_ranks(_worker, (str(tmp_path), recipe_name, case), tmp_path)
    for rank in range(WORLD):
        result = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        if recipe_name == "delayed" and "prefetch" in case:
            # Known: the prefetch casts b's weight shard with b's delayed scale and records
            # its amax, though b then computes in high precision: b's FP8 state (which b's
            # high-precision computation never reads) differs. Everything else must not.
            for records in result.values():
                for r in records:
                    assert any(k.startswith("b.") for k in r["fp8_state"])
                    r["fp8_state"] = {k: v for k, v in r["fp8_state"].items()
                                      if not k.startswith("b.")}
        assert_bit_identical([StepRecord(**r) for r in result["fp8"]],
                             [StepRecord(**r) for r in result["reference"]])
