"""What the tests of the C++ steps of LayerNormLinear and LayerNormMLP share
(test_norm_linear_fused_step.py, test_norm_mlp_fused_step.py): steps on both paths, their
bitwise comparison, and the checks every C++ step must pass against its Python path."""
from __future__ import annotations

import copy

import pytest
import torch
from conftest import assert_bitwise_equal, randn

from transformer_fp8 import DelayedScaling, Float8CurrentScaling, fp8_autocast
from transformer_fp8.modules import linear_fused_step
from transformer_fp8.quantization.state import FP8_STATE_KEYS


def node_name(out) -> str:
    """The name of the node that made ``out`` (a C++ node's own name, not "CppFunction")."""
    if out.grad_fn is None:
        return "none"
    name = type(out.grad_fn).__name__
    return out.grad_fn.name() if name == "CppFunction" else name


def python_path(monkeypatch, switch: str) -> None:
    """Turn the C++ step named by ``switch`` (linear_fused_step's NORM_ENABLED, ...) off."""
    monkeypatch.setattr(linear_fused_step, switch, False)


def run_steps(layer, inputs, grads, recipe, input_grad=True, autocast_bf16=False):
    """Steps of forward in fp8_autocast and backward after it: (output, input gradient,
    parameter gradients, node) per step. With return_bias the bias is added after the node."""
    results = []
    for x, g in zip(inputs, grads):
        x = x.detach().requires_grad_(input_grad)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast_bf16), \
                fp8_autocast(fp8_recipe=recipe):
            out = layer(x)
        if isinstance(out, tuple):  # return_bias: (out, bias), the bias not added
            node = node_name(out[0])
            out = out[0] + out[1]
        else:
            node = node_name(out)
        out.backward(g.to(out.dtype))
        params = [p.grad.clone() if p.grad is not None else None for p in layer.parameters()]
        layer.zero_grad(set_to_none=True)
        results.append((out.detach(), x.grad, params, node))
    return results


def assert_same(fused, python, fused_layer, python_layer):
    """Outputs, input and parameter gradients of every step, then the FP8 state, bit for bit."""
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


def check_torch_autocast(layer, features: int, out_features: int, recipe, fused_node: str,
                         switch: str, gen, monkeypatch) -> None:
    """float32 parameters, bfloat16 compute (torch.autocast on the CPU): both paths agree."""
    python_layer = copy.deepcopy(layer)
    inputs = [randn(gen, 2, 16, features, scale=s) for s in (1.0, 20.0, 0.1)]
    grads = [randn(gen, 2, 16, out_features, scale=s) for s in (1.0, 1e-3, 5.0)]
    fused = run_steps(layer, inputs, grads, recipe, autocast_bf16=True)
    python_path(monkeypatch, switch)
    python = run_steps(python_layer, inputs, grads, recipe, autocast_bf16=True)
    assert fused[0][0].dtype == torch.bfloat16
    assert fused_node in fused[0][3]
    assert_same(fused, python, layer, python_layer)


def check_no_grad(layer, features: int, recipe, entry: str, switch: str, gen,
                  monkeypatch) -> None:
    """Forwards under no_grad: the C++ step (``entry``, linear_fused_step's function) runs,
    with the Python path's outputs and recorded state."""
    python_layer = copy.deepcopy(layer)
    xs = [randn(gen, 3, 16, features, scale=s) for s in (4.0, 0.1)]

    def run(model):
        outs = []
        for x in xs:
            with torch.no_grad(), fp8_autocast(fp8_recipe=recipe):
                outs.append(model(x))
        return outs

    calls = []
    function = getattr(linear_fused_step, entry)
    monkeypatch.setattr(linear_fused_step, entry, lambda *a: calls.append(1) or function(*a))
    fused = run(layer)
    assert len(calls) == len(xs), "the C++ step ran"
    python_path(monkeypatch, switch)
    for step, (a, b) in enumerate(zip(fused, run(python_layer))):
        assert_bitwise_equal(a, b, f"step {step}")
        assert a.grad_fn is None
    for key in FP8_STATE_KEYS:
        assert_bitwise_equal(getattr(layer, key), getattr(python_layer, key), key)


def check_double_backward_refused(layer, features: int, recipe, fused_node: str, gen,
                                  match: str) -> None:
    x = randn(gen, 16, features).requires_grad_(True)
    with fp8_autocast(fp8_recipe=recipe):
        out = layer(x)
    assert fused_node in node_name(out)
    (grad_x,) = torch.autograd.grad(out.square().sum(), [x], create_graph=True)
    with pytest.raises(RuntimeError, match=match):
        grad_x.sum().backward()


