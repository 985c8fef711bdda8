"""FP8 weight all-gather under FSDP2 with Float8CurrentScaling, on two CPU processes (gloo).

Every rank casts its weight shard with the scale of the FULL weight's amax: the ranks agree on
all weights' amaxes with ONE all_reduce(MAX) per step (counted), and the gathered FP8 weight is
bit for bit TensorQuantizer.current's cast of the full weight (and its transpose); losses and
every gradient equal those of the run with high-precision all-gathers, bit for bit; each weight
all-gather moves at most 55% of the bytes. Where each rank is an FSDP group of its own, nothing
is reduced across ranks. A recipe with no FP8 all-gather falls back to the
high-precision all-gather with one warning. (DelayedScaling: tests/test_fsdp_fp8_all_gather.py.)
"""
from __future__ import annotations

import math
import os
import warnings
from dataclasses import asdict

import torch
import torch.distributed as dist
from integration_compare import StepRecord, assert_bit_identical, record_step
from multiprocess import WORLD, run_ranks
from test_fsdp_fp8_all_gather import (
    GATHERED_GEMMS,
    GatherBytes,
    _batch,
    _model,
    _train,
    pytestmark,  # noqa: F401 (the same skip)
)

import transformer_fp8 as tfp8
from transformer_fp8.modules.fsdp import current_scale as fsdp_current_scale
from transformer_fp8.modules.fsdp.gathered_weight import GatheredFp8Weight
from transformer_fp8.quantization.quantizer import TensorQuantizer

CURRENT = tfp8.Float8CurrentScaling()
POW2 = tfp8.Float8CurrentScaling(use_power_2_scales=True)
STEPS = 3
# The GEMM weights in the order the forward uses them.
WEIGHTS = ("0.weight", "2.fc1_weight", "2.fc2_weight", "3.weight")


class Counting:
    """Replaces ``owner.name`` by a wrapper that records the element count of the first
    argument of each call (per step: ``next_step``)."""

    def __init__(self, owner, name: str):
        self.owner, self.name = owner, name
        self._original = getattr(owner, name)
        self.steps: list = [[]]

    def next_step(self) -> None:
        self.steps.append([])

    def __enter__(self):
        def counting(tensor, *args, **kwargs):
            self.steps[-1].append(tensor.numel())
            return self._original(tensor, *args, **kwargs)
        setattr(self.owner, self.name, counting)
        return self

    def __exit__(self, *exc):
        setattr(self.owner, self.name, self._original)


def _copy(t: torch.Tensor) -> torch.Tensor:
    """A copy with the same strides (a block scale layout is part of what is checked)."""
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype).copy_(t)


class Operands:
    """The FP8 weight operands the GEMMs take from the all-gathers (data, transpose, scale_inv)."""

    def __init__(self):
        self.taken: list = []
        self._original = GatheredFp8Weight.fp8_operand

    def __enter__(self):
        def keeping(weight, *args):
            q = self._original(weight, *args)
            if q is not None:
                self.taken.append({
                    "data": q.data.view(torch.uint8).clone(), "scale_inv": _copy(q.scale_inv),
                    "data_t": None if q.data_t is None else q.data_t.view(torch.uint8).clone(),
                    "scale_inv_t": None if q.data_t is None else _copy(q.scale_inv_t)})
            return q
        GatheredFp8Weight.fp8_operand = keeping
        return self

    def __exit__(self, *exc):
        GatheredFp8Weight.fp8_operand = self._original


def _full_weights(model) -> dict:
    state = model.state_dict()
    return {k: state[k].full_tensor().detach().clone() for k in WEIGHTS}


def _run(rank: int, fp8_all_gather: bool, recipe=CURRENT) -> dict:
    model = _model(0, fp8_all_gather, recipe=recipe)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    records, weights = [], []
    with GatherBytes() as gathers, Operands() as operands, \
            Counting(dist, "all_reduce") as reduces, \
            Counting(fsdp_current_scale, "all_reduce_max") as batched:
        for step in range(STEPS):
            with tfp8.fp8_autocast(fp8_recipe=recipe):
                loss = model(_batch(rank, step)).square().mean()
            loss.backward()
            records.append(asdict(record_step(loss, model)))
            reduces.next_step()
            batched.next_step()
            weights.append(_full_weights(model))
            opt.step()
            opt.zero_grad()
    return {"steps": records, "sent": gathers.sent, "operands": operands.taken,
            "weights": weights, "reduces": reduces.steps[:STEPS],
            "batched": batched.steps[:STEPS]}


def _worker(rank, out_dir):
    result = {f"{pow2}/{flag}": _run(rank, flag, POW2 if pow2 else CURRENT)
              for pow2 in (False, True) for flag in (False, True)}
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


