"""Two CPU processes (gloo) with DistributedDataParallel: one amax reduction per forward and
one per backward pass make every rank's FP8 state identical; with reduce_amax=False each rank
keeps its own; with current scaling every rank casts with the same scales."""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import transformer_fp8 as tfp8

WORLD = 2
STEPS = 3

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")


def _fp8_tensors(model):
    return [t.detach().clone() for layer in model if isinstance(layer, tfp8.Linear) for t in (
        layer.fp8_fwd_amax_history, layer.fp8_fwd_scale, layer.fp8_fwd_scale_inv,
        layer.fp8_bwd_amax_history, layer.fp8_bwd_scale, layer.fp8_bwd_scale_inv)]


def _counting(calls: list, fn):
    def wrapper(*args, **kwargs):
        result = fn(*args, **kwargs)
        calls.append(result.clone() if isinstance(result, torch.Tensor) else 1)
        return result
    return wrapper


def _worker(rank, init_file, out_dir, mode, explicit_group):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=WORLD)
    try:
        group = dist.new_group(list(range(WORLD))) if explicit_group else None
        torch.manual_seed(0)  # same weights on every rank
        model = tfp8.convert_to_fp8(torch.nn.Sequential(
            torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16)))
        # Without the buffer broadcast, each rank's FP8 state is only what it computed itself.
        ddp = torch.nn.parallel.DistributedDataParallel(model, broadcast_buffers=False)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
        recipe = (tfp8.Float8CurrentScaling() if mode == "current" else
                  tfp8.DelayedScaling(amax_history_len=4, reduce_amax=mode == "delayed"))
        reductions, scales = [], []
        dist.all_reduce = _counting(reductions, dist.all_reduce)
        tfp8.ops.compute_scale_from_amax = _counting(scales, tfp8.ops.compute_scale_from_amax)
        data = torch.Generator().manual_seed(1000 + rank)  # different data on every rank
        states, reductions_per_step = [], []
        for _ in range(STEPS):
            reductions.clear()
            x = torch.randn(16, 32, generator=data) * (rank + 1)
            with tfp8.fp8_autocast(fp8_recipe=recipe, fp8_group=group):
                out = ddp(x)
            out.square().mean().backward()
            opt.step()
            opt.zero_grad()
            states.append(_fp8_tensors(model))
            reductions_per_step.append(len(reductions))
        torch.save({"states": states, "reductions": reductions_per_step, "scales": scales},
                   os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _run(tmp_path, mode, explicit_group=False):
    mp.spawn(_worker, args=(str(tmp_path / "init"), str(tmp_path), mode, explicit_group),
             nprocs=WORLD, join=True)
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]


@pytest.mark.parametrize("explicit_group", [False, True], ids=["world", "fp8_group"])
def test_reduced_amax_gives_identical_state_on_every_rank(tmp_path, explicit_group):
    rank0, rank1 = _run(tmp_path, "delayed", explicit_group)
    for step in range(STEPS):
        for a, b in zip(rank0["states"][step], rank1["states"][step]):
            assert torch.equal(a, b), f"step {step}: ranks disagree"
    assert rank0["states"][-1][0][-1].all(), "amaxes were recorded"
    # One collective for the forward amaxes and one for the backward ones, per step.
    assert rank0["reductions"] == rank1["reductions"] == [2] * STEPS


def test_without_reduction_ranks_keep_their_own_amax(tmp_path):
    rank0, rank1 = _run(tmp_path, "no_reduce")
    for step in range(STEPS):
        history0, history1 = rank0["states"][step][0], rank1["states"][step][0]
        filled = min(step + 1, history0.shape[0] - 1)
        # The input column (different data per rank) differs in every recorded row; the
        # weights are the same on both ranks.
        assert (history0[-filled:, 0] != history1[-filled:, 0]).all(), f"step {step}"
    assert rank0["reductions"] == [0] * STEPS


def test_current_scaling_scales_agree_across_ranks(tmp_path):
    rank0, rank1 = _run(tmp_path, "current")
    assert len(rank0["scales"]) == STEPS * 2 * 3  # input, weight, grad of two layers
    for a, b in zip(rank0["scales"], rank1["scales"]):
        assert torch.equal(a, b)
