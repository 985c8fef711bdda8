"""What each rank runs for test_te_tensor_parallel_attention.py: MultiheadAttention and
TransformerLayer built with Transformer Engine's tp_group / set_parallel_mode /
sequence_parallel, each rank holding its shards of an unsharded reference module's weights (the
same seed on every rank), and the reference run on every rank. A case's record per step:
{key: (the sharded module's tensor, the reference's cut as this rank holds it)}.

Layout (Megatron's, [sequence, batch, hidden] for "sbhd"): the input and the output are whole
on every rank, or with sequence_parallel the rank's part of dim 0. Each rank backpropagates the
loss of what it holds (a tensor whole on every rank carries the whole loss on each).

How the rank's shards are cut (Transformer Engine's layout): the query, key and value weights
(and biases) by rows, the rank's heads; a fused QKV weight by rows in the interleaved layout
(whole groups), or [the rank's queries | its keys | its values] in the plain one; proj's
weight by columns; fc1 by rows (of each half where gated), fc2 by columns; a learnable sink's
offsets by head; everything else whole.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
from integration_compare import STEP_SCALES
from te_tensor_parallel_norm_cases import _fp8_state, _summed

import transformer_fp8 as tfp8

SEQ, BATCH, HIDDEN, HEADS, GROUPS, FFN = 8, 2, 64, 4, 2, 64  # local GEMMs: multiples of 16
SEQ_ENC = 6  # (the encoder output's sequence, for the decoder layers)
HEAD = HIDDEN // HEADS
STEPS = 3
WEIGHT_FACTORS = (1.0, 3.0, 0.5)  # weights and norm weights scaled at each step: scales change
RECIPES = {"high": None,
           "delayed": lambda: tfp8.DelayedScaling(amax_history_len=4,
                                                  amax_compute_algo="most_recent"),
           "current": tfp8.Float8CurrentScaling}

_MHA = [
    # input_layernorm (LayerNormLinear QKV, its parameters split into query/key/value)
    *[dict(module="mha", sp=sp, recipe=r, ln=True, rotary=True)
      for sp in (False, True) for r in RECIPES],
    # one fused QKV Linear, interleaved layout (whole groups per rank)
    *[dict(module="mha", sp=sp, recipe=r, fuse=True) for sp in (False, True) for r in RECIPES],
    # the fused weight in the plain [queries | keys | values] layout, query/key norms
    dict(module="mha", sp=True, recipe="current", fuse=True, interleaved=False,
         qk_norm="RMSNorm", rotary=True),
    dict(module="mha", sp=False, recipe="high", ln=True, qk_norm="LayerNorm", bias=False,
         softmax="learnable"),
    dict(module="mha", sp=True, recipe="delayed", ln=True, return_bias=True, ln_out=True),
    dict(module="mha", sp=False, recipe="delayed", fmt="bshd", rotary=True),
]
_LAYER = [
    *[dict(module="layer", sp=sp, recipe=r, rotary=True) for sp in (False, True)
      for r in RECIPES],
    dict(module="layer", sp=True, recipe="current", norm="RMSNorm", act="swiglu",
         qk_norm="RMSNorm", rotary=True),
    dict(module="layer", sp=True, recipe="delayed", post_ln=True, fuse=True),
    dict(module="layer", sp=False, recipe="high", fmt="bshd", act="geglu"),
    # Transformer Engine's variants: parallel branches, an output norm (sequence-parallel: its
    # weights marked, their gradients the rank's part of the sequence)
    dict(module="layer", sp=True, recipe="current", parallel=True),
    dict(module="layer", sp=True, recipe="delayed", output_ln=True),
    dict(module="layer", sp=False, recipe="delayed", output_ln=True, norm="RMSNorm"),
    # decoder layers: the cross-attention's query and key/value projections (split, and fused
    # in the plain layout) column-parallel, the encoder output the rank's part of dim 0 too
    dict(module="layer", sp=True, recipe="delayed", decoder=True, rotary=True),
    dict(module="layer", sp=False, recipe="high", decoder=True, fuse=True, interleaved=False),
    dict(module="layer", sp=True, recipe="current", decoder=True, fuse=True),
]
CASES = _MHA + _LAYER


def case_name(case: dict) -> str:
    parts = [case["module"], "sp" if case["sp"] else "nosp"]
    parts += [k for k in ("ln", "fuse", "rotary", "return_bias", "ln_out", "post_ln",
                          "output_ln", "parallel", "decoder") if case.get(k)]
    parts += ["plain_qkv"] * (case.get("interleaved") is False)
    parts += ["nobias"] * (case.get("bias") is False)
    parts += [str(case[k]) for k in ("qk_norm", "softmax", "fmt", "norm", "act") if k in case]
    return "-".join(parts + [case["recipe"]])


def dtype_of(case) -> torch.dtype:
    """float64 for the high-precision cases: attention at these weights amplifies float32's
    rounding to ~70 dB (the unsharded layer in float32 against float64), too close to what a
    wrong shard gives; in float64 a wrong shard is all that can show."""
    return torch.float64 if case["recipe"] == "high" else torch.float32


def build(case, group=None, ranks=1):
    kw = dict(num_gqa_groups=GROUPS, attention_dropout=0.0, bias=case.get("bias", True),
              params_dtype=dtype_of(case),
              fuse_qkv_params=case.get("fuse", False),
              qkv_weight_interleaved=case.get("interleaved", True),
              qk_norm_type=case.get("qk_norm"), softmax_type=case.get("softmax", "vanilla"),
              normalization=case.get("norm", "LayerNorm"))
    if group is not None:
        kw.update(tp_group=group, tp_size=ranks, set_parallel_mode=True,
                  sequence_parallel=case["sp"])
    fmt = case.get("fmt", "sbhd")
    if case["module"] == "mha":
        return tfp8.MultiheadAttention(HIDDEN, HEADS, input_layernorm=case.get("ln", False),
                                       return_bias=case.get("return_bias", False),
                                       return_layernorm_output=case.get("ln_out", False),
                                       qkv_format=fmt, **kw)
    return tfp8.TransformerLayer(
        HIDDEN, FFN, HEADS, hidden_dropout=0.0, attn_input_format=fmt,
        activation=case.get("act", "gelu"),
        apply_residual_connection_post_layernorm=case.get("post_ln", False),
        output_layernorm=case.get("output_ln", False),
        parallel_attention_mlp=case.get("parallel", False),
        layer_type="decoder" if case.get("decoder") else "encoder", **kw)


def _rows(t, rank, ranks):
    return t.chunk(ranks, 0)[rank]


def _fused_plain_rows(t, rank, ranks, sizes=(HEADS * HEAD, GROUPS * HEAD, GROUPS * HEAD)):
    """The rank's rows of a fused weight in the [queries | keys | values] layout (a fused
    key/value weight: [keys | values])."""
    parts = t.split(list(sizes))
    return torch.cat([_rows(p, rank, ranks) for p in parts])


def shard_of(case, name: str, rank: int, ranks: int):
    """How the rank's shard of Parameter ``name`` is cut from the whole tensor."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf.startswith(("query_", "key_", "value_")) or leaf == "softmax_offset":
        return lambda t: _rows(t, rank, ranks)
    if name.endswith(("qkv.weight", "qkv.bias")):  # (qkv or layernorm_qkv, fused)
        if case.get("interleaved", True):
            return lambda t: _rows(t, rank, ranks)
        return lambda t: _fused_plain_rows(t, rank, ranks)
    if name.endswith(("key_value.weight", "key_value.bias")):  # (cross-attention, fused)
        if case.get("interleaved", True):  # (per group: its key, its value)
            return lambda t: _rows(t, rank, ranks)
        return lambda t: _fused_plain_rows(t, rank, ranks, (GROUPS * HEAD, GROUPS * HEAD))
    if name.endswith(("query_layer.weight", "query_layer.bias", "layernorm_query.weight",
                      "layernorm_query.bias")):
        return lambda t: _rows(t, rank, ranks)
    if name.endswith("proj.weight") or name.endswith("fc2_weight"):
        return lambda t: t.chunk(ranks, 1)[rank]
    if leaf in ("fc1_weight", "fc1_bias"):
        if case.get("act") in ("swiglu", "geglu"):  # the rank's rows of each half
            return lambda t: torch.cat([_rows(h, rank, ranks) for h in t.chunk(2, 0)])
        return lambda t: _rows(t, rank, ranks)
    return lambda t: t  # norms, proj's and fc2's biases: whole on every rank


