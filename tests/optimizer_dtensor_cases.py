"""What each rank runs for test_optimizer_loading.py's DTensor case: a Transformer Engine
FusedAdam state (step in the group, store_param_remainders' int16 masters) loaded into a
FusedAdam over bfloat16 DTensor parameters sharded over the ranks (FSDP2's layout), then one
step with a zero gradient, which moves nothing: the rebuilt masters must be Transformer
Engine's float32 masters bit for bit, and the parameters unchanged."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard, init_device_mesh

from transformer_fp8.optimizers import FusedAdam


def te_split(master: torch.Tensor):
    """Transformer Engine's split of a float32 master: bfloat16 parameter and int16 remainder."""
    bits = master.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    low = bits & 0xFFFF
    high = (bits >> 16) + (low >= 0x8000).to(torch.int64)
    signed = lambda v: (v & 0xFFFF) - ((v & 0xFFFF) >= 0x8000).to(torch.int64) * 0x10000  # noqa: E731
    return signed(high).to(torch.int16).view(torch.bfloat16), signed(low).to(torch.int16)


def worker(rank, out_dir):
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    master = torch.randn(8, 4) * 3
    param_bf16, remainder = te_split(master)
    shard = lambda t: DTensor.from_local(  # noqa: E731
        t.chunk(dist.get_world_size())[rank].clone(), mesh, [Shard(0)])
    param = torch.nn.Parameter(shard(param_bf16))
    optimizer = FusedAdam([param], lr=1e-3, master_weights=True, store_param_remainders=True)
    optimizer.load_state_dict({
        "state": {0: {"exp_avg": shard(torch.zeros(8, 4)), "exp_avg_sq": shard(torch.zeros(8, 4)),
                      "master_param": shard(remainder)}},
        "param_groups": [dict(lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8,
                              weight_decay=0.0, step=3, params=[0])]})
    param.grad = shard(torch.zeros(8, 4, dtype=torch.bfloat16))
    optimizer.step()
    torch.save({"master": optimizer.state[param]["master_param"].full_tensor(),
                "param": param.detach().full_tensor(), "expected_master": master,
                "expected_param": param_bf16, "step": float(optimizer.state[param]["step"])},
               os.path.join(out_dir, f"rank{rank}.pt"))
