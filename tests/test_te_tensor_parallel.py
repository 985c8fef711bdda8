"""Transformer Engine's tensor parallelism on Linear (tp_group, tp_size, parallel_mode,
sequence_parallel; modules/te_tensor_parallel.py) on 2 gloo ranks, against the unsharded layer
run on every rank with the same weights and data (te_tensor_parallel_cases.py).

* Outside fp8_autocast: output, input gradient, weight and bias gradients allclose to the
  unsharded layer's (torch.nn.Linear's computation on the gathered weight), for column and row,
  with and without sequence_parallel, bias or not, return_bias or not.
* Inside fp8_autocast, DelayedScaling and Float8CurrentScaling, over 3 steps whose input and
  weight scales change: the same tensors within float32 rounding of the unsharded FP8 layer
  (MIN_SQNR_DB: one element one FP8 step off would cost 31-60 dB on these sizes), and the FP8
  state bit for bit the unsharded layer's on every rank (the weight amax MAX-reduced from the
  shards is the full weight's; the gathered input and grad_output are the whole tensors).
* A column -> row MLP trained 3 SGD steps, with and without sequence_parallel.
* Refusals naming the argument, in one process and on the ranks.
"""
from __future__ import annotations

import copy
import pickle

import pytest
import torch
from integration_compare import assert_close_or_sqnr, assert_rank_records_match
from multiprocess import needs_gloo, rank_results
from te_tensor_parallel_cases import CASES, case_name, worker

import transformer_fp8 as tfp8

MIN_SQNR_DB = 90.0
RANKS = 2


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return rank_results(worker, tmp_path_factory.mktemp("te_tp"), world=RANKS)


def _close(what, got, expected, exact_recipe: bool) -> None:
    assert_close_or_sqnr(what, got, expected, exact_recipe, MIN_SQNR_DB)


@needs_gloo
@pytest.mark.parametrize("case", CASES, ids=case_name)
def test_layer_matches_the_unsharded_layer(ranks, case):
    name = case_name(case)
    high = case["recipe"] == "high"
    assert_rank_records_match(name, ranks, high, MIN_SQNR_DB)
    if case["recipe"] == "delayed":  # the scales changed from step to step
        scales = [r["fp8_state"][0]["fp8_fwd_scale"] for r in ranks[0]["cases"][name]]
        assert not torch.equal(scales[0], scales[1]) and not torch.equal(scales[1], scales[2])


@needs_gloo
@pytest.mark.parametrize("run", ["delayed-nosp", "delayed-sp", "current-nosp", "current-sp"])
def test_column_row_mlp_trains_as_the_unsharded_one(ranks, run):
    for rank, result in enumerate(ranks):
        for step, record in enumerate(result["mlp"][run]):
            for key, (got, expected) in record.items():
                where = f"{run} rank {rank} step {step} {key}"
                if key == "fp8_state":
                    for k in got:  # (after SGD steps: float32-close weights, same FP8 casts)
                        _close(f"{where} {k}", got[k], expected[k], exact_recipe=False)
                else:
                    _close(where, got, expected, exact_recipe=False)
    states = [r["mlp"][run][-1]["fp8_state"][0] for r in ranks]
    for k in states[0]:
        assert torch.equal(states[0][k], states[1][k]), f"{run}: ranks' {k} differ"


@needs_gloo
@pytest.mark.parametrize("what", ["fuse_wgrad_accumulation", "is_first_microbatch",
                                  "checkpoint"])
def test_layer_options_work_sharded(ranks, what):
    """fuse_wgrad_accumulation (main_grad), is_first_microbatch and non-reentrant activation
    checkpointing (bit for bit the run without it) on sharded layers, DelayedScaling."""
    for rank, result in enumerate(ranks):
        for step, record in enumerate(result["options"][what]):
            for key, (got, expected) in record.items():
                where = f"{what} rank {rank} step {step} {key}"
                if what == "checkpoint":
                    assert torch.equal(got, expected), where
                else:
                    _close(where, got, expected, exact_recipe=False)