def _outputs(case, result):
    """(out, returned bias or None, ln_out or None)."""
    result = result if isinstance(result, tuple) else (result,)
    out, rest = result[0], list(result[1:])
    bias = rest.pop(0) if case.get("return_bias") else None
    ln_out = rest.pop(0) if case.get("ln_out") else None
    return out, bias, ln_out


def _run_case(case, rank, ranks, group):
    sp = case["sp"]
    recipe = RECIPES[case["recipe"]] and RECIPES[case["recipe"]]()
    torch.manual_seed(1)
    full = build(case)
    with torch.no_grad():  # not the initial values, which hide a wrong gradient
        for name, p in full.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.uniform_(0.5, 1.5)
            elif "bias" in name or "softmax_offset" in name:
                p.uniform_(-0.5, 0.5)
    module = build(case, group, ranks)
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(shard_of(case, name, rank, ranks)(full.get_parameter(name)))
    seq_part = lambda t: t.chunk(ranks, 0)[rank] if sp else t  # noqa: E731  (dim 0)
    bshd = case.get("fmt") == "bshd"
    rotary = tfp8.RotaryPositionEmbedding(HEAD)(SEQ) if case.get("rotary") else None
    records = []
    for step in range(STEPS):
        with torch.no_grad():
            for m in (full, module):
                for name, p in m.named_parameters():
                    if "weight" in name:
                        p.mul_(WEIGHT_FACTORS[step])
        gen = torch.Generator().manual_seed(10 + step)
        shape = (BATCH, SEQ, HIDDEN) if bshd else (SEQ, BATCH, HIDDEN)
        dtype = dtype_of(case)
        x = (torch.randn(*shape, generator=gen) * STEP_SCALES[step]).to(dtype)
        upstream = torch.randn(*shape, generator=gen).to(dtype)
        upstream_ln = torch.randn(*shape, generator=gen).to(dtype)
        enc = (torch.randn(SEQ_ENC, BATCH, HIDDEN, generator=gen).to(dtype)
               if case.get("decoder") else None)
        cross = {} if enc is None else {"encoder_output": enc}
        cross_local = {} if enc is None else {"encoder_output": seq_part(enc)}
        full_x = x.clone().requires_grad_()
        x_local = seq_part(x).clone().requires_grad_()
        with tfp8.fp8_autocast(enabled=recipe is not None, fp8_recipe=recipe):
            ref, ref_bias, ref_ln = _outputs(case, full(full_x, rotary_pos_emb=rotary, **cross))
            got, got_bias, got_ln = _outputs(case, module(x_local, rotary_pos_emb=rotary,
                                                          **cross_local))
        if ref_bias is not None:
            ref, got = ref + ref_bias, got + got_bias
        loss_ref = (ref * upstream).sum()
        loss = (got * seq_part(upstream)).sum()
        if ref_ln is not None:
            loss_ref = loss_ref + (ref_ln * upstream_ln).sum()
            loss = loss + (got_ln * seq_part(upstream_ln)).sum()
        loss_ref.backward()
        loss.backward()
        record = {"out": (got.detach(), seq_part(ref).detach()),
                  "x_grad": (x_local.grad, seq_part(full_x.grad))}
        if ref_ln is not None:
            record["ln_out"] = (got_ln.detach(), seq_part(ref_ln).detach())
        for name, p in module.named_parameters():
            expected = shard_of(case, name, rank, ranks)(full.get_parameter(name).grad)
            if getattr(p, "sequence_parallel", False):
                # The rank's part of the sequence only: Megatron-LM sums these (marked
                # sequence_parallel) over the tensor-parallel group.
                record[f"{name}.grad_summed"] = (_summed(p.grad, group), expected)
            else:
                record[f"{name}.grad"] = (p.grad, expected)
        if recipe is not None:
            record["fp8_state"] = (_fp8_state(module), _fp8_state(full))
        records.append(record)
        for p in (*full.parameters(), *module.parameters()):
            p.grad = None
    return records


