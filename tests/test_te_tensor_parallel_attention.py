"""Transformer Engine's tensor parallelism on MultiheadAttention and TransformerLayer
(set_parallel_mode=True with tp_group, sequence_parallel) on 2 gloo ranks, against the
unsharded module run on every rank with the same weights and data
(te_tensor_parallel_attention_cases.py): grouped query heads (4 heads, 2 groups: one group
per rank), the query/key/value Parameters split or one fused weight in both layouts, rotary
embeddings, query/key norms, a learnable attention sink, "bshd", return_bias and
return_layernorm_output, a post-norm residual, gated activations, parallel attention and MLP
branches and an output norm:

* outside fp8_autocast (in float64): output, input gradient and every Parameter's gradient
  within rounding of the unsharded module's (HIGH_MIN_SQNR_DB) (with sequence_parallel, the
  Parameters marked sequence_parallel, the
  norm weights and the row-parallel biases, have gradients of the rank's part of the sequence:
  summed over the ranks, as Megatron-LM sums them; the query/key norm weights, which see the
  rank's heads, are summed by the module itself);
* under DelayedScaling and Float8CurrentScaling, over 3 steps whose scales change: the same
  tensors within float32 rounding of the unsharded FP8 module (MIN_SQNR_DB; LAYER_MIN_SQNR_DB for
  TransformerLayer), and its FP8 state
  bit for bit on every rank (MultiheadAttention; TransformerLayer's within float32
  rounding);
* a layer given its group after construction; refusals naming the argument.
"""
from __future__ import annotations

import copy
import pickle

import pytest
import torch
from integration_compare import assert_rank_records_match
from multiprocess import needs_gloo, rank_results
from te_tensor_parallel_attention_cases import CASES, case_name, worker

import transformer_fp8 as tfp8

MIN_SQNR_DB = 90.0
# A TransformerLayer's casts after proj's reduction see float32 rounding differences, which
# may move values across FP8 rounding boundaries, more of them through a decoder's second
# attention (89.5 dB seen for an encoder layer, 65.8 dB for a decoder): still above FP8's own
# error (~30 dB) and what a wrong shard gives (< 20 dB).
LAYER_MIN_SQNR_DB = 50.0
HIGH_MIN_SQNR_DB = 120.0  # (float64; the norms compute their statistics in float32)
RANKS = 2


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return rank_results(worker, tmp_path_factory.mktemp("te_tp_attention"), world=RANKS,
                        timeout_s=420)


@needs_gloo
@pytest.mark.parametrize("case", CASES, ids=case_name)
def test_module_matches_the_unsharded_module(ranks, case):
    name = case_name(case)
    high = case["recipe"] == "high"
    cases_of_rank0 = [dict(r) for r in ranks[0]["cases"][name]]  # (before fp8_state pops)
    keys = set(ranks[0]["cases"][name][0])
    # every Parameter's gradient compared (none left out by a missing key)
    params = [k.rsplit(".grad", 1)[0] for k in keys if ".grad" in k]
    assert len(params) == len(set(params)) and len(params) >= 4, sorted(keys)
    if case.get("qk_norm"):
        assert any("q_norm" in p for p in params)
    if case["module"] == "layer" and not high:
        # A TransformerLayer's FP8 state within float32 rounding, not bit for bit: the
        # second norm's amax is of the residual sum after proj's all-reduce, whose float32
        # sum order differs from the unsharded GEMM's (MultiheadAttention's: bit for bit).
        for result in ranks:
            for record in result["cases"][name]:
                got, expected = record.pop("fp8_state")
                assert got.keys() == expected.keys() and got
                for k in got:
                    torch.testing.assert_close(got[k], expected[k], rtol=1e-5, atol=0,
                                               msg=lambda m: f"{name} {k}: {m}")
    for result in ranks if not (case.get("rotary") or case.get("qk_norm")) else []:
        for record in result["cases"][name]:
            for key in [k for k in record if k.endswith("key_bias.grad")]:
                # Zero but for rounding: a key bias shifts every score of a query by the same
                # q . b, which the softmax cancels (no rotary embedding or norm between them).
                # Compared as that, against the value bias's.
                got, expected = record.pop(key)
                scale = record[key.replace("key_bias", "value_bias")][1].abs().max()
                assert got.abs().max() <= 1e-3 * scale and expected.abs().max() <= 1e-3 * scale
    # (high precision by SQNR too: run in float64, see dtype_of)
    assert_rank_records_match(name, ranks, False, HIGH_MIN_SQNR_DB if high else
                              MIN_SQNR_DB if case["module"] == "mha" else LAYER_MIN_SQNR_DB)
    if case["recipe"] == "delayed":  # the scales changed from step to step
        states = [r["fp8_state"][0] for r in cases_of_rank0]
        key = next(k for k in states[0] if k.endswith("fp8_fwd_scale"))
        assert not torch.equal(states[0][key], states[1][key])
        assert not torch.equal(states[1][key], states[2][key])