@needs_gloo
def test_distributed_refusals_and_warning(ranks):
    said = ranks[0]["refusals"]
    assert "tp_size=4 does not match tp_group, whose size is 2" in said["tp_size"]
    assert "tp_group has 2 ranks, the layer was built for tp_size=4" in said["set_group"]
    assert said["tp_size_from_group"] == "2"  # tp_size left at 1: the group's size
    assert ("Linear: with sequence_parallel the first dimension is the sequence, split over "
            "the 2 ranks (row: the output's, the same as the input's); got an input of shape "
            "(3, 2, 32)") in said["sequence"]
    assert len(said["warnings"]) == 1 and "fp8_group" in said["warnings"][0]
    assert said["late_group_runs"] == "(8, 48)"


def test_one_process_refusals_and_attributes():
    with pytest.raises(ValueError, match="parallel_mode must be None, 'column' or 'row', got "
                                         "'columnwise'"):
        tfp8.Linear(32, 32, parallel_mode="columnwise", tp_size=2)
    with pytest.raises(ValueError, match="out_features=48 is not divisible by the 5"):
        tfp8.Linear(32, 48, parallel_mode="column", tp_size=5)
    with pytest.raises(ValueError, match="in_features=32 is not divisible by the 3"):
        tfp8.Linear(32, 48, parallel_mode="row", tp_size=3)
    with pytest.raises(ValueError, match="tp_size must be a positive integer, got 0"):
        tfp8.Linear(32, 48, parallel_mode="row", tp_size=0)
    with pytest.raises(TypeError, match="tp_group must be a torch.distributed.ProcessGroup"):
        tfp8.Linear(32, 48, parallel_mode="row", tp_group="tp")
    with pytest.raises(ValueError, match=r"Linear: parameters_split part 'a' \(31 rows\) is "
                                         "not divisible by the 3 tensor-parallel ranks"):
        tfp8.Linear(32, 48, parallel_mode="column", tp_size=3,
                    parameters_split={"a": 31, "b": 17})
    # Each part cut over the ranks, as Transformer Engine: the rank holds its rows of each.
    split = tfp8.Linear(32, 48, parallel_mode="column", tp_size=2,
                        parameters_split={"a": 32, "b": 16})
    assert [tuple(p.shape) for p in split.parameters()] == [(16, 32), (8, 32), (16,), (8,)]
    assert all(p.partition_dim == 0 for p in split.parameters())
    split = tfp8.Linear(32, 48, parallel_mode="row", tp_size=2, parameters_split=("a", "b"))
    assert [tuple(p.shape) for p in split.parameters()] == [(24, 16), (24, 16), (24,), (24,)]
    layer = tfp8.Linear(32, 48, parallel_mode="row", tp_size=2, sequence_parallel=True)
    assert tuple(layer.weight.shape) == (48, 16) and tuple(layer.bias.shape) == (48,)
    assert (layer.in_features, layer.out_features) == (16, 48)
    assert (layer.tp_size, layer.parallel_mode, layer.sequence_parallel) == (2, "row", True)
    assert (layer.weight.tensor_model_parallel, layer.weight.partition_dim) == (True, 1)
    assert layer.bias.sequence_parallel is True  # Megatron-LM sums these gradients
    with pytest.raises(RuntimeError, match=r"call set_tensor_parallel_group\(tp_group\)"):
        layer(torch.randn(4, 16))
    with pytest.raises(ValueError, match="tp_group has 1 ranks, the layer was built for "
                                         "tp_size=2"):
        layer.set_tensor_parallel_group(None)
    assert copy.deepcopy(layer).tp_size == 2  # (the options are shared, not copied)
    assert pickle.loads(pickle.dumps(layer)).tp_group is None
    # Without communication (no options, one rank, or parallel_mode=None) a plain layer.
    for options in ({}, dict(parallel_mode="column", tp_size=1),
                    dict(parallel_mode=None, tp_size=2, sequence_parallel=True)):
        plain = tfp8.Linear(32, 48, **options)
        assert tuple(plain.weight.shape) == (48, 32) and plain._te_tp is None, options
        assert plain._fused_step is tfp8.Linear._fused_step
    assert (plain.tp_size, plain.parallel_mode, plain.sequence_parallel) == (2, None, True)
    assert tfp8.Linear(32, 48).tp_size == 1
    # The other modules still refuse them, naming those that take them.
    with pytest.raises(ValueError, match="parallel_mode='column' is not supported .*Linear, "
                                         "LayerNormLinear, LayerNormMLP, the attention modules "
                                         "and TransformerLayer take tp_group"):
        tfp8.GroupedLinear(2, 32, 48, parallel_mode="column")
