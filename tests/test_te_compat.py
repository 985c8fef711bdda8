"""Transformer Engine code after `import transformer_fp8 as te`: its signatures, defaults,
parameter names and checkpoints (the points where TE code would break or silently change).
Models written for TE run in tests/test_te_models.py, its checkpoints load in
tests/test_te_checkpoints.py."""
from __future__ import annotations

import copy
import inspect

import pytest
import torch
import torch.nn.functional as F

import transformer_fp8 as te
from transformer_fp8 import DelayedScaling
from transformer_fp8.modules.te_args import TE_ACCEPTED, TE_IGNORED

# ---- 8. autocast's signature and calibration ------------------------------------------------


def test_autocast_signatures_are_transformer_engines():
    fp8 = inspect.signature(te.fp8_autocast).parameters
    assert list(fp8)[:5] == ["enabled", "calibrating", "fp8_recipe", "fp8_group", "_graph"]
    assert list(inspect.signature(te.autocast).parameters)[:5] == [
        "enabled", "calibrating", "recipe", "amax_reduction_group", "_graph"]
    # Positional calls bind as in Transformer Engine: the recipe is the third argument.
    recipe = DelayedScaling(amax_history_len=4)
    layer = te.Linear(32, 16)
    for context in (te.fp8_autocast(True, False, recipe), te.autocast(True, False, recipe)):
        with context:
            layer(torch.randn(8, 32))
    assert layer.fp8_fwd_amax_history.shape == (4, 2)
    with pytest.raises(TypeError, match="calibrating must be True or False"):
        with te.fp8_autocast(True, "yes"):
            pass
    with pytest.raises(ValueError, match="_graph=True"):
        with te.autocast(_graph=True):
            pass


@pytest.mark.parametrize("module_kind", ["linear", "mlp", "grouped"])
def test_calibration_records_amaxes_in_high_precision_and_updates_at_exit(module_kind):
    torch.manual_seed(0)
    recipe = DelayedScaling(amax_history_len=8)
    module = {"linear": lambda: te.Linear(32, 48),
              "mlp": lambda: te.LayerNormMLP(32, 48, activation="relu"),
              "grouped": lambda: te.GroupedLinear(2, 32, 48)}[module_kind]()
    call = (lambda x: module(x, [5, 7])) if module_kind == "grouped" else module
    xs = [torch.randn(12, 32) * s for s in (1.0, 3.0)]
    expected_out = [call(x) for x in xs]
    with torch.no_grad(), te.fp8_autocast(enabled=False, calibrating=True, fp8_recipe=recipe):
        outs = [call(x) for x in xs]
        recorded = module.fp8_fwd_amax_history[0].clone()
    for out, ref in zip(outs, expected_out):
        assert torch.equal(out, ref), "calibration runs the high-precision forward"
    # What was recorded: per GEMM, max |input| and max |weight| over both calls.
    if module_kind == "linear":
        want = [max(x.abs().max() for x in xs), module.weight.abs().max()]
    elif module_kind == "grouped":
        want = [max(x[:5].abs().max() for x in xs), module.weight0.abs().max(),
                max(x[5:].abs().max() for x in xs), module.weight1.abs().max()]
    else:
        ln = [module._norm_hp(x) for x in xs]
        act = [F.relu(F.linear(y, module.fc1_weight, module.fc1_bias)) for y in ln]
        want = [max(y.abs().max() for y in ln), module.fc1_weight.abs().max(),
                max(a.abs().max() for a in act), module.fc2_weight.abs().max()]
    want = torch.stack([torch.as_tensor(w, dtype=torch.float32) for w in want])
    assert torch.equal(recorded, want)
    # At exit: the history rolled and the scales are fp8_max / amax (E4M3 forward).
    assert torch.equal(module.fp8_fwd_amax_history[-1], want)
    assert torch.equal(module.fp8_fwd_scale, (448.0 / want.double()).float())
    assert torch.all(module.fp8_bwd_scale == 1), "backward is not calibrated"
    # Without calibrating, a disabled context records nothing.
    fresh = te.Linear(32, 48)
    with te.fp8_autocast(enabled=False, fp8_recipe=recipe):
        fresh(xs[0])
    assert torch.all(fresh.fp8_fwd_amax_history == 0) and torch.all(fresh.fp8_fwd_scale == 1)


# ---- 1. checkpoint passes keyword arguments to the function ---------------------------------

