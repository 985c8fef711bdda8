"""FP8 weight all-gather under FSDP2 with Float8BlockScaling (128x128 weight blocks), on two CPU
processes (gloo).

Where FSDP2's row shards hold whole 128-row blocks, each rank quantises its shard's blocks and
the all-gather moves the FP8 data and the blocks' scale_invs: the gathered operand and its
transpose are bit for bit BlockQuantizer(2, ...).cast of the full weight (data, scales and the
scales' layout); losses and every gradient equal those of the run with high-precision
all-gathers, bit for bit; those all-gathers move at most 55% of the bytes. A weight whose
shards would cut a block (here 32 rows over 2 ranks) is all-gathered in high precision, said
once in a warning; 1x128 weight blocks likewise.
"""
from __future__ import annotations

import os
import warnings
from dataclasses import asdict

import torch
from integration_compare import StepRecord, assert_bit_identical, record_step
from multiprocess import WORLD, run_ranks
from test_fsdp_fp8_all_gather import (
    GatherBytes,
    _batch,
    pytestmark,  # noqa: F401 (the same skip)
)
from test_fsdp_fp8_all_gather_current import Operands

import transformer_fp8 as tfp8
from transformer_fp8.quantization.blockwise import BlockQuantizer

try:
    from torch.distributed.fsdp import fully_shard
except ImportError:  # an older torch (pytestmark skips)
    fully_shard = None

BLOCKS = tfp8.Float8BlockScaling()  # w_block_scaling_dim=2: 128x128 weight blocks
STEPS = 3
# The weights gathered in FP8, in the order the forward uses them (rows 256, 512, 256: 128,
# 256, 128 per rank); "3.weight" (32 rows, 16 per rank) cuts a block: high precision.
FP8_WEIGHTS = ("0.weight", "2.fc1_weight", "2.fc2_weight")


