"""FP8 weight all-gather under FSDP2, beyond the two-rank case of test_fsdp_fp8_all_gather.py:
three gloo ranks, so that FSDP2 pads the shards of weights whose rows do not divide by 3 (80 and
16 rows), and activation checkpointing of the sharded layers (non-reentrant). Either way the run
with FP8 all-gathers is bit for bit the run with high-precision ones (DelayedScaling: each shard
cast with the layer's delayed weight scale)."""
from __future__ import annotations

import os
from dataclasses import asdict

import pytest
import torch
import torch.distributed as dist
from integration_compare import STEP_SCALES, StepRecord, assert_bit_identical, record_step
from multiprocess import run_ranks
from test_fsdp_fp8_all_gather import GatherBytes

import transformer_fp8 as tfp8

RECIPE = tfp8.DelayedScaling(amax_history_len=16, amax_compute_algo="most_recent")
STEPS = 3

try:
    from torch.distributed.fsdp import fully_shard
except ImportError:  # an older torch
    fully_shard = None

pytestmark = pytest.mark.skipif(
    fully_shard is None or not dist.is_available() or not dist.is_gloo_available(),
    reason="needs torch.distributed with gloo and FSDP2 (fully_shard)")


class _Checkpointed(torch.nn.Module):
    """Runs ``layer`` under non-reentrant activation checkpointing."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.layer, x, use_reentrant=False)


def _model(fp8_all_gather: bool, checkpoint: bool):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 80), torch.nn.GELU(),
                                torch.nn.Linear(80, 16))
    tfp8.convert_to_fp8(model, recipe=RECIPE, fp8_all_gather=fp8_all_gather)
    for index in (0, 2):
        fully_shard(model[index])
        if checkpoint:
            model[index] = _Checkpointed(model[index])
    return fully_shard(model)


def _train(rank: int, fp8_all_gather: bool, checkpoint: bool) -> tuple:
    """(step records, bytes each weight all-gather sent)."""
    model = _model(fp8_all_gather, checkpoint)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with GatherBytes() as gathers:
        records = [_step(model, opt, rank, step) for step in range(STEPS)]
    return records, gathers.sent


def _step(model, opt, rank: int, step: int) -> dict:
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(100 * step + rank))
    with tfp8.fp8_autocast(fp8_recipe=RECIPE):
        loss = model(x * STEP_SCALES[step % len(STEP_SCALES)]).square().mean()
    loss.backward()
    record = asdict(record_step(loss, model))
    opt.step()
    opt.zero_grad()
    return record


def _worker(rank, out_dir, checkpoint):
    result = {str(flag): _train(rank, flag, checkpoint) for flag in (False, True)}
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.parametrize("checkpoint", [False, True], ids=["three_ranks_uneven",
                                                           "three_ranks_checkpointed"])
def test_fp8_all_gather_bit_identical_with_padded_shards(tmp_path, checkpoint):
    run_ranks(_worker, (str(tmp_path), checkpoint), tmp_path, world=3)
    for rank in range(3):
        result = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        (fp8, fp8_sent), (high, high_sent) = result["True"], result["False"]
        assert_bit_identical([StepRecord(**r) for r in fp8], [StepRecord(**r) for r in high])
        # the steps trained: the weights moved, the losses differ from step to step
        assert len({r["loss"].item() for r in fp8}) == STEPS
        # every all-gather moved FP8 weights (float32 biases ride along): < 55% of the bytes
        assert len(fp8_sent) == len(high_sent) > 0
        assert all(f <= 0.55 * h for f, h in zip(fp8_sent, high_sent)), (fp8_sent, high_sent)
