"""Two CPU processes (gloo) with DistributedDataParallel: one amax reduction per forward and
one per backward pass make every rank's FP8 state identical and equal to the MAX of the ranks'
amaxes; losses, DDP's gradients and the FP8 state follow the same steps run in one process;
with reduce_amax=False each rank keeps its own amax; with current scaling every rank casts
with its own amax. Every run is bounded in time (tests/multiprocess.py)."""
from __future__ import annotations

import os
import time
from dataclasses import asdict

import pytest
import torch
import torch.distributed as dist
from integration_compare import (STEP_SCALES, StepRecord, assert_close,
                                 data_parallel_in_one_process, record_step)
from conftest import assert_bitwise_equal
from multiprocess import WORLD, run_ranks

import transformer_fp8 as tfp8

STEPS = 3
ROWS = 16
LR = 0.1

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")


def _fp8_tensors(model):
    return [t.detach().clone() for layer in model if isinstance(layer, tfp8.Linear) for t in (
        layer.fp8_fwd_amax_history, layer.fp8_fwd_scale, layer.fp8_fwd_scale_inv,
        layer.fp8_bwd_amax_history, layer.fp8_bwd_scale, layer.fp8_bwd_scale_inv)]


def _counting(calls: list, fn):
    def wrapper(*args, **kwargs):
        result = fn(*args, **kwargs)
        calls.append(result.clone() if isinstance(result, torch.Tensor) else 1)
        return result
    return wrapper


def _model():
    torch.manual_seed(0)  # same weights on every rank
    return tfp8.convert_to_fp8(torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16)))


def _recipe(mode):
    return (tfp8.Float8CurrentScaling() if mode.startswith("current") else
            tfp8.DelayedScaling(amax_history_len=4, reduce_amax=mode == "delayed"))


