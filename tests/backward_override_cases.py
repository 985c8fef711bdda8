"""What the ranks run for test_backward_override.py's FSDP2 case (2 gloo ranks): layer b runs
under a backward_override in a nested fp8_autocast after layer a under the same recipe without
it, both FSDP2-sharded with fp8_all_gather; with forward prefetch b's weight is all-gathered
under a's context, in FP8. b is also run under a non-reentrant checkpoint (its recomputation
in backward gathers the weight again). Each rank's gradients (b's input gradient, b's weight
gradient) with fp8_all_gather and with high-precision all-gathers."""
from __future__ import annotations

import os
import warnings

import torch
from torch.distributed.fsdp import fully_shard

import transformer_fp8 as tfp8

RECIPES = {"current": tfp8.Float8CurrentScaling, "block": tfp8.Float8BlockScaling}


class _Two(torch.nn.Module):
    def __init__(self, fp8_all_gather: bool, kind: str, override: str, checkpointed: bool):
        super().__init__()
        torch.manual_seed(0)
        self.a = tfp8.Linear(128, 256, fp8_all_gather=fp8_all_gather)
        self.b = tfp8.Linear(256, 256, fp8_all_gather=fp8_all_gather)
        self.plain = RECIPES[kind]()
        self.override = RECIPES[kind](backward_override=override)
        self.checkpointed = checkpointed

    def forward(self, x):
        with tfp8.fp8_autocast(fp8_recipe=self.plain):
            h = self.a(x)
        with tfp8.fp8_autocast(fp8_recipe=self.override):
            if self.checkpointed:
                return torch.utils.checkpoint.checkpoint(self.b, h, use_reentrant=False), h
            return self.b(h), h


def _run(rank: int, fp8_all_gather: bool, prefetch: bool, case: tuple) -> dict:
    model = _Two(fp8_all_gather, *case)
    fully_shard(model.a)
    fully_shard(model.b)
    fully_shard(model)
    if prefetch:
        model.a.set_modules_to_forward_prefetch([model.b])
    x = torch.randn(32, 128, generator=torch.Generator().manual_seed(rank))
    out, h = model(x)
    h.retain_grad()
    out.square().sum().backward()
    return {"input_grad": h.grad.clone(),
            "weight_grad": model.b.weight.grad.full_tensor().clone()}


# (recipe kind, override, checkpointed)
CASES = [("current", "high_precision", False), ("current", "dequantized", False),
         ("current", "high_precision", True), ("block", "high_precision", True),
         ("block", "dequantized", True)]


def worker(rank, out_dir):
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    results = {}
    for case in CASES:
        for prefetch in (False, True):
            for fp8_all_gather in (False, True):
                for name, value in _run(rank, fp8_all_gather, prefetch, case).items():
                    results[(case, prefetch, fp8_all_gather, name)] = value
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
