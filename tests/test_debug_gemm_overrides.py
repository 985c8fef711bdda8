"""transformer_fp8.debug.override(..., gemms=...): the chosen GEMMs (fprop, dgrad, wgrad, of
every GEMM of a module or of one, "fc2.wgrad") run in high precision; every other tensor is bit
for bit what the plain FP8 run gives, the amaxes the remaining FP8 GEMMs need are recorded as
before; bad names are refused."""
from __future__ import annotations

import copy

import pytest
import torch
from conftest import assert_bitwise_equal, randn

import transformer_fp8 as tfp8
from transformer_fp8 import debug
from transformer_fp8.testing import sqnr

DELAYED = tfp8.DelayedScaling(amax_history_len=4)
RECIPES = [pytest.param(DELAYED, id="delayed"), pytest.param(tfp8.Float8CurrentScaling(),
                                                              id="current"),
           pytest.param(tfp8.Float8BlockScaling(), id="block")]
# step()'s tensors: output, input gradient, then the parameters' gradients in this order.
NAMES = ["out", "x.grad", "0.weight", "0.bias", "2.fc1_weight", "2.fc1_bias", "2.fc2_weight",
         "2.fc2_bias", "2.layer_norm_weight", "2.layer_norm_bias"]


def make_model():
    return torch.nn.Sequential(tfp8.Linear(64, 64), torch.nn.GELU(), tfp8.LayerNormMLP(64, 128))


def run(model, x, grads, recipe, hidden_grads=None):
    """Steps (one per grad), the last step's tensors (see NAMES); hidden_grads, if a list,
    receives the gradient reaching layer 0's output at each step."""
    for grad in grads:
        x_in = x.clone().requires_grad_(True)
        model.zero_grad()
        if recipe is None:
            hidden = model[0](x_in)
        else:
            with tfp8.fp8_autocast(fp8_recipe=recipe):
                hidden = model[0](x_in)
        if hidden_grads is not None:
            hidden.register_hook(hidden_grads.append)
        if recipe is None:
            out = model[2](model[1](hidden))
        else:
            with tfp8.fp8_autocast(fp8_recipe=recipe):
                out = model[2](model[1](hidden))
        out.backward(grad)
    params = dict(model.named_parameters())
    return [out.detach(), x_in.grad] + [params[name].grad.clone() for name in NAMES[2:]]


def setup(gen):
    torch.manual_seed(gen.initial_seed() % 2**31)
    model = make_model()
    x = randn(gen, 24, 64)
    grads = [randn(gen, 24, 64) * scale for scale in (1.0, 8.0)]  # the scales change
    return model, copy.deepcopy(model), x, grads


def assert_same_except(got, expected, changed: set):
    for name, g, e in zip(NAMES, got, expected):
        if name not in changed:
            assert_bitwise_equal(g, e, name)


@pytest.mark.parametrize("recipe", RECIPES)
def test_high_precision_wgrad_leaves_every_other_tensor_bit_identical(gen, recipe):
    model, plain, x, grads = setup(gen)
    debug.override(model, "0", fp8=False, gemms=["wgrad"])
    hidden_grads = []
    got = run(model, x, grads, recipe, hidden_grads)
    expected = run(plain, x, grads, recipe)
    assert_same_except(got, expected, {"0.weight"})
    # The weight gradient is torch's product of the unquantised grad_output and input.
    torch.testing.assert_close(got[2], hidden_grads[-1].t() @ x, rtol=1e-5, atol=1e-6)
    assert not torch.equal(got[2], expected[2])
    for name in ("fp8_fwd_amax_history", "fp8_bwd_amax_history", "fp8_fwd_scale",
                 "fp8_bwd_scale"):  # fprop and dgrad still cast (and record) the same tensors
        assert_bitwise_equal(getattr(model[0], name), getattr(plain[0], name), name)


@pytest.mark.parametrize("recipe", RECIPES)
def test_high_precision_fprop_and_dgrad(gen, recipe):
    model, plain, x, grads = setup(gen)
    debug.override(model, "0", fp8=False, gemms=["fprop"])
    got = run(model, x, grads, recipe)
    hp = copy.deepcopy(plain)
    expected = run(plain, x, grads, recipe)
    # fprop in high precision changes what every later tensor sees: compare layer 0's own
    # output against torch in a one-layer model instead.
    single, single_plain = copy.deepcopy(hp[0]), copy.deepcopy(hp[0])
    debug.override(torch.nn.Sequential(single), "0", fp8=False, gemms=["fprop", "dgrad"])
    x_in = x.clone().requires_grad_(True)
    with tfp8.fp8_autocast(fp8_recipe=recipe):
        out = single(x_in)
    out.backward(grads[0])
    x_ref = x.clone().requires_grad_(True)
    ref_out = single_plain(x_ref)  # outside fp8_autocast: torch.nn.Linear's computation
    ref_out.backward(grads[0])
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x_in.grad, x_ref.grad, rtol=1e-5, atol=1e-6)
    assert sqnr(single_plain.weight.grad, single.weight.grad) < 60  # wgrad still in FP8
    assert not torch.equal(got[0], expected[0])