def _batch(rank, step):
    """Different data on every rank (rank 1's twice as large), a new magnitude every step."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(ROWS, 32, generator=gen) * STEP_SCALES[step] * (rank + 1)


def _worker(rank, out_dir, mode, explicit_group):
    if mode == "current_python":  # the Python path, whose scales the test counts
        from transformer_fp8.modules import linear_fused_step
        linear_fused_step.ENABLED = False
    group = dist.new_group(list(range(WORLD))) if explicit_group else None
    model = _model()
    # Without the buffer broadcast, each rank's FP8 state is only what it computed itself.
    ddp = torch.nn.parallel.DistributedDataParallel(model, broadcast_buffers=False)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    recipe = _recipe(mode)
    reductions, scales = [], []
    dist.all_reduce = _counting(reductions, dist.all_reduce)
    tfp8.ops.compute_scale_from_amax = _counting(scales, tfp8.ops.compute_scale_from_amax)
    records, amaxes, reductions_per_step = [], [], []
    for step in range(STEPS):
        reductions.clear()
        x = _batch(rank, step)
        with tfp8.fp8_autocast(fp8_recipe=recipe, fp8_group=group):
            out = ddp(x)
        loss = out.square().mean()
        loss.backward()
        records.append(asdict(record_step(loss, model)))  # DDP's averaged gradients
        amaxes.append(x.abs().max())
        opt.step()
        opt.zero_grad()
        reductions_per_step.append(len(reductions))
    torch.save({"records": records, "amaxes": amaxes, "reductions": reductions_per_step,
                "scales": scales}, os.path.join(out_dir, f"rank{rank}.pt"))


def _run(tmp_path, mode, explicit_group=False):
    run_ranks(_worker, (str(tmp_path), mode, explicit_group), tmp_path)
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]
    for result in results:
        result["records"] = [StepRecord(**r) for r in result["records"]]
    return results


def single_process_run(mode):
    """The DDP run in one process (integration_compare.data_parallel_in_one_process): one
    record per rank (its own loss, the shared gradients and FP8 state) per step."""
    model = _model()
    return data_parallel_in_one_process(model, _batch, _recipe(mode), WORLD, STEPS, lr=LR)


@pytest.mark.parametrize("explicit_group", [False, True], ids=["world", "fp8_group"])
def test_reduced_amax_gives_identical_state_on_every_rank(tmp_path, explicit_group):
    rank0, rank1 = _run(tmp_path, "delayed", explicit_group)
    # Every rank holds the same state, and its value is the MAX of the ranks' amaxes.
    for step in range(STEPS):
        for key, state in rank0["records"][step].fp8_state.items():
            assert torch.equal(state, rank1["records"][step].fp8_state[key]), \
                f"step {step}: ranks disagree on {key}"
        history = rank0["records"][step].fp8_state["0.fp8_fwd_amax_history"]
        assert history[-1, 0] == max(rank0["amaxes"][step], rank1["amaxes"][step]), \
            f"step {step}: the input amax is not the MAX over the ranks"
    # One collective for the forward amaxes and one for the backward ones, per step; at the
    # first step, one more per role: the ranks agree on the new reduction's layout.
    assert rank0["reductions"] == rank1["reductions"] == [4] + [2] * (STEPS - 1)


@pytest.mark.parametrize("mode", ["delayed", "current"])
def test_ddp_training_matches_one_process(tmp_path, mode):
    """Each rank's loss, DDP's averaged gradients and the FP8 state, step by step, against the
    same steps on the whole batch in one process: equal up to the order of the wgrad sums."""
    ranks = _run(tmp_path, mode)
    reference = single_process_run(mode)
    for rank, result in enumerate(ranks):
        assert_close(result["records"], reference[rank], min_sqnr_db=60.0)


def test_without_reduction_ranks_keep_their_own_amax(tmp_path):
    rank0, rank1 = _run(tmp_path, "no_reduce")
    for step in range(STEPS):
        for rank, result in enumerate((rank0, rank1)):
            history = result["records"][step].fp8_state["0.fp8_fwd_amax_history"]
            assert history[-1, 0] == result["amaxes"][step], f"rank {rank}, step {step}"
    assert rank0["reductions"] == [0] * STEPS


def test_current_scaling_casts_with_each_ranks_own_amax(tmp_path):
    """Float8CurrentScaling, as Transformer Engine's: each rank casts what it holds with its own
    amax, with no collective (a cast's all-reduce paired other layers' casts when ranks ran
    different experts); the weights, the same on every rank, get the same scales."""
    rank0, rank1 = _run(tmp_path, "current_python")
    assert rank0["reductions"] == rank1["reductions"] == [0] * STEPS
    assert len(rank0["scales"]) == STEPS * 2 * 3  # input, weight, grad of two layers
    for step in range(STEPS):
        # The first scale of each step is the first layer's input's, the second its weight's.
        for result in (rank0, rank1):
            torch.testing.assert_close(result["scales"][6 * step],
                                       (448.0 / result["amaxes"][step]).reshape(1),
                                       rtol=1e-6, atol=0)
        assert torch.equal(rank0["scales"][6 * step + 1], rank1["scales"][6 * step + 1])
        assert not torch.equal(rank0["scales"][6 * step], rank1["scales"][6 * step])


def _moe_worker(rank, out_dir):
    """Three expert layers; rank 0 runs experts 0 and 1, rank 1 runs experts 1 and 2."""
    recipe = tfp8.DelayedScaling(amax_history_len=4)
    torch.manual_seed(0)
    experts = torch.nn.ModuleList(tfp8.Linear(32, 32, recipe=recipe) for _ in range(3))
    mine = [0, 1] if rank == 0 else [1, 2]
    data = torch.Generator().manual_seed(2000 + rank)
    states, amaxes = [], []
    for _ in range(STEPS):
        x = torch.randn(16, 32, generator=data) * (rank + 1)
        grad = torch.randn(16, 32, generator=data)
        with tfp8.fp8_autocast(fp8_recipe=recipe):
            outs = [experts[e](x) for e in mine]
        torch.autograd.backward(outs, [grad] * len(outs))
        amaxes.append((x.abs().max(), grad.abs().max()))
        states.append(_fp8_tensors(experts))
    torch.save({"states": states, "amaxes": amaxes,
                "weight_amax": [e.weight.abs().max() for e in experts]},
               os.path.join(out_dir, f"rank{rank}.pt"))


def test_ranks_running_different_experts_share_one_reduction(tmp_path):
    """Mixture-of-experts routing: ranks run different subsets of the FP8 layers. The reduction
    covers every layer on every rank (same layout everywhere), so each expert's history holds
    the amax of the ranks that ran it, identically on both ranks."""
    run_ranks(_moe_worker, (str(tmp_path),), tmp_path)
    rank0, rank1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True)
                    for r in range(WORLD))
    for step in range(STEPS):
        for a, b in zip(rank0["states"][step], rank1["states"][step]):
            assert torch.equal(a, b), f"step {step}: ranks disagree"
    last = rank0["states"][-1]
    fwd_history = [last[6 * e] for e in range(3)]  # per expert: fwd history first
    bwd_history = [last[6 * e + 3] for e in range(3)]
    x0, g0 = rank0["amaxes"][-1]
    x1, g1 = rank1["amaxes"][-1]
    assert fwd_history[0][-1, 0] == x0, "expert 0: rank 0's input only"
    assert fwd_history[2][-1, 0] == x1, "expert 2: rank 1's input only"
    assert fwd_history[1][-1, 0] == max(x0, x1), "expert 1: both ranks"
    assert bwd_history[0][-1, 0] == g0 and bwd_history[2][-1, 0] == g1
    assert bwd_history[1][-1, 0] == max(g0, g1)
    for e in range(3):
        assert fwd_history[e][-1, 1] == rank0["weight_amax"][e]


def _two_steps_worker(rank, out_dir, case):
    """Layer P trains under the world group's step, layer Q under another step of the same
    recipe record: a group of this rank alone, or a recipe that differs in reduce_amax only;
    nested or one after the other."""
    own = [dist.new_group([0]), dist.new_group([1])][rank]
    outer = tfp8.DelayedScaling(amax_history_len=4)
    inner = dict(fp8_recipe=tfp8.DelayedScaling(amax_history_len=4,
                                                reduce_amax=not case.startswith("no_reduce")),
                 fp8_group=own if case.startswith("group") else None)
    torch.manual_seed(0)
    p_layer, q_layer = (tfp8.Linear(32, 32, recipe=outer) for _ in range(2))
    data = torch.Generator().manual_seed(3000 + rank)
    q_amaxes, p_amaxes = [], []
    for _ in range(STEPS):
        x = torch.randn(16, 32, generator=data) * (1 + 9 * rank)
        grad = torch.randn(16, 32, generator=data) * (1 + 9 * rank)
        if case.endswith("nested"):
            with tfp8.fp8_autocast(fp8_recipe=outer):
                h = p_layer(x)
                with tfp8.fp8_autocast(**inner):
                    q_in = h
                    out = q_layer(h)
        else:
            with tfp8.fp8_autocast(**inner):
                q_in = x
                h = q_layer(x)
            with tfp8.fp8_autocast(fp8_recipe=outer):
                out = p_layer(h)
        q_out_grad = []
        (out if case.endswith("nested") else h).register_hook(
            lambda g: q_out_grad.append(g.abs().max()))
        out.backward(grad)
        q_amaxes.append((q_in.abs().max(), q_out_grad[0],
                         q_layer.fp8_fwd_amax_history[-1, 0].clone(),
                         q_layer.fp8_bwd_amax_history[-1, 0].clone()))
        p_amaxes.append(p_layer.fp8_fwd_amax_history[-1, 0].clone())
    torch.save({"q": q_amaxes, "p": p_amaxes}, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.parametrize("case", ["group_nested", "group_sequential", "no_reduce_nested",
                                  "no_reduce_sequential"])
def test_a_layer_of_another_step_keeps_its_own_reduction(tmp_path, case):
    """Layer Q runs under a step of the same recipe record as the world's (a group of its rank
    alone, or reduce_amax=False): its histories hold its own rank's amaxes, never the world's
    MAX (the world step covered every layer of its recipe record, Q included), while layer P's
    hold the world's MAX."""
    run_ranks(_two_steps_worker, (str(tmp_path), case), tmp_path)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]
    for rank in ranks:
        for q_in, q_grad, q_fwd, q_bwd in rank["q"]:
            assert q_fwd == q_in and q_bwd == q_grad
    assert ranks[0]["q"][-1][2] != ranks[1]["q"][-1][2], "the ranks' amaxes differ"
    for a, b in zip(ranks[0]["p"], ranks[1]["p"]):
        assert a == b, "P: the world's MAX on both ranks"


