"""What each rank runs for test_te_tensor_parallel.py: Linear layers built with Transformer
Engine's tp_group / parallel_mode / sequence_parallel, each rank holding its shard of the
weights of an unsharded reference layer (the same seed on every rank), and the reference run
on every rank. A case's record per step: the sharded layer's tensors (output, input gradient,
weight and bias gradients, FP8 state) and the reference's tensors cut as this rank holds them.

Layout (Megatron's, [sequence, batch, features]): column-parallel takes the whole input (with
sequence_parallel, its rank's part of the sequence) and gives the rank's output columns;
row-parallel takes the rank's input features and gives the whole output (with
sequence_parallel, its rank's part of the sequence).
"""
from __future__ import annotations

import copy
import itertools
import os
import warnings

import torch
import torch.distributed as dist
from integration_compare import STEP_SCALES

import transformer_fp8 as tfp8

SEQ, BATCH, IN, OUT, HIDDEN = 6, 4, 64, 96, 64  # the local GEMM sizes: multiples of 16
STEPS = 3
WEIGHT_FACTORS = (1.0, 3.0, 0.5)  # the weights scaled at each step: the weight scale changes

RECIPES = {"high": None,
           "delayed": lambda: tfp8.DelayedScaling(amax_history_len=4,
                                                  amax_compute_algo="most_recent"),
           "current": tfp8.Float8CurrentScaling}
CASES = [dict(mode=m, sp=sp, bias=b, return_bias=rb, recipe=r)
         for m, sp, (b, rb), r in itertools.product(
             ("column", "row"), (False, True), ((True, False), (False, False), (True, True),
                                                (False, True)), RECIPES)]


def case_name(case: dict) -> str:
    return (f"{case['mode']}-{'sp' if case['sp'] else 'nosp'}-"
            f"{'bias' if case['bias'] else 'nobias'}"
            f"{'-return_bias' if case['return_bias'] else ''}-{case['recipe']}")


def cut_input(x, mode, sp, rank, ranks):
    """The rank's part of the layer's whole input."""
    if mode == "row":
        x = x.chunk(ranks, -1)[rank]
    return x.chunk(ranks, 0)[rank] if (mode == "column" and sp) else x


def cut_output(y, mode, sp, rank, ranks):
    """The rank's part of the layer's whole output."""
    if mode == "column":
        return y.chunk(ranks, -1)[rank]
    return y.chunk(ranks, 0)[rank] if sp else y


def shard(param, mode, rank, ranks, is_bias=False):
    if param is None:
        return None
    if mode == "column":
        return param.chunk(ranks, 0)[rank]
    return param if is_bias else param.chunk(ranks, 1)[rank]


def _fp8_state(layer) -> dict:
    return {k: v.detach().clone() for k, v in layer.state_dict().items()
            if "fp8_" in k and v.is_floating_point()}


def _run_case(case, rank, ranks, group):
    mode, sp = case["mode"], case["sp"]
    recipe = RECIPES[case["recipe"]] and RECIPES[case["recipe"]]()
    torch.manual_seed(1)
    full = tfp8.Linear(IN, OUT, bias=case["bias"])
    if full.bias is not None:
        with torch.no_grad():
            full.bias.uniform_(-0.5, 0.5)  # large enough that a bias added twice shows
    layer = tfp8.Linear(IN, OUT, bias=case["bias"], tp_group=group, tp_size=ranks,
                        parallel_mode=mode, sequence_parallel=sp,
                        return_bias=case["return_bias"])
    with torch.no_grad():
        layer.weight.copy_(shard(full.weight, mode, rank, ranks))
        if layer.bias is not None:
            layer.bias.copy_(shard(full.bias, mode, rank, ranks, is_bias=True))
    records = []
    for step in range(STEPS):
        with torch.no_grad():
            for lin in (full, layer):
                lin.weight.mul_(WEIGHT_FACTORS[step])
        gen = torch.Generator().manual_seed(10 + step)
        x = torch.randn(SEQ, BATCH, IN, generator=gen) * STEP_SCALES[step]
        upstream = torch.randn(SEQ, BATCH, OUT, generator=gen)
        full_x, x_local = x.clone().requires_grad_(), cut_input(x, mode, sp, rank, ranks)
        x_local = x_local.clone().requires_grad_()
        with tfp8.fp8_autocast(enabled=recipe is not None, fp8_recipe=recipe):
            ref = full(full_x)
            got = layer(x_local)
        if case["return_bias"]:
            got, returned = got
            assert (returned is None) == (layer.bias is None)
            got = got if returned is None else got + returned
        (ref * upstream).sum().backward()
        # The rank's part of the loss (the whole loss where the output is whole on every rank)
        (got * cut_output(upstream, mode, sp, rank, ranks)).sum().backward()
        record = {
            "out": (got.detach(), cut_output(ref, mode, sp, rank, ranks).detach()),
            "x_grad": (x_local.grad, cut_input(full_x.grad, mode, sp, rank, ranks)),
            "weight_grad": (layer.weight.grad, shard(full.weight.grad, mode, rank, ranks))}
        if layer.bias is not None:
            whole = full.bias.grad
            if mode == "row" and sp:  # the rank's part of the sequence only (Megatron sums)
                record["bias_grad_sum"] = (_summed(layer.bias.grad, group), whole)
                whole = cut_output(upstream, mode, sp, rank, ranks).sum((0, 1))
            record["bias_grad"] = (layer.bias.grad, shard(whole, mode, rank, ranks, True))
        if recipe is not None:
            record["fp8_state"] = (_fp8_state(layer), _fp8_state(full))
        records.append(record)
        for p in (*full.parameters(), *layer.parameters()):
            p.grad = None
    return records