def _late_group(rank, ranks, group) -> dict:
    """A TransformerLayer built with tp_size alone, its group given afterwards (Transformer
    Engine's set_tensor_parallel_group), and the refusals that need a group."""
    said = {}
    layer = tfp8.TransformerLayer(HIDDEN, FFN, HEADS, num_gqa_groups=GROUPS, tp_size=ranks,
                                  set_parallel_mode=True, sequence_parallel=True,
                                  hidden_dropout=0.0, attention_dropout=0.0,
                                  qk_norm_type="RMSNorm")
    try:
        layer(torch.randn(SEQ // ranks, BATCH, HIDDEN))
    except RuntimeError as e:
        said["no_group"] = str(e)
    layer.set_tensor_parallel_group(group)
    said["tp_group_is_set"] = layer.tp_group is group and all(
        m.tp_group is group for m in layer.modules()
        if hasattr(m, "tp_group") and m is not layer)
    out = layer(torch.randn(SEQ // ranks, BATCH, HIDDEN))
    out.sum().backward()
    said["late_group_runs"] = str(tuple(out.shape))
    said["q_norm_grads_summed"] = bool(
        torch.equal(_summed(layer.self_attention.q_norm.weight.grad, group),
                    ranks * layer.self_attention.q_norm.weight.grad))
    for name, build_it in (
            ("tp_size_mismatch", lambda: tfp8.MultiheadAttention(
                HIDDEN, HEADS, tp_group=group, tp_size=ranks * 2, set_parallel_mode=True)),
            ("group_without_mode", lambda: tfp8.TransformerLayer(HIDDEN, FFN, HEADS,
                                                                 tp_group=group))):
        try:
            build_it()
        except ValueError as e:
            said[name] = str(e)
    return said


def worker(rank, out_dir):
    ranks = dist.get_world_size()
    group = dist.new_group(list(range(ranks)))
    results = {"cases": {case_name(c): _run_case(c, rank, ranks, group) for c in CASES},
               "late": _late_group(rank, ranks, group)}
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