def _current_moe_worker(rank, out_dir, path):
    """Float8CurrentScaling, ranks running different experts (rank 0 experts 0 and 1, rank 1
    expert 1 alone), of very different magnitudes; then the same forwards and backwards under
    a group of this rank alone, as reference. ``path``: "python" turns the C++ step off."""
    if path == "python":
        from transformer_fp8.modules import linear_fused_step
        linear_fused_step.ENABLED = False
    own = [dist.new_group([0]), dist.new_group([1])][rank]
    recipe = tfp8.Float8CurrentScaling()
    torch.manual_seed(0)
    experts = torch.nn.ModuleList(tfp8.Linear(32, 32) for _ in range(2))
    with torch.no_grad():
        experts[1].weight.mul_(1e4)
    mine = [0, 1] if rank == 0 else [1]
    data = torch.Generator().manual_seed(4000 + rank)
    x = torch.randn(16, 32, generator=data) * (1 if rank == 0 else 1e4)
    grad = torch.randn(16, 32, generator=data)
    results = {}
    for name, group in (("world", None), ("own", own)):
        x_run = x.clone().requires_grad_()
        with tfp8.fp8_autocast(fp8_recipe=recipe, fp8_group=group):
            outs = [experts[e](x_run) for e in mine]
        torch.autograd.backward(outs, [grad] * len(outs))
        results[name] = [o.detach() for o in outs] + [x_run.grad] + [
            experts[e].weight.grad.clone() for e in mine]
        experts.zero_grad()
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.parametrize("path", ["cpp", "python"])
def test_current_scaling_with_ranks_running_different_experts(tmp_path, path):
    """Each rank casts with its own amaxes: ranks that run different experts (even different
    numbers of them) compute exactly what they compute alone. (A cast's all-reduce over the
    group paired one rank's expert with another's: 7 dB outputs, or a hang.)"""
    run_ranks(_current_moe_worker, (str(tmp_path), path), tmp_path)
    for rank in range(WORLD):
        result = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        for got, want in zip(result["world"], result["own"], strict=True):
            assert torch.equal(got, want), rank