def _model(fp8_all_gather: bool, recipe=BLOCKS):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(128, 256), torch.nn.ReLU(),
        tfp8.LayerNormMLP(256, 512, recipe=recipe), torch.nn.Linear(256, 32))
    with torch.no_grad():  # each 128-row block of a weight gets its own (power-of-two) scales
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(2.0 ** (torch.arange(p.shape[0]) // 128 * -2.0)[:, None])
    tfp8.convert_to_fp8(model, recipe=recipe, fp8_all_gather=fp8_all_gather)
    if fp8_all_gather:
        tfp8.enable_fp8_all_gather(model)
    for layer in model:
        if isinstance(layer, (tfp8.Linear, tfp8.LayerNormMLP)):
            fully_shard(layer)
    return fully_shard(model)


def _input(rank: int, step: int) -> torch.Tensor:
    return torch.cat([_batch(rank, step)] * 4, dim=1)  # [8, 128]


def _run(rank: int, fp8_all_gather: bool, recipe=BLOCKS) -> dict:
    model = _model(fp8_all_gather, recipe)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    records, weights = [], []
    with GatherBytes() as gathers, Operands() as operands, \
            warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(STEPS):
            with tfp8.fp8_autocast(fp8_recipe=recipe):
                loss = model(_input(rank, step)).square().mean()
            loss.backward()
            records.append(asdict(record_step(loss, model)))
            state = model.state_dict()
            weights.append({k: state[k].full_tensor().detach().clone() for k in FP8_WEIGHTS})
            opt.step()
            opt.zero_grad()
    return {"steps": records, "sent": gathers.sent, "operands": operands.taken,
            "weights": weights,
            "warnings": [str(w.message) for w in caught if "fp8_all_gather" in str(w.message)]}


def _worker(rank, out_dir):
    result = {str(flag): _run(rank, flag) for flag in (False, True)}
    result["dim1"] = _run(rank, True, tfp8.Float8BlockScaling(w_block_scaling_dim=1))
    result["dim1_high"] = _run(rank, False, tfp8.Float8BlockScaling(w_block_scaling_dim=1))
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


def test_block_scaling_gathers_the_block_cast_of_the_full_weight(tmp_path):
    run_ranks(_worker, (str(tmp_path),), tmp_path)
    quantizer = BlockQuantizer(2, torch.float8_e4m3fn, BLOCKS.power_2_scale)
    for rank in range(WORLD):
        result = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        high, fp8 = result["False"], result["True"]
        assert_bit_identical([StepRecord(**r) for r in fp8["steps"]],
                             [StepRecord(**r) for r in high["steps"]])
        # Per step: forward layers 0, 2, 3, then the backward's re-gathers 3, 2, 0. Layers 0 and
        # 2 in FP8 (data and block scales), layer 3 in high precision.
        assert len(fp8["sent"]) == len(high["sent"]) > 0
        ratios = [f / h for f, h in zip(fp8["sent"], high["sent"])]
        print(f"rank {rank}: bytes per all-gather, FP8 / high precision: {ratios}")
        assert len(ratios) == 6 * STEPS, ratios
        for step in range(STEPS):
            in_fp8 = [r != 1.0 for r in ratios[6 * step:6 * step + 6]]
            assert in_fp8 == [True, True, False, False, True, True], ratios
        # 1 byte per weight element and the blocks' scale_invs, against float32 weights:
        # 25.4-25.6% of the bytes in this test.
        assert all(0.25 < r < 0.26 for r in ratios if r != 1.0), ratios
        assert len(fp8["warnings"]) == 1 and "not whole 128-row blocks" in fp8["warnings"][0]
        # The gathered operands are BlockQuantizer(2, ...).cast of the full weight, bit for bit.
        per_step = len(FP8_WEIGHTS)
        assert len(fp8["operands"]) == STEPS * per_step and high["operands"] == []
        for step in range(STEPS):
            for i, name in enumerate(FP8_WEIGHTS):
                got = fp8["operands"][step * per_step + i]
                want = quantizer.cast(fp8["weights"][step][name], with_transpose=True)
                assert torch.equal(got["data"], want.data.view(torch.uint8)), (step, name)
                assert torch.equal(got["scale_inv"], want.scale_inv), (step, name)
                assert got["scale_inv"].stride() == want.scale_inv.stride(), (step, name)
                # (row blocks that no two ranks could swap unseen)
                assert all(col.unique().numel() == col.numel() > 1
                           for col in got["scale_inv"].t()), (name, got["scale_inv"])
                assert (got["data_t"] is None) == (name == "0.weight"), (step, name)
                if got["data_t"] is not None:
                    assert torch.equal(got["data_t"], want.data_t.view(torch.uint8))
                    assert torch.equal(got["scale_inv_t"], want.scale_inv_t), (step, name)
                    assert got["scale_inv_t"].stride() == want.scale_inv_t.stride()
        # 1x128 weight blocks: high precision, said once, bit-identical.
        dim1, dim1_high = result["dim1"], result["dim1_high"]
        assert dim1["sent"] == dim1_high["sent"] and dim1["operands"] == []
        assert len(dim1["warnings"]) == 1 and "w_block_scaling_dim=1" in dim1["warnings"][0]
        assert_bit_identical([StepRecord(**r) for r in dim1["steps"]],
                             [StepRecord(**r) for r in dim1_high["steps"]])


def _one_rank_worker(rank, out_dir):
    torch.save({str(flag): _run(rank, flag) for flag in (False, True)},
               os.path.join(out_dir, f"rank{rank}.pt"))


def test_one_rank_fsdp_group_runs_block_scaling_as_high_precision_gathers(tmp_path):
    """A one-rank FSDP group: FSDP2 copies the first all-gather input only, which would lose
    the block scales (IndexError), and a copy saves no bytes: the weights go to the module in
    high precision, which quantises them. Bit-identical to high-precision all-gathers."""
    run_ranks(_one_rank_worker, (str(tmp_path),), tmp_path, world=1)
    result = torch.load(tmp_path / "rank0.pt", weights_only=True)
    high, fp8 = result["False"], result["True"]
    assert_bit_identical([StepRecord(**r) for r in fp8["steps"]],
                         [StepRecord(**r) for r in high["steps"]])
    assert fp8["warnings"] == [] and fp8["operands"] == high["operands"] == []