def test_current_scaling_gathers_the_cast_of_the_full_weight_with_one_amax_reduction(tmp_path):
    """Also with use_power_2_scales=True (gathered in high precision before): the scale of the
    full weight's amax rounded down to a power of two, as the layer's quantizer rounds it."""
    run_ranks(_worker, (str(tmp_path),), tmp_path)
    for rank, pow2 in ((r, p) for r in range(WORLD) for p in (False, True)):
        result = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        high, fp8 = result[f"{pow2}/False"], result[f"{pow2}/True"]
        assert_bit_identical([StepRecord(**r) for r in fp8["steps"]],
                             [StepRecord(**r) for r in high["steps"]])
        # Bytes: 1 per weight element (the float32 biases and norm weights keep 4).
        assert len(fp8["sent"]) == len(high["sent"]) > 0
        ratios = [f / h for f, h in zip(fp8["sent"], high["sent"])]
        print(f"rank {rank}: bytes per all-gather, FP8 / high precision: {ratios}")
        assert max(ratios) <= 0.55 and all(0.26 < r < 0.28 for r in ratios), ratios
        # All-reduces per step (their element counts). High precision: none (every rank casts
        # what it holds with its own amax, the full weight the same on every rank). FP8
        # all-gather: ONE all_reduce of the 4 weights' amaxes together (each rank holds a shard).
        assert high["reduces"] == [[]] * STEPS, high["reduces"]
        assert fp8["reduces"] == [[GATHERED_GEMMS]] * STEPS, fp8["reduces"]
        assert fp8["batched"] == [[GATHERED_GEMMS]] * STEPS and high["batched"] == [[]] * STEPS
        # The gathered operand is TensorQuantizer.current's cast of the full weight, bit for bit.
        assert len(fp8["operands"]) == STEPS * GATHERED_GEMMS and high["operands"] == []
        scales = set()
        for step in range(STEPS):
            for i, name in enumerate(WEIGHTS):
                got = fp8["operands"][step * GATHERED_GEMMS + i]
                want = TensorQuantizer.current(torch.float8_e4m3fn, None, power_2=pow2).cast(
                    fp8["weights"][step][name], with_transpose=True)
                assert torch.equal(got["data"], want.data.view(torch.uint8)), (step, name)
                assert torch.equal(got["scale_inv"], want.scale_inv), (step, name)
                # The transpose is taken where a dgrad GEMM needs it (not for the first layer,
                # whose input needs no gradient).
                assert (got["data_t"] is None) == (name == "0.weight"), (step, name)
                if got["data_t"] is not None:
                    assert torch.equal(got["data_t"], want.data_t.view(torch.uint8)), (step, name)
                scales.add((name, got["scale_inv"].item()))
        # The weights' scales changed with the weights (a scale kept from a past step shows;
        # a power of two changes less often).
        if pow2:
            assert all(math.frexp(s)[0] == 0.5 for _, s in scales), scales
        else:
            assert len(scales) == STEPS * GATHERED_GEMMS, scales


ROWWISE = tfp8.Float8RowwiseScaling()


def _worker_fallback(rank, out_dir):
    result = {}
    for flag in (False, True):
        model = _model(0, flag, recipe=ROWWISE)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        with GatherBytes() as gathers, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            steps = _train(model, opt, 3, rank, recipe=ROWWISE)
        result[str(flag)] = {"steps": steps, "sent": gathers.sent,
                             "warnings": [str(w.message) for w in caught
                                          if "fp8_all_gather" in str(w.message)]}
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


def test_a_recipe_without_fp8_all_gather_falls_back_to_high_precision(tmp_path):
    run_ranks(_worker_fallback, (str(tmp_path),), tmp_path)
    for rank in range(WORLD):
        result = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        high, fp8 = result["False"], result["True"]
        assert fp8["sent"] == high["sent"], "high-precision all-gathers"
        assert len(fp8["warnings"]) == 1 and "Float8RowwiseScaling" in fp8["warnings"][0]
        assert_bit_identical([StepRecord(**r) for r in fp8["steps"]],
                             [StepRecord(**r) for r in high["steps"]])


