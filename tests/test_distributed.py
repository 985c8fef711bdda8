"""Two CPU processes (gloo) with DistributedDataParallel: one amax reduction per step makes
every rank's FP8 state identical; with reduce_amax=False each rank keeps its own."""
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


def _worker(rank, init_file, out_dir, reduce_amax, explicit_group):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=WORLD)
    try:
        group = dist.new_group(list(range(WORLD))) if explicit_group else None
        torch.manual_seed(0)  # same weights on every rank
        model = tfp8.convert_to_fp8(torch.nn.Sequential(
            torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16)))
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
        recipe = tfp8.DelayedScaling(amax_history_len=4, reduce_amax=reduce_amax)
        data = torch.Generator().manual_seed(1000 + rank)  # different data on every rank
        states = []
        for _ in range(STEPS):
            x = torch.randn(16, 32, generator=data) * (rank + 1)
            with tfp8.fp8_autocast(fp8_recipe=recipe, fp8_group=group):
                out = ddp(x)
            out.square().mean().backward()
            opt.step()
            opt.zero_grad()
            states.append(_fp8_tensors(model))
        torch.save(states, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _run(tmp_path, reduce_amax, explicit_group=False):
    mp.spawn(_worker, args=(str(tmp_path / "init"), str(tmp_path), reduce_amax, explicit_group),
             nprocs=WORLD, join=True)
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]


@pytest.mark.parametrize("explicit_group", [False, True], ids=["world", "fp8_group"])
def test_reduced_amax_gives_identical_state_on_every_rank(tmp_path, explicit_group):
    rank0, rank1 = _run(tmp_path, reduce_amax=True, explicit_group=explicit_group)
    for step in range(STEPS):
        for a, b in zip(rank0[step], rank1[step]):
            assert torch.equal(a, b), f"step {step}: ranks disagree"
    assert rank0[-1][0][-1].all(), "amaxes were recorded"


def test_without_reduction_ranks_keep_their_own_amax(tmp_path):
    rank0, rank1 = _run(tmp_path, reduce_amax=False)
    for step in range(STEPS):
        fwd_history0, fwd_history1 = rank0[step][0], rank1[step][0]
        assert not torch.equal(fwd_history0, fwd_history1), f"step {step}"