@needs_gloo
def test_group_given_after_construction(ranks):
    said = ranks[0]["late"]
    assert "call set_tensor_parallel_group(tp_group) before the forward pass" in \
        said["no_group"]
    assert said["tp_group_is_set"] is True
    assert said["late_group_runs"] == "(4, 2, 64)"  # (the rank's part of the sequence)
    assert said["q_norm_grads_summed"] is True
    assert "MultiheadAttention: tp_size=4 does not match tp_group, whose size is 2" in \
        said["tp_size_mismatch"]
    assert ("TransformerLayer: tp_size=2 (or a tp_group of that many ranks) needs "
            "set_parallel_mode=True") in said["group_without_mode"]


def test_sharded_shapes_and_attributes():
    mha = tfp8.MultiheadAttention(64, 4, num_gqa_groups=2, tp_size=2, set_parallel_mode=True,
                                  sequence_parallel=True, input_layernorm=True)
    shapes = {n: tuple(p.shape) for n, p in mha.named_parameters()}
    assert shapes["layernorm_qkv.query_weight"] == (32, 64)
    assert shapes["layernorm_qkv.key_weight"] == shapes["layernorm_qkv.value_weight"] == (16, 64)
    assert shapes["proj.weight"] == (64, 32) and shapes["proj.bias"] == (64,)
    assert (mha.num_attention_heads_per_partition, mha.num_gqa_groups_per_partition) == (2, 1)
    assert (mha.num_attention_heads, mha.num_gqa_groups, mha.tp_size) == (4, 2, 2)
    assert mha.core_attention.num_gqa_groups_per_partition == 1
    assert mha.layernorm_qkv.query_weight.partition_dim == 0
    assert mha.proj.weight.partition_dim == 1 and mha.proj.bias.sequence_parallel is True
    assert mha.layernorm_qkv.layer_norm_weight.sequence_parallel is True
    fused = tfp8.MultiheadAttention(64, 4, tp_size=2, set_parallel_mode=True,
                                    fuse_qkv_params=True)
    assert tuple(fused.qkv.weight.shape) == (96, 64)  # (4 + 2 * 4) heads * 16 / 2 ranks
    layer = tfp8.TransformerLayer(64, 128, 4, tp_size=2, set_parallel_mode=True,
                                  activation="swiglu", sequence_parallel=True)
    assert tuple(layer.layernorm_mlp.fc1_weight.shape) == (128, 64)  # both halves' rows
    assert tuple(layer.layernorm_mlp.fc2_weight.shape) == (64, 64)
    assert (layer.tp_size, layer.sequence_parallel) == (2, True)
    # deepcopy shares the options; a pickle drops the group (none was given here)
    assert copy.deepcopy(layer).tp_size == 2
    assert pickle.loads(pickle.dumps(mha)).num_attention_heads_per_partition == 2
    attn = tfp8.DotProductAttention(4, 16, num_gqa_groups=2, tp_size=2)
    assert (attn.num_attention_heads_per_partition, attn.num_gqa_groups_per_partition) == (2, 1)
    # The rank's heads are what the module takes.
    q, kv = torch.randn(5, 1, 2, 16), torch.randn(5, 1, 1, 16)
    assert tuple(attn(q, kv, kv).shape) == (5, 1, 32)
    with pytest.raises(ValueError, match=r"query_layer must have shape \[s, b, 2, 16\]"):
        attn(torch.randn(5, 1, 4, 16), kv, kv)
    sink = tfp8.DotProductAttention(4, 16, tp_size=2, softmax_type="learnable")
    assert tuple(sink.softmax_offset.shape) == (2,)