@pytest.mark.parametrize("reentrant", [True, False])
def test_checkpoint_passes_keyword_arguments_to_the_function(reentrant):
    torch.manual_seed(0)
    layer = te.TransformerLayer(32, 64, 2, hidden_dropout=0.0, attention_dropout=0.0)
    x = torch.randn(6, 2, 32)
    grads = []
    for checkpointed in (False, True):
        layer.zero_grad(set_to_none=True)
        x_in = x.clone().requires_grad_(True)
        if checkpointed:
            out = te.checkpoint(layer, x_in, checkpoint_core_attention=False,
                                use_reentrant=reentrant)
        else:
            out = layer(x_in, checkpoint_core_attention=False)
        out.square().mean().backward()
        grads.append([out.detach(), x_in.grad] + [p.grad for p in layer.parameters()])
    for a, b in zip(*grads):
        assert torch.equal(a, b)
    seen = {}

    def function(t, *, scale):
        seen["scale"] = scale
        return t * scale
    x_in = torch.randn(4, requires_grad=True)
    te.checkpoint(function, x_in, scale=3.0, use_reentrant=reentrant).sum().backward()
    assert seen["scale"] == 3.0 and torch.equal(x_in.grad, torch.full((4,), 3.0))


# ---- 2 and 7. MultiheadAttention's default and Transformer Engine's parameter names --------

def _names(module):
    return {n: tuple(p.shape) for n, p in module.named_parameters()}


def test_multihead_attention_defaults_to_no_layernorm_with_tes_names():
    torch.manual_seed(0)
    mha = te.MultiheadAttention(64, 4, num_gqa_groups=2, attention_dropout=0.0)
    assert not mha.input_layernorm and not hasattr(mha, "layernorm_qkv")
    assert _names(mha) == {"qkv.query_weight": (64, 64), "qkv.key_weight": (32, 64),
                           "qkv.value_weight": (32, 64), "qkv.query_bias": (64,),
                           "qkv.key_bias": (32,), "qkv.value_bias": (32,),
                           "proj.weight": (64, 64), "proj.bias": (64,)}
    # What it computes: the projections of the input itself (no norm), causal attention.
    x = torch.randn(5, 2, 64)
    q = F.linear(x, mha.qkv.query_weight, mha.qkv.query_bias).view(5, 2, 4, 16)
    k = F.linear(x, mha.qkv.key_weight, mha.qkv.key_bias).view(5, 2, 2, 16)
    v = F.linear(x, mha.qkv.value_weight, mha.qkv.value_bias).view(5, 2, 2, 16)
    q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
    k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    ctx = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    ref = F.linear(ctx.permute(2, 0, 1, 3).reshape(5, 2, 64), mha.proj.weight, mha.proj.bias)
    torch.testing.assert_close(mha(x), ref, rtol=1e-5, atol=1e-6)
    # input_layernorm=True: a LayerNormLinear with the same split names.
    normed = te.MultiheadAttention(64, 4, input_layernorm=True, normalization="RMSNorm")
    assert set(_names(normed)) == {
        "layernorm_qkv.layer_norm_weight", "layernorm_qkv.query_weight",
        "layernorm_qkv.key_weight", "layernorm_qkv.value_weight", "layernorm_qkv.query_bias",
        "layernorm_qkv.key_bias", "layernorm_qkv.value_bias", "proj.weight", "proj.bias"}
    fused = te.MultiheadAttention(64, 4, fuse_qkv_params=True, bias=False)
    assert _names(fused) == {"qkv.weight": (192, 64), "proj.weight": (64, 64)}
    # return_bias: proj's bias returned, not added.
    rb = te.MultiheadAttention(64, 4, num_gqa_groups=2, return_bias=True,
                               attention_dropout=0.0)
    rb.load_state_dict(mha.state_dict())
    out, bias = rb(x)
    assert torch.equal(bias, mha.proj.bias)
    torch.testing.assert_close(out + bias, mha(x), rtol=1e-6, atol=1e-6)


def test_transformer_layer_names_for_every_qkv_configuration():
    base = "self_attention.layernorm_qkv."
    for fuse, expected in ((False, {"query_weight", "key_weight", "value_weight"}),
                           (True, {"weight"})):
        layer = te.TransformerLayer(64, 96, 4, num_gqa_groups=2, fuse_qkv_params=fuse,
                                    bias=False, normalization="RMSNorm")
        names = {n[len(base):] for n in _names(layer) if n.startswith(base)}
        assert names == expected | {"layer_norm_weight"}, fuse


