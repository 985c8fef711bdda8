"""FP8 weight all-gather under FSDP2 where FSDP2 does not all-gather at every forward: it keeps
the root's weights gathered after forward (its default), keeps every weight gathered with
reshard_after_forward=False, and after backward while gradients accumulate
(set_reshard_after_backward(False)). A forward pass then meets a weight cast with an earlier
pass's delayed scale, whose amax this pass has not recorded: the module gathers it again. The
run is bit for bit the run with high-precision all-gathers (the weight scale stayed 1.0 for
every step, or microbatch 2 used the scale from before the update: gradients 11-27 dB off).
With is_first_microbatch, a weight gathered in FP8 is cast at every gather all the same (it
raised: the gathered weight is read-only): bit for bit the high-precision run without it."""
from __future__ import annotations

import os
from dataclasses import asdict

import pytest
import torch
import torch.distributed as dist
from integration_compare import STEP_SCALES, StepRecord, assert_bit_identical, record_step
from multiprocess import run_ranks

import transformer_fp8 as tfp8

STEPS = 3

try:
    from torch.distributed.fsdp import fully_shard
except ImportError:  # an older torch
    fully_shard = None

pytestmark = pytest.mark.skipif(
    fully_shard is None or not dist.is_available() or not dist.is_gloo_available(),
    reason="needs torch.distributed with gloo and FSDP2 (fully_shard)")


def recipe():
    return tfp8.DelayedScaling(amax_history_len=4)


def _model(fp8_all_gather: bool, case: str):
    torch.manual_seed(0)
    model = torch.nn.Sequential(tfp8.Linear(32, 64, recipe=recipe()), torch.nn.ReLU(),
                                tfp8.Linear(64, 32, recipe=recipe()))
    if fp8_all_gather:
        tfp8.enable_fp8_all_gather(model)
    if case == "root_only":
        return fully_shard(model)  # FSDP2's defaults: the root stays gathered after forward
    keep = case == "no_reshard_after_forward"
    for index in (0, 2):
        fully_shard(model[index], reshard_after_forward=not keep)
    return fully_shard(model, reshard_after_forward=not keep)


def _batch(rank: int, step: int, microbatch: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * step + 10 * microbatch + rank)
    return torch.randn(8, 32, generator=gen) * STEP_SCALES[step % len(STEP_SCALES)] * (1 + rank)


def _train(rank: int, fp8_all_gather: bool, case: str) -> list:
    model = _model(fp8_all_gather, case)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    records = []
    microbatches = 1 if case in ("root_only", "no_reshard_after_forward") else 2
    for step in range(STEPS):
        if microbatches == 1:  # an evaluation forward before the step
            with torch.no_grad(), tfp8.fp8_autocast(fp8_recipe=recipe()):
                model(_batch(rank, step, 7))
        total = 0
        for mb in range(microbatches):
            last = mb == microbatches - 1
            if case == "accumulation":
                model.set_requires_gradient_sync(last)
                model.set_reshard_after_backward(last)
            # (a weight gathered in FP8 is cast at every gather: is_first_microbatch keeps no
            # copy of it, so that run is the high-precision one without is_first_microbatch)
            kwargs = ({"is_first_microbatch": mb == 0}
                      if case == "first_microbatch" and fp8_all_gather else {})
            with tfp8.fp8_autocast(fp8_recipe=recipe()):
                out = model[2](model[1](model[0](_batch(rank, step, mb), **kwargs)), **kwargs) \
                    if kwargs else model(_batch(rank, step, mb))
            loss = out.square().mean()
            loss.backward()
            total = total + loss.detach()
        records.append(asdict(record_step(total, model)))
        opt.step()
        opt.zero_grad()
    return records


def _worker(rank, out_dir, case):
    result = {str(flag): _train(rank, flag, case) for flag in (False, True)}
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.parametrize("case", ["root_only", "no_reshard_after_forward", "accumulation",
                                  "first_microbatch"])
def test_a_weight_left_gathered_is_gathered_again(tmp_path, case):
    run_ranks(_worker, (str(tmp_path), case), tmp_path)
    for rank in range(2):
        result = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        fp8, high = result["True"], result["False"]
        assert_bit_identical([StepRecord(**r) for r in fp8], [StepRecord(**r) for r in high])
        assert len({r["loss"].item() for r in fp8}) == STEPS
        # the weight scales moved from step to step (an amax recorded at every step)
        scales = [r["fp8_state"]["0.fp8_fwd_scale"][1].item() for r in fp8]
        assert scales[0] != 1.0 and len(set(scales)) > 1, scales
