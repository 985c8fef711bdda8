"""What each rank runs for test_te_tensor_parallel_norm.py: LayerNormLinear (parallel_mode=
"column") and LayerNormMLP (set_parallel_mode=True) built with Transformer Engine's tp_group /
sequence_parallel, each rank holding its shards of an unsharded reference module's weights
(the same seed on every rank), and the reference run on every rank. A case's record per step:
{key: (the sharded module's tensor, the reference's cut as this rank holds it)}.

Layout (Megatron's, [sequence, batch, features]): the input is whole on every rank, or with
sequence_parallel the rank's part of dim 0. LayerNormLinear's output is the rank's columns (of
the whole sequence); LayerNormMLP's is whole, or with sequence_parallel the rank's part of dim 0.
Each rank backpropagates the loss of what it holds (Megatron's convention: a tensor whole on
every rank carries the whole loss on each).
"""
from __future__ import annotations

import itertools
import os

import torch
import torch.distributed as dist
from integration_compare import STEP_SCALES
from te_tensor_parallel_cases import checkpointed_and_plain

import transformer_fp8 as tfp8

SEQ, BATCH, HIDDEN, OUT, FFN = 6, 4, 64, 96, 64  # the local GEMM sizes: multiples of 16
STEPS = 3
WEIGHT_FACTORS = (1.0, 3.0, 0.5)  # weights and norm weights scaled at each step: scales change
RECIPES = {"high": None,
           "delayed": lambda: tfp8.DelayedScaling(amax_history_len=4,
                                                  amax_compute_algo="most_recent"),
           "current": tfp8.Float8CurrentScaling}

_BASE = [dict(sp=sp, bias=b, return_bias=rb, recipe=r)
         for sp, (b, rb), r in itertools.product(
             (False, True), ((True, False), (False, False), (True, True)), RECIPES)]
# Norm options, the returned norm output (its gradient path), gated activations.
_EXTRA = [dict(sp=True, bias=True, return_bias=False, recipe="delayed", norm="RMSNorm",
               ln_out=True),
          dict(sp=False, bias=True, return_bias=False, recipe="current", ln_out=True),
          dict(sp=True, bias=True, return_bias=True, recipe="current", ln_out=True,
               gathered=True),
          dict(sp=True, bias=True, return_bias=False, recipe="high", ln_out=True,
               gathered=True),
          # (without sequence_parallel nothing is gathered: the rank's norm output)
          dict(sp=False, bias=True, return_bias=False, recipe="delayed", ln_out=True,
               gathered=True)]
_GATED = [dict(sp=True, bias=True, return_bias=False, recipe="delayed", act="swiglu"),
          dict(sp=False, bias=False, return_bias=False, recipe="current", act="geglu",
               norm="RMSNorm"),
          dict(sp=True, bias=True, return_bias=False, recipe="delayed", act="clamped_swiglu")]
CASES = ([dict(module="LayerNormLinear", **c) for c in _BASE + _EXTRA]
         + [dict(module="LayerNormMLP", **c) for c in _BASE + _EXTRA + _GATED])


def case_name(case: dict) -> str:
    parts = [case["module"], "sp" if case["sp"] else "nosp",
             "bias" if case["bias"] else "nobias"]
    parts += [k for k in ("return_bias",) if case[k]]
    parts += [case[k] for k in ("norm", "act") if k in case]
    parts += ["ln_out"] * bool(case.get("ln_out")) + ["gathered"] * bool(case.get("gathered"))
    return "-".join(parts + [case["recipe"]])


def _rows(t, rank, ranks, gated=False):
    """The rank's rows of a column-parallel weight or bias (of each half, where gated)."""
    if gated:
        return torch.cat([half.chunk(ranks, 0)[rank] for half in t.chunk(2, 0)])
    return t.chunk(ranks, 0)[rank]


def _shards(case, rank, ranks) -> dict:
    """Parameter name -> how the rank's shard is cut from the whole tensor."""
    gated = case.get("act") in ("swiglu", "geglu", "clamped_swiglu")
    whole = lambda t: t  # noqa: E731
    norm = {"layer_norm_weight": whole, "layer_norm_bias": whole}
    if case["module"] == "LayerNormLinear":
        return {**norm, "weight": lambda t: _rows(t, rank, ranks),
                "bias": lambda t: _rows(t, rank, ranks)}
    return {**norm, "fc1_weight": lambda t: _rows(t, rank, ranks, gated),
            "fc1_bias": lambda t: _rows(t, rank, ranks, gated),
            "fc2_weight": lambda t: t.chunk(ranks, 1)[rank], "fc2_bias": whole}


