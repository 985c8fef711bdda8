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

import transformer_fp8 as tfp8
from transformer_fp8 import DelayedScaling, Format, fp8_autocast
from transformer_fp8.modules import linear_fused_step
from transformer_fp8.quantization.state import FP8_STATE_KEYS

RECIPE = DelayedScaling(amax_history_len=4)
CURRENT = tfp8.Float8CurrentScaling()
FUSED_NODE = "Fp8LinearStep"
IN, OUT = 32, 48


def _node(out) -> str:
    if out.grad_fn is None:
        return "none"
    name = type(out.grad_fn).__name__
    return out.grad_fn.name() if name == "CppFunction" else name


def _python_path(monkeypatch):
    monkeypatch.setattr(linear_fused_step, "NORM_ENABLED", False)


def _run(layer, inputs, grads, recipe, input_grad=True, autocast_bf16=False):
    """Steps of forward in fp8_autocast and backward after it: (output, input gradient,
    parameter gradients, node) per step."""
    results = []
    for x, g in zip(inputs, grads):
        x = x.detach().requires_grad_(input_grad)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast_bf16), \
                fp8_autocast(fp8_recipe=recipe):
            out = layer(x)
        if isinstance(out, tuple):  # return_bias: (out, bias), the bias not added
            node = _node(out[0])
            out = out[0] + out[1]
        else:
            node = _node(out)
        out.backward(g.to(out.dtype))
        params = [p.grad.clone() if p.grad is not None else None for p in layer.parameters()]
        layer.zero_grad(set_to_none=True)
        results.append((out.detach(), x.grad, params, node))
    return results


def _assert_same(fused, python, fused_layer, python_layer):
    for step, (got, ref) in enumerate(zip(fused, python)):
        assert_bitwise_equal(got[0], ref[0], f"step {step} output")
        assert (got[1] is None) == (ref[1] is None), f"step {step} input gradient"
        if ref[1] is not None:
            assert_bitwise_equal(got[1], ref[1], f"step {step} input gradient")
        for i, (a, b) in enumerate(zip(got[2], ref[2])):
            assert (a is None) == (b is None), f"step {step} parameter {i}"
            if b is not None:
                assert_bitwise_equal(a, b, f"step {step} parameter {i} gradient")
    for key in FP8_STATE_KEYS:
        assert_bitwise_equal(getattr(fused_layer, key), getattr(python_layer, key), key)


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
    dtype = cfg.get("dtype", torch.float32)
    recipe = cfg.get("recipe", RECIPE)
    if kind == "current":  # Float8CurrentScaling with the case's format
        recipe = tfp8.Float8CurrentScaling(fp8_format=recipe.fp8_format)
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    layer = _layer(cfg, normalization, device)
    python_layer = copy.deepcopy(layer)
    # Inputs at different magnitudes and offsets: the scales change from step to step.
    inputs = [randn(gen, *cfg["shape"], dtype=dtype, device=device, scale=s) + shift
              for s, shift in ((1.0, 0.0), (30.0, 5.0), (0.01, -0.02), (3.0, 1.0))]
    grads = [randn(gen, *cfg["shape"][:-1], OUT, dtype=dtype, device=device, scale=s)
             for s in (1e-3, 10.0, 1.0, 1e-5)]
    input_grad = cfg.get("input_grad", True)
    fused = _run(layer, inputs, grads, recipe, input_grad)
    _python_path(monkeypatch)
    python = _run(python_layer, inputs, grads, recipe, input_grad)
    assert all(FUSED_NODE in r[3] for r in fused), [r[3] for r in fused]
    assert all(FUSED_NODE not in r[3] for r in python)
    _assert_same(fused, python, layer, python_layer)
    # (step 2: grad_output at 1.0, well inside the range the scales were set for)
    grads_of = dict(zip([n for n, _ in layer.named_parameters()], fused[2][2]))
    for name in ("layer_norm_weight", "weight"):
        if name not in cfg.get("frozen", ()) and name in grads_of:
            assert grads_of[name] is not None and grads_of[name].abs().sum() > 0, name
    if kind == "delayed":
        assert layer.fp8_bwd_amax_history.any(), "the backward recorded its amaxes"
        assert layer.fp8_fwd_amax_history[:, 0].any(), "the norm's output amax was recorded"
    else:
        assert not layer.fp8_fwd_amax_history.any(), "current scaling records none"


@pytest.mark.parametrize("recipe", [RECIPE, CURRENT], ids=["delayed", "current"])
def test_fused_step_under_torch_autocast_is_bit_identical(recipe, gen, monkeypatch):
    """float32 parameters, bfloat16 compute (torch.autocast on the CPU)."""
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    layer = _layer({}, "LayerNorm", "cpu")
    python_layer = copy.deepcopy(layer)
    inputs = [randn(gen, 2, 16, IN, scale=s) for s in (1.0, 20.0, 0.1)]
    grads = [randn(gen, 2, 16, OUT, scale=s) for s in (1.0, 1e-3, 5.0)]
    fused = _run(layer, inputs, grads, recipe, autocast_bf16=True)
    _python_path(monkeypatch)
    python = _run(python_layer, inputs, grads, recipe, autocast_bf16=True)
    assert fused[0][0].dtype == torch.bfloat16
    assert FUSED_NODE in fused[0][3]
    _assert_same(fused, python, layer, python_layer)


def _inside_checkpoint(layer, x, reentrant: bool, recipe):
    """(the node of the layer's output, whether it kept a replay record) in the original
    forward of a checkpointed region."""
    seen = []

    def region(t):
        with fp8_autocast(fp8_recipe=recipe):
            out = layer(t)
        seen.append((_node(out), bool(layer._replay_records)))
        return out

    torch.utils.checkpoint.checkpoint(region, x, use_reentrant=reentrant).sum().backward()
    return seen[0]