def _routed_expert_worker(rank, out_dir, variant):
    """Expert E runs under a group of this rank alone, nested in the world's context (dense
    layer D): "first", only rank 0 routes tokens to E at the first step; "later", no rank at
    the first step, only rank 0 at the second. Which step owns E then differs between the
    ranks, and the world step's reduction must still line up."""
    own = [dist.new_group([0]), dist.new_group([1])][rank]
    recipe = tfp8.DelayedScaling(amax_history_len=4)
    torch.manual_seed(0)
    dense, expert = tfp8.Linear(32, 32), tfp8.Linear(32, 32)
    data = torch.Generator().manual_seed(5000 + rank)
    expert_rows, dense_rows = [], []
    for step in range(3):
        if variant == "first":
            runs = rank == 0 or step > 0
        else:
            runs = (rank == 0 and step == 1) or step == 2
        x = torch.randn(16, 32, generator=data) * (1 + 9 * rank)
        with tfp8.fp8_autocast(fp8_recipe=recipe):
            h = dense(x)
            with tfp8.fp8_autocast(fp8_recipe=recipe, fp8_group=own):
                out = expert(h) if runs else h * 1
        out.sum().backward()
        # (the amax this rank saw, the amax its history holds for this step)
        dense_rows.append((x.abs().max(), dense.fp8_fwd_amax_history[-1, 0].clone()))
        if runs:
            expert_rows.append((h.abs().max(), expert.fp8_fwd_amax_history[-1, 0].clone()))
    torch.save({"dense": dense_rows, "expert": expert_rows},
               os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.parametrize("variant", ["first", "later"])
def test_an_expert_of_a_nested_group_routed_on_some_ranks(tmp_path, variant):
    """The ranks disagree on which step owns the expert (one ran it under its own group, the
    other never did): the world step's layout is the same on both (zeros in place of the
    amaxes of a state another step owns), so every step completes; the expert's history holds
    its own rank's amax, the dense layer's the world's MAX."""
    run_ranks(_routed_expert_worker, (str(tmp_path), variant), tmp_path)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]
    for rank in ranks:
        assert rank["expert"], "the expert ran"
        for amax, recorded in rank["expert"]:
            assert recorded == amax
    for (amax0, recorded0), (amax1, recorded1) in zip(ranks[0]["dense"], ranks[1]["dense"]):
        assert recorded0 == recorded1 == max(amax0, amax1)