def _summed(t, group):
    t = t.clone()
    dist.all_reduce(t, group=group)
    return t


class Mlp(torch.nn.Module):
    """fc1 column-parallel, fc2 row-parallel (or both unsharded)."""

    def __init__(self, group=None, ranks=1, sp=False):
        super().__init__()
        tp = {} if group is None else dict(tp_group=group, tp_size=ranks, sequence_parallel=sp)
        self.fc1 = tfp8.Linear(IN, HIDDEN, parallel_mode="column" if tp else None, **tp)
        self.fc2 = tfp8.Linear(HIDDEN, OUT, parallel_mode="row" if tp else None, **tp)

    def forward(self, x):
        return self.fc2(torch.nn.functional.gelu(self.fc1(x)))


def _run_mlp(rank, ranks, group, sp, recipe_name):
    recipe = RECIPES[recipe_name]()
    torch.manual_seed(2)
    full = Mlp()
    model = Mlp(group, ranks, sp)
    with torch.no_grad():
        for name in ("fc1", "fc2"):
            mode = "column" if name == "fc1" else "row"
            src, dst = getattr(full, name), getattr(model, name)
            dst.weight.copy_(shard(src.weight, mode, rank, ranks))
            dst.bias.copy_(shard(src.bias, mode, rank, ranks, is_bias=True))
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (full, model)]
    records = []
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(20 + step)
        x = torch.randn(SEQ, BATCH, IN, generator=gen) * STEP_SCALES[step]
        with tfp8.fp8_autocast(fp8_recipe=recipe):
            ref = full(x)
            got = model(x.chunk(ranks, 0)[rank] if sp else x)
        loss_ref = ref.square().mean()
        # (sequence parallel: each rank's mean over its part; their mean is the whole's)
        loss = _summed(got.square().mean().detach(), group) / ranks if sp else \
            got.square().mean().detach()
        (ref.square().mean()).backward()
        (got.square().mean() / (ranks if sp else 1)).backward()
        if sp:  # Megatron's reduction of the sequence-parallel (row) bias gradient
            dist.all_reduce(model.fc2.bias.grad, group=group)
        records.append({
            "loss": (loss, loss_ref.detach()),
            "out": (got.detach(), cut_output(ref, "row", sp, rank, ranks).detach()),
            **{f"{name}.{p}": (getattr(model, name)._parameters[p].grad,
                               shard(getattr(full, name)._parameters[p].grad,
                                     "column" if name == "fc1" else "row", rank, ranks,
                                     p == "bias"))
               for name in ("fc1", "fc2") for p in ("weight", "bias")},
            "fp8_state": ({f"{n}.{k}": v for n in ("fc1", "fc2")
                           for k, v in _fp8_state(getattr(model, n)).items()},
                          {f"{n}.{k}": v for n in ("fc1", "fc2")
                           for k, v in _fp8_state(getattr(full, n)).items()})})
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
    return records


