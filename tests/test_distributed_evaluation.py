"""Two ranks (gloo): an evaluation between training steps, under another step (another
fp8_group, or a recipe that differs in reduce_amax only), leaves the layers to the training
step. It took their states for its own step, which the training step then neither reduced nor
updated: a layer that trained on rank 0 only (an expert) kept its own scales on rank 1."""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import transformer_fp8 as tfp8
from multiprocess import WORLD, needs_gloo, run_ranks

TRAIN = tfp8.DelayedScaling(amax_history_len=4, amax_compute_algo="most_recent")


def _worker(rank, out_dir, how):
    train_group = dist.new_group(list(range(WORLD))) if how == "fp8_group" else None
    evaluation = (dict(fp8_recipe=TRAIN) if how == "fp8_group" else  # (the default group)
                  dict(fp8_recipe=tfp8.DelayedScaling(amax_history_len=4,
                                                      amax_compute_algo="most_recent",
                                                      reduce_amax=False)))
    torch.manual_seed(0)
    dense, expert = tfp8.Linear(32, 32), tfp8.Linear(32, 32)
    data = torch.Generator().manual_seed(11 + rank)
    states = []
    for step in range(4):
        x = torch.randn(16, 32, generator=data) * (1 + 9 * rank) * (step + 1)
        with tfp8.fp8_autocast(fp8_recipe=TRAIN, fp8_group=train_group):
            h = dense(x)
            routed = step == 0 or rank == 0  # (after the first step, rank 0 only)
            out = expert(h) if routed else h
        out.sum().backward()
        with torch.no_grad(), tfp8.fp8_autocast(**evaluation):
            expert(dense(torch.randn(16, 32, generator=data)))
        states.append([t.clone() for t in (expert.fp8_fwd_amax_history, expert.fp8_fwd_scale)])
    torch.save(states, os.path.join(out_dir, f"rank{rank}.pt"))


@needs_gloo
@pytest.mark.parametrize("how", ["fp8_group", "reduce_amax"])
def test_an_evaluation_under_another_step_keeps_the_ranks_states_equal(tmp_path, how):
    run_ranks(_worker, (str(tmp_path), how), tmp_path)
    rank0, rank1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True)
                    for r in range(WORLD))
    for step, (a, b) in enumerate(zip(rank0, rank1)):
        for name, x, y in zip(("history", "scale"), a, b):
            assert torch.equal(x, y), f"step {step}: the expert's {name} differs across ranks"
    assert (rank0[-1][0][1:, 0] > 0).all(), "the expert's input amaxes of its last steps"


def _nested_worker(rank, out_dir):
    expert_group = dist.new_group(list(range(WORLD)))  # (another group object, same ranks)
    torch.manual_seed(0)
    dense, expert = tfp8.Linear(32, 32), tfp8.Linear(32, 32)
    scales = []
    for step in range(3):
        x = torch.randn(16, 32) * (rank + 1) * (step + 1)
        with tfp8.fp8_autocast(fp8_recipe=TRAIN):
            h = dense(x)
            with tfp8.fp8_autocast(fp8_recipe=TRAIN, fp8_group=expert_group):
                if rank == 0 or step > 0:  # (no token routed to rank 1's expert at first)
                    expert(h)
        scales.append(expert.fp8_fwd_scale.clone())
    torch.save(scales, os.path.join(out_dir, f"rank{rank}.pt"))


@needs_gloo
def test_a_nested_group_whose_layers_ran_on_some_ranks_only_reduces_alike(tmp_path):
    """Forward steps only (a nested group's backward reduction needs every rank's backward to
    reach one of its layers: docs/good-to-know.md): a rank whose nested step recorded nothing
    decided alone to check the reduction's layout (its plan's key was made of the devices it
    recorded), while the others reduced: mismatched collectives (gloo aborted)."""
    run_ranks(_nested_worker, (str(tmp_path),), tmp_path)
    rank0, rank1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True)
                    for r in range(WORLD))
    for step, (a, b) in enumerate(zip(rank0, rank1)):
        assert torch.equal(a, b), f"step {step}: the expert's scales differ across ranks"