MODULES = {"Linear": (lambda: tfp8.Linear(64, 64), [48]),
           "GroupedLinear": (lambda: tfp8.GroupedLinear(3, 64, 64), [16, 0, 32])}


def gemm_results(layer, splits, x, grad, recipe) -> dict:
    """One step's output (fprop), input gradient (dgrad), weight gradients (wgrad) and bias
    gradients (no GEMM)."""
    x = x.clone().requires_grad_(True)
    layer.zero_grad()
    with tfp8.fp8_autocast(fp8_recipe=recipe):
        out = layer(x) if len(splits) == 1 else layer(x, splits)
    out.backward(grad)
    grads = {n: p.grad for n, p in layer.named_parameters()}
    return {"fprop": out.detach(), "dgrad": x.grad,
            "wgrad": torch.cat([g for n, g in grads.items() if "weight" in n]),
            "bias": torch.cat([g for n, g in grads.items() if "bias" in n])}


@pytest.mark.parametrize("kind", ["fprop", "dgrad", "wgrad"])
@pytest.mark.parametrize("recipe", RECIPES + [pytest.param(tfp8.Float8RowwiseScaling(),
                                                           id="rowwise")])
@pytest.mark.parametrize("module", list(MODULES))
def test_one_gemm_kind_in_high_precision_leaves_the_two_others_bit_identical(
        gen, module, recipe, kind):
    """gemms=[kind]: that GEMM's result is torch's float32 product of the unquantised
    operands (which the FP8 one is not), the two other GEMMs' results (and the bias
    gradients) bit for bit the plain FP8 run's, over steps whose delayed scales change. (A
    mapping of "fprop" that also ran dgrad in high precision passed every test.)"""
    make, splits = MODULES[module]
    torch.manual_seed(gen.initial_seed() % 2**31)
    layer = make()
    plain = copy.deepcopy(layer)
    debug.override(torch.nn.Sequential(layer), "0", fp8=False, gemms=[kind])
    weights = [p.detach() for n, p in layer.named_parameters() if "weight" in n]
    biases = [p.detach() for n, p in layer.named_parameters() if "bias" in n]
    for scale in (1.0, 8.0, 0.25):
        x, grad = randn(gen, 48, 64) * scale, randn(gen, 48, 64) / scale
        got = gemm_results(layer, splits, x, grad, recipe)
        expected = gemm_results(plain, splits, x, grad, recipe)
        xs, gs = x.split(splits), grad.split(splits)
        exact = {"fprop": torch.cat([torch.nn.functional.linear(a, w, b)
                                     for a, w, b in zip(xs, weights, biases)]),
                 "dgrad": torch.cat([g @ w for g, w in zip(gs, weights)]),
                 "wgrad": torch.cat([g.t() @ a for a, g in zip(xs, gs)])}
        for name in ("fprop", "dgrad", "wgrad", "bias"):
            if name != kind:
                assert_bitwise_equal(got[name], expected[name], f"{name} (scale {scale})")
        assert got[kind].dtype == torch.float32
        torch.testing.assert_close(got[kind], exact[kind], rtol=1e-5, atol=1e-5)
        assert not torch.allclose(expected[kind], exact[kind], rtol=1e-5, atol=1e-5)


def test_every_gemm_in_high_precision_is_the_high_precision_layer(gen):
    model, plain, x, grads = setup(gen)
    debug.override(model, "0", fp8=False, gemms=["fprop", "dgrad", "wgrad"])
    debug.override(plain, "0", fp8=False)
    got, expected = run(model, x, grads, DELAYED), run(plain, x, grads, DELAYED)
    for name, g, e in zip(NAMES, got, expected):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-5, msg=name)
    assert not model[0].fp8_fwd_amax_history.any()  # nothing of layer 0 was cast
    assert not model[0].fp8_bwd_amax_history.any()