def _hanging_worker(rank, out_dir):
    if rank == 1:
        time.sleep(3600)  # never reaches the collective
    dist.barrier()


def test_a_hanging_rank_fails_the_test_with_a_message(tmp_path):
    """The runner's time limit: a rank stuck in a collective is killed and the test fails."""
    start = time.monotonic()
    with pytest.raises(pytest.fail.Exception, match=r"ranks \[0, 1\] of 2 had not finished"):
        run_ranks(_hanging_worker, (str(tmp_path),), tmp_path, timeout_s=8)
    assert time.monotonic() - start < 30


def _nan_worker(rank, out_dir):
    from transformer_fp8.quantization.update_plan import all_reduce_max
    recipe = tfp8.DelayedScaling(amax_history_len=4)
    result = {}
    for nan_rank in range(WORLD):
        torch.manual_seed(0)
        layer = tfp8.Linear(32, 16, recipe=recipe)
        for step in range(3):
            x = _batch(rank, step)
            if step == 2 and rank == nan_rank:
                x[0, 0] = float("nan")
            with tfp8.fp8_autocast(fp8_recipe=recipe):
                layer(x)
        amaxes = torch.tensor([1.0, 2.0, 3.0, 4.0])
        amaxes[nan_rank] = float("nan")
        amaxes[2 + rank] = 5.0 + rank  # (finite values reduced as floats are)
        all_reduce_max(amaxes, None)
        result[nan_rank] = (layer.fp8_fwd_amax_history.clone(), layer.fp8_fwd_scale.clone(),
                            amaxes)
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


def test_a_nan_amax_survives_the_reduction_whichever_rank_holds_it(tmp_path):
    """A NaN amax on one rank: every rank's history holds NaN as one process running both
    batches does. gloo's float MAX kept a NaN on rank 0 and dropped one on rank 1 (the other
    rank's finite amax took its place: under 'most_recent' the scale then depended on the rank
    the NaN came from)."""
    run_ranks(_nan_worker, (str(tmp_path),), tmp_path)
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]
    for nan_rank in range(WORLD):
        (h0, s0, a0), (h1, s1, a1) = results[0][nan_rank], results[1][nan_rank]
        assert_bitwise_equal(h0, h1)
        assert_bitwise_equal(s0, s1)
        assert torch.isnan(h0[-1, 0]), (nan_rank, h0[:, 0])  # (the NaN step, rolled last)
        assert torch.isnan(a0[nan_rank]) and torch.isnan(a1[nan_rank])
        expected = torch.tensor([1.0, 2.0, 5.0, 6.0])
        expected[nan_rank] = float("nan")
        assert_bitwise_equal(a0, expected)
        assert_bitwise_equal(a1, expected)
    # the same state whichever rank held the NaN (one process's result)
    assert_bitwise_equal(results[0][0][0], results[0][1][0])
    assert_bitwise_equal(results[0][0][1], results[0][1][1])