def _build(case, group=None, ranks=1, **options):
    kw = dict(bias=case["bias"], return_bias=case["return_bias"],
              normalization=case.get("norm", "LayerNorm"),
              return_layernorm_output=case.get("ln_out", False), **options)
    if group is not None:
        kw.update(tp_group=group, tp_size=ranks, sequence_parallel=case["sp"],
                  return_layernorm_output_gathered=case.get("gathered", False))
    if case["module"] == "LayerNormLinear":
        if group is not None:
            kw["parallel_mode"] = "column"
        return tfp8.LayerNormLinear(HIDDEN, OUT, **kw)
    if group is not None:
        kw["set_parallel_mode"] = True
    if case.get("act") == "clamped_swiglu":  # (a limit that clamps some of both halves)
        kw["activation_params"] = {"limit": 0.5, "alpha": 1.5}
    return tfp8.LayerNormMLP(HIDDEN, FFN, activation=case.get("act", "gelu"), **kw)


def _fp8_state(module) -> dict:
    return {k: v.detach().clone() for k, v in module.state_dict().items()
            if "fp8_" in k and v.is_floating_point()}


def _summed(t, group):
    t = t.clone()
    dist.all_reduce(t, group=group)
    return t


def _outputs(module, result, case):
    """(out, returned bias or None, ln_out or None) of a forward's result."""
    result = result if isinstance(result, tuple) else (result,)
    out, rest = result[0], list(result[1:])
    bias = rest.pop(0) if case["return_bias"] else None
    ln_out = rest.pop(0) if case.get("ln_out") else None
    return out, bias, ln_out


def _run_case(case, rank, ranks, group):
    sp, mlp = case["sp"], case["module"] == "LayerNormMLP"
    gathered = case.get("gathered", False)
    recipe = RECIPES[case["recipe"]] and RECIPES[case["recipe"]]()
    torch.manual_seed(1)
    full = _build(case)
    with torch.no_grad():  # not the initial ones, which hide a wrong gradient
        for name, p in full.named_parameters():
            if "layer_norm_weight" in name:
                p.uniform_(0.5, 1.5)
            elif "bias" in name:
                p.uniform_(-0.5, 0.5)
    module = _build(case, group, ranks)
    shards = _shards(case, rank, ranks)
    _copy_shards(full, module, shards)
    seq_part = lambda t: t.chunk(ranks, 0)[rank] if sp else t  # noqa: E731
    # the module's output as the rank holds it
    cut_out = seq_part if mlp else (lambda t: t.chunk(ranks, -1)[rank])
    records = []
    for step in range(STEPS):
        with torch.no_grad():
            for m in (full, module):
                for name, p in m.named_parameters():
                    if "weight" in name:
                        p.mul_(WEIGHT_FACTORS[step])
        gen = torch.Generator().manual_seed(10 + step)
        x = torch.randn(SEQ, BATCH, HIDDEN, generator=gen) * STEP_SCALES[step]
        upstream = torch.randn(SEQ, BATCH, HIDDEN if mlp else OUT, generator=gen)
        upstream_ln = torch.randn(SEQ, BATCH, HIDDEN, generator=gen)
        full_x = x.clone().requires_grad_()
        x_local = seq_part(x).clone().requires_grad_()
        with tfp8.fp8_autocast(enabled=recipe is not None, fp8_recipe=recipe):
            ref, ref_bias, ref_ln = _outputs(full, full(full_x), case)
            got, got_bias, got_ln = _outputs(module, module(x_local), case)
        if case["return_bias"] and case["bias"]:
            ref, got = ref + ref_bias, got + got_bias
        loss_ref = (ref * upstream).sum()
        loss = (got * cut_out(upstream)).sum()
        if ref_ln is not None:
            loss_ref = loss_ref + (ref_ln * upstream_ln).sum()
            if gathered and sp:  # whole on every rank, each using its features (a column
                cols = lambda t: t.chunk(ranks, -1)[rank]  # noqa: E731  consumer)
                loss = loss + (cols(got_ln) * cols(upstream_ln)).sum()
            else:
                loss = loss + (got_ln * seq_part(upstream_ln)).sum()
        loss_ref.backward()
        loss.backward()
        record = {"out": (got.detach(), cut_out(ref).detach()),
                  "x_grad": (x_local.grad, seq_part(full_x.grad))}
        if ref_ln is not None:
            record["ln_out"] = (got_ln.detach(),
                                ref_ln.detach() if gathered and sp else seq_part(ref_ln).detach())
        for name, p in module.named_parameters():
            expected = shards[name](full.get_parameter(name).grad)
            if sp and (name.startswith("layer_norm") or name == "fc2_bias"):
                # The rank's part of the sequence only: Megatron-LM sums these (marked
                # sequence_parallel) over the tensor-parallel group.
                record[f"{name}.grad_summed"] = (_summed(p.grad, group), expected)
                if name == "fc2_bias":  # (added after the reduction: the rank's upstream)
                    record[f"{name}.grad"] = (p.grad, seq_part(upstream).sum((0, 1)))
            else:
                record[f"{name}.grad"] = (p.grad, expected)
        if recipe is not None:
            record["fp8_state"] = (_fp8_state(module), _fp8_state(full))
        records.append(record)
        for p in (*full.parameters(), *module.parameters()):
            p.grad = None
    return records


