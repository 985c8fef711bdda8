"""What the rank runs for test_current_scaling_power_2.py's FSDP2 case (1 gloo rank): a Linear
whose weight FSDP2 all-gathers in FP8, left gathered in another form (a forward under
Float8CurrentScaling() with reshard_after_forward=False; a power-of-two layer inside a context
of another recipe) and then run under power-of-two current scales: its output must be the
unsharded layer's under them, bit for bit."""
from __future__ import annotations

import os
import warnings

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import transformer_fp8 as tfp8

POW2 = tfp8.Float8CurrentScaling(use_power_2_scales=True)


def worker(rank, out_dir):
    warnings.simplefilter("ignore")
    mesh = init_device_mesh("cpu", (1,))
    torch.manual_seed(0)
    unsharded = tfp8.Linear(64, 64)
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(1)) * 3
    with tfp8.fp8_autocast(fp8_recipe=POW2):
        expected = unsharded(x).detach()
    results = {}
    for name, other in (("current", tfp8.Float8CurrentScaling()),
                        ("delayed", tfp8.DelayedScaling())):
        model = tfp8.Linear(64, 64)
        model.load_state_dict(unsharded.state_dict())
        tfp8.enable_fp8_all_gather(model)
        fully_shard(model, mesh=mesh, reshard_after_forward=False)
        with torch.no_grad(), tfp8.fp8_autocast(fp8_recipe=other):
            model(x)  # (an evaluation: left gathered in that recipe's form, no backward after)
        with tfp8.fp8_autocast(fp8_recipe=POW2):
            out = model(x)
        results[name] = (out.detach(), expected)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