def test_one_process_refusals():
    with pytest.raises(ValueError, match=r"MultiheadAttention: tp_size=2 \(or a tp_group of "
                                         r"that many ranks\) needs set_parallel_mode=True"):
        tfp8.MultiheadAttention(64, 4, tp_size=2)
    with pytest.raises(TypeError, match="MultiheadAttention: set_parallel_mode must be True or "
                                        "False, got 'yes'"):
        tfp8.MultiheadAttention(64, 4, tp_size=2, set_parallel_mode="yes")
    with pytest.raises(ValueError, match=r"MultiheadAttention: num_attention_heads \(4\) must "
                                         "be divisible by the 3 tensor-parallel ranks"):
        tfp8.MultiheadAttention(96, 4, tp_size=3, set_parallel_mode=True)
    with pytest.raises(ValueError, match=r"MultiheadAttention: num_gqa_groups \(1\) must be "
                                         "divisible by the 2 tensor-parallel ranks"):
        tfp8.MultiheadAttention(64, 4, num_gqa_groups=1, tp_size=2, set_parallel_mode=True)
    with pytest.raises(ValueError, match=r"TransformerLayer: num_gqa_groups \(1\) must be "
                                         "divisible by the 2 tensor-parallel ranks"):
        tfp8.TransformerLayer(64, 64, 4, num_gqa_groups=1, tp_size=2, set_parallel_mode=True)
    with pytest.raises(ValueError, match=r"LayerNormMLP: ffn_hidden_size=48 is not "
                                         "divisible by the 5 tensor-parallel ranks"):
        tfp8.TransformerLayer(80, 48, 5, tp_size=5, set_parallel_mode=True)
    with pytest.raises(TypeError, match="MultiheadAttention: tp_group must be a "
                                        "torch.distributed.ProcessGroup"):
        tfp8.MultiheadAttention(64, 4, tp_group="tp", set_parallel_mode=True)
    with pytest.raises(ValueError, match="DotProductAttention.set_tensor_parallel_group: "
                                         "tp_group has 1 ranks, the module was built for "
                                         "tp_size=2"):
        tfp8.DotProductAttention(4, 16, tp_size=2).set_tensor_parallel_group(None)
    # One rank: set_parallel_mode changes nothing (no sharding, no communication).
    torch.manual_seed(0)
    plain = tfp8.TransformerLayer(64, 64, 4, hidden_dropout=0.0, attention_dropout=0.0)
    torch.manual_seed(0)
    one = tfp8.TransformerLayer(64, 64, 4, hidden_dropout=0.0, attention_dropout=0.0,
                                set_parallel_mode=True, tp_size=1)
    x = torch.randn(6, 2, 64)
    assert torch.equal(plain(x), one(x))


def test_megatron_marks_survive_meta_initialisation():
    """to_empty() out of "meta" makes new Parameters: Transformer Engine's marks, which decide
    Megatron-LM's sums of gradients over the ranks, are set on them again."""
    def marks(module):
        return {n: (getattr(p, "sequence_parallel", None), getattr(p, "partition_dim", None))
                for n, p in module.named_parameters()}
    kwargs = dict(tp_size=2, set_parallel_mode=True, sequence_parallel=True,
                  output_layernorm=True, num_gqa_groups=2)
    expected = marks(tfp8.TransformerLayer(64, 64, 4, **kwargs))
    assert expected["layernorm.weight"] == (True, None)
    assert expected["self_attention.proj.bias"] == (True, None)
    assert expected["self_attention.qkv.key_weight"] == (None, 0)
    layer = tfp8.TransformerLayer(64, 64, 4, device="meta", **kwargs)
    layer.to_empty(device="cpu")
    assert marks(layer) == expected
    for module in layer.modules():
        if module is not layer and hasattr(module, "reset_parameters"):
            module.reset_parameters()
    assert marks(layer) == expected
    norm = tfp8.RMSNorm(16, sequence_parallel=True, device="meta").to_empty(device="cpu")
    assert norm.weight.sequence_parallel is True


def test_query_key_norms_need_the_group_before_their_gradient_sum():
    mha = tfp8.MultiheadAttention(64, 4, tp_size=2, set_parallel_mode=True,
                                  qk_norm_type="RMSNorm")
    with pytest.raises(RuntimeError, match="RMSNorm: a query/key norm of a MultiheadAttention "
                                           "built with tp_size and no tp_group"):
        mha.q_norm(torch.randn(3, 16))
