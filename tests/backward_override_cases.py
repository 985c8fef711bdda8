"""What the ranks run for test_backward_override.py's FSDP2 case (2 gloo ranks): layer b runs
under a backward_override in a nested fp8_autocast after layer a under plain current scaling,
both FSDP2-sharded with fp8_all_gather; with forward prefetch b's weight is all-gathered under
a's context, in FP8. Each rank's gradients (b's input gradient, b's weight gradient) with
fp8_all_gather and with high-precision all-gathers, with and without prefetch."""
from __future__ import annotations

import os
import warnings

import torch
from torch.distributed.fsdp import fully_shard

import transformer_fp8 as tfp8

PLAIN = tfp8.Float8CurrentScaling()


class _Two(torch.nn.Module):
    def __init__(self, fp8_all_gather: bool, override: str):
        super().__init__()
        torch.manual_seed(0)
        self.a = tfp8.Linear(32, 48, fp8_all_gather=fp8_all_gather)
        self.b = tfp8.Linear(48, 16, fp8_all_gather=fp8_all_gather)
        self.override = tfp8.Float8CurrentScaling(backward_override=override)

    def forward(self, x):
        with tfp8.fp8_autocast(fp8_recipe=PLAIN):
            h = self.a(x)
        with tfp8.fp8_autocast(fp8_recipe=self.override):
            return self.b(h), h


def _run(rank: int, fp8_all_gather: bool, prefetch: bool, override: str) -> dict:
    model = _Two(fp8_all_gather, override)
    fully_shard(model.a)
    fully_shard(model.b)
    fully_shard(model)
    if prefetch:
        model.a.set_modules_to_forward_prefetch([model.b])
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(rank))
    out, h = model(x)
    h.retain_grad()
    out.square().sum().backward()
    return {"input_grad": h.grad.clone(),
            "weight_grad": model.b.weight.grad.full_tensor().clone()}


def worker(rank, out_dir):
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    results = {}
    for override in ("high_precision", "dequantized"):
        for prefetch in (False, True):
            for fp8_all_gather in (False, True):
                for name, value in _run(rank, fp8_all_gather, prefetch, override).items():
                    results[(override, prefetch, fp8_all_gather, name)] = value
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
