"""Transformer Engine's tensor parallelism on LayerNormLinear (parallel_mode="column") and
LayerNormMLP (set_parallel_mode=True; modules/te_tensor_parallel_norm.py) on 2 gloo ranks,
against the unsharded module run on every rank with the same weights and data
(te_tensor_parallel_norm_cases.py), with and without sequence_parallel, bias or not,
return_bias or not, return_layernorm_output (gathered or not), RMSNorm, gated activations:

* outside fp8_autocast: output, input gradient and every weight, bias and norm-weight
  gradient allclose to the unsharded module's (with sequence_parallel the norm weights' and
  fc2's bias's gradients cover the rank's part of the sequence: summed over the ranks, as
  Megatron-LM sums Parameters marked sequence_parallel);
* under DelayedScaling and Float8CurrentScaling, over 3 steps whose scales change: the same
  tensors within float32 rounding of the unsharded FP8 module (MIN_SQNR_DB), and its FP8 state
  bit for bit on every rank;
* fuse_wgrad_accumulation, is_first_microbatch and activation checkpointing on the sharded
  modules;
* refusals naming the argument, in one process and on the ranks; Transformer Engine's
  Parameter attributes.
"""
from __future__ import annotations

import pytest
import torch
from integration_compare import assert_close_or_sqnr, assert_rank_records_match
from multiprocess import needs_gloo, rank_results
from te_tensor_parallel_norm_cases import CASES, case_name, worker

import transformer_fp8 as tfp8

MIN_SQNR_DB = 90.0
RANKS = 2


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return rank_results(worker, tmp_path_factory.mktemp("te_tp_norm"), world=RANKS)


def _close(what, got, expected, high_precision: bool) -> None:
    assert_close_or_sqnr(what, got, expected, high_precision, MIN_SQNR_DB)


@needs_gloo
@pytest.mark.parametrize("case", CASES, ids=case_name)
def test_module_matches_the_unsharded_module(ranks, case):
    name = case_name(case)
    high = case["recipe"] == "high"
    keys = set(ranks[0]["cases"][name][0])
    params = ["layer_norm_weight", "weight"] if case["module"] == "LayerNormLinear" else \
        ["layer_norm_weight", "fc1_weight", "fc2_weight"]
    for param in params:  # every gradient compared (none left out by a missing key)
        assert {f"{param}.grad", f"{param}.grad_summed"} & keys, f"{name}: {param}"
    assert_rank_records_match(name, ranks, high, MIN_SQNR_DB)
    if case["recipe"] == "delayed":  # the scales changed from step to step
        scales = [r["fp8_state"][0]["fp8_fwd_scale"] for r in ranks[0]["cases"][name]]
        assert not torch.equal(scales[0], scales[1]) and not torch.equal(scales[1], scales[2])


@needs_gloo
@pytest.mark.parametrize("module", ["LayerNormLinear", "LayerNormMLP"])
@pytest.mark.parametrize("what", ["fuse_wgrad_accumulation", "is_first_microbatch",
                                  "checkpoint"])
def test_module_options_work_sharded(ranks, module, what):
    """fuse_wgrad_accumulation (main_grad, two backwards), is_first_microbatch (True, False,
    False) and non-reentrant activation checkpointing (bit for bit the run without it) on the
    sharded modules, sequence_parallel, DelayedScaling."""
    for rank, result in enumerate(ranks):
        records = result["options"][f"{module}-{what}"]
        assert records and all(records), what
        for step, record in enumerate(records):
            for key, (got, expected) in record.items():
                where = f"{module} {what} rank {rank} step {step} {key}"
                if what == "checkpoint":
                    assert got is not None and torch.equal(got, expected), where
                else:
                    _close(where, got, expected, high_precision=False)


@needs_gloo
def test_distributed_refusals(ranks):
    said = ranks[0]["refusals"]
    assert ("LayerNormLinear: tp_size=4 does not match tp_group, whose size is 2"
            in said["norm_linear_tp_size"])
    assert "LayerNormMLP: tp_size=4 does not match tp_group, whose size is 2" in \
        said["mlp_tp_size"]
    assert ("LayerNormMLP: tp_size=2 (or a tp_group of that many ranks) needs "
            "set_parallel_mode=True") in said["mlp_group_without_mode"]
    assert "tp_group has 2 ranks, the layer was built for tp_size=4" in said["set_group"]
    assert said["mlp_tp_size_from_group"] == "2"
    assert ("LayerNormMLP: with sequence_parallel the first dimension is the sequence, split "
            "over the 2 ranks") in said["sequence"]
    assert said["late_group_runs"] == "(6, 2, 48)"  # (the gathered sequence, its columns)


