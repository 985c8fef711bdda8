"""The C++ Linear steps (fp8_linear_delayed, fp8_linear_current; modules/linear_fused_step.py)
against the Python path they replace (linear.py's _Fp8LinearFunction): outputs, every gradient
and every FP8 state buffer bit for bit over steps where the scales move; which path runs when;
their errors."""
from __future__ import annotations

import copy

import pytest
import torch
from conftest import DEVICE_PARAMS, assert_bitwise_equal, randn
from fused_step_checks import (assert_same, check_checkpointed_region, check_edge_input,
                               check_histories_count_as_written, check_partial_backward,
                               edge_inputs, inside_checkpoint, node_name)

import transformer_fp8 as tfp8
from transformer_fp8 import DelayedScaling, Format, fp8_autocast
from transformer_fp8.modules import linear_fused_step
from transformer_fp8.quantization.state import FP8_STATE_KEYS

RECIPE = DelayedScaling(amax_history_len=4)
FUSED_NODE = "Fp8LinearStep"
CURRENT = tfp8.Float8CurrentScaling()


_node = node_name


def _python_path(monkeypatch):
    monkeypatch.setattr(linear_fused_step, "ENABLED", False)


def _run(layer, inputs, grads, recipe=RECIPE, input_grad=True, autocast_bf16=False):
    """Steps of forward in fp8_autocast and backward after it: outputs, gradients, nodes."""
    results = []
    for x, g in zip(inputs, grads):
        x = x.detach().requires_grad_(input_grad)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast_bf16), \
                fp8_autocast(fp8_recipe=recipe):
            out = layer(x)
        node = getattr(layer, "node", None) or _node(out)
        out.backward(g.to(out.dtype))
        params = [p.grad.clone() if p.grad is not None else None for p in layer.parameters()]
        layer.zero_grad(set_to_none=True)
        results.append((out.detach(), x.grad, params, node))
    return results


CASES = {
    "3d": dict(shape=(2, 24, 32)),
    "padded_rows": dict(shape=(21, 32)),
    "exact_rows": dict(shape=(32, 32)),
    "no_bias": dict(shape=(2, 8, 32), bias=False),
    "bf16": dict(shape=(3, 16, 32), dtype=torch.bfloat16),
    "fp16": dict(shape=(40, 32), dtype=torch.float16),
    "e4m3": dict(shape=(2, 24, 32), recipe=DelayedScaling(fp8_format=Format.E4M3,
                                                          amax_history_len=3)),
    "margin_most_recent": dict(shape=(48, 32), recipe=DelayedScaling(
        margin=1, amax_compute_algo="most_recent", amax_history_len=2)),
    "frozen_weight": dict(shape=(2, 24, 32), frozen=("weight",)),
    "frozen_bias": dict(shape=(2, 24, 32), frozen=("bias",)),
    "frozen_layer_input_grad": dict(shape=(2, 24, 32), frozen=("weight", "bias")),
    "no_input_grad": dict(shape=(2, 24, 32), input_grad=False),
    "return_bias": dict(shape=(2, 24, 32), return_bias=True),
    "parameters_split": dict(shape=(2, 24, 32), parameters_split=("a", "b")),
}


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("kind", ["delayed", "current"])
def test_fused_step_is_bit_identical_to_python_path(kind, case, device, gen, monkeypatch):
    cfg = CASES[case]
    dtype = cfg.get("dtype", torch.float32)
    recipe = cfg.get("recipe", RECIPE)
    if kind == "current":  # Float8CurrentScaling with the case's format
        recipe = tfp8.Float8CurrentScaling(fp8_format=recipe.fp8_format)
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    kwargs = {}
    if "parameters_split" in cfg:
        kwargs["parameters_split"] = cfg["parameters_split"]
    layer = tfp8.Linear(32, 48, bias=cfg.get("bias", True), params_dtype=dtype, device=device,
                        return_bias=cfg.get("return_bias", False), **kwargs)
    for name in cfg.get("frozen", ()):
        getattr(layer, name).requires_grad_(False)
    if cfg.get("return_bias"):
        layer = _AddReturnedBias(layer)
    python_layer = copy.deepcopy(layer)
    # Inputs at different magnitudes: the scales change from step to step.
    inputs = [randn(gen, *cfg["shape"], dtype=dtype, device=device, scale=s)
              for s in (1.0, 30.0, 0.01, 3.0)]
    grads = [randn(gen, *cfg["shape"][:-1], 48, dtype=dtype, device=device, scale=s)
             for s in (1e-3, 10.0, 1.0, 1e-5)]
    input_grad = cfg.get("input_grad", True)
    fused = _run(layer, inputs, grads, recipe, input_grad)
    _python_path(monkeypatch)
    python = _run(python_layer, inputs, grads, recipe, input_grad)
    assert all(FUSED_NODE in r[3] for r in fused), [r[3] for r in fused]
    assert all(FUSED_NODE not in r[3] for r in python)
    assert_same(fused, python, _inner(layer), _inner(python_layer))
    if kind == "delayed":
        assert _inner(layer).fp8_bwd_amax_history.any(), "the backward recorded its amaxes"
    else:
        assert not _inner(layer).fp8_fwd_amax_history.any(), "current scaling records none"


