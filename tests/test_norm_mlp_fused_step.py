"""LayerNormMLP's C++ steps (fp8_norm_mlp_delayed, fp8_norm_mlp_current; csrc/norm_mlp_step.cpp,
modules/linear_fused_step.py) against the Python path they replace (layernorm_mlp.py's
_LayerNormMLPFunction): outputs, every gradient (input, norm weight and bias, both GEMMs'
weights and biases) and every FP8 state buffer bit for bit over steps where the scales move,
for every activation and norm; which path runs when; their errors."""
from __future__ import annotations

import copy

import pytest
import torch
from conftest import DEVICE_PARAMS, assert_bitwise_equal, randn
from fused_step_checks import (case_recipe, check_checkpointed_region,
                               check_double_backward_refused, check_edge_input,
                               check_histories_count_as_written,
                               check_inplace_input_change_refused, check_no_grad,
                               check_partial_backward, check_torch_autocast,
                               compare_with_python_path, edge_inputs, inside_checkpoint, node_name,
                               output_and_recorded_amaxes, python_path)

import transformer_fp8 as tfp8
from transformer_fp8 import DelayedScaling, Format, fp8_autocast

RECIPE = DelayedScaling(amax_history_len=4)
CURRENT = tfp8.Float8CurrentScaling()
FUSED_NODE = "Fp8NormMlpStep"
HIDDEN, FFN = 32, 48
NORM_PARAMS = ("layer_norm_weight", "layer_norm_bias")


def _python_path(monkeypatch):
    python_path(monkeypatch, "NORM_MLP_ENABLED")


CASES = {
    "3d": dict(shape=(2, 24, HIDDEN)),
    "padded_rows": dict(shape=(21, HIDDEN)),
    "exact_rows": dict(shape=(32, HIDDEN)),
    "no_bias": dict(shape=(2, 8, HIDDEN), bias=False),
    "bf16": dict(shape=(3, 16, HIDDEN), dtype=torch.bfloat16),
    "fp16": dict(shape=(40, HIDDEN), dtype=torch.float16),
    "zero_centered_gamma": dict(shape=(2, 24, HIDDEN), zero_centered_gamma=True),
    "e4m3": dict(shape=(2, 24, HIDDEN), recipe=DelayedScaling(fp8_format=Format.E4M3,
                                                              amax_history_len=3)),
    "frozen_norm": dict(shape=(2, 24, HIDDEN), frozen=NORM_PARAMS),
    "frozen_fc1": dict(shape=(2, 24, HIDDEN), frozen=("fc1_weight", "fc1_bias")),
    "frozen_fc1_bias": dict(shape=(2, 24, HIDDEN), frozen=("fc1_bias",)),
    "frozen_fc2": dict(shape=(2, 24, HIDDEN), frozen=("fc2_weight", "fc2_bias")),
    "no_input_grad": dict(shape=(2, 24, HIDDEN), input_grad=False),
    # Only fc1's parameters before fc2: fc2's dgrad, no norm backward, no fc1 dgrad.
    "no_norm_grad": dict(shape=(2, 24, HIDDEN), input_grad=False, frozen=NORM_PARAMS),
    # Only fc2's weight trains: no dgrad at all.
    "fc2_wgrad_only": dict(shape=(2, 24, HIDDEN), input_grad=False,
                           frozen=NORM_PARAMS + ("fc1_weight", "fc1_bias", "fc2_bias")),
    "return_bias": dict(shape=(2, 24, HIDDEN), return_bias=True),
}


def _layer(cfg, normalization, activation, device):
    dtype = cfg.get("dtype", torch.float32)
    layer = tfp8.LayerNormMLP(HIDDEN, FFN, bias=cfg.get("bias", True), params_dtype=dtype,
                              device=device, normalization=normalization,
                              activation=activation,
                              zero_centered_gamma=cfg.get("zero_centered_gamma", False),
                              return_bias=cfg.get("return_bias", False))
    with torch.no_grad():  # parameters away from their initial ones and zeros
        layer.layer_norm_weight.add_(torch.rand(HIDDEN, device=device).to(dtype))
        for name in ("layer_norm_bias", "fc1_bias", "fc2_bias"):
            param = getattr(layer, name)
            if param is not None:
                param.add_(torch.randn(param.shape, device=device).to(dtype) * 0.1)
    for name in cfg.get("frozen", ()):
        param = getattr(layer, name, None)
        if param is not None:
            param.requires_grad_(False)
    return layer