def _refusals(rank, ranks, group) -> dict:
    """What the distributed refusals and the scale warning say (their messages)."""
    said = {}
    try:
        tfp8.Linear(IN, OUT, tp_group=group, tp_size=ranks * 2, parallel_mode="column")
    except ValueError as e:
        said["tp_size"] = str(e)
    layer = tfp8.Linear(IN, OUT, tp_size=ranks * 2, parallel_mode="column")
    try:
        layer.set_tensor_parallel_group(group)
    except ValueError as e:
        said["set_group"] = str(e)
    row = tfp8.Linear(IN, OUT, tp_group=group, parallel_mode="row", sequence_parallel=True)
    said["tp_size_from_group"] = str(row.tp_size)
    try:
        row(torch.randn(ranks + 1, 2, IN // ranks))
    except ValueError as e:
        said["sequence"] = str(e)
    # fp8_group of this rank only: the scales cannot agree, a warning (once)
    own = [dist.new_group([r]) for r in range(ranks)][rank]
    col = tfp8.Linear(IN, OUT, tp_group=group, parallel_mode="column")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            with tfp8.fp8_autocast(fp8_recipe=tfp8.DelayedScaling(), fp8_group=own):
                col(torch.randn(8, IN)).sum().backward()
    said["warnings"] = [str(w.message) for w in caught if "tensor parallelism" in
                        str(w.message)]
    late = tfp8.Linear(IN, OUT, tp_size=ranks, parallel_mode="column")
    late.set_tensor_parallel_group(group)
    said["late_group_runs"] = str(tuple(late(torch.randn(8, IN)).shape))
    return said


def _with_options(rank, ranks, group) -> dict:
    """fuse_wgrad_accumulation, is_first_microbatch and activation checkpointing on sharded
    layers under DelayedScaling, against the unsharded layer (the same options) and, for the
    checkpoint, the same sharded MLP without it: {what: [{key: (got, expected)}]}."""
    recipe = RECIPES["delayed"]()
    out = {}
    # fuse_wgrad_accumulation: the weight gradient accumulated into main_grad (two backwards)
    torch.manual_seed(3)
    full = tfp8.Linear(IN, OUT)
    layer = tfp8.Linear(IN, OUT, tp_group=group, parallel_mode="column", sequence_parallel=True,
                        fuse_wgrad_accumulation=True)
    with torch.no_grad():
        layer.weight.copy_(shard(full.weight, "column", rank, ranks))
        layer.bias.copy_(shard(full.bias, "column", rank, ranks, True))
    layer.weight.main_grad = torch.zeros_like(layer.weight)
    for step in range(2):
        x = torch.randn(SEQ, BATCH, IN, generator=torch.Generator().manual_seed(30 + step))
        with tfp8.fp8_autocast(fp8_recipe=recipe):
            ref, got = full(x), layer(x.chunk(ranks, 0)[rank])
        ref.square().sum().backward()
        got.square().sum().backward()
    out["fuse_wgrad_accumulation"] = [{"main_grad": (layer.weight.main_grad.clone(),
                                                     shard(full.weight.grad, "column", rank,
                                                           ranks))}]
    # is_first_microbatch: the cast weight kept (True) and reused (False)
    torch.manual_seed(4)
    full = tfp8.Linear(IN, OUT)
    layer = tfp8.Linear(IN, OUT, tp_group=group, parallel_mode="row")
    with torch.no_grad():
        layer.weight.copy_(shard(full.weight, "row", rank, ranks))
        layer.bias.copy_(full.bias)
    records = []
    for step, first in enumerate((True, False, False)):
        x = torch.randn(SEQ, BATCH, IN, generator=torch.Generator().manual_seed(40 + step))
        with tfp8.fp8_autocast(fp8_recipe=recipe):
            ref = full(x, is_first_microbatch=first)
            got = layer(x.chunk(ranks, -1)[rank], is_first_microbatch=first)
        records.append({"out": (got.detach(), ref.detach())})
    out["is_first_microbatch"] = records
    # non-reentrant activation checkpointing of a column -> row MLP (sequence parallel)
    torch.manual_seed(5)
    x = torch.randn(SEQ // ranks, BATCH, IN, generator=torch.Generator().manual_seed(50))
    out["checkpoint"] = checkpointed_and_plain(Mlp(group, ranks, sp=True), x, recipe)
    return out


def checkpointed_and_plain(model, x, recipe) -> list:
    """One FP8 step of ``model`` under a non-reentrant activation checkpoint and one of its
    copy without: [{"tensor i": (checkpointed, plain)}] over the output, the input gradient
    and every parameter's gradient (the test asks them bit for bit)."""
    models = [model, copy.deepcopy(model)]  # (the same FP8 state for both runs)
    results = []
    for run, checkpointed in zip(models, (True, False)):
        xc = x.clone().requires_grad_()
        with tfp8.fp8_autocast(fp8_recipe=recipe):
            y = (torch.utils.checkpoint.checkpoint(run, xc, use_reentrant=False)
                 if checkpointed else run(xc))
        y.square().sum().backward()
        results.append([y.detach(), xc.grad] + [p.grad for p in run.parameters()])
    return [{f"tensor {i}": (a, b) for i, (a, b) in enumerate(zip(*results))}]


def worker(rank, out_dir):
    ranks = dist.get_world_size()
    group = dist.new_group(list(range(ranks)))
    results = {"cases": {case_name(c): _run_case(c, rank, ranks, group) for c in CASES},
               "mlp": {f"{r}-{'sp' if sp else 'nosp'}": _run_mlp(rank, ranks, group, sp, r)
                       for r in ("delayed", "current") for sp in (False, True)},
               "options": _with_options(rank, ranks, group),
               "refusals": _refusals(rank, ranks, group)}
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