class _AddReturnedBias(torch.nn.Module):
    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, x):
        out, bias = self.layer(x)
        self.node = _node(out)  # the layer's own, before the addition
        return out + bias


def _inner(layer):
    return layer.layer if isinstance(layer, _AddReturnedBias) else layer


@pytest.mark.parametrize("recipe", [RECIPE, CURRENT], ids=["delayed", "current"])
def test_fused_step_under_torch_autocast_is_bit_identical(recipe, gen, monkeypatch):
    """float32 parameters, bfloat16 compute (torch.autocast on the CPU)."""
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    layer = tfp8.Linear(32, 48)
    python_layer = copy.deepcopy(layer)
    inputs = [randn(gen, 2, 16, 32, scale=s) for s in (1.0, 20.0, 0.1)]
    grads = [randn(gen, 2, 16, 48, scale=s) for s in (1.0, 1e-3, 5.0)]
    fused = _run(layer, inputs, grads, recipe, autocast_bf16=True)
    _python_path(monkeypatch)
    python = _run(python_layer, inputs, grads, recipe, autocast_bf16=True)
    assert fused[0][0].dtype == torch.bfloat16
    assert FUSED_NODE in fused[0][3]
    assert_same(fused, python, layer, python_layer)


def test_microbatches_retain_graph_and_grad_of_input_only(gen, monkeypatch):
    """Several forwards in one context, a backward pass run twice (retain_graph), and
    torch.autograd.grad for the input only: the same numbers and one update per pass."""
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    layer = tfp8.Linear(32, 32)
    python_layer = copy.deepcopy(layer)
    xs = [randn(gen, 20, 32, scale=s) for s in (1.0, 8.0)]

    def run(model):
        got = []
        for step in range(3):
            with fp8_autocast(fp8_recipe=RECIPE):
                outs = [model(x.requires_grad_(True)) for x in xs]
            loss = sum((o * (i + 1 + step)).sum() for i, o in enumerate(outs))
            loss.backward(retain_graph=True)
            loss.backward()
            got += [model.weight.grad.clone(), model.bias.grad.clone()]
            model.zero_grad(set_to_none=True)
            with fp8_autocast(fp8_recipe=RECIPE):
                out = model(xs[0])
            got += list(torch.autograd.grad(out.square().sum(), [xs[0]]))
            got += [model.fp8_bwd_scale.clone(), model.fp8_fwd_scale.clone()]
        return got

    fused = run(layer)
    _python_path(monkeypatch)
    python = run(python_layer)
    for i, (a, b) in enumerate(zip(fused, python)):
        assert_bitwise_equal(a, b, f"value {i}")
    for key in FP8_STATE_KEYS:
        assert_bitwise_equal(getattr(layer, key), getattr(python_layer, key), key)