def _compare(kind, normalization, activation, cfg, device, gen, monkeypatch):
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    layer = _layer(cfg, normalization, activation, device)
    compare_with_python_path(layer, cfg, case_recipe(kind, cfg, RECIPE), HIDDEN, FUSED_NODE,
                             "NORM_MLP_ENABLED", device, gen, monkeypatch)
    if kind == "delayed":
        assert layer.fp8_fwd_amax_history[:, 2].any(), "the activation's output amax"


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("kind", ["delayed", "current"])
def test_fused_step_is_bit_identical_to_python_path(kind, normalization, case, device, gen,
                                                    monkeypatch):
    _compare(kind, normalization, "gelu", CASES[case], device, gen, monkeypatch)


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("activation", ["relu", "silu", "qgelu", "srelu", "swiglu", "geglu",
                                        "reglu", "qgeglu", "sreglu", "glu"])
@pytest.mark.parametrize("kind", ["delayed", "current"])
def test_every_activation_is_bit_identical_to_python_path(kind, activation, device, gen,
                                                          monkeypatch):
    for case in ("3d", "no_norm_grad"):
        _compare(kind, "RMSNorm", activation, CASES[case], device, gen, monkeypatch)
        monkeypatch.undo()


@pytest.mark.parametrize("recipe", [RECIPE, CURRENT], ids=["delayed", "current"])
def test_fused_step_under_torch_autocast_is_bit_identical(recipe, gen, monkeypatch):
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    check_torch_autocast(_layer({}, "LayerNorm", "swiglu", "cpu"), HIDDEN, HIDDEN, recipe,
                         FUSED_NODE, "NORM_MLP_ENABLED", gen, monkeypatch)


def test_python_path_where_the_fused_step_does_not_apply(gen):
    layer = tfp8.LayerNormMLP(HIDDEN, FFN)
    x = randn(gen, 16, HIDDEN).requires_grad_(True)

    def node(recipe=RECIPE, **kwargs):
        with fp8_autocast(fp8_recipe=recipe):
            out = layer(x, **kwargs)
        return node_name(out[0] if isinstance(out, tuple) else out)

    assert FUSED_NODE in node()
    assert FUSED_NODE in node(CURRENT)
    assert FUSED_NODE not in node(is_first_microbatch=True)  # the weights are kept
    assert FUSED_NODE not in node(tfp8.Float8BlockScaling())
    layer.return_layernorm_output = True
    assert FUSED_NODE not in node()
    layer.return_layernorm_output = False

    # Under torch.utils.checkpoint: delayed scaling keeps its replay record on the C++ step,
    # current scaling takes the Python path (which keeps it).
    for reentrant in (False, True):
        for recipe, fused in ((RECIPE, True), (CURRENT, False)):
            name, kept = inside_checkpoint(layer, x, reentrant, recipe)
            assert kept and (reentrant or (FUSED_NODE in name) == fused), (name, recipe)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_checkpointed_fused_step_is_bit_identical_to_python_path(normalization, reentrant, gen,
                                                                 monkeypatch):
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    model = torch.nn.Sequential(
        tfp8.LayerNormMLP(HIDDEN, FFN, normalization=normalization),
        tfp8.LayerNormMLP(HIDDEN, FFN, normalization=normalization, activation="swiglu"))
    check_checkpointed_region(model, HIDDEN, reentrant, RECIPE, "NORM_MLP_ENABLED", gen,
                              monkeypatch)


def test_weights_kept_by_is_first_microbatch_are_dropped_by_a_fused_step(gen, monkeypatch):
    """is_first_microbatch=True keeps both FP8 weights; after an optimizer step a call without
    it (the C++ step) drops them, so a later False quantises the new weights, as on the Python
    path."""
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    layer = tfp8.LayerNormMLP(HIDDEN, FFN)
    python_layer = copy.deepcopy(layer)
    xs = [randn(gen, 16, HIDDEN, scale=s) for s in (1.0, 4.0, 0.5, 2.0, 1.5)]

    def run(model):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        got, nodes = [], []
        for x, flag in zip(xs, (True, False, "step", None, False)):
            if flag == "step":
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                continue
            with fp8_autocast(fp8_recipe=RECIPE):
                out = model(x, is_first_microbatch=flag)
            nodes.append(node_name(out))
            out.square().sum().backward()
            got += [out.detach(), model.fc1_weight.grad.clone(), model.fc2_weight.grad.clone()]
        return got, nodes

    fused, fused_nodes = run(layer)
    assert FUSED_NODE in fused_nodes[2], fused_nodes
    _python_path(monkeypatch)
    python, _ = run(python_layer)
    for i, (a, b) in enumerate(zip(fused, python)):
        assert_bitwise_equal(a, b, f"value {i}")


@pytest.mark.parametrize("recipe", [RECIPE, CURRENT], ids=["delayed", "current"])
def test_no_grad_forward_is_bit_identical_to_python_path(recipe, gen, monkeypatch):
    check_no_grad(tfp8.LayerNormMLP(HIDDEN, FFN), HIDDEN, recipe, "_norm_mlp_step",
                  "NORM_MLP_ENABLED", gen, monkeypatch)