@pytest.mark.parametrize("recipe", RECIPES)
def test_one_gemm_of_layernorm_mlp(gen, recipe):
    model, plain, x, grads = setup(gen)
    reference = copy.deepcopy(plain)
    debug.override(model, "2", fp8=False, gemms="fc2.wgrad")
    got = run(model, x, grads, recipe)
    expected = run(plain, x, grads, recipe)
    assert_same_except(got, expected, {"2.fc2_weight"})
    fc2 = NAMES.index("2.fc2_weight")
    exact = run(reference, x, grads, None)
    assert sqnr(exact[fc2], got[fc2]) > sqnr(exact[fc2], expected[fc2])  # no E5M2 grad_output there


def test_bad_gemm_names_are_refused_and_nothing_changes():
    model = make_model()
    with pytest.raises(ValueError, match="'xgrad' names no GEMM kind"):
        debug.override(model, "*", fp8=False, gemms=["xgrad"])
    with pytest.raises(ValueError, match="has no GEMM 'fc3'"):
        debug.override(model, "2", fp8=False, gemms=["fc3.wgrad"])
    with pytest.raises(ValueError, match="has no GEMM 'fc1'"):
        debug.override(model, "*", fp8=False, gemms=["fc1.wgrad"])  # layer 0 has one GEMM
    with pytest.raises(ValueError, match="with fp8=False"):
        debug.override(model, "*", gemms=["wgrad"])
    with pytest.raises(TypeError, match="gemms must hold strings"):
        debug.override(model, "*", fp8=False, gemms=[3])
    assert debug.overrides(model) == {}


def test_an_empty_gemms_list_is_refused():
    """gemms=[] (a list built by a filter that kept nothing) ran the whole layer in high
    precision, as fp8=False without gemms does."""
    model = make_model()
    for empty in ([], (), iter([])):
        with pytest.raises(ValueError, match="gemms must name at least one GEMM"):
            debug.override(model, "0", fp8=False, gemms=empty)
    assert debug.overrides(model) == {}
    # An iterator is read once, for every matching module (the second module saw it empty).
    debug.override(model, "*", fp8=False, gemms=iter(["wgrad"]))
    assert {name: bool(o.gemms) for name, o in debug.overrides(model).items()} == \
        {"0": True, "2": True}


@pytest.mark.parametrize("kind", ["fprop", "dgrad", "wgrad"])
def test_an_input_without_gradient_leaves_the_state_of_the_plain_run(gen, kind):
    """An input that needs no gradient (a first layer): no dgrad reads the weight's transpose.
    Under an fprop override that was the weight's only FP8 orientation, so nothing was cast:
    no amax recorded, no scale kept for a recomputation (the first forward of a reentrant
    checkpoint, whose replay then recorded the amax after the update and cast with the new
    scale). The plain run casts the weight for fprop: the override casts it as well."""
    torch.manual_seed(gen.initial_seed() % 2**31)
    model = torch.nn.Sequential(tfp8.Linear(64, 64))
    plain = copy.deepcopy(model)
    debug.override(model, "0", fp8=False, gemms=[kind])
    for scale in (1.0, 8.0, 0.5):
        x, grad = randn(gen, 24, 64) * scale, randn(gen, 24, 64)
        for m in (model, plain):
            with tfp8.fp8_autocast(fp8_recipe=DELAYED):
                out = m(x)
            out.backward(grad)
    for name in ("fp8_fwd_amax_history", "fp8_fwd_scale", "fp8_fwd_scale_inv"):
        assert_bitwise_equal(getattr(model[0], name), getattr(plain[0], name), name)


@pytest.mark.parametrize("gemms", [["fprop"], ["fprop", "dgrad"]])
def test_a_compiled_fprop_override_is_bit_identical_to_eager(gemms):
    """torch.compile (aot_eager) of a layer whose fprop runs in high precision, under delayed
    scaling: the FP8 GEMMs' scale_invs (copies kept for backward) were used by no forward
    GEMM, so the compiler moved the copies into the backward, which read the scales the
    update had rewritten (RuntimeError: modified by an inplace operation)."""
    from integration_compare import assert_bit_identical, step_batches, train
    torch.manual_seed(0)
    eager = make_model()
    debug.override(eager, "*", fp8=False, gemms=gemms)
    compiled = copy.deepcopy(eager)
    torch._dynamo.reset()
    compiled_fn = torch.compile(compiled, backend="aot_eager")
    batches = step_batches(torch.Generator().manual_seed(0), 3, 24, 64)
    assert_bit_identical(train(compiled, compiled_fn, batches, DELAYED),
                         train(eager, eager, batches, DELAYED))
    a, b = torch.randn(16, 32), torch.randn(8, 32)
    torch.library.opcheck(torch.ops.transformer_fp8_debug.linear_keeping,
                          (a, b, torch.randn(8), [torch.ones(1)]))
