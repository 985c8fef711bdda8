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


def _moe_worker(rank, init_file, out_dir):
    """Three expert layers; rank 0 runs experts 0 and 1, rank 1 runs experts 1 and 2."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=WORLD)
    try:
        recipe = tfp8.DelayedScaling(amax_history_len=4)
        torch.manual_seed(0)
        experts = torch.nn.ModuleList(tfp8.Linear(32, 32, recipe=recipe) for _ in range(3))
        mine = [0, 1] if rank == 0 else [1, 2]
        data = torch.Generator().manual_seed(2000 + rank)
        states, amaxes = [], []
        for _ in range(STEPS):
            x = torch.randn(16, 32, generator=data) * (rank + 1)
            grad = torch.randn(16, 32, generator=data)
            with tfp8.fp8_autocast(fp8_recipe=recipe):
                outs = [experts[e](x) for e in mine]
            torch.autograd.backward(outs, [grad] * len(outs))
            amaxes.append((x.abs().max(), grad.abs().max()))
            states.append(_fp8_tensors(experts))
        torch.save({"states": states, "amaxes": amaxes,
                    "weight_amax": [e.weight.abs().max() for e in experts]},
                   os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_ranks_running_different_experts_share_one_reduction(tmp_path):
    """Mixture-of-experts routing: ranks run different subsets of the FP8 layers. The reduction
    covers every layer on every rank (same layout everywhere), so each expert's history holds
    the amax of the ranks that ran it, identically on both ranks."""
    mp.spawn(_moe_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=WORLD,
             join=True)
    rank0, rank1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True)
                    for r in range(WORLD))
    for step in range(STEPS):
        for a, b in zip(rank0["states"][step], rank1["states"][step]):
            assert torch.equal(a, b), f"step {step}: ranks disagree"
    last = rank0["states"][-1]
    fwd_history = [last[6 * e] for e in range(3)]  # per expert: fwd history first
    bwd_history = [last[6 * e + 3] for e in range(3)]
    x0, g0 = rank0["amaxes"][-1]
    x1, g1 = rank1["amaxes"][-1]
    assert fwd_history[0][-1, 0] == x0, "expert 0: rank 0's input only"
    assert fwd_history[2][-1, 0] == x1, "expert 2: rank 1's input only"
    assert fwd_history[1][-1, 0] == max(x0, x1), "expert 1: both ranks"
    assert bwd_history[0][-1, 0] == g0 and bwd_history[2][-1, 0] == g1
    assert bwd_history[1][-1, 0] == max(g0, g1)
    for e in range(3):
        assert fwd_history[e][-1, 1] == rank0["weight_amax"][e]
