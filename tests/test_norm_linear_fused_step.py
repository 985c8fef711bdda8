"""LayerNormLinear's C++ steps (fp8_norm_linear_delayed, fp8_norm_linear_current; the norm in
front of csrc/linear_step.cpp's GEMM, modules/linear_fused_step.py) against the Python path
they replace (layernorm_linear.py's _LayerNormLinearFunction): outputs, every gradient (input,
norm weight and bias, weight, bias) and every FP8 state buffer bit for bit over steps where the
scales move; which path runs when; their errors."""
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
from transformer_fp8.modules import linear_fused_step

RECIPE = DelayedScaling(amax_history_len=4)
CURRENT = tfp8.Float8CurrentScaling()
FUSED_NODE = "Fp8LinearStep"
IN, OUT = 32, 48


def _python_path(monkeypatch):
    python_path(monkeypatch, "NORM_ENABLED")


CASES = {
    "3d": dict(shape=(2, 24, IN)),
    "padded_rows": dict(shape=(21, IN)),
    "exact_rows": dict(shape=(32, IN)),
    "no_bias": dict(shape=(2, 8, IN), bias=False),
    "bf16": dict(shape=(3, 16, IN), dtype=torch.bfloat16),
    "fp16": dict(shape=(40, IN), dtype=torch.float16),
    "zero_centered_gamma": dict(shape=(2, 24, IN), zero_centered_gamma=True),
    "e4m3": dict(shape=(2, 24, IN), recipe=DelayedScaling(fp8_format=Format.E4M3,
                                                          amax_history_len=3)),
    "frozen_norm": dict(shape=(2, 24, IN), frozen=("layer_norm_weight", "layer_norm_bias")),
    "frozen_weight": dict(shape=(2, 24, IN), frozen=("weight",)),
    "frozen_gemm": dict(shape=(2, 24, IN), frozen=("weight", "bias")),
    # Only the norm's parameters take the GEMM's dgrad.
    "no_input_grad": dict(shape=(2, 24, IN), input_grad=False),
    # Nothing before the GEMM wants a gradient: no dgrad, no weight transpose.
    "wgrad_only": dict(shape=(2, 24, IN), input_grad=False,
                       frozen=("layer_norm_weight", "layer_norm_bias")),
    "return_bias": dict(shape=(2, 24, IN), return_bias=True),
    "parameters_split": dict(shape=(2, 24, IN), parameters_split=("a", "b")),
}


def _layer(cfg, normalization, device):
    dtype = cfg.get("dtype", torch.float32)
    kwargs = {}
    if "parameters_split" in cfg:
        kwargs["parameters_split"] = cfg["parameters_split"]
    layer = tfp8.LayerNormLinear(IN, OUT, bias=cfg.get("bias", True), params_dtype=dtype,
                                 device=device, normalization=normalization,
                                 zero_centered_gamma=cfg.get("zero_centered_gamma", False),
                                 return_bias=cfg.get("return_bias", False), **kwargs)
    with torch.no_grad():  # norm parameters away from their initial ones and zeros
        layer.layer_norm_weight.add_(torch.rand(IN, device=device).to(dtype))
        if layer.layer_norm_bias is not None:
            layer.layer_norm_bias.add_(torch.randn(IN, device=device).to(dtype) * 0.1)
    for name in cfg.get("frozen", ()):
        param = getattr(layer, name, None)
        if param is not None:
            param.requires_grad_(False)
    return layer


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("kind", ["delayed", "current"])
def test_fused_step_is_bit_identical_to_python_path(kind, normalization, case, device, gen,
                                                    monkeypatch):
    cfg = CASES[case]
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    compare_with_python_path(_layer(cfg, normalization, device), cfg,
                             case_recipe(kind, cfg, RECIPE), OUT, FUSED_NODE, "NORM_ENABLED",
                             device, gen, monkeypatch)


@pytest.mark.parametrize("recipe", [RECIPE, CURRENT], ids=["delayed", "current"])
def test_fused_step_under_torch_autocast_is_bit_identical(recipe, gen, monkeypatch):
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    check_torch_autocast(_layer({}, "LayerNorm", "cpu"), IN, OUT, recipe, FUSED_NODE,
                         "NORM_ENABLED", gen, monkeypatch)


