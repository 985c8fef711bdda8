"""The cross-rank amax reduction has the same layout on every rank whatever the garbage collector
does: a dead model that one rank has freed and another still holds in a reference cycle (FSDP2
makes such cycles) does not change one rank's reduction alone. Ranks that really hold different
FP8 layers get a clear error on every rank at the step where the layout changes, not a gloo size
mismatch or an NCCL hang, and no scale changes. Two gloo processes (tests/multiprocess.py)."""
from __future__ import annotations

import gc
import os
from dataclasses import asdict

import pytest
import torch
import torch.distributed as dist
from conftest import assert_bitwise_equal
from integration_compare import STEP_SCALES, StepRecord, record_step
from multiprocess import WORLD, run_ranks

import transformer_fp8 as tfp8

STEPS = 3
RECIPE = tfp8.DelayedScaling(amax_history_len=4)

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")


def _model():
    torch.manual_seed(0)  # same weights on every rank
    return tfp8.convert_to_fp8(torch.nn.Sequential(
        torch.nn.Linear(32, 48), torch.nn.ReLU(), torch.nn.Linear(48, 16)), recipe=RECIPE)


def _step(model, opt, rank: int, step: int) -> StepRecord:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(8, 32, generator=gen) * STEP_SCALES[step] * (rank + 1)
    with tfp8.fp8_autocast(fp8_recipe=RECIPE):
        loss = model(x).square().mean()
    loss.backward()
    record = record_step(loss, model)
    opt.step()
    opt.zero_grad()
    return record


def _train(model, rank: int) -> list:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return [asdict(_step(model, opt, rank, step)) for step in range(STEPS)]


def _dead_model_worker(rank: int, out_dir: str, leave_a_dead_model: bool) -> None:
    if leave_a_dead_model:
        first = _model()
        _train(first, rank)
        first.__dict__["_cycle"] = first  # a reference cycle: only the collector frees it
        if rank == 0:
            gc.disable()  # rank 0 keeps the dead model registered until a collection
        del first
        if rank == 1:
            gc.collect()  # rank 1 has freed it
    records = _train(_model(), rank)
    torch.save(records, os.path.join(out_dir, f"rank{rank}.pt"))


def _records(tmp_path, leave_a_dead_model: bool) -> list:
    out = tmp_path / str(leave_a_dead_model)
    out.mkdir()
    run_ranks(_dead_model_worker, (str(out), leave_a_dead_model), out)
    return [[StepRecord(**r) for r in torch.load(out / f"rank{rank}.pt", weights_only=True)]
            for rank in range(WORLD)]


def test_a_dead_model_freed_on_one_rank_only_changes_nothing(tmp_path):
    """Rank 0 still holds the first model (dead, in a cycle, collector off), rank 1 has freed
    it: training the second model gives bit for bit what it gives with no first model."""
    with_dead, without = _records(tmp_path, True), _records(tmp_path, False)
    for rank in range(WORLD):
        for step, (got, want) in enumerate(zip(with_dead[rank], without[rank])):
            assert_bitwise_equal(got.loss, want.loss, f"rank {rank} step {step}: loss")
            for name, value in want.grads.items():
                assert_bitwise_equal(got.grads[name], value, f"rank {rank} step {step}: {name}")
            for name, value in want.fp8_state.items():
                assert_bitwise_equal(got.fp8_state[name], value,
                                     f"rank {rank} step {step}: {name}")
    # and the ranks agree (the amaxes were reduced across them)
    for name, value in without[0][-1].fp8_state.items():
        assert_bitwise_equal(without[1][-1].fp8_state[name], value, f"ranks differ on {name}")


def _scales(model) -> list:
    return [t.clone() for layer in model if isinstance(layer, tfp8.Linear)
            for t in (layer.fp8_fwd_scale, layer.fp8_bwd_scale)]


