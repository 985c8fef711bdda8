"""FP8 weight all-gather under FSDP2 where a layer's weight is gathered in another fp8_autocast
context than the one its forward computes in, on two CPU processes (gloo):

* activation checkpointing: a region whose forward ran in high precision (a nested
  ``fp8_autocast(enabled=False)``, also calibrating) recomputed during a backward inside an
  enabled fp8_autocast, and FP8 regions recomputed during a backward outside any context (the
  usual ``loss.backward()``), with torch.utils.checkpoint in both modes;
* FSDP2's explicit forward prefetch, which gathers the next layer's weight in the current
  layer's pre-forward, before the next layer's forward opens its own context;
* a forward in another context (an evaluation) between a checkpointed forward and its
  backward: in FP8 (under no_grad or not, and with weights FSDP2 leaves gathered), compared as
  below: the backward's all-gather repeats the evaluation's form, and the recomputation casts
  the forward's operand from the high-precision weight instead (fsdp.high_precision.
  replay_operands; under DelayedScaling the evaluation's scale was updated since); in high
  precision, where the all-gather switches form and the forward's weight gradients would be
  lost, refused with a RuntimeError;
* a checkpointed layer called twice in a forward (gathered twice in one pass): its
  recomputations take the backward's all-gather as it is, no second collective.

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
from transformer_fp8.modules import base

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

    def __init__(self, checkpoint, calibrating: bool, split_batch: bool = False):
        super().__init__()
        self.a = torch.nn.Linear(32, 64)
        self.b = torch.nn.Linear(64, 64)
        self.c = torch.nn.Linear(64, 16)
        self.checkpoint, self.calibrating = checkpoint, calibrating
        self.split_batch = split_batch  # a runs on each half of the batch: called twice

    def _run(self, layer, x):
        if self.checkpoint is None:
            return layer(x)
        return torch.utils.checkpoint.checkpoint(
            layer, x, use_reentrant=self.checkpoint == "reentrant")

    def forward(self, x):
        if self.split_batch:
            h = torch.relu(torch.cat([self._run(self.a, half) for half in x.chunk(2)]))
        else:
            h = torch.relu(self._run(self.a, x))
        with tfp8.fp8_autocast(enabled=False, calibrating=self.calibrating):
            h = torch.relu(self._run(self.b, h))
        return self._run(self.c, h)


def _model(recipe, fp8_all_gather: bool, checkpoint, calibrating: bool, prefetch: bool,
           split_batch: bool = False, keep_gathered: bool = False):
    torch.manual_seed(0)
    model = Net(checkpoint, calibrating, split_batch)
    tfp8.convert_to_fp8(model, recipe=recipe, fp8_all_gather=fp8_all_gather)
    for layer in (model.a, model.b, model.c):
        # keep_gathered: FSDP2 leaves the weights gathered from the forward to the backward
        fully_shard(layer, reshard_after_forward=not keep_gathered)
    if prefetch:  # b's and c's weights gathered in the pre-forward of the layer before them
        model.a.set_modules_to_forward_prefetch([model.b])
        model.b.set_modules_to_forward_prefetch([model.c])
    return fully_shard(model)


def _batch(rank: int, step: int) -> torch.Tensor:
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(100 * step + rank))
    return x * STEP_SCALES[step % len(STEP_SCALES)]


def _train(rank, recipe, fp8_all_gather, checkpoint=None, calibrating=False, prefetch=False,
           backward_inside=False, evaluate_between=None, evaluate_with_grad=False,
           split_batch=False, keep_gathered=False) -> list:
    """STEPS SGD steps; ``backward_inside``: loss.backward() inside the enabled context;
    ``evaluate_between``: "inside" or "outside" an enabled context, an evaluation forward
    (no_grad unless ``evaluate_with_grad``, another batch) between each forward and its
    backward."""
    model = _model(recipe, fp8_all_gather, checkpoint, calibrating, prefetch, split_batch,
                   keep_gathered)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    records = []
    for step in range(STEPS):
        x = _batch(rank, step).requires_grad_(True)  # (the reentrant mode needs it)
        with tfp8.fp8_autocast(fp8_recipe=recipe):
            loss = model(x).square().mean()
            if backward_inside:
                loss.backward()
        if evaluate_between is not None:
            with torch.set_grad_enabled(evaluate_with_grad), tfp8.fp8_autocast(
                    enabled=evaluate_between == "inside", fp8_recipe=recipe):
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
    # between the forward and its recomputation; also one that records a graph (never
    # backpropagated), and with the weights left gathered (the evaluation gathers them again,
    # in place, for its own pass)
    "fp8_evaluation_before_backward": dict(checkpoint="non_reentrant",
                                           evaluate_between="inside"),
    "fp8_evaluation_before_backward_reentrant": dict(checkpoint="reentrant",
                                                     evaluate_between="inside"),
    "fp8_evaluation_with_grad_before_backward": dict(checkpoint="non_reentrant",
                                                     evaluate_between="inside",
                                                     evaluate_with_grad=True),
    "fp8_evaluation_before_backward_kept_gathered": dict(checkpoint="non_reentrant",
                                                         evaluate_between="inside",
                                                         keep_gathered=True),
    # a checkpointed layer called twice in one forward (two all-gathers in one pass)
    "layer_called_twice_checkpointed": dict(checkpoint="non_reentrant", split_batch=True),
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


class ReplayGathers:
    """Counts the weights a checkpoint's recomputation all-gathers again in high precision
    (fsdp.high_precision.replay_operands: the backward's all-gather is not the forward's form)."""

    def __init__(self):
        self.count = 0
        self._original = base.replay_operands

    def __enter__(self):
        def counting(module, plans):
            weights = self._original(module, plans)
            self.count += len(weights)
            return weights
        base.replay_operands = counting
        return self

    def __exit__(self, *exc):
        base.replay_operands = self._original


def _worker(rank: int, out_dir: str, recipe_name: str, case: str) -> None:
    recipe, options = RECIPES[recipe_name], CASES[case]
    reference_options = {k: v for k, v in options.items() if k not in ("checkpoint", "prefetch")}
    result = {"reference": _train(rank, recipe, False, **reference_options)}
    with ReplayGathers() as replay_gathers:
        result["fp8"] = _train(rank, recipe, True, **options)
    torch.save((result, replay_gathers.count), os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.parametrize("recipe_name,case", [
    pytest.param(r, c, id=f"{r}-{c}") for r in RECIPES for c in CASES])
def test_gather_follows_the_form_the_layer_computes_in(tmp_path, recipe_name, case):
    run_ranks(_worker, (str(tmp_path), recipe_name, case), tmp_path)
    for rank in range(WORLD):
        result, replay_gathers = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        # No collective besides the backward's all-gathers, except where an evaluation gathered
        # the weights again in between: one per recomputed FP8 layer (a and c) and step.
        # (Current scaling leaves weights FSDP2 kept gathered as they are: their scale is the
        # unchanged weights' own.)
        regathered = "evaluation" in case and not (recipe_name == "current"
                                                   and "kept_gathered" in case)
        assert replay_gathers == (2 * STEPS if regathered else 0), replay_gathers
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