def test_python_path_where_the_fused_step_does_not_apply(gen):
    layer = tfp8.LayerNormLinear(IN, IN)
    x = randn(gen, 16, IN).requires_grad_(True)

    def node(recipe=RECIPE, **kwargs):
        with fp8_autocast(fp8_recipe=recipe):
            out = layer(x, **kwargs)
        return _node(out[0] if isinstance(out, tuple) else out)

    assert FUSED_NODE in node()
    assert FUSED_NODE in node(CURRENT)
    assert FUSED_NODE not in node(is_first_microbatch=True)  # the weight is kept
    assert FUSED_NODE not in node(tfp8.Float8BlockScaling())
    layer.return_layernorm_output = True  # the norm's output is returned too
    assert FUSED_NODE not in node()
    layer.return_layernorm_output = False
    for reentrant in (False, True):
        node_name, kept = _inside_checkpoint(layer, x, reentrant, RECIPE)
        assert kept and (reentrant or FUSED_NODE in node_name), node_name
        node_name, kept = _inside_checkpoint(layer, x, reentrant, CURRENT)
        assert kept and (reentrant or FUSED_NODE not in node_name), node_name


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_checkpointed_fused_step_is_bit_identical_to_python_path(reentrant, gen, monkeypatch):
    """A checkpointed region of two layers: the C++ step's original forward with the Python
    path's recomputation (a replay of the recorded scales) against the Python path."""
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    model = torch.nn.Sequential(tfp8.LayerNormLinear(IN, 64), torch.nn.GELU(),
                                tfp8.LayerNormLinear(64, IN, normalization="RMSNorm"))
    python_model = copy.deepcopy(model)
    xs = [randn(gen, 2, 12, IN, scale=s) for s in (1.0, 20.0, 0.05)]

    def run(m):
        got = []
        for x in xs:
            x = x.clone().requires_grad_(True)
            with fp8_autocast(fp8_recipe=RECIPE):
                out = torch.utils.checkpoint.checkpoint(m, x, use_reentrant=reentrant)
            (out * out).sum().backward()
            got += [out.detach(), x.grad] + [p.grad.clone() for p in m.parameters()]
            m.zero_grad(set_to_none=True)
        m.state_dict()  # (runs a reentrant checkpoint's waiting backward update)
        return got

    fused = run(model)
    _python_path(monkeypatch)
    python = run(python_model)
    for i, (a, b) in enumerate(zip(fused, python)):
        assert_bitwise_equal(a, b, f"value {i}")
    for layer, python_layer in ((model[0], python_model[0]), (model[2], python_model[2])):
        for key in FP8_STATE_KEYS:
            assert_bitwise_equal(getattr(layer, key), getattr(python_layer, key), key)
        assert not layer._replay_records, "every record was replayed"


@pytest.mark.parametrize("recipe", [RECIPE, CURRENT], ids=["delayed", "current"])
def test_no_grad_forward_is_bit_identical_to_python_path(recipe, gen, monkeypatch):
    layer = tfp8.LayerNormLinear(IN, OUT)
    python_layer = copy.deepcopy(layer)
    xs = [randn(gen, 3, 16, IN, scale=s) for s in (4.0, 0.1)]

    def run(model):
        outs = []
        for x in xs:
            with torch.no_grad(), fp8_autocast(fp8_recipe=recipe):
                outs.append(model(x))
        return outs

    calls = []
    name = "_norm_delayed_step" if recipe is RECIPE else "_norm_current_step"
    entry = getattr(linear_fused_step, name)
    monkeypatch.setattr(linear_fused_step, name, lambda *a: calls.append(1) or entry(*a))
    fused = run(layer)
    assert len(calls) == len(xs), "the C++ step ran"
    _python_path(monkeypatch)
    for step, (a, b) in enumerate(zip(fused, run(python_layer))):
        assert_bitwise_equal(a, b, f"step {step}")
        assert a.grad_fn is None
    for key in FP8_STATE_KEYS:
        assert_bitwise_equal(getattr(layer, key), getattr(python_layer, key), key)


@pytest.mark.parametrize("recipe", [RECIPE, CURRENT], ids=["delayed", "current"])
def test_double_backward_is_refused_as_in_the_python_path(recipe, gen):
    layer = tfp8.LayerNormLinear(IN, IN)
    x = randn(gen, 16, IN).requires_grad_(True)
    with fp8_autocast(fp8_recipe=recipe):
        out = layer(x)
    assert FUSED_NODE in _node(out)
    (grad_x,) = torch.autograd.grad(out.square().sum(), [x], create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice.*once_differentiable"):
        grad_x.sum().backward()


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
    context = fp8_autocast(fp8_recipe=RECIPE)
    with torch.no_grad():
        context.__enter__()  # (left after the comparison: its exit rolls the histories)
        try:
            expected = reference(x)
            recorded = reference.fp8_fwd_amax_history[0].clone()
        finally:
            context.__exit__(None, None, None)
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
    layer = tfp8.LayerNormLinear(IN, IN, device=device)
    x = randn(gen, 16, IN, device=device).requires_grad_(True)
    fwd, bwd = layer.fp8_fwd_amax_history, layer.fp8_bwd_amax_history
    with fp8_autocast(fp8_recipe=RECIPE):
        before = fwd._version
        out = layer(x)
        assert FUSED_NODE in _node(out)
        assert fwd._version > before, "forward amaxes recorded"
    before = bwd._version
    seen = []
    x.register_hook(lambda grad: seen.append(bwd._version))
    out.backward(randn(gen, 16, IN, device=device))
    assert seen and seen[0] > before, "grad_output amax recorded"