def test_python_path_where_the_fused_step_does_not_apply(gen):
    layer = tfp8.LayerNormLinear(IN, IN)
    x = randn(gen, 16, IN).requires_grad_(True)

    def node(recipe=RECIPE, **kwargs):
        with fp8_autocast(fp8_recipe=recipe):
            out = layer(x, **kwargs)
        return node_name(out[0] if isinstance(out, tuple) else out)

    assert FUSED_NODE in node()
    assert FUSED_NODE in node(CURRENT)
    assert FUSED_NODE not in node(is_first_microbatch=True)  # the weight is kept
    assert FUSED_NODE not in node(tfp8.Float8BlockScaling())
    layer.return_layernorm_output = True  # the norm's output is returned too
    assert FUSED_NODE not in node()
    layer.return_layernorm_output = False
    for reentrant in (False, True):
        name, kept = inside_checkpoint(layer, x, reentrant, RECIPE)
        assert kept and (reentrant or FUSED_NODE in name), name
        name, kept = inside_checkpoint(layer, x, reentrant, CURRENT)
        assert kept and (reentrant or FUSED_NODE not in name), name


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_checkpointed_fused_step_is_bit_identical_to_python_path(reentrant, gen, monkeypatch):
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    model = torch.nn.Sequential(tfp8.LayerNormLinear(IN, 64), torch.nn.GELU(),
                                tfp8.LayerNormLinear(64, IN, normalization="RMSNorm"))
    check_checkpointed_region(model, IN, reentrant, RECIPE, "NORM_ENABLED", gen, monkeypatch)


@pytest.mark.parametrize("recipe", [RECIPE, CURRENT], ids=["delayed", "current"])
def test_no_grad_forward_is_bit_identical_to_python_path(recipe, gen, monkeypatch):
    entry = "_norm_delayed_step" if recipe is RECIPE else "_norm_current_step"
    check_no_grad(tfp8.LayerNormLinear(IN, OUT), IN, recipe, entry, "NORM_ENABLED", gen,
                  monkeypatch)


@pytest.mark.parametrize("recipe", [RECIPE, CURRENT], ids=["delayed", "current"])
def test_double_backward_is_refused_as_in_the_python_path(recipe, gen):
    check_double_backward_refused(tfp8.LayerNormLinear(IN, IN), IN, recipe, FUSED_NODE, gen,
                                  "differentiate twice.*once_differentiable")


def _state() -> list:
    """The delayed operator's state arguments (see test_linear_fused_step.py's _state)."""
    return [torch.zeros(1), torch.zeros(1), torch.ones(1), torch.ones(1), torch.ones(2),
            torch.zeros(1), torch.ones(1), torch.ones(1)]


def test_operator_errors_name_the_argument(gen):
    op = torch.ops.transformer_fp8.fp8_norm_linear_delayed
    e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2
    state = _state()
    x, w, nw, nb = randn(gen, 16, 16), randn(gen, 32, 16), torch.ones(16), torch.zeros(16)

    def call(*, x=x, nw=nw, nb=nb, norm="LayerNorm", eps=1e-5, w=w, bias=None, state=state):
        return op(x, nw, nb, norm, eps, False, w, bias, *state, e4, e5, torch.float32)

    with pytest.raises(RuntimeError, match="argument 'normalization' of "
                                           "fp8_norm_linear_delayed.*\"BatchNorm\""):
        call(norm="BatchNorm")
    with pytest.raises(RuntimeError, match="argument 'norm_weight'.*\\[16\\].*\\[8\\]"):
        call(nw=torch.ones(8))
    with pytest.raises(RuntimeError, match="argument 'norm_bias'.*None for RMSNorm"):
        call(norm="RMSNorm")
    with pytest.raises(RuntimeError, match="argument 'norm_bias'.*\\[16\\]"):
        call(nb=torch.zeros(4))
    with pytest.raises(RuntimeError, match="argument 'eps'.*>= 0.*-1"):
        call(eps=-1.0)
    with pytest.raises(RuntimeError, match="argument 'input' of fp8_norm_linear_delayed"):
        call(x=randn(gen, 4, 8))
    bad = list(state)
    bad[4] = torch.ones(1)
    with pytest.raises(RuntimeError, match="argument 'fwd_scale_inv' of "
                                           "fp8_norm_linear_delayed.*2 element"):
        call(state=bad)
    assert torch.equal(state[0], torch.zeros(1)), "a refused call records nothing"
    # A valid call computes the Python path's LayerNorm -> Linear.
    out = call()
    assert out.shape == (16, 32)
    current = torch.ops.transformer_fp8.fp8_norm_linear_current
    with pytest.raises(RuntimeError, match="argument 'normalization' of "
                                           "fp8_norm_linear_current"):
        current(x, nw, None, "layernorm", 1e-5, False, w, None, e4, e5, torch.float32)
    with pytest.raises(RuntimeError, match="argument 'norm_bias' of fp8_norm_linear_current"):
        tfp8._C.norm_linear_current(x, nw, nb, "RMSNorm", 1e-5, False, w, None, e4, e5,
                                    torch.float32)