# ---- 3. a mask with "causal" is ignored ------------------------------------------------------

def test_a_mask_passed_with_causal_is_ignored():
    torch.manual_seed(0)
    layer = te.TransformerLayer(32, 64, 2, hidden_dropout=0.0, attention_dropout=0.0)
    x = torch.randn(6, 2, 32)
    mask = torch.randint(0, 2, (1, 1, 6, 6), dtype=torch.bool)
    assert torch.equal(layer(x, attention_mask=mask), layer(x))
    dpa = te.DotProductAttention(2, 16)
    q, k, v = (torch.randn(6, 2, 2, 16) for _ in range(3))
    for mask_type in ("causal", "no_mask"):
        assert torch.equal(dpa(q, k, v, attention_mask=mask, attn_mask_type=mask_type),
                           dpa(q, k, v, attn_mask_type=mask_type))


# ---- 4. torch.autocast: the autocast dtype out, float32 gradients ---------------------------

@pytest.mark.parametrize("build", ["layer", "layernorm", "rmsnorm"])
def test_autocast_returns_the_autocast_dtype(build):
    torch.manual_seed(0)
    block = {"layer": lambda: te.TransformerLayer(32, 64, 2),
             "layernorm": lambda: te.LayerNorm(32),
             "rmsnorm": lambda: te.RMSNorm(32)}[build]()
    x = torch.randn(6, 2, 32, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = block(x)
        loss = out.float().sum()
    loss.backward()
    assert out.dtype == torch.bfloat16
    assert x.grad.dtype == torch.float32
    assert all(p.grad.dtype == torch.float32 for p in block.parameters())
    if build != "layer":
        # The value, as Transformer Engine's: input and parameters rounded to bfloat16, the
        # norm in float32, its result rounded to bfloat16.
        rounded = copy.deepcopy(block).to(torch.bfloat16).float()
        assert torch.equal(out, rounded(x.detach().bfloat16().float()).to(torch.bfloat16))


# ---- 5 and 9. Linear's Transformer Engine arguments; return_bias -----------------------------

def test_linear_takes_transformer_engines_arguments():
    torch.manual_seed(0)
    # nn.Linear's positional order is kept: (in, out, bias, device, dtype).
    assert te.Linear(32, 16, False).bias is None
    layer = te.Linear(32, 16, init_method=torch.nn.init.ones_, return_bias=True,
                      sequence_parallel=False, name=None, parallel_mode=None,
                      fuse_wgrad_accumulation=False, tp_group=None, tp_size=1,
                      get_rng_state_tracker=None, rng_tracker_name=None, ub_overlap_ag=False,
                      ub_name=None, delay_wgrad_compute=False, symmetric_ar_type=None,
                      save_original_input=False, parameters_split=None)
    assert torch.all(layer.weight == 1) and torch.all(layer.bias == 0)
    with torch.no_grad():
        layer.bias.normal_()
    x = torch.randn(8, 32)
    for enabled in (False, True):
        with te.fp8_autocast(enabled=enabled):
            out, bias = layer(x)
            plain = te.Linear(32, 16)
            plain.load_state_dict(layer.state_dict())
            full = plain(x)
        assert torch.equal(bias, layer.bias)
        if enabled:
            torch.testing.assert_close(out + bias, full, rtol=0.1, atol=0.5)
        else:
            assert torch.equal(out, F.linear(x, layer.weight))
    # Tensor parallelism (test_te_tensor_parallel.py): on one rank nothing to shard.
    assert tuple(te.Linear(32, 16, sequence_parallel=True, parallel_mode="column")
                 .weight.shape) == (16, 32)
    with pytest.raises(ValueError, match="parallel_mode must be None, 'column' or 'row'"):
        te.Linear(32, 16, parallel_mode="diagonal")
    with pytest.raises(TypeError, match="unexpected keyword argument 'bogus'"):
        te.Linear(32, 16, bogus=1)
    with pytest.raises(ValueError, match="fp8_output=True is not supported"):
        layer(x, fp8_output=True)
    # parameters_split: Transformer Engine's names, joined along the output features.
    split = te.Linear(32, 48, parameters_split={"query": 16, "key": 16, "value": 16})
    assert _names(split) == {f"{n}_{k}": (16, 32) if k == "weight" else (16,)
                             for n in ("query", "key", "value") for k in ("weight", "bias")}
    joined = torch.cat([split.query_weight, split.key_weight, split.value_weight])
    joined_bias = torch.cat([split.query_bias, split.key_bias, split.value_bias])
    assert torch.equal(split(x), F.linear(x, joined, joined_bias))
    even = te.Linear(32, 48, parameters_split=("a", "b", "c"), bias=False)
    assert set(_names(even)) == {"a_weight", "b_weight", "c_weight"}
    with pytest.raises(ValueError, match="parameters_split must split the 48 output"):
        te.Linear(32, 48, parameters_split={"q": 16, "k": 16})


@pytest.mark.parametrize("module", ["linear", "layernorm_linear"])
def test_init_method_initialises_each_split_part_as_its_own_weight(module):
    """A fan-based init_method sees each part's shape, as in Transformer Engine (it saw the
    joined [48, 32] weight: xavier's bound sqrt(6 / 80) instead of sqrt(6 / 48)); biases zero;
    reset_parameters() gives the same distribution."""
    seen = []

    def init(weight):
        seen.append(tuple(weight.shape))
        torch.nn.init.ones_(weight)

    split = {"query": 16, "key": 16, "value": 16}
    make = {"linear": lambda: te.Linear(32, 48, init_method=init, parameters_split=split),
            "layernorm_linear": lambda: te.LayerNormLinear(32, 48, init_method=init,
                                                           parameters_split=split)}[module]
    layer = make()
    assert seen == [(16, 32)] * 3
    assert all(getattr(layer, f"{n}_bias").count_nonzero() == 0 for n in split)
    torch.manual_seed(0)
    xavier = {"linear": lambda: te.Linear(32, 3 * 1024, init_method=torch.nn.init.xavier_uniform_,
                                          parameters_split=("q", "k", "v")),
              "layernorm_linear": lambda: te.LayerNormLinear(
                  32, 3 * 1024, init_method=torch.nn.init.xavier_uniform_,
                  parameters_split=("q", "k", "v"))}[module]()
    bound = (6 / (32 + 1024)) ** 0.5  # one part's fans
    for name in ("q_weight", "k_weight", "v_weight"):
        weight = getattr(xavier, name)
        assert weight.abs().max() <= bound and weight.abs().max() > 0.95 * bound


@pytest.mark.parametrize("kind", ["linear", "layernorm_linear", "mlp", "grouped", "mha"])
def test_return_bias_without_bias_returns_what_transformer_engine_returns(kind):
    # Transformer Engine 2.x: Linear and LayerNormMLP return None (their bias tensor is None
    # without a bias), LayerNormLinear and GroupedLinear their empty placeholder bias tensors.
    module = {"linear": lambda: te.Linear(32, 16, bias=False, return_bias=True),
              "layernorm_linear": lambda: te.LayerNormLinear(32, 16, bias=False,
                                                             return_bias=True),
              "mlp": lambda: te.LayerNormMLP(32, 16, bias=False, return_bias=True),
              "grouped": lambda: te.GroupedLinear(2, 32, 16, bias=False, return_bias=True),
              "mha": lambda: te.MultiheadAttention(32, 2, bias=False, return_bias=True)}[kind]()
    x = torch.randn(6, 1, 32) if kind == "mha" else torch.randn(6, 32)
    for recipe in (None, te.DelayedScaling()):
        with te.fp8_autocast(enabled=recipe is not None, fp8_recipe=recipe):
            out, bias = module(x, [2, 4]) if kind == "grouped" else module(x)
        if kind in ("linear", "mlp", "mha"):
            assert bias is None
        else:
            for b in (bias if kind == "grouped" else [bias]):
                assert isinstance(b, torch.Tensor) and b.numel() == 0 and b.dtype == out.dtype


def test_layernorm_takes_normalized_shape():
    torch.manual_seed(0)
    for cls in (te.LayerNorm, te.RMSNorm):
        a, b, c = cls(normalized_shape=32), cls(32), cls(hidden_size=32)
        assert _names(a) == _names(b) == _names(c)
        assert cls(normalized_shape=[32]).hidden_size == 32
        with pytest.raises(ValueError, match="normalized_shape must be an int or a 1-element"):
            cls(normalized_shape=(4, 8))
        with pytest.raises(ValueError, match="normalized_shape .* and hidden_size .* must agree"):
            cls(normalized_shape=32, hidden_size=16)


# ---- 6. every Transformer Engine argument at its default -----------------------------------

# Transformer Engine's constructor arguments (transformer_engine/pytorch, 2.x) that this
# library does not implement, with their defaults: each module must accept them all.
TE_DEFAULT_ONLY = {
    "Linear": dict(sequence_parallel=False, tp_group=None, tp_size=1,
                   get_rng_state_tracker=None, rng_tracker_name=None, parallel_mode=None,
                   ub_overlap_ag=False, ub_overlap_rs=False, ub_overlap_rs_dgrad=False,
                   ub_bulk_dgrad=False, ub_bulk_wgrad=False, ub_name=None,
                   symmetric_ar_type=None, save_original_input=False, name=None),
    "LayerNormLinear": dict(sequence_parallel=False, tp_group=None, tp_size=1,
                            get_rng_state_tracker=None, parallel_mode=None,
                            return_layernorm_output_gathered=False, ub_overlap_ag=False,
                            ub_overlap_rs=False, ub_overlap_rs_dgrad=False,
                            ub_bulk_wgrad=False, ub_bulk_dgrad=False, ub_name=None,
                            symmetric_ar_type=None, name=None),
    "LayerNormMLP": dict(sequence_parallel=False, get_rng_state_tracker=None, tp_group=None,
                         tp_size=1,
                         return_layernorm_output_gathered=False, seq_length=None,
                         micro_batch_size=None, set_parallel_mode=False, ub_overlap_ag=False,
                         name=None, ub_overlap_rs=False, ub_overlap_rs_dgrad=False,
                         ub_bulk_dgrad=False, ub_bulk_wgrad=False, symmetric_ar_type=None,
                         checkpoint=False),
    "GroupedLinear": dict(sequence_parallel=False, tp_group=None, tp_size=1,
                          get_rng_state_tracker=None, rng_tracker_name=None,
                          parallel_mode=None, ub_overlap_rs=False, ub_overlap_ag=False,
                          ub_name=None, save_original_input=False, single_grouped_weight=False,
                          single_grouped_bias=False, name=None, use_grouped_tensor=None),
    "MultiheadAttention": dict(tp_group=None,
                               tp_size=1, get_rng_state_tracker=None, sequence_parallel=False,
                               set_parallel_mode=False, rotary_pos_interleaved=False,
                               ub_overlap_ag=False, ub_overlap_rs=False,
                               ub_overlap_rs_dgrad=False, ub_bulk_dgrad=False,
                               ub_bulk_wgrad=False, name=None, seq_length=None,
                               micro_batch_size=None),
    "TransformerLayer": dict(enc_dec_attn_mask_type="no_mask",
                             enc_dec_bottom_right_diagonal=None, enc_dec_window_size=None,
                             tp_group=None, tp_size=1, get_rng_state_tracker=None,
                             seq_length=None, micro_batch_size=None, sequence_parallel=False,
                             set_parallel_mode=False, rotary_pos_interleaved=False,
                             ub_tp_comm_overlap=False, ub_overlap_ag=True, ub_overlap_rs=True,
                             ub_overlap_rs_dgrad=False, ub_bulk_dgrad=True, ub_bulk_wgrad=True,
                             name=None),
    "DotProductAttention": dict(sequence_parallel=False, tp_size=1, get_rng_state_tracker=None,
                                tp_group=None, cp_group=None, cp_global_ranks=None,
                                cp_stream=None, cp_comm_type="p2p", return_max_logit=False,
                                name=None),
    "LayerNorm": dict(sequence_parallel=None), "RMSNorm": dict(sequence_parallel=None),
}
SIZES = {"Linear": (32, 32), "LayerNormLinear": (32, 32), "LayerNormMLP": (32, 64),
         "GroupedLinear": (2, 32, 32), "MultiheadAttention": (32, 2),
         "TransformerLayer": (32, 64, 2), "DotProductAttention": (2, 16),
         "LayerNorm": (32,), "RMSNorm": (32,)}
# One non-default value per refused argument, for the refusal check.
NON_DEFAULT = {"checkpoint": True,
               "delay_wgrad_compute": None, "single_grouped_weight": True}


@pytest.mark.parametrize("name", list(TE_DEFAULT_ONLY))
def test_every_transformer_engine_argument_is_accepted_at_its_default(name):
    cls = getattr(te, name)
    cls(*SIZES[name], **TE_DEFAULT_ONLY[name])
    for option in TE_DEFAULT_ONLY[name]:
        value = NON_DEFAULT.get(option)
        if value is None or option in TE_IGNORED:
            continue
        with pytest.raises(ValueError, match=f"{option}=.* is not supported"):
            cls(*SIZES[name], **{option: value})


def test_te_argument_table_covers_what_the_modules_accept():
    """Every default-only argument above is in te_args' table (with its default first) or is
    ignored, so the README's table (written from it) is complete."""
    for options in TE_DEFAULT_ONLY.values():
        for option, default in options.items():
            if option in TE_IGNORED or (option, default) in (
                    ("cp_group", None), ("cp_global_ranks", None), ("cp_stream", None),
                    ("cp_comm_type", "p2p"), ("return_max_logit", False)):
                continue
            assert option in TE_ACCEPTED, option
            assert default in TE_ACCEPTED[option][0] or option.startswith("ub_"), option


@pytest.mark.parametrize("kind", ["layernorm_linear", "mlp", "grouped", "linear_split", "mha"])
def test_parameter_order_is_transformer_engines(kind):
    """Optimizers and their state_dicts know parameters by position: in Transformer Engine's
    order (norm first; GroupedLinear's weight and bias per GEMM; split weights, then split
    biases) an optimizer state saved with Transformer Engine's module fits parameter for
    parameter (the norm parameters came last before: Adam's state misattached)."""
    module, expected = {
        "layernorm_linear": (lambda: te.LayerNormLinear(32, 16),
                             ["layer_norm_weight", "layer_norm_bias", "weight", "bias"]),
        "mlp": (lambda: te.LayerNormMLP(32, 64, normalization="RMSNorm"),
                ["layer_norm_weight", "fc1_weight", "fc1_bias", "fc2_weight", "fc2_bias"]),
        "grouped": (lambda: te.GroupedLinear(2, 32, 16),
                    ["weight0", "bias0", "weight1", "bias1"]),
        "linear_split": (lambda: te.Linear(32, 32, parameters_split=("a", "b")),
                         ["a_weight", "b_weight", "a_bias", "b_bias"]),
        "mha": (lambda: te.MultiheadAttention(32, 2, input_layernorm=True),
                ["layernorm_qkv.layer_norm_weight", "layernorm_qkv.layer_norm_bias",
                 "layernorm_qkv.query_weight", "layernorm_qkv.key_weight",
                 "layernorm_qkv.value_weight", "layernorm_qkv.query_bias",
                 "layernorm_qkv.key_bias", "layernorm_qkv.value_bias", "proj.weight",
                 "proj.bias"]),
    }[kind]
    module = module()
    assert [name for name, _ in module.named_parameters()] == expected


@pytest.mark.parametrize("make", [lambda: te.Linear(32, 16), lambda: te.LayerNormLinear(32, 16),
                                  lambda: te.LayerNormMLP(32, 64),
                                  lambda: te.GroupedLinear(2, 32, 16),
                                  lambda: te.LayerNorm(32), lambda: te.RMSNorm(32)],
                         ids=["Linear", "LayerNormLinear", "LayerNormMLP", "GroupedLinear",
                              "LayerNorm", "RMSNorm"])
def test_reset_parameters_takes_transformer_engines_defer_init(make):
    """reset_parameters(defer_init=True) leaves the module as it is (the caller initialises
    later, as in Transformer Engine); defer_init=False initialises again."""
    module = make()
    with torch.no_grad():
        for p in module.parameters():
            p.fill_(3.0)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    module.reset_parameters(defer_init=True)
    for key, value in module.state_dict().items():
        assert torch.equal(value, before[key]), key
    module.reset_parameters(defer_init=False)
    assert any(not torch.all(p == 3.0) for p in module.parameters())


@pytest.mark.parametrize("norm", [te.LayerNorm, te.RMSNorm])
def test_norms_accept_sm_margin(norm):
    """sm_margin (Transformer Engine's kernel tuning knob) is accepted and changes nothing."""
    torch.manual_seed(0)
    a = norm(32, sm_margin=8)
    b = norm(32, sm_margin={"forward": 4, "backward": 4})
    x = torch.randn(4, 32)
    assert torch.equal(a(x), norm(32)(x)) and torch.equal(b(x), a(x))
    with pytest.raises(TypeError, match="sm_margin must be an int"):
        norm(32, sm_margin="8")

