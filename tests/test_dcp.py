"""torch.distributed.checkpoint with FSDP2 (fully_shard) on two CPU processes (gloo): layers
built for a recipe with a non-default history length save and load bit for bit, and training
resumes with the same losses, gradients and FP8 state, bit for bit. The FSDP2 steps match the
same steps run in one process."""
from __future__ import annotations

import os
from dataclasses import asdict

import pytest
import torch
import torch.distributed as dist
from integration_compare import (STEP_SCALES, StepRecord, assert_bit_identical, assert_close,
                                 data_parallel_in_one_process, record_step)
from multiprocess import WORLD, run_ranks

import transformer_fp8 as tfp8

RECIPE = tfp8.DelayedScaling(amax_history_len=16)

try:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.fsdp import fully_shard
except ImportError:  # an older torch
    dcp = fully_shard = None

pytestmark = pytest.mark.skipif(
    fully_shard is None or not dist.is_available() or not dist.is_gloo_available(),
    reason="needs torch.distributed with gloo, FSDP2 (fully_shard) and distributed checkpoint")


def _model(seed: int):
    torch.manual_seed(seed)
    model = tfp8.convert_to_fp8(torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16)), recipe=RECIPE)
    for layer in model:
        if isinstance(layer, tfp8.Linear):
            fully_shard(layer)
    return fully_shard(model)


def _train(model, opt, steps: int, rank: int, first: int) -> list:
    """SGD steps; a record (as a dict) per step: loss, full gradients, FP8 state."""
    records = []
    for step in range(first, first + steps):
        x = _batch(rank, step)
        with tfp8.fp8_autocast(fp8_recipe=RECIPE):
            loss = model(x).square().mean()
        loss.backward()
        records.append(asdict(record_step(loss, model)))
        opt.step()
        opt.zero_grad()
    return records


def _full(state: dict) -> dict:
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in state.items()}


def _worker(rank, out_dir):
    model = _model(seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    first = _train(model, opt, 3, rank, first=0)
    saved = _full(model.state_dict())
    dcp.save({"model": model.state_dict()}, checkpoint_id=os.path.join(out_dir, "ckpt"))
    expected = _train(model, opt, 3, rank, first=3)

    # Built afresh for the same recipe, with other weights: everything comes from the file.
    resumed = _model(seed=123)
    state = {"model": resumed.state_dict()}
    dcp.load(state, checkpoint_id=os.path.join(out_dir, "ckpt"))
    resumed.load_state_dict(state["model"])
    loaded = _full(resumed.state_dict())
    resumed_opt = torch.optim.SGD(resumed.parameters(), lr=0.05)
    got = _train(resumed, resumed_opt, 3, rank, first=3)
    torch.save({"first": first, "saved": saved, "loaded": loaded, "expected": expected,
                "got": got},
               os.path.join(out_dir, f"rank{rank}.pt"))


def _batch(rank: int, step: int) -> torch.Tensor:
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(100 * step + rank))
    return x * STEP_SCALES[step % len(STEP_SCALES)]


def _single_process_run(steps: int) -> list:
    """The FSDP2 steps in one process: every rank's batch in one forward, the ranks' losses
    summed, the gradients divided by the world size (FSDP2's average). Per rank, a record per
    step (its own loss, the shared gradients and FP8 state)."""
    torch.manual_seed(0)
    model = tfp8.convert_to_fp8(torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16)), recipe=RECIPE)
    return data_parallel_in_one_process(model, _batch, RECIPE, WORLD, steps, lr=0.05)


def test_dcp_roundtrip_with_fsdp2_is_bit_identical(tmp_path):
    run_ranks(_worker, (str(tmp_path),), tmp_path)
    reference = _single_process_run(3)
    for rank in range(WORLD):
        result = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        # FSDP2 training: the same steps as in one process, up to the order of the sums.
        assert_close([StepRecord(**r) for r in result["first"]], reference[rank],
                     min_sqnr_db=60.0)
        saved, loaded = result["saved"], result["loaded"]
        assert saved.keys() == loaded.keys()
        assert saved["0.fp8_fwd_amax_history"].shape == (RECIPE.amax_history_len, 2)
        assert saved["0.fp8_fwd_amax_history"][-3:].all(), "three steps of amaxes recorded"
        for key in saved:
            assert torch.equal(saved[key], loaded[key]), f"rank {rank}: {key} differs"
        assert_bit_identical([StepRecord(**r) for r in result["got"]],
                             [StepRecord(**r) for r in result["expected"]])
