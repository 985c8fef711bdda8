"""transformer_fp8.debug.override: a layer overridden to high precision computes bit for bit
what it computes outside fp8_autocast (forward and gradients) and records no FP8 state; one
overridden to a stateless recipe computes bit for bit what that recipe's fp8_autocast gives;
the other layers are unaffected; bad arguments are refused."""
from __future__ import annotations

import copy

import pytest
import torch
from conftest import assert_bitwise_equal, randn

import transformer_fp8 as tfp8
from transformer_fp8 import debug

DELAYED = tfp8.DelayedScaling(amax_history_len=4)


def make_model(device):
    return torch.nn.Sequential(tfp8.Linear(64, 64, device=device), torch.nn.GELU(),
                               tfp8.LayerNormMLP(64, 128, device=device))


def step(model, x, grad, recipe):
    """(output, input gradient, parameter gradients) of one step; recipe None: no autocast."""
    x = x.clone().requires_grad_(True)
    model.zero_grad()
    if recipe is None:
        out = model(x)
    else:
        with tfp8.fp8_autocast(fp8_recipe=recipe):
            out = model(x)
    out.backward(grad)
    return [out.detach(), x.grad] + [p.grad.clone() for p in model.parameters()]


def assert_same(got, expected):
    for i, (g, e) in enumerate(zip(got, expected)):
        assert_bitwise_equal(g, e, f"tensor {i}")


@pytest.mark.parametrize("recipe", [DELAYED, tfp8.Float8CurrentScaling(),
                                    tfp8.Float8BlockScaling(), tfp8.Float8RowwiseScaling()],
                         ids=["delayed", "current", "block", "rowwise"])
def test_high_precision_override_is_bit_identical_to_the_layer_outside_fp8(gen, device, recipe):
    torch.manual_seed(gen.initial_seed() % 2**31)
    model = make_model(device)
    reference = copy.deepcopy(model)
    assert debug.override(model, "2", fp8=False) == ["2"]
    x, grad = randn(gen, 16, 64, device=device), randn(gen, 16, 64, device=device)
    got = step(model, x, grad, recipe)
    # Reference: layer 0 in FP8 (same recipe), layer 2 in high precision by hand.
    x_in = x.clone().requires_grad_(True)
    with tfp8.fp8_autocast(fp8_recipe=recipe):
        hidden = reference[1](reference[0](x_in))
    out = reference[2](hidden)  # outside the context: its torch composition
    out.backward(grad)
    assert_same(got, [out.detach(), x_in.grad] + [p.grad for p in reference.parameters()])
    assert not model[2].fp8_fwd_amax_history.any() and not model[2].fp8_bwd_amax_history.any()
    assert debug.overrides(model) == {"2": debug.PrecisionOverride(None)}
    assert debug.clear_overrides(model) == ["2"] and debug.overrides(model) == {}
    step(model, x, grad, DELAYED)
    assert model[2].fp8_fwd_amax_history.any()  # FP8 again


@pytest.mark.parametrize("override_recipe", [tfp8.Float8CurrentScaling(),
                                             tfp8.Float8BlockScaling(),
                                             tfp8.Float8RowwiseScaling()],
                         ids=["current", "block", "rowwise"])
def test_recipe_override_is_bit_identical_to_that_recipe(gen, device, override_recipe):
    """Over steps whose inputs change scale: bit for bit that recipe's run, and the delayed
    state of the overridden layers (histories, scales, scale_invs, forward and backward) left
    as it was."""
    torch.manual_seed(gen.initial_seed() % 2**31)
    model = make_model(device)
    debug.override(model, ["0", "2"], recipe=override_recipe)
    reference = copy.deepcopy(model)
    debug.clear_overrides(reference)
    state = {n: b.clone() for n, b in model.named_buffers() if "scale" in n}
    assert len(state) == 8  # forward and backward scale and scale_inv of both layers
    for scale in (1.0, 8.0, 0.25):
        x = randn(gen, 16, 64, device=device) * scale
        grad = randn(gen, 16, 64, device=device) / scale
        assert_same(step(model, x, grad, DELAYED), step(reference, x, grad, override_recipe))
    for name, buffer in model.named_buffers():
        if "amax_history" in name:  # (resized to DELAYED's length: nothing recorded)
            assert not buffer.any(), name
        elif name in state:  # (not fp8_recipe_fields: DELAYED adopted)
            assert_bitwise_equal(buffer, state[name], name)


