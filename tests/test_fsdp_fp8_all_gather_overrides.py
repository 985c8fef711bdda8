"""FP8 weight all-gather under FSDP2 with debug overrides of some GEMMs (two CPU processes,
gloo): such a layer's weights are all-gathered in high precision and the layer casts them
itself for the GEMMs that stay FP8, so the run is bit for bit the one with high-precision
all-gathers. (The FP8-gathered weight was refused by the overridden quantizer, 'read-only',
or dequantised into a 'high-precision' GEMM: 0.099 off F.linear.)"""
from __future__ import annotations

import os
from dataclasses import asdict

import torch
from integration_compare import StepRecord, assert_bit_identical, record_step
from multiprocess import WORLD, run_ranks
from test_fsdp_fp8_all_gather import _batch, _model, pytestmark  # noqa: F401 (the same skip)

import transformer_fp8 as tfp8
from transformer_fp8 import debug

RECIPES = {"delayed": tfp8.DelayedScaling(amax_history_len=4),
           "current": tfp8.Float8CurrentScaling()}
OVERRIDES = (("0", ["fprop"]), ("2", ["fc2.dgrad"]), ("3", ["wgrad"]))
STEPS = 3


def _run(rank: int, recipe, fp8_all_gather: bool) -> list:
    model = _model(0, fp8_all_gather, recipe)
    for layers, gemms in OVERRIDES:
        debug.override(model, layers, fp8=False, gemms=gemms)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    records = []
    for step in range(STEPS):
        x = _batch(rank, step).requires_grad_()
        with tfp8.fp8_autocast(fp8_recipe=recipe):
            loss = model(x).square().mean()
        loss.backward()
        records.append(asdict(record_step(loss, model, {"input": x})))
        opt.step()
        opt.zero_grad()
    return records


def _worker(rank, out_dir):
    result = {f"{name}-{flag}": _run(rank, recipe, flag)
              for name, recipe in RECIPES.items() for flag in (False, True)}
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


def test_overridden_gemms_see_the_high_precision_weight(tmp_path):
    run_ranks(_worker, (str(tmp_path),), tmp_path)
    for rank in range(WORLD):
        result = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        for name in RECIPES:
            assert_bit_identical([StepRecord(**r) for r in result[f"{name}-True"]],
                                 [StepRecord(**r) for r in result[f"{name}-False"]])
