"""FP8 weight all-gather under FSDP2 with what training scripts add to it, on two CPU processes
(gloo): mixed precision (``MixedPrecisionPolicy(param_dtype=torch.bfloat16)``: each shard is
rounded to bfloat16 before its FP8 cast, as the high-precision all-gather's GEMM would cast the
bfloat16 weight) and torch.compile (backend aot_eager). Losses, every gradient and the FP8 state
are bit for bit those of the same run with high-precision all-gathers (mixed precision) or run
eagerly (compile), over steps whose scales change, and the all-gathers carry 1 byte per weight
element (counted at the collective)."""
from __future__ import annotations

import os
from dataclasses import asdict

import pytest
import torch
import torch.distributed as dist
from integration_compare import STEP_SCALES, StepRecord, assert_bit_identical, record_step
from multiprocess import WORLD, run_ranks
from test_fsdp_fp8_all_gather import GatherBytes

import transformer_fp8 as tfp8

try:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
except ImportError:  # an older torch
    fully_shard = MixedPrecisionPolicy = None

pytestmark = pytest.mark.skipif(
    fully_shard is None or not dist.is_available() or not dist.is_gloo_available(),
    reason="needs torch.distributed with gloo and FSDP2 (fully_shard)")

STEPS = 3
RECIPES = {"delayed": tfp8.DelayedScaling(amax_history_len=8, amax_compute_algo="most_recent"),
           "current": tfp8.Float8CurrentScaling()}


def _model(recipe, fp8_all_gather: bool, mixed: bool):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 16))
    tfp8.convert_to_fp8(model, recipe=recipe, fp8_all_gather=fp8_all_gather)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if mixed else MixedPrecisionPolicy()
    for index in (0, 2):
        fully_shard(model[index], mp_policy=policy)
    return fully_shard(model, mp_policy=policy)


def _train(rank: int, recipe, fp8_all_gather: bool, mixed: bool, compiled: bool) -> tuple:
    model = _model(recipe, fp8_all_gather, mixed)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    run = torch.compile(model, backend="aot_eager") if compiled else model
    records = []
    with GatherBytes() as gathers:
        for step in range(STEPS):
            x = torch.randn(8, 32, generator=torch.Generator().manual_seed(100 * step + rank))
            with tfp8.fp8_autocast(fp8_recipe=recipe):
                loss = run(x * STEP_SCALES[step]).float().square().mean()
            loss.backward()
            records.append(asdict(record_step(loss, model)))
            opt.step()
            opt.zero_grad()
    return records, gathers.sent


def _worker(rank: int, out_dir: str, recipe_name: str, setting: str) -> None:
    recipe = RECIPES[recipe_name]
    if setting == "mixed":  # FP8 all-gather against high-precision all-gather
        reference = _train(rank, recipe, False, mixed=True, compiled=False)
        fp8 = _train(rank, recipe, True, mixed=True, compiled=False)
    else:  # compiled against eager, with FP8 or high-precision all-gathers
        fp8_all_gather = setting == "compiled"
        reference = _train(rank, recipe, fp8_all_gather, mixed=False, compiled=False)
        fp8 = _train(rank, recipe, fp8_all_gather, mixed=False, compiled=True)
    torch.save({"reference": reference, "fp8": fp8}, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.parametrize("setting", ["mixed", "compiled", "compiled_hp_gather"])
@pytest.mark.parametrize("recipe_name", list(RECIPES))
def test_fp8_all_gather_with_mixed_precision_and_compile(tmp_path, recipe_name, setting):
    run_ranks(_worker, (str(tmp_path), recipe_name, setting), tmp_path)
    for rank in range(WORLD):
        result = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        (ref_records, ref_sent), (records, sent) = result["reference"], result["fp8"]
        assert_bit_identical([StepRecord(**r) for r in records],
                             [StepRecord(**r) for r in ref_records])
        # Each layer's all-gather: its weight shard at 1 byte per element, its bias shard in
        # the parameters' dtype (bfloat16 with mixed precision); the high-precision run's
        # weights in that dtype too.
        size = 2 if setting == "mixed" else 4
        layers = ((32 * 64 // WORLD, 64 // WORLD), (64 * 16 // WORLD, 16 // WORLD))
        weight_size = size if setting == "compiled_hp_gather" else 1
        assert set(sent) == {w * weight_size + b * size for w, b in layers}, (rank, sent)
        if setting == "mixed":
            assert set(ref_sent) == {(w + b) * size for w, b in layers}, (rank, ref_sent)