def test_one_process_refusals():
    with pytest.raises(ValueError, match="LayerNormLinear: parallel_mode='row' is not "
                                         "supported: the norm needs every feature of a row"):
        tfp8.LayerNormLinear(64, 96, parallel_mode="row", tp_size=2)
    with pytest.raises(ValueError, match="LayerNormLinear: parallel_mode must be None, "
                                         "'column' or 'row', got 'col'"):
        tfp8.LayerNormLinear(64, 96, parallel_mode="col", tp_size=2)
    with pytest.raises(ValueError, match=r"LayerNormLinear: out_features=96 is not divisible "
                                         r"by the 5 tensor-parallel ranks \(parallel_mode="):
        tfp8.LayerNormLinear(64, 96, parallel_mode="column", tp_size=5)
    with pytest.raises(ValueError, match=r"LayerNormMLP: ffn_hidden_size=64 is not divisible "
                                         r"by the 3 tensor-parallel ranks \(set_parallel_mode="
                                         r"True\)"):
        tfp8.LayerNormMLP(64, 64, set_parallel_mode=True, tp_size=3)
    with pytest.raises(ValueError, match=r"LayerNormMLP: tp_size=2 \(or a tp_group of that "
                                         "many ranks\\) needs set_parallel_mode=True"):
        tfp8.LayerNormMLP(64, 64, tp_size=2)
    with pytest.raises(TypeError, match="LayerNormMLP: set_parallel_mode must be True or "
                                        "False, got 'yes'"):
        tfp8.LayerNormMLP(64, 64, set_parallel_mode="yes", tp_size=2)
    with pytest.raises(TypeError, match="LayerNormLinear: tp_group must be a "
                                        "torch.distributed.ProcessGroup"):
        tfp8.LayerNormLinear(64, 96, parallel_mode="column", tp_group="tp")
    with pytest.raises(ValueError, match="LayerNormMLP: tp_size must be a positive integer"):
        tfp8.LayerNormMLP(64, 64, set_parallel_mode=True, tp_size=0)
    with pytest.raises(ValueError, match=r"LayerNormLinear: parameters_split part 'a' \(55 "
                                         r"rows\) is not divisible by the 3 tensor-parallel"):
        tfp8.LayerNormLinear(64, 96, parallel_mode="column", tp_size=3,
                             parameters_split={"a": 55, "b": 41})
    with pytest.raises(TypeError, match="LayerNormLinear: return_layernorm_output_gathered "
                                        "must be True or False"):
        tfp8.LayerNormLinear(64, 96, return_layernorm_output_gathered=1.5)
    module = tfp8.LayerNormMLP(64, 64, set_parallel_mode=True, tp_size=2)
    with pytest.raises(RuntimeError, match=r"LayerNormMLP: built with tp_size=2 and no "
                                           r"tp_group: call set_tensor_parallel_group"):
        module(torch.randn(4, 64))


def test_sharded_shapes_and_attributes():
    module = tfp8.LayerNormLinear(64, 96, parallel_mode="column", tp_size=2,
                                  sequence_parallel=True)
    assert tuple(module.weight.shape) == (48, 64) and tuple(module.bias.shape) == (48,)
    assert (module.in_features, module.out_features) == (64, 48)
    assert (module.tp_size, module.parallel_mode, module.sequence_parallel) == (2, "column", True)
    for p in (module.weight, module.bias):
        assert (p.tensor_model_parallel, p.partition_dim, p.partition_stride) == (True, 0, 1)
    assert module.layer_norm_weight.sequence_parallel is True
    assert module.layer_norm_bias.sequence_parallel is True
    assert module._fused_step is None  # (the Python path, between the collectives)
    mlp = tfp8.LayerNormMLP(64, 64, set_parallel_mode=True, tp_size=2, activation="swiglu")
    assert tuple(mlp.fc1_weight.shape) == (64, 64) and tuple(mlp.fc2_weight.shape) == (64, 32)
    assert (mlp.fc1_weight.partition_dim, mlp.fc1_bias.partition_dim,
            mlp.fc2_weight.partition_dim) == (0, 0, 1)
    assert mlp.fc2_bias.sequence_parallel is False and mlp.layer_norm_weight.sequence_parallel \
        is False  # (no sequence_parallel: whole gradients on every rank)
    assert (mlp.set_parallel_mode, mlp.size_per_partition, mlp.tp_size) == (True, 32, 2)
    # One rank, or no options: the plain module, its C++ step included.
    for options in ({}, dict(set_parallel_mode=True, tp_size=1),
                    dict(set_parallel_mode=True, tp_size=1, sequence_parallel=True)):
        plain = tfp8.LayerNormMLP(64, 64, **options)
        assert tuple(plain.fc2_weight.shape) == (64, 64) and plain._te_tp is None, options
        assert plain._fused_step is tfp8.LayerNormMLP._fused_step
    plain = tfp8.LayerNormLinear(64, 96, parallel_mode=None, tp_size=2, sequence_parallel=True)
    assert tuple(plain.weight.shape) == (96, 64) and plain._te_tp is None
    assert plain.layer_norm_weight.sequence_parallel is True  # (Transformer Engine marks it)
    assert not tfp8.LayerNormMLP(64, 64).set_parallel_mode


def test_row_mode_on_one_rank_is_the_unsharded_layer():
    """parallel_mode='row' with one rank shards nothing (Transformer Engine takes it too):
    bit for bit LayerNormLinear without it; more ranks are refused (above)."""
    torch.manual_seed(0)
    row = tfp8.LayerNormLinear(64, 96, parallel_mode="row")
    torch.manual_seed(0)
    plain = tfp8.LayerNormLinear(64, 96)
    x = torch.randn(8, 64)
    with tfp8.fp8_autocast(fp8_recipe=tfp8.DelayedScaling()):
        out_row, out_plain = row(x), plain(x)
    assert torch.equal(out_row, out_plain)