@pytest.mark.parametrize("kind", ["delayed", "current"])
def test_weight_kept_by_is_first_microbatch_is_dropped_by_a_fused_step(kind, gen, monkeypatch):
    """is_first_microbatch=True keeps the FP8 weight; an optimizer step changes the weight; a
    call without is_first_microbatch (the C++ step) must drop the kept copy, as the Python path
    does, so that a later is_first_microbatch=False quantises the new weight, not the old."""
    recipe = RECIPE if kind == "delayed" else CURRENT
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    layer = tfp8.Linear(32, 32)
    python_layer = copy.deepcopy(layer)
    xs = [randn(gen, 16, 32, scale=s) for s in (1.0, 4.0, 0.5, 2.0, 1.5)]

    def run(model):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        got, nodes = [], []
        for x, flag in zip(xs, (True, False, "step", None, False)):
            if flag == "step":
                optimizer.step()  # the weight changes: the kept FP8 copy is stale
                optimizer.zero_grad(set_to_none=True)
                continue
            with fp8_autocast(fp8_recipe=recipe):
                out = model(x, is_first_microbatch=flag)
            nodes.append(_node(out))
            out.square().sum().backward()
            got += [out.detach(), model.weight.grad.clone()]
        return got, nodes

    fused, fused_nodes = run(layer)
    assert FUSED_NODE in fused_nodes[2], fused_nodes  # the None call took the C++ step
    _python_path(monkeypatch)
    python, python_nodes = run(python_layer)
    assert all(FUSED_NODE not in n for n in python_nodes)
    for i, (a, b) in enumerate(zip(fused, python)):
        assert_bitwise_equal(a, b, f"value {i}")


def test_python_path_where_the_fused_step_does_not_apply(gen):
    layer = tfp8.Linear(32, 32)
    x = randn(gen, 16, 32).requires_grad_(True)

    def node(**kwargs):
        with fp8_autocast(fp8_recipe=kwargs.pop("recipe", RECIPE)):
            return _node(layer(x, **kwargs))

    assert FUSED_NODE in node()
    assert FUSED_NODE not in node(is_first_microbatch=True)  # the weight is kept
    assert FUSED_NODE in node(recipe=CURRENT)
    assert FUSED_NODE not in node(recipe=tfp8.Float8BlockScaling())
    # Under torch.utils.checkpoint: delayed scaling keeps its replay record on the C++ step,
    # current scaling takes the Python path (which keeps it).
    for reentrant in (False, True):
        node, kept = inside_checkpoint(layer, x, reentrant, RECIPE)
        assert kept and (reentrant or FUSED_NODE in node), node
        node, kept = inside_checkpoint(layer, x, reentrant, CURRENT)
        assert kept and (reentrant or FUSED_NODE not in node), node


def _in_fp8(layer, x, recipe):
    with fp8_autocast(fp8_recipe=recipe):
        return layer(x)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_checkpointed_fused_step_is_bit_identical_to_python_path(reentrant, gen, monkeypatch):
    """A checkpointed region of two layers: the C++ step's original forward with the Python
    path's recomputation against the Python path throughout."""
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    model = torch.nn.Sequential(tfp8.Linear(32, 64), torch.nn.GELU(), tfp8.Linear(64, 32))
    check_checkpointed_region(model, 32, reentrant, RECIPE, "ENABLED", gen, monkeypatch)


def test_no_grad_forward_records_amaxes_like_python_path(gen, monkeypatch):
    layer = tfp8.Linear(32, 32)
    python_layer = copy.deepcopy(layer)
    x = randn(gen, 3, 16, 32, scale=4.0)

    def run(model):
        with torch.no_grad(), fp8_autocast(fp8_recipe=RECIPE):
            return model(x)

    out = run(layer)
    _python_path(monkeypatch)
    assert_bitwise_equal(out, run(python_layer))
    assert out.grad_fn is None
    for key in FP8_STATE_KEYS:
        assert_bitwise_equal(getattr(layer, key), getattr(python_layer, key), key)


@pytest.mark.parametrize("recipe", [RECIPE, CURRENT], ids=["delayed", "current"])
def test_inference_mode_forward_is_bit_identical_to_python_path(recipe, gen, monkeypatch):
    """Under torch.inference_mode (inference tensors in, no autograd): the same outputs and, for
    delayed scaling, the same recorded amaxes and updated scales, over steps."""
    layer = tfp8.Linear(32, 48)
    python_layer = copy.deepcopy(layer)
    xs = [randn(gen, 2, 24, 32, scale=s) for s in (1.0, 30.0, 0.02)]

    def run(model):
        outs = []
        for x in xs:
            with torch.inference_mode(), fp8_autocast(fp8_recipe=recipe):
                outs.append(model(x.clone()))
        return outs

    name = "_delayed_step" if recipe is RECIPE else "_current_step"
    calls = []
    entry = getattr(linear_fused_step, name)
    monkeypatch.setattr(linear_fused_step, name, lambda *a: calls.append(1) or entry(*a))
    fused = run(layer)
    assert len(calls) == len(xs), "the C++ step ran"
    _python_path(monkeypatch)
    for step, (a, b) in enumerate(zip(fused, run(python_layer))):
        assert_bitwise_equal(a, b, f"step {step}")
    for key in FP8_STATE_KEYS:
        assert_bitwise_equal(getattr(layer, key), getattr(python_layer, key), key)