def test_operator_matches_the_module(gen):
    """torch.ops.transformer_fp8.fp8_norm_linear_delayed on a module's state slices computes
    the module's output and records the same amaxes."""
    layer = tfp8.LayerNormLinear(IN, OUT, recipe=RECIPE)
    reference = copy.deepcopy(layer)
    x = randn(gen, 20, IN, scale=3.0)
    expected, recorded = output_and_recorded_amaxes(reference, x, RECIPE)
    fmt = RECIPE.fp8_format
    slices = linear_fused_step._state_slices(layer, fmt)
    got = torch.ops.transformer_fp8.fp8_norm_linear_delayed(
        x, layer.layer_norm_weight.detach(), layer.layer_norm_bias.detach(), "LayerNorm",
        layer.eps, False, layer.weight.detach(), layer.bias.detach(), *slices, fmt.fwd_dtype,
        fmt.bwd_dtype, torch.float32)
    assert_bitwise_equal(got, expected)
    assert_bitwise_equal(layer.fp8_fwd_amax_history[0], recorded)
    assert recorded.all(), "input and weight amaxes recorded"


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_recorded_histories_count_as_written(device, gen):
    check_histories_count_as_written(tfp8.LayerNormLinear(IN, IN, device=device), IN, IN, RECIPE,
                                     FUSED_NODE, device, gen)


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("case", list(edge_inputs(IN, "cpu")))
@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("recipe", [RECIPE, CURRENT], ids=["delayed", "current"])
def test_edge_inputs_are_bit_identical_to_python_path(recipe, normalization, case, device,
                                                      monkeypatch):
    check_edge_input(lambda: tfp8.LayerNormLinear(IN, OUT, normalization=normalization,
                                                  device=device),
                     case, IN, OUT, recipe, FUSED_NODE, "NORM_ENABLED", device, monkeypatch)


@pytest.mark.parametrize("shape", [(16, IN), (2, 8, IN)], ids=["2d", "3d"])
@pytest.mark.parametrize("recipe", [RECIPE, CURRENT], ids=["delayed", "current"])
def test_input_changed_in_place_after_forward_is_refused(recipe, shape, gen):
    check_inplace_input_change_refused(tfp8.LayerNormLinear(IN, OUT), shape, recipe,
                                       FUSED_NODE, gen)


@pytest.mark.parametrize("param", ["weight", "bias", "layer_norm_weight"])
@pytest.mark.parametrize("recipe", [RECIPE, CURRENT], ids=["delayed", "current"])
def test_backward_for_one_parameter_is_bit_identical_to_python_path(recipe, param, gen,
                                                                   monkeypatch):
    check_partial_backward(tfp8.LayerNormLinear(IN, OUT), IN, OUT, param, recipe, FUSED_NODE,
                           "NORM_ENABLED", gen, monkeypatch)


@pytest.mark.parametrize("recipe", [DelayedScaling(amax_history_len=4),
                                    tfp8.Float8CurrentScaling()], ids=["delayed", "current"])
@pytest.mark.parametrize("cls", ["LayerNormLinear", "LayerNormMLP"])
def test_normalization_switched_on_a_built_module(monkeypatch, cls, recipe):
    """RMSNorm-built, then normalization='LayerNorm' (no bias): both paths train alike (the
    Python path's backward returned a bias gradient for the absent bias and raised).
    LayerNorm-built, then 'RMSNorm' with its bias still there: refused naming it (the C++ step
    raised, the Python path ignored the bias); with the bias removed first, both paths agree."""
    make = getattr(tfp8, cls)
    gen = torch.Generator().manual_seed(3)
    inputs = [randn(gen, 16, 32, scale=s) for s in (1.0, 6.0, 0.3)]
    grads = [randn(gen, 16, 48 if cls == "LayerNormLinear" else 32) for _ in inputs]

    def train(layer):
        results = []
        for x, g in zip(inputs, grads):
            x = x.clone().requires_grad_(True)
            with fp8_autocast(fp8_recipe=recipe):
                out = layer(x)
            out.backward(g)
            results.append([out.detach(), x.grad] + [
                p.grad.clone() for p in layer.parameters() if p.grad is not None])
        return results

    for built, switched in (("RMSNorm", "LayerNorm"), ("LayerNorm", "RMSNorm")):
        torch.manual_seed(0)
        layer = make(32, 48, normalization=built)
        if switched == "RMSNorm":
            with pytest.raises(ValueError, match="layer_norm_bias would be left unused"):
                layer.normalization = "RMSNorm"
            layer.layer_norm_bias = None
        layer.normalization = switched
        python = copy.deepcopy(layer)
        fused = train(layer)
        with monkeypatch.context() as patch:
            for switch in ("NORM_ENABLED", "NORM_MLP_ENABLED"):
                patch.setattr(linear_fused_step, switch, False)
            expected = train(python)
        for step, (a, b) in enumerate(zip(fused, expected)):
            assert len(a) == len(b)
            for u, v in zip(a, b):
                assert_bitwise_equal(u, v, f"{built}->{switched} step {step}")