class _Parallel(torch.nn.Module):
    """Three FP8 layers on the same input, their outputs summed: an override of one leaves the
    others' inputs as they were."""

    def __init__(self):
        super().__init__()
        self.branches = torch.nn.ModuleList([tfp8.Linear(64, 64) for _ in range(3)])

    def forward(self, x):
        return sum(branch(x) for branch in self.branches)


def test_only_the_matching_layers_change(gen):
    """Over two steps: the other layers' outputs, gradients and FP8 state are bit for bit those
    of the run without the override; the overridden one computes in high precision (its
    gradients those of torch.nn.Linear) and records no amax."""
    torch.manual_seed(gen.initial_seed() % 2**31)
    model = _Parallel()
    reference = copy.deepcopy(model)
    debug.override(model, "branches.1", fp8=False)
    for _ in range(2):
        x, grad = randn(gen, 16, 64), randn(gen, 16, 64)
        step(model, x, grad, DELAYED)
        step(reference, x, grad, DELAYED)
        for i in (0, 2):
            got, expected = model.branches[i], reference.branches[i]
            for a, e in zip(got.fp8_state_tensors(), expected.fp8_state_tensors()):
                assert_bitwise_equal(a, e, f"branch {i} FP8 state")
            for a, e in zip(got.parameters(), expected.parameters()):
                assert_bitwise_equal(a.grad, e.grad, f"branch {i} gradients")
        overridden = model.branches[1]
        assert not overridden.fp8_fwd_amax_history.any()
        assert not overridden.fp8_bwd_amax_history.any()
        plain = torch.nn.Linear(64, 64)
        plain.load_state_dict(overridden.state_dict(), strict=False)
        out = plain(x)
        out.backward(grad)
        assert_bitwise_equal(overridden.weight.grad, plain.weight.grad, "high-precision wgrad")


def test_override_refuses_bad_arguments():
    model = make_model("cpu")
    with pytest.raises(ValueError, match="needs fp8=False .* or a recipe"):
        debug.override(model, "0")
    with pytest.raises(ValueError, match="either fp8=False or a recipe, not both"):
        debug.override(model, "0", fp8=False, recipe=tfp8.Float8CurrentScaling())
    with pytest.raises(TypeError, match="recipe must be a Float8CurrentScaling.*DelayedScaling"):
        debug.override(model, "0", recipe=DELAYED)
    with pytest.raises(ValueError, match=r"layers='9' matches no FP8 module"):
        debug.override(model, "9", fp8=False)
    with pytest.raises(TypeError, match="fp8 must be a bool, got 0"):
        debug.override(model, "0", fp8=0)


def test_an_override_is_immutable_and_hashable():
    """PrecisionOverride is a value: hashable (a per-GEMM one raised "unhashable type: 'dict'")
    and unchangeable, so what overrides() returns cannot change a module's override (its gemms
    dict of sets could be changed in place, past override()'s checks)."""
    model = make_model("cpu")
    debug.override(model, "0", fp8=False, gemms=["wgrad"])
    debug.override(model, "2", fp8=False, gemms="fc1.dgrad")
    got = debug.overrides(model)
    assert len({got["0"], got["2"], copy.deepcopy(got["0"])}) == 2
    with pytest.raises(AttributeError):
        got["2"].gemms.add((1, "fprop"))
    assert got["0"] == debug.PrecisionOverride(None, {(0, "wgrad")})
    assert got["2"] == debug.PrecisionOverride(None, [(0, "dgrad")])  # (fc1: GEMM 0)
    with pytest.raises(AttributeError):
        got["2"].gemms = frozenset()
    got.clear()
    assert debug.overrides(model)["2"] == debug.PrecisionOverride(None, {(0, "dgrad")})
    assert hash(debug.PrecisionOverride(tfp8.Float8CurrentScaling()))