def _different_layers_worker(rank: int, out_dir: str) -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    extra = _model() if rank == 0 else None  # a live FP8 model on rank 0 only, same device
    before = _scales(model)
    try:
        _step(model, opt, rank, 0)
        message = None
    except RuntimeError as error:
        message = str(error)
    unchanged = all(torch.equal(a, b) for a, b in zip(before, _scales(model)))
    del extra  # the ranks hold the same layers again: the next step runs
    _step(model, opt, rank, 1)
    torch.save({"message": message, "unchanged": unchanged, "scales": _scales(model)},
               os.path.join(out_dir, f"rank{rank}.pt"))


def test_ranks_with_different_layers_get_a_clear_error_on_every_rank(tmp_path):
    run_ranks(_different_layers_worker, (str(tmp_path),), tmp_path)
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]
    for rank, result in enumerate(results):
        assert result["message"] is not None, f"rank {rank} raised nothing"
        assert "ranks hold different FP8 layers" in result["message"], result["message"]
        assert "from 2 to 4 states" in result["message"], result["message"]
        assert result["unchanged"], f"rank {rank}: a scale changed in the failed step"
    for a, b in zip(results[0]["scales"], results[1]["scales"]):
        assert_bitwise_equal(a, b, "the ranks' scales after the recovered step")


def _dead_covered_layer_worker(rank: int, out_dir: str) -> None:
    gc.disable()
    torch.manual_seed(0)
    dead = tfp8.Linear(16, 16, recipe=RECIPE)
    with tfp8.fp8_autocast(fp8_recipe=RECIPE):
        dead(torch.randn(4, 16))  # now covered by this thread's kept step
    dead.__dict__["_cycle"] = dead
    del dead
    if rank == 0:
        gc.collect()  # rank 0 has freed it, rank 1 not yet
    with tfp8.fp8_autocast(fp8_recipe=RECIPE):
        pass  # a step in which no FP8 layer runs: the same reduction on both ranks
    model = _model()
    records = _train(model, rank)
    gc.enable()
    torch.save(records, os.path.join(out_dir, f"rank{rank}.pt"))


def test_a_dead_layer_covered_by_a_kept_step_changes_no_rank_alone(tmp_path):
    """A layer covered by the kept step (it ran before), dead in a cycle, freed on one rank
    only: the next steps reduce alike on both ranks (no collective mismatch) and train."""
    run_ranks(_dead_covered_layer_worker, (str(tmp_path),), tmp_path)
    records = [[StepRecord(**r) for r in torch.load(tmp_path / f"rank{rank}.pt",
                                                    weights_only=True)] for rank in range(WORLD)]
    for name, value in records[0][-1].fp8_state.items():
        assert_bitwise_equal(records[1][-1].fp8_state[name], value, f"ranks differ on {name}")


def _fresh_recipe_worker(rank: int, out_dir: str) -> None:
    from transformer_fp8.quantization import amax_step

    amax_step.MAX_KEPT_PLANS = 4  # (a small bound: few steps pass it)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    steps = amax_step.MAX_KEPT_PLANS + 6
    for step in range(steps):
        # a recipe made anew at every step, which never equals the last (a new lambda)
        recipe = tfp8.DelayedScaling(amax_history_len=4,
                                     amax_compute_algo=lambda history: history.amax(0))
        x = torch.randn(8, 32, generator=torch.Generator().manual_seed(step))
        with tfp8.fp8_autocast(fp8_recipe=recipe):
            model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    sizes = {"plans": len(amax_step._EVERY_STATE_PLANS), "layouts": len(amax_step._LAST_LAYOUT),
             "steps": steps, "bound": amax_step.MAX_KEPT_PLANS}
    torch.save(sizes, os.path.join(out_dir, f"rank{rank}.pt"))


def test_recipes_made_anew_at_every_step_keep_a_bounded_number_of_plans(tmp_path):
    """The plans and layouts kept for the reduction are keyed by recipe: a recipe made at every
    step (a new lambda as amax_compute_algo) added one of each per step, without end."""
    run_ranks(_fresh_recipe_worker, (str(tmp_path),), tmp_path)
    for rank in range(WORLD):
        sizes = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        bound = sizes["bound"]
        assert sizes["steps"] > bound
        assert 0 < sizes["plans"] <= bound and 0 < sizes["layouts"] <= bound, sizes