def _worker_one_rank_groups(rank, out_dir):
    # Each rank its own FSDP group and fp8_group of one rank, and its own weights (seed): the
    # weights' amaxes are not to be reduced with the other rank's.
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    groups = [dist.new_group([r]) for r in range(WORLD)]
    mesh = DeviceMesh.from_group(groups[rank], "cpu")
    result = {}
    for flag in (False, True):
        torch.manual_seed(rank)
        model = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.ReLU(),
                                    torch.nn.Linear(48, 16))
        tfp8.convert_to_fp8(model, recipe=CURRENT, fp8_all_gather=flag)
        for layer in model:
            if isinstance(layer, tfp8.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        records = []
        with Operands() as operands, Counting(fsdp_current_scale, "all_reduce_max") as batched:
            for step in range(STEPS):
                with tfp8.fp8_autocast(fp8_recipe=CURRENT, fp8_group=groups[rank]):
                    loss = model(_batch(rank, step)).square().mean()
                loss.backward()
                records.append(asdict(record_step(loss, model)))
                opt.step()
                opt.zero_grad()
        result[str(flag)] = {"steps": records, "operands": len(operands.taken),
                             "batched": batched.steps}
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


def test_current_scaling_with_one_rank_fsdp_groups_reduces_nothing_across_ranks(tmp_path):
    run_ranks(_worker_one_rank_groups, (str(tmp_path),), tmp_path)
    losses = []
    for rank in range(WORLD):
        result = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        high, fp8 = result["False"], result["True"]
        assert_bit_identical([StepRecord(**r) for r in fp8["steps"]],
                             [StepRecord(**r) for r in high["steps"]])
        assert fp8["operands"] == 2 * STEPS
        # A one-rank FSDP group: the amaxes stay on the rank, no all-reduce at all.
        assert fp8["batched"] == [[]], fp8["batched"]
        losses.append(fp8["steps"][0]["loss"])
    assert not torch.equal(losses[0], losses[1]), "the ranks train different models"


OPTIMIZERS = {  # (large steps: the weights' amaxes move)
    "sgd": lambda params: torch.optim.SGD(params, lr=2.0, foreach=False),
    # foreach and fused steps move no version counter of a DTensor Parameter
    "sgd_foreach": lambda params: torch.optim.SGD(params, lr=2.0, foreach=True),
    "adam_fused": lambda params: torch.optim.Adam(params, lr=0.3, fused=True),
    # the same, each step's first gather made by an explicit unshard (manual prefetch), not by
    # the root's forward
    "adam_fused_unshard": lambda params: torch.optim.Adam(params, lr=0.3, fused=True),
}


def _steps_in_one_context(rank: int, fp8_all_gather: bool, optimizer: str = "sgd") -> dict:
    """STEPS training steps (forward, backward, optimizer step) inside ONE fp8_autocast: the
    weights change between the gathers of one forward pass id."""
    model = _model(0, fp8_all_gather, recipe=CURRENT)
    opt = OPTIMIZERS[optimizer](model.parameters())
    records = []
    with Counting(fsdp_current_scale, "all_reduce_max") as batched:
        with tfp8.fp8_autocast(fp8_recipe=CURRENT):
            for step in range(STEPS):
                if optimizer.endswith("_unshard"):
                    model[0].unshard()
                loss = model(_batch(rank, step)).square().mean()
                loss.backward()
                records.append(asdict(record_step(loss, model)))
                batched.next_step()
                opt.step()
                opt.zero_grad()
    return {"steps": records, "batched": batched.steps[:STEPS]}


def _worker_one_context_and_a_dead_model(rank, out_dir):
    import gc
    result = {f"{name}-{flag}": _steps_in_one_context(rank, flag, name)
              for name in OPTIMIZERS for flag in (False, True)}
    # A model deleted but not yet collected (FSDP2's module and state refer to each other),
    # collected on rank 0 only: the next model's reduction covers its own weights alone.
    gc.disable()
    try:
        _steps_in_one_context(rank, True)
        if rank == 0:
            gc.collect()
        result["after"] = _steps_in_one_context(rank, True)
    finally:
        gc.enable()
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


def test_weights_changed_inside_one_fp8_autocast_are_gathered_with_their_new_amax(tmp_path):
    """Optimizer steps inside one fp8_autocast (for-loop, foreach and fused ones; gathers
    made by the forward or by an explicit unshard): each step's gathers cast with the amaxes
    of the weights as they are (they reused the first step's: losses 1-6% off from the second
    step), bit for bit the high-precision all-gathers; after the first step, one reduction of
    all the weights per step (an unshard before the first forward reduces what it finds:
    FSDP2 has not yet linked the tree). A deleted
    model that one rank's garbage collector has freed and the other's not does not enter the
    reduction (the ranks reduced different numbers of amaxes: gloo timed out)."""
    run_ranks(_worker_one_context_and_a_dead_model, (str(tmp_path),), tmp_path)
    for rank in range(WORLD):
        result = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        for name in OPTIMIZERS:
            high, fp8 = result[f"{name}-False"], result[f"{name}-True"]
            assert_bit_identical([StepRecord(**r) for r in fp8["steps"]],
                                 [StepRecord(**r) for r in high["steps"]])
            assert fp8["batched"][1:] == [[len(WEIGHTS)]] * (STEPS - 1), (name, fp8["batched"])
        assert_bit_identical([StepRecord(**r) for r in result["after"]["steps"]],
                             [StepRecord(**r) for r in result["sgd-True"]["steps"]])