def test_bad_arguments_are_named_with_what_was_expected():
    """Each refused argument is named, with what was expected and what was given (gemms=3
    raised "'int' object is not iterable", a recipe class "got type", override(None, ...) an
    AttributeError; an E5M2 recipe was accepted and failed at the first forward; a pattern
    naming a TransformerLayer did not say how to reach its FP8 modules)."""
    model = torch.nn.Sequential(tfp8.TransformerLayer(64, 128, 4), tfp8.GroupedLinear(2, 64, 64))
    with pytest.raises(TypeError, match=r"gemms must be a GEMM name or an iterable.*got int 3"):
        debug.override(model, "1", fp8=False, gemms=3)
    with pytest.raises(TypeError, match=r"gemms must be .*got bytes b'wgrad'"):
        debug.override(model, "1", fp8=False, gemms=b"wgrad")
    with pytest.raises(TypeError, match=r"gemms must hold strings .*got int 3"):
        debug.override(model, "1", fp8=False, gemms=["wgrad", 3])
    with pytest.raises(ValueError, match=r"'.wgrad' has no GEMM name before the dot"):
        debug.override(model, "1", fp8=False, gemms=[".wgrad"])
    with pytest.raises(TypeError, match=r"got the class Float8CurrentScaling: pass an "
                                        r"instance, e.g. Float8CurrentScaling\(\)"):
        debug.override(model, "1", recipe=tfp8.Float8CurrentScaling)
    e5m2 = tfp8.Float8CurrentScaling(fp8_format=tfp8.recipe.Format.E5M2)
    with pytest.raises(ValueError, match=r"recipe: Format.E5M2 cannot train"):
        debug.override(model, "1", recipe=e5m2)
    for call in (lambda: debug.override(None, "*", fp8=False),
                 lambda: debug.clear_overrides(None), lambda: debug.overrides(None)):
        with pytest.raises(TypeError, match="model must be a torch.nn.Module, got NoneType"):
            call()
    with pytest.raises(ValueError, match=r"layers='0' matches no FP8 module of the model; its "
                                         r"FP8 modules are: 0.self_attention.layernorm_qkv, "
                                         r"0.self_attention.proj, 0.layernorm_mlp, 1 \('0' is a "
                                         r"TransformerLayer.*match them with '0.\*'\)"):
        debug.override(model, "0", fp8=False)
    assert debug.overrides(model) == {}
    debug.override(model, "0.*", fp8=False)
    with pytest.raises(ValueError, match=r"layers='0.self_attn\*' matches no FP8 module; the "
                                         r"modules with an override: 0.layernorm_mlp, "):
        debug.clear_overrides(model, "0.self_attn*")  # a typo: the overrides stay
    assert debug.clear_overrides(model, "1") == []  # an FP8 module, not overridden: nothing
    assert len(debug.overrides(model)) == 3
    assert debug.clear_overrides(model, "0.self_attention.*") == [
        "0.self_attention.layernorm_qkv", "0.self_attention.proj"]
    assert debug.clear_overrides(model) == ["0.layernorm_mlp"]
    assert debug.clear_overrides(model) == []  # every override (none left): no error


@pytest.mark.parametrize("recipe", [DELAYED, tfp8.Float8CurrentScaling()], ids=["delayed",
                                                                               "current"])
def test_an_override_is_honoured_by_the_linear_ticket_however_it_is_set(recipe):
    """The Linear ticket (the C++ step of the last forward, called again) checks the override
    itself: one set past Fp8State.__setattr__ (which drops the ticket) ran in FP8."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(tfp8.Linear(64, 64))
    x = torch.randn(32, 64, requires_grad=True)
    expected = torch.nn.functional.linear(x, model[0].weight, model[0].bias)
    with tfp8.fp8_autocast(fp8_recipe=recipe):
        model(x)
        model(x)
        assert model[0]._fused_ticket is not None
        model[0].__dict__["_fp8_override"] = debug.PrecisionOverride(None)
        out = model(x)
    assert_bitwise_equal(out, expected, "output")