@pytest.mark.parametrize("recipe", [RECIPE, CURRENT], ids=["delayed", "current"])
def test_double_backward_is_refused_as_in_the_python_path(recipe, gen):
    check_double_backward_refused(tfp8.LayerNormMLP(HIDDEN, FFN), HIDDEN, recipe, FUSED_NODE,
                                  gen, "differentiate twice the FP8 LayerNormMLP")


def _operator_args(gen, **changes):
    args = dict(input=randn(gen, 16, 16), norm_weight=torch.ones(16), norm_bias=torch.zeros(16),
                normalization="LayerNorm", eps=1e-5, zero_centered_gamma=False,
                fc1_weight=randn(gen, 32, 16), fc1_bias=None, fc2_weight=randn(gen, 16, 32),
                fc2_bias=None, activation="gelu", fwd_amax=torch.zeros(4),
                fwd_scale=torch.ones(4), fwd_scale_inv=torch.ones(4), bwd_amax=torch.zeros(2),
                bwd_scale=torch.ones(2), bwd_scale_inv=torch.ones(2),
                fwd_dtype=torch.float8_e4m3fn, bwd_dtype=torch.float8_e5m2,
                out_dtype=torch.float32)
    args.update(changes)
    return args


def test_operator_errors_name_the_argument(gen):
    op = torch.ops.transformer_fp8.fp8_norm_mlp_delayed

    def call(**changes):
        return op(*_operator_args(gen, **changes).values())

    with pytest.raises(RuntimeError, match="argument 'fc2_weight' of fp8_norm_mlp_delayed.*"
                                           "\\[16, 32\\]"):
        call(fc2_weight=randn(gen, 8, 32))
    with pytest.raises(RuntimeError, match="argument 'fc2_bias'.*\\[16\\]"):
        call(fc2_bias=torch.zeros(32))
    with pytest.raises(RuntimeError, match="argument 'bias' of fp8_norm_mlp_delayed.*\\[32\\]"):
        call(fc1_bias=torch.zeros(16))
    with pytest.raises(RuntimeError, match="argument 'normalization'.*\"rms\""):
        call(normalization="rms")
    with pytest.raises(RuntimeError, match="argument 'norm_weight'.*\\[16\\]"):
        call(norm_weight=torch.ones(32))
    with pytest.raises(RuntimeError, match="argument 'fwd_amax'.*4 element"):
        call(fwd_amax=torch.zeros(2))
    with pytest.raises(RuntimeError, match="argument 'bwd_scale_inv'.*float32"):
        call(bwd_scale_inv=torch.ones(2, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="activation"):
        call(activation="tanh")
    args = _operator_args(gen)
    out = op(*args.values())
    assert out.shape == (16, 16) and torch.isfinite(out).all()
    assert args["fwd_amax"].all(), "the four forward amaxes recorded"
    current = torch.ops.transformer_fp8.fp8_norm_mlp_current
    state = ("fwd_amax", "fwd_scale", "fwd_scale_inv", "bwd_amax", "bwd_scale", "bwd_scale_inv")
    rms = {k: v for k, v in _operator_args(gen, normalization="RMSNorm").items()
           if k not in state}
    with pytest.raises(RuntimeError, match="argument 'norm_bias' of fp8_norm_mlp_current"):
        current(*rms.values())


@pytest.mark.parametrize("change,message", [
    (dict(activation="tanh"), "argument 'activation' must be one of"),
    (dict(fc2_weight="bf16_wrong_width"), "argument 'fc2_weight' of fp8_norm_mlp_delayed"),
    (dict(activation="swiglu"), "argument 'fc2_weight' of fp8_norm_mlp_delayed.*\\[16, 16\\]"),
    (dict(fwd_dtype=torch.float8_e5m2), "argument 'fwd_dtype'.*float8_e4m3fn"),
    (dict(out_dtype=torch.int32), "argument 'out_dtype'"),
    (dict(fc1_weight="float64"), "argument 'weight' of fp8_norm_mlp_delayed.*Double"),
    (dict(fc2_weight="float64"), "argument 'fc2_weight'.*Double"),
    (dict(input="meta"), "argument 'input'.*weight's device"),
])
def test_a_refused_call_leaves_the_state_alone(gen, change, message):
    """Every argument is checked before the first cast writes its amax slot: a call the
    operator refuses leaves the amaxes as they were (an unknown activation, a wrong fc2 width,
    E5M2 forward, an int out_dtype or a float64 weight used to be refused only after the casts
    before them had recorded their amaxes)."""
    op = torch.ops.transformer_fp8.fp8_norm_mlp_delayed
    args = _operator_args(gen)
    key, value = next(iter(change.items()))
    if value == "float64":
        value = args[key].double()
    elif value == "bf16_wrong_width":
        value = randn(gen, 16, 24)
    elif value == "meta":
        value = args[key].to("meta")
    args[key] = value
    args["fwd_amax"].fill_(-1.0)
    args["bwd_amax"].fill_(-1.0)
    with pytest.raises(RuntimeError, match=message):
        op(*args.values())
    assert torch.equal(args["fwd_amax"], torch.full((4,), -1.0))
    assert torch.equal(args["bwd_amax"], torch.full((2,), -1.0))


def test_python_entry_checks_its_slots(gen):
    args = _operator_args(gen)
    head = [args[k] for k in ("input", "norm_weight", "norm_bias", "normalization", "eps",
                              "zero_centered_gamma", "fc1_weight", "fc1_bias", "fc2_weight",
                              "fc2_bias", "activation")]
    dtypes = [args["fwd_dtype"], args["bwd_dtype"], args["out_dtype"]]
    with pytest.raises(RuntimeError, match="argument 'slots' of norm_mlp must hold 15"):
        tfp8._C.norm_mlp(*head, [torch.zeros(1)] * 3, *dtypes, None)
    with pytest.raises(RuntimeError, match="argument 'slots' of fp8_norm_mlp_delayed.*1 "
                                           "element"):
        tfp8._C.norm_mlp(*head, [torch.zeros(2)] * 15, *dtypes, None)


def test_operator_matches_the_module(gen):
    """torch.ops.transformer_fp8.fp8_norm_mlp_delayed on a module's state buffers computes
    the module's output and records the same amaxes."""
    layer = tfp8.LayerNormMLP(HIDDEN, FFN, recipe=RECIPE)
    reference = copy.deepcopy(layer)
    x = randn(gen, 20, HIDDEN, scale=3.0)
    expected, recorded = output_and_recorded_amaxes(reference, x, RECIPE)
    fmt = RECIPE.fp8_format
    p = {name: param.detach() for name, param in layer.named_parameters()}
    got = torch.ops.transformer_fp8.fp8_norm_mlp_delayed(
        x, p["layer_norm_weight"], p["layer_norm_bias"], "LayerNorm", layer.eps, False,
        p["fc1_weight"], p["fc1_bias"], p["fc2_weight"], p["fc2_bias"], "gelu",
        layer.fp8_fwd_amax_history[0], layer.fp8_fwd_scale, layer.fp8_fwd_scale_inv,
        layer.fp8_bwd_amax_history[0], layer.fp8_bwd_scale, layer.fp8_bwd_scale_inv,
        fmt.fwd_dtype, fmt.bwd_dtype, torch.float32)
    assert_bitwise_equal(got, expected)
    assert_bitwise_equal(layer.fp8_fwd_amax_history[0], recorded)
    assert recorded.all(), "the four forward amaxes recorded"


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_recorded_histories_count_as_written(device, gen):
    check_histories_count_as_written(tfp8.LayerNormMLP(HIDDEN, FFN, device=device), HIDDEN,
                                     HIDDEN, RECIPE, FUSED_NODE, device, gen)


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("case", list(edge_inputs(HIDDEN, "cpu")))
@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
@pytest.mark.parametrize("recipe", [RECIPE, CURRENT], ids=["delayed", "current"])
def test_edge_inputs_are_bit_identical_to_python_path(recipe, activation, case, device,
                                                      monkeypatch):
    check_edge_input(lambda: tfp8.LayerNormMLP(HIDDEN, FFN, activation=activation,
                                               device=device),
                     case, HIDDEN, HIDDEN, recipe, FUSED_NODE, "NORM_MLP_ENABLED", device,
                     monkeypatch)


@pytest.mark.parametrize("shape", [(16, HIDDEN), (2, 8, HIDDEN)], ids=["2d", "3d"])
@pytest.mark.parametrize("recipe", [RECIPE, CURRENT], ids=["delayed", "current"])
def test_input_changed_in_place_after_forward_is_refused(recipe, shape, gen):
    check_inplace_input_change_refused(tfp8.LayerNormMLP(HIDDEN, FFN), shape, recipe,
                                       FUSED_NODE, gen)


@pytest.mark.parametrize("param", ["fc2_weight", "fc2_bias", "fc1_weight", "layer_norm_weight"])
@pytest.mark.parametrize("recipe", [RECIPE, CURRENT], ids=["delayed", "current"])
def test_backward_for_one_parameter_is_bit_identical_to_python_path(recipe, param, gen,
                                                                   monkeypatch):
    """fc2's parameters only: fc1's grad_output amax is still recorded, as the Python path
    does (it decides from the forward's requires_grad, not from the pass's inputs)."""
    check_partial_backward(tfp8.LayerNormMLP(HIDDEN, FFN), HIDDEN, HIDDEN, param, recipe,
                           FUSED_NODE, "NORM_MLP_ENABLED", gen, monkeypatch)