@pytest.mark.parametrize("recipe", [RECIPE, CURRENT], ids=["delayed", "current"])
def test_double_backward_is_refused_as_in_the_python_path(recipe, gen):
    layer = tfp8.Linear(32, 32)
    x = randn(gen, 16, 32).requires_grad_(True)
    with fp8_autocast(fp8_recipe=recipe):
        out = layer(x)
    (grad_x,) = torch.autograd.grad(out.square().sum(), [x], create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice.*once_differentiable"):
        grad_x.sum().backward()


def _state() -> list:
    """fp8_linear_delayed's state arguments: input and weight amax slots and scales, their
    scale_invs [2], grad_output's amax slot, scale and scale_inv."""
    return [torch.zeros(1), torch.zeros(1), torch.ones(1), torch.ones(1), torch.ones(2),
            torch.zeros(1), torch.ones(1), torch.ones(1)]


def test_operator_errors_name_the_argument(gen):
    op = torch.ops.transformer_fp8.fp8_linear_delayed
    e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2
    state = _state()
    w = randn(gen, 32, 16)
    with pytest.raises(RuntimeError, match="argument 'input'.*\\[..., 16\\]"):
        op(randn(gen, 4, 8), w, None, *state, e4, e5, torch.float32)
    with pytest.raises(RuntimeError, match="argument 'weight'.*2-D"):
        op(randn(gen, 4, 16), randn(gen, 16), None, *state, e4, e5, torch.float32)
    with pytest.raises(RuntimeError, match="argument 'bias'.*\\[32\\]"):
        op(randn(gen, 4, 16), w, randn(gen, 16), *state, e4, e5, torch.float32)
    bad = list(state)
    bad[3] = torch.ones(2)
    with pytest.raises(RuntimeError, match="argument 'weight_scale'.*1 element"):
        op(randn(gen, 16, 16), w, None, *bad, e4, e5, torch.float32)
    bad = list(state)
    bad[4] = torch.ones(1)
    with pytest.raises(RuntimeError, match="argument 'fwd_scale_inv'.*2 element"):
        op(randn(gen, 16, 16), w, None, *bad, e4, e5, torch.float32)
    bad = list(state)
    bad[5] = torch.zeros(1, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="argument 'grad_amax'.*float32"):
        op(randn(gen, 16, 16), w, None, *bad, e4, e5, torch.float32)
    assert torch.equal(state[0], torch.zeros(1)) and torch.equal(state[1], torch.zeros(1)), \
        "a refused call records nothing"
    current = torch.ops.transformer_fp8.fp8_linear_current
    with pytest.raises(RuntimeError, match="argument 'input' of fp8_linear_current"):
        current(randn(gen, 4, 8), w, None, e4, e5, torch.float32)


@pytest.mark.parametrize("change,message", [
    ("fwd_e5m2", "argument 'fwd_dtype'.*float8_e4m3fn"),
    ("out_int32", "argument 'out_dtype'"),
    ("weight_float64", "argument 'weight' of fp8_linear_delayed.*Double"),
    ("input_int", "argument 'input' of fp8_linear_delayed.*Int"),
    ("bias_bool", "argument 'bias' of fp8_linear_delayed.*Bool"),
    ("input_meta", "argument 'input'.*weight's device"),
])
def test_a_refused_call_leaves_the_amaxes_alone(gen, change, message):
    """Dtypes and devices are checked before the first cast: the input and weight casts used
    to record their amaxes, then the GEMM refused E5M2 x E5M2, an int out_dtype or a float64
    weight (and a float64 weight was reported as argument 'x')."""
    op = torch.ops.transformer_fp8.fp8_linear_delayed
    state = _state()
    for slot in (state[0], state[1], state[5]):
        slot.fill_(-1.0)
    x, w, bias = randn(gen, 16, 16), randn(gen, 32, 16), None
    fwd, bwd, out = torch.float8_e4m3fn, torch.float8_e5m2, torch.float32
    if change == "fwd_e5m2":
        fwd = bwd = torch.float8_e5m2
    elif change == "out_int32":
        out = torch.int32
    elif change == "weight_float64":
        w = w.double()
    elif change == "input_int":
        x = x.int()
    elif change == "bias_bool":
        bias = torch.ones(32, dtype=torch.bool)
    else:
        x = x.to("meta")
    with pytest.raises(RuntimeError, match=message):
        op(x, w, bias, *state, fwd, bwd, out)
    assert all(torch.equal(slot, torch.full((1,), -1.0)) for slot in (state[0], state[1],
                                                                       state[5]))


def test_python_entry_checks_arguments_as_the_operator(gen):
    """transformer_fp8._C.linear_delayed / linear_current (what the module calls, without the
    dispatcher) run the operators' own functions: the same checks."""
    e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2
    state = _state()
    w = randn(gen, 32, 16)
    with pytest.raises(RuntimeError, match="argument 'input' of fp8_linear_delayed"):
        tfp8._C.linear_delayed(randn(gen, 4, 8), w, None, *state, e4, e5, torch.float32, None)
    bad = list(state)
    bad[4] = torch.ones(2, 1)
    with pytest.raises(RuntimeError, match="argument 'fwd_scale_inv'.*2 element"):
        tfp8._C.linear_delayed(randn(gen, 16, 16), w, None, *bad, e4, e5, torch.float32, None)
    with pytest.raises(RuntimeError, match="argument 'weight' of fp8_linear_current.*2-D"):
        tfp8._C.linear_current(randn(gen, 4, 16), randn(gen, 16), None, e4, e5, torch.float32)
    assert torch.equal(state[0], torch.zeros(1)), "a refused call records nothing"


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_recorded_histories_count_as_written(device, gen):
    check_histories_count_as_written(tfp8.Linear(32, 32, device=device), 32, 32, RECIPE,
                                     FUSED_NODE, device, gen)


def test_the_c_step_runs_in_a_group_of_several_ranks(gen, monkeypatch):
    """Neither recipe reduces inside the step (current scaling: each rank's own amaxes; delayed
    scaling: at the step's end), so the C++ step runs whatever the group's size."""
    from transformer_fp8.quantization import update_plan
    monkeypatch.setattr(update_plan, "world_size", lambda group: 2)
    layer = tfp8.Linear(32, 32)
    x = randn(gen, 16, 32).requires_grad_(True)
    for recipe in (CURRENT, RECIPE):
        with fp8_autocast(fp8_recipe=recipe):
            assert FUSED_NODE in _node(layer(x))


def test_pickled_layer_holds_no_quantizer_after_the_fused_step(gen):
    """The C++ step's cached state slices (and the quantizers they were made with) are a cache:
    a whole-module pickle or deepcopy leaves them out, and the copy computes the same."""
    import pickle
    layer = tfp8.Linear(32, 32, recipe=RECIPE)
    x = randn(gen, 16, 32)
    with fp8_autocast(fp8_recipe=RECIPE):
        layer(x).sum().backward()
    assert layer._fused_step_cache is not None
    data = pickle.dumps(layer)
    assert b"Quantizer" not in data
    for copy_ in (pickle.loads(data), copy.deepcopy(layer)):
        assert copy_._fused_step_cache is None
        with fp8_autocast(fp8_recipe=RECIPE):
            assert_bitwise_equal(copy_(x), layer(x))


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("case", list(edge_inputs(32, "cpu")))
@pytest.mark.parametrize("recipe", [RECIPE, CURRENT], ids=["delayed", "current"])
def test_edge_inputs_are_bit_identical_to_python_path(recipe, case, device, monkeypatch):
    check_edge_input(lambda: tfp8.Linear(32, 48, device=device), case, 32, 48, recipe,
                     FUSED_NODE, "ENABLED", device, monkeypatch)


@pytest.mark.parametrize("param", ["weight", "bias"])
@pytest.mark.parametrize("recipe", [RECIPE, CURRENT], ids=["delayed", "current"])
def test_backward_for_one_parameter_is_bit_identical_to_python_path(recipe, param, gen,
                                                                   monkeypatch):
    check_partial_backward(tfp8.Linear(32, 48), 32, 48, param, recipe, FUSED_NODE, "ENABLED",
                           gen, monkeypatch)