def check_histories_count_as_written(layer, features: int, out_features: int, recipe,
                                     fused_node: str, device, gen) -> None:
    """The C++ step writes the amaxes through views made past autograd's view tracking: it
    moves the histories' version counters itself, as an operator with a Tensor(a!) argument."""
    x = randn(gen, 16, features, device=device).requires_grad_(True)
    fwd, bwd = layer.fp8_fwd_amax_history, layer.fp8_bwd_amax_history
    with fp8_autocast(fp8_recipe=recipe):
        before = fwd._version
        out = layer(x)
        assert fused_node in node_name(out)
        assert fwd._version > before, "forward amaxes recorded"
    before = bwd._version
    seen = []  # the version once the node has run, before the update at the pass's end
    x.register_hook(lambda grad: seen.append(bwd._version))
    out.backward(randn(gen, 16, out_features, device=device))
    assert seen and seen[0] > before, "grad_output amax recorded"


def case_recipe(kind: str, cfg: dict, default):
    """The recipe of a comparison case: its own (or ``default``), as Float8CurrentScaling with
    the same format for kind "current"."""
    recipe = cfg.get("recipe", default)
    if kind == "current":
        recipe = Float8CurrentScaling(fp8_format=recipe.fp8_format)
    return recipe


def compare_with_python_path(layer, cfg: dict, recipe, out_features: int, fused_node: str,
                             switch: str, device, gen, monkeypatch) -> None:
    """Four steps of ``layer`` (its C++ step) and of a copy on the Python path, inputs and
    gradients at magnitudes that move the scales from step to step: every output, gradient and
    FP8 state buffer bit for bit; the trained weights' gradients not all zero; delayed scaling
    recorded amaxes in both passes, current scaling none. ``cfg``: shape, dtype, input_grad,
    frozen (the names of the parameters that take no gradient)."""
    dtype = cfg.get("dtype", torch.float32)
    python_layer = copy.deepcopy(layer)
    inputs = [randn(gen, *cfg["shape"], dtype=dtype, device=device, scale=s) + shift
              for s, shift in ((1.0, 0.0), (30.0, 5.0), (0.01, -0.02), (3.0, 1.0))]
    grads = [randn(gen, *cfg["shape"][:-1], out_features, dtype=dtype, device=device, scale=s)
             for s in (1e-3, 10.0, 1.0, 1e-5)]
    input_grad = cfg.get("input_grad", True)
    fused = run_steps(layer, inputs, grads, recipe, input_grad)
    python_path(monkeypatch, switch)
    python = run_steps(python_layer, inputs, grads, recipe, input_grad)
    assert all(fused_node in r[3] for r in fused), [r[3] for r in fused]
    assert all(fused_node not in r[3] for r in python)
    assert_same(fused, python, layer, python_layer)
    # (step 2: grad_output at 1.0, well inside the range the scales were set for)
    for (name, _), grad in zip(layer.named_parameters(), fused[2][2]):
        if name not in cfg.get("frozen", ()) and not name.endswith("bias"):
            assert grad is not None and grad.abs().sum() > 0, name
    if isinstance(recipe, DelayedScaling):
        assert layer.fp8_bwd_amax_history.any(), "the backward recorded its amaxes"
        assert layer.fp8_fwd_amax_history[:, 0].any(), "the norm's output amax was recorded"
    else:
        assert not layer.fp8_fwd_amax_history.any(), "current scaling records none"


def output_and_recorded_amaxes(layer, x, recipe) -> tuple:
    """(layer(x) without gradients, row 0 of its forward history as the forward left it), read
    inside the context, before its exit's update rolls the history."""
    context = fp8_autocast(fp8_recipe=recipe)
    with torch.no_grad():
        context.__enter__()
        try:
            return layer(x), layer.fp8_fwd_amax_history[0].clone()
        finally:
            context.__exit__(None, None, None)


def edge_inputs(features: int, device) -> dict:
    """Inputs at the edges (name: tensor): no rows, no rows in 3-D, one row, a non-contiguous
    view, a transposed copy, +inf and NaN entries."""
    def randn(*shape):
        return torch.randn(*shape, device=device)
    with_inf = randn(16, features)
    with_inf[3, 5] = float("inf")
    with_inf[7, 0] = float("-inf")
    with_nan = randn(16, features)
    with_nan[2, 1] = float("nan")
    return {"empty": randn(0, features), "empty_3d": randn(2, 0, features),
            "one_row": randn(1, features), "non_contiguous": randn(24, features + 8)[:, :features],
            "transposed": randn(features, 24).t(), "inf": with_inf, "nan": with_nan}


def check_edge_input(make, case: str, features: int, out_features: int, recipe, fused_node: str,
                     switch: str, device, monkeypatch) -> None:
    """One forward + backward of ``make()`` on edge_inputs()[case] on both paths: output, input
    and parameter gradients and FP8 state bit for bit (NaN included)."""
    torch.manual_seed(0)
    layer = make()
    python_layer = copy.deepcopy(layer)
    x = edge_inputs(features, device)[case]
    grad = torch.randn(*x.shape[:-1], out_features, device=device)
    fused = run_steps(layer, [x], [grad], recipe)
    python_path(monkeypatch, switch)
    python = run_steps(python_layer, [x], [grad], recipe)
    assert fused_node in fused[0][3] and fused_node not in python[0][3]
    assert_same(fused, python, layer, python_layer)