def _with_options(rank, ranks, group) -> dict:
    """fuse_wgrad_accumulation, is_first_microbatch and non-reentrant activation checkpointing
    on the sharded modules (sequence_parallel, DelayedScaling), against the unsharded module
    (the same options) and, for the checkpoint, the same sharded module without it:
    {what: [{key: (got, expected)}]}."""
    recipe = RECIPES["delayed"]()
    out = {}
    for module_name in ("LayerNormLinear", "LayerNormMLP"):
        case = dict(module=module_name, sp=True, bias=True, return_bias=False)
        shards = _shards(case, rank, ranks)
        x_all = [torch.randn(SEQ, BATCH, HIDDEN, generator=torch.Generator().manual_seed(s))
                 for s in (30, 31, 32)]
        # fuse_wgrad_accumulation: the weight gradients accumulated into main_grad
        torch.manual_seed(3)
        full = _build(case)
        module = _build(case, group, ranks, fuse_wgrad_accumulation=True)
        _copy_shards(full, module, shards)
        weights = [(n, p) for n, p in module.named_parameters()
                   if n in ("weight", "fc1_weight", "fc2_weight")]
        for _, p in weights:
            p.main_grad = torch.zeros_like(p)
        for x in x_all[:2]:
            with tfp8.fp8_autocast(fp8_recipe=recipe):
                ref, got = full(x), module(x.chunk(ranks, 0)[rank])
            ref.square().sum().backward()
            got.square().sum().backward()
        out[f"{module_name}-fuse_wgrad_accumulation"] = [
            {n: (p.main_grad.clone(), shards[n](full.get_parameter(n).grad))
             for n, p in weights}]
        # is_first_microbatch: the cast weights kept (True) and reused (False)
        torch.manual_seed(4)
        full, module = _build(case), _build(case, group, ranks)
        _copy_shards(full, module, shards)
        records = []
        for x, first in zip(x_all, (True, False, False)):
            with tfp8.fp8_autocast(fp8_recipe=recipe):
                ref = full(x, is_first_microbatch=first)
                got = module(x.chunk(ranks, 0)[rank], is_first_microbatch=first)
            cut = (lambda t: t.chunk(ranks, 0)[rank]) if module_name == "LayerNormMLP" else \
                (lambda t: t.chunk(ranks, -1)[rank])
            records.append({"out": (got.detach(), cut(ref).detach())})
        out[f"{module_name}-is_first_microbatch"] = records
        # non-reentrant activation checkpointing: bit for bit the run without it
        torch.manual_seed(5)
        out[f"{module_name}-checkpoint"] = checkpointed_and_plain(
            _build(case, group, ranks), x_all[0].chunk(ranks, 0)[rank], recipe)
    return out


def _copy_shards(full, module, shards) -> None:
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(shards[name](full.get_parameter(name)))

def _refusals(rank, ranks, group) -> dict:
    """What the distributed refusals say."""
    said = {}
    for name, build in (
            ("norm_linear_tp_size", lambda: tfp8.LayerNormLinear(
                HIDDEN, OUT, tp_group=group, tp_size=ranks * 2, parallel_mode="column")),
            ("mlp_tp_size", lambda: tfp8.LayerNormMLP(
                HIDDEN, FFN, tp_group=group, tp_size=ranks * 2, set_parallel_mode=True)),
            ("mlp_group_without_mode", lambda: tfp8.LayerNormMLP(HIDDEN, FFN,
                                                                  tp_group=group))):
        try:
            build()
        except ValueError as e:
            said[name] = str(e)
    late = tfp8.LayerNormMLP(HIDDEN, FFN, tp_size=ranks * 2, set_parallel_mode=True)
    try:
        late.set_tensor_parallel_group(group)
    except ValueError as e:
        said["set_group"] = str(e)
    mlp = tfp8.LayerNormMLP(HIDDEN, FFN, tp_group=group, set_parallel_mode=True,
                            sequence_parallel=True)
    said["mlp_tp_size_from_group"] = str(mlp.tp_size)
    try:
        mlp(torch.randn(HIDDEN))
    except ValueError as e:
        said["sequence"] = str(e)
    late = tfp8.LayerNormLinear(HIDDEN, OUT, tp_size=ranks, parallel_mode="column",
                                sequence_parallel=True)
    late.set_tensor_parallel_group(group)
    said["late_group_runs"] = str(tuple(late(torch.randn(3, 2, HIDDEN)).shape))
    return said


def worker(rank, out_dir):
    ranks = dist.get_world_size()
    group = dist.new_group(list(range(ranks)))
    results = {"cases": {case_name(c): _run_case(c, rank, ranks, group) for c in CASES},
               "options": _with_options(rank, ranks, group),
               "refusals": _refusals(rank, ranks, group)}
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