def check_inplace_input_change_refused(layer, shape, recipe, fused_node: str, gen) -> None:
    """The norm's backward needs the layer's input: changed in place after the forward, the
    backward is refused (autograd's version check), as on the Python path, for 2-D and 3-D
    inputs alike (the C++ step saves a view sharing the input's version counter)."""
    x = randn(gen, *shape).requires_grad_(True)
    h = x * 1.0  # (a non-leaf, as a residual stream is)
    with fp8_autocast(fp8_recipe=recipe):
        out = layer(h)
    assert fused_node in node_name(out)
    h.mul_(3.0)
    # (3-D: the saved input is a view made in the forward's no-grad mode, whose error names it)
    with pytest.raises(RuntimeError, match="modified by an inplace operation|modified inplace"):
        out.sum().backward()


def check_partial_backward(layer, features: int, out_features: int, param: str, recipe,
                           fused_node: str, switch: str, gen, monkeypatch) -> None:
    """A backward pass limited to one parameter (``backward(inputs=[param])``), over steps:
    that gradient and the FP8 state (every grad_output amax the Python path records, whatever
    the pass asks for) bit for bit on both paths."""
    python_layer = copy.deepcopy(layer)
    xs = [randn(gen, 2, 8, features, scale=s) for s in (1.0, 8.0, 0.25)]
    grads = [randn(gen, 2, 8, out_features, scale=s) for s in (1.0, 1e-2, 4.0)]

    def run(model):
        got = []
        for x, g in zip(xs, grads):
            x = x.clone().requires_grad_(True)
            with fp8_autocast(fp8_recipe=recipe):
                out = model(x)
            got.append(node_name(out))
            target = getattr(model, param)
            out.backward(g, inputs=[target])
            got.append(target.grad.clone())
            model.zero_grad(set_to_none=True)
        return got

    fused = run(layer)
    python_path(monkeypatch, switch)
    python = run(python_layer)
    assert fused_node in fused[0] and fused_node not in python[0]
    for i in range(1, len(fused), 2):
        assert_bitwise_equal(fused[i], python[i], f"{param} gradient, step {i // 2}")
    for key in FP8_STATE_KEYS:
        assert_bitwise_equal(getattr(layer, key), getattr(python_layer, key), key)


SWITCHES = ("ENABLED", "NORM_ENABLED", "NORM_MLP_ENABLED")


@pytest.fixture(params=["cpp_step", "python_path"])
def every_step_path(request, monkeypatch):
    """A test module's tests run twice: with the modules' C++ steps (the default) and with the
    Python autograd functions they replace (used with pytest.mark.usefixtures)."""
    if request.param == "python_path":
        for switch in SWITCHES:
            monkeypatch.setattr(linear_fused_step, switch, False)
    return request.param


def inside_checkpoint(layer, x, reentrant: bool, recipe):
    """(the node of the layer's output, whether it kept a replay record) in the original
    forward of a checkpointed region (the reentrant mode runs it under no_grad: no node)."""
    seen = []

    def region(t):
        with fp8_autocast(fp8_recipe=recipe):
            out = layer(t)
        seen.append((node_name(out), bool(layer._replay_records)))
        return out

    torch.utils.checkpoint.checkpoint(region, x, use_reentrant=reentrant).sum().backward()
    return seen[0]


def check_checkpointed_region(model, features: int, reentrant: bool, recipe, switch: str, gen,
                              monkeypatch) -> None:
    """A checkpointed region (``model``): the C++ steps' original forward with the Python
    path's recomputation (a replay of the recorded scales) against the Python path throughout,
    over steps: outputs, every gradient and every FP8 layer's state bit for bit, every replay
    record used."""
    python_model = copy.deepcopy(model)
    xs = [randn(gen, 2, 12, features, scale=s) for s in (1.0, 20.0, 0.05)]

    def run(m):
        got = []
        for x in xs:
            x = x.clone().requires_grad_(True)
            with fp8_autocast(fp8_recipe=recipe):
                out = torch.utils.checkpoint.checkpoint(m, x, use_reentrant=reentrant)
            (out * out).sum().backward()
            got += [out.detach(), x.grad] + [p.grad.clone() for p in m.parameters()]
            m.zero_grad(set_to_none=True)
        # A reentrant checkpoint's backward update waits for the next step (amax_step's
        # BackwardStep); taking the state runs it, here rather than in the other run's step.
        m.state_dict()
        return got

    fused = run(model)
    python_path(monkeypatch, switch)
    python = run(python_model)
    for i, (a, b) in enumerate(zip(fused, python)):
        assert_bitwise_equal(a, b, f"value {i}")
    for layer, python_layer in zip(model, python_model):
        if not hasattr(layer, "fp8_fwd_amax_history"):
            continue  # (not an FP8 layer)
        for key in FP8_STATE_KEYS:
            assert_bitwise_equal(getattr(layer, key), getattr(python_layer, key), key)
        assert not layer._replay_records, "every record was replayed"
