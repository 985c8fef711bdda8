"""transformer_fp8.testing: sqnr / rel_error on hand-made tensors, compare_to_reference against
a step computed by hand, assert_fp8_parity on models that pass and on planted errors that must
fail, and the pytest plugin (fixture, ini thresholds, entry point, import cost)."""
from __future__ import annotations

import copy
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import randn

import transformer_fp8 as tfp8
from transformer_fp8.quantization.autocast import current_state
from transformer_fp8.testing import (DEFAULT_GRAD_MIN_SQNR_DB, DEFAULT_MIN_SQNR_DB,
                                     assert_fp8_parity, compare_to_reference, rel_error, sqnr)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = tfp8.DelayedScaling(amax_history_len=16)


def in_fp8() -> bool:
    """Whether an enabled fp8_autocast is active (planted bugs below act only there)."""
    state = current_state()
    return state is not None and state.enabled


# ---- sqnr / rel_error --------------------------------------------------------------------------

def test_sqnr_and_rel_error_exact_values():
    expected = torch.tensor([3.0, 4.0])            # norm 5
    actual = torch.tensor([3.0, 4.0625])           # noise norm 1/16 (exact in float32)
    assert sqnr(actual, expected) == pytest.approx(20 * math.log10(80), abs=1e-12)
    assert rel_error(actual, expected) == 0.0125
    assert sqnr(expected.bfloat16(), expected) == math.inf            # 3 and 4 are exact
    assert rel_error(expected, expected) == 0.0
    assert sqnr(torch.ones(3), torch.zeros(3)) == -math.inf
    assert rel_error(torch.ones(3), torch.zeros(3)) == math.inf
    assert math.isnan(sqnr(torch.tensor([math.nan, 1.0]), expected))
    assert math.isnan(rel_error(expected, torch.tensor([1.0, math.nan])))


def test_sqnr_is_in_float64_whatever_the_inputs_dtype(gen):
    expected = randn(gen, 1000)
    actual = expected + randn(gen, 1000) * 1e-3
    by_hand = 20 * math.log10(expected.double().norm().item()
                              / (actual.double() - expected.double()).norm().item())
    assert sqnr(actual, expected) == pytest.approx(by_hand, rel=1e-12)


def test_sqnr_refuses_bad_arguments():
    with pytest.raises(ValueError, match=r"same shape.*\(2,\).*\(3,\)"):
        sqnr(torch.ones(2), torch.ones(3))
    with pytest.raises(TypeError, match="expected must be a torch.Tensor, got list"):
        rel_error(torch.ones(2), [1.0, 1.0])


# ---- compare_to_reference ----------------------------------------------------------------------

def linear_pair(gen, device, in_features=64, out_features=32):
    model = tfp8.Linear(in_features, out_features, device=device)
    with torch.no_grad():
        model.weight.copy_(randn(gen, out_features, in_features, device=device)
                           / in_features ** 0.5)
        model.bias.copy_(randn(gen, out_features, device=device))
    return model, copy.deepcopy(model)


def test_compare_matches_a_step_computed_by_hand(gen, device):
    model, reference = linear_pair(gen, device)
    by_hand = copy.deepcopy(model)
    x = randn(gen, 24, 64, device=device)
    loss_fn = lambda out: (out ** 2).mean()  # noqa: E731
    report = compare_to_reference(model, reference, x, loss_fn=loss_fn, recipe=RECIPE, steps=2)

    # The same steps by hand: a calibrating high-precision step with its backward (every
    # delayed scale from these inputs), then two FP8 steps.
    with tfp8.fp8_autocast(enabled=False, calibrating=True, fp8_recipe=RECIPE):
        out = by_hand(x.clone().requires_grad_(True))
    loss_fn(out).backward()
    for _ in range(2):
        x_fp8 = x.clone().requires_grad_(True)
        by_hand.zero_grad()
        with tfp8.fp8_autocast(fp8_recipe=RECIPE):
            out = by_hand(x_fp8)
        loss = loss_fn(out)
        loss.backward()
    x_ref = x.clone().requires_grad_(True)
    ref_out = reference(x_ref)
    ref_loss = loss_fn(ref_out)
    ref_loss.backward()
    assert [e.name for e in report.entries] == ["output", "loss", "input_grad[0]",
                                                "grad:weight", "grad:bias"]
    assert report["output"].sqnr_db == sqnr(out, ref_out)
    assert report["loss"].rel_error == rel_error(loss, ref_loss)
    assert report["input_grad[0]"].sqnr_db == sqnr(x_fp8.grad, x_ref.grad)
    assert report["grad:weight"].sqnr_db == sqnr(by_hand.weight.grad, reference.weight.grad)
    assert report["grad:weight"].shape == (32, 64)
    assert 23 <= report["output"].sqnr_db < 60  # FP8, not high precision
    # The FP8 state advanced as by hand; nothing was written to .grad.
    assert torch.equal(model.fp8_fwd_scale, by_hand.fp8_fwd_scale)
    assert torch.equal(model.fp8_bwd_amax_history, by_hand.fp8_bwd_amax_history)
    assert model.weight.grad is None and model.bias.grad is None


def test_compare_with_the_model_itself_as_reference(gen, device):
    model, copy_ = linear_pair(gen, device)
    x = randn(gen, 16, 64, device=device)
    same = compare_to_reference(model, model, x, recipe=tfp8.Float8CurrentScaling())
    separate = compare_to_reference(model, copy_, x, recipe=tfp8.Float8CurrentScaling())
    assert [(e.name, e.sqnr_db) for e in same.entries] == \
        [(e.name, e.sqnr_db) for e in separate.entries]
    table = str(same)
    assert "grad:weight" in table and "32x64" in table and "SQNR (dB)" in table


def test_compare_bfloat16_model_against_float32_reference(gen, device):
    model, _ = linear_pair(gen, device)
    model = model.to(torch.bfloat16)
    reference = copy.deepcopy(model).float()
    x = randn(gen, 32, 64, device=device, dtype=torch.bfloat16)
    report = assert_fp8_parity(model, reference, x, recipe=RECIPE)
    assert report["output"].sqnr_db >= 23 and report["grad:weight"].sqnr_db >= 19


def test_compare_same_dropout_masks_in_both_runs(gen, device):
    model = torch.nn.Sequential(tfp8.Linear(64, 64, device=device), torch.nn.Dropout(0.5))
    x = randn(gen, 32, 64, device=device)
    report = compare_to_reference(model, copy.deepcopy(model), x, recipe=RECIPE)
    assert report["output"].sqnr_db >= 23  # different masks would give ~0 dB


def test_compare_refuses_bad_arguments(gen):
    model, reference = linear_pair(gen, "cpu")
    x = randn(gen, 16, 64)
    with pytest.raises(ValueError, match="steps must be a positive integer, got 0"):
        compare_to_reference(model, reference, x, steps=0)
    with pytest.raises(ValueError, match=r"reference has no trainable parameter named \['1"):
        compare_to_reference(torch.nn.Sequential(torch.nn.ReLU(), model), reference, x)
    with pytest.raises(TypeError, match="reference must be a torch.nn.Module, got function"):
        compare_to_reference(model, lambda t: t, x)
    with pytest.raises(ValueError, match="loss_fn must return a one-element tensor"):
        compare_to_reference(model, reference, x, loss_fn=lambda out: out)
    with pytest.raises(ValueError, match="grad_min_sqnr_db must be a number of dB"):
        assert_fp8_parity(model, reference, x, grad_min_sqnr_db="high")


# ---- assert_fp8_parity -------------------------------------------------------------------------

@pytest.mark.parametrize("recipe", [RECIPE, tfp8.Float8CurrentScaling(),
                                    tfp8.Float8BlockScaling()], ids=["delayed", "current",
                                                                     "block"])
def test_parity_passes_on_fp8_modules(gen, device, recipe):
    torch.manual_seed(gen.initial_seed() % 2**31)
    model = torch.nn.Sequential(tfp8.LayerNormMLP(64, 128, device=device),
                                tfp8.Linear(64, 32, device=device))
    report = assert_fp8_parity(model, copy.deepcopy(model).float(),
                               randn(gen, 4, 16, 64, device=device), recipe=recipe)
    assert report.failures(DEFAULT_MIN_SQNR_DB, DEFAULT_GRAD_MIN_SQNR_DB) == []
    assert len([e for e in report.entries if e.kind == "param_grad"]) == 8


def test_planted_wrong_gradient_fails_and_is_named(gen, device):
    model, reference = linear_pair(gen, device)
    x = randn(gen, 32, 64, device=device)
    assert_fp8_parity(model, reference, x, recipe=RECIPE)
    model.weight.register_hook(lambda g: g * 2)  # a wrong scale in the weight gradient only
    with pytest.raises(AssertionError) as failure:
        assert_fp8_parity(model, reference, x, recipe=RECIPE)
    message = str(failure.value)
    assert message.startswith("FP8 parity failed for 1 tensor(s), worst first: grad:weight: ")
    assert f"< {DEFAULT_GRAD_MIN_SQNR_DB} dB (rel. error " in message
    entry = failure.value.args[0]
    reported = float(entry.split("grad:weight: ")[1].split(" dB")[0])
    # 2g against g: the noise is as large as the signal, 0 dB, give or take the FP8 error of g
    # (2 g_fp8 - g = g + 2 e with |e| / |g| ~ 0.03-0.1 here: -0.13 dB at seed 2138830950)
    assert abs(reported) < 1.0
    assert "output" in message  # the whole table follows


def test_planted_transposed_input_fails(gen, device):
    """An FP8 path that multiplies the wrong operand layout (x reversed along the features)
    is far from the reference: the output, input and weight gradients fail (the bias
    gradient, grad_output's column sums, is the same)."""
    model, reference = linear_pair(gen, device, 64, 64)

    class Wrong(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return self.inner(x.flip(-1) if in_fp8() else x)

    wrapped, wrapped_ref = Wrong(model), Wrong(reference)
    with pytest.raises(AssertionError) as failure:
        assert_fp8_parity(wrapped, wrapped_ref, randn(gen, 32, 64, device=device),
                          recipe=RECIPE)
    listed = str(failure.value).split("\n")[0]
    assert listed.startswith("FP8 parity failed for 3 tensor(s), worst first: ")
    for name in ("output: ", "input_grad[0]: ", "grad:inner.weight: "):
        assert name in listed
    assert "grad:inner.bias: " not in listed


def test_nan_fails_parity(gen):
    model, reference = linear_pair(gen, "cpu")
    with torch.no_grad():
        model.weight[0, 0] = math.nan
    with pytest.raises(AssertionError, match="output: nan dB"):
        assert_fp8_parity(model, reference, randn(gen, 16, 64), recipe=RECIPE)


def test_sqnr_with_infinities():
    """Equal infinities add no noise; an inf against a finite value is infinite noise (the
    check fails, with a report, rather than raising 'math domain error')."""
    expected = torch.tensor([3.0, 4.0, -math.inf])
    assert sqnr(expected.clone(), expected) == math.inf
    assert sqnr(torch.tensor([3.0, 4.0625, -math.inf]), expected) == pytest.approx(
        20 * math.log10(80), abs=1e-12)
    assert sqnr(torch.tensor([3.0, math.inf, -math.inf]), expected) == -math.inf
    assert rel_error(torch.tensor([3.0, math.inf, -math.inf]), expected) == math.inf
    assert sqnr(torch.tensor([3.0, 4.0, 0.0]), expected) == -math.inf


class _CutInFp8(torch.nn.Module):
    """Two layers; under an enabled fp8_autocast the first one's output is detached (a planted
    graph cut: its gradients, and the input's, vanish)."""

    def __init__(self, first, second):
        super().__init__()
        self.first, self.second = first, second

    def forward(self, x):
        h = self.first(x)
        return self.second(h.detach() if in_fp8() else h)


def test_a_gradient_missing_from_the_fp8_run_fails(gen):
    model = _CutInFp8(tfp8.Linear(64, 64), tfp8.Linear(64, 32))
    reference = copy.deepcopy(model)
    with pytest.raises(AssertionError) as failure:
        assert_fp8_parity(model, reference, randn(gen, 16, 64), recipe=RECIPE)
    listed = str(failure.value).split("\n")[0]
    for name in ("input_grad[0]: -inf dB", "grad:first.weight: -inf dB",
                 "grad:first.bias: -inf dB"):
        assert name in listed, listed


def test_the_reference_runs_in_high_precision_inside_a_callers_fp8_autocast(gen):
    """Inside an outer fp8_autocast the reference ran in FP8 too: a planted x2 in the FP8 path
    then compared FP8 with FP8 and passed (inf dB)."""
    class Doubled(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return self.inner(x) * (2 if in_fp8() else 1)

    model = Doubled(tfp8.Linear(64, 32))
    with tfp8.fp8_autocast(fp8_recipe=RECIPE), pytest.raises(AssertionError, match="output: "):
        assert_fp8_parity(model, model, randn(gen, 16, 64), recipe=RECIPE)


@pytest.mark.parametrize("option", ["fuse_wgrad_accumulation", "delay_wgrad_compute"])
def test_routed_weight_gradients_are_refused(gen, option):
    model = tfp8.Linear(64, 32, **{option: True})
    with pytest.raises(ValueError, match="bypass autograd"):
        compare_to_reference(model, model, randn(gen, 16, 64), recipe=RECIPE)


def test_a_gradient_that_is_zero_in_math_is_measured_against_the_noise_floor(gen):
    """A key bias before a softmax has a gradient that is zero in math: both runs hold rounding
    noise (-3 to +1 dB against its own norm, so a correct TransformerLayer failed). It is
    measured against GRAD_NOISE_FLOOR times the largest parameter gradient; a real gradient of
    that size in the FP8 run still fails."""
    import copy

    from transformer_fp8.testing import GRAD_NOISE_FLOOR
    torch.manual_seed(0)
    layer = tfp8.TransformerLayer(64, 256, 2, hidden_dropout=0.0, attention_dropout=0.0)
    x = randn(gen, 16, 4, 64)
    report = assert_fp8_parity(layer, copy.deepcopy(layer), x, recipe=RECIPE)
    assert report["grad:self_attention.layernorm_qkv.key_bias"].sqnr_db >= 10

    class LeakyKeyBias(torch.nn.Module):  # planted: the FP8 run's key-bias gradient is real
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, inp):
            out = self.inner(inp)
            state = tfp8.quantization.autocast.current_state()
            if state is not None and state.enabled:
                bias = self.inner.self_attention.layernorm_qkv.key_bias
                out = out + bias.sum() * 1e-2
            return out

    leaky = LeakyKeyBias(layer)
    with pytest.raises(AssertionError, match="key_bias"):
        assert_fp8_parity(leaky, copy.deepcopy(leaky), x, recipe=RECIPE)
    assert 0 < GRAD_NOISE_FLOOR < 1e-3


class LayerScaleBlock(torch.nn.Module):
    """x + gamma * fc2(gelu(fc1(x))) with a tiny gamma (LayerScale, as CaiT and DINOv2 start
    it): fc1's and fc2's gradients are real but ~gamma times the others."""

    def __init__(self, gamma: float):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(256, 1024), torch.nn.Linear(1024, 256)
        self.gamma = torch.nn.Parameter(torch.full((256,), gamma))

    def forward(self, x):
        return x + self.gamma * self.fc2(torch.nn.functional.gelu(self.fc1(x)))


@pytest.mark.parametrize("gamma", [1e-5, 1e-6])
def test_a_small_real_gradient_is_not_taken_for_noise(gen, gamma):
    """A LayerScale branch's weight gradients fall under the noise floor, but a float64 run
    shows them real: measured against their own size, a gradient doubled, zeroed or negated by
    the FP8 path fails (it passed at 14-35 dB against the floor); the correct model passes."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), LayerScaleBlock(gamma),
                                torch.nn.Linear(256, 256))
    tfp8.convert_to_fp8(model)
    x = randn(gen, 4, 64, 256)
    assert_fp8_parity(model, copy.deepcopy(model), x, recipe=RECIPE)
    for factor in (2.0, 0.0, -1.0):
        broken = copy.deepcopy(model)
        broken[1].fc1.weight.register_hook(
            lambda g, factor=factor: g * factor if current_state() is not None else g)
        with pytest.raises(AssertionError, match="grad:1.fc1.weight"):
            assert_fp8_parity(broken, copy.deepcopy(model), x, recipe=RECIPE)


def test_a_zero_gradient_under_an_upcast_softmax_keeps_the_noise_floor(gen):
    """A key bias before a softmax computed in float32 whatever the parameters' dtype (as
    HuggingFace's eager attention does): the float64 run holds float32 noise there too, not
    the reference's noise, so the gradient is still taken as zero in math (it failed at -2 dB
    when a float64 run that was not all float64 marked it real)."""
    class Attention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k = torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)
            self.v, self.o = torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)

        def forward(self, x):
            w = self.q(x) @ self.k(x).transpose(-1, -2) / 8.0
            p = torch.nn.functional.softmax(w, dim=-1, dtype=torch.float32).to(x.dtype)
            return self.o(p @ self.v(x))

    torch.manual_seed(0)
    model = tfp8.convert_to_fp8(Attention())
    report = assert_fp8_parity(model, copy.deepcopy(model), randn(gen, 4, 32, 64),
                               recipe=RECIPE)
    assert report["grad:k.bias"].sqnr_db > 10


def test_a_zero_initialised_branch_still_counts_as_fp8(gen):
    """x + fc2(gelu(fc1(x))) with fc2 zero-initialised (ReZero, adaLN-Zero): the output is
    bit for bit the high-precision one, the gradients are not; it ran in FP8 and passes."""
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = tfp8.Linear(64, 128), tfp8.Linear(128, 64)
            torch.nn.init.zeros_(self.fc2.weight)
            torch.nn.init.zeros_(self.fc2.bias)

        def forward(self, x):
            return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))

    torch.manual_seed(0)
    block = Block()
    report = assert_fp8_parity(block, copy.deepcopy(block), randn(gen, 16, 64), recipe=RECIPE)
    assert report.ran_in_fp8 and report["output"].sqnr_db == math.inf


def test_nothing_in_fp8_is_told_in_the_fp8_runs_grad_mode(gen):
    """torch's TransformerEncoderLayer takes another path without gradients (its fast path):
    the run outside FP8 that tells whether anything ran in FP8 records gradients as the FP8
    run does, so an unconverted bfloat16 copy is still seen as nothing in FP8."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True).eval()
    with pytest.raises(AssertionError, match="nothing ran in FP8"):
        assert_fp8_parity(copy.deepcopy(layer).bfloat16(), layer,
                          randn(gen, 2, 8, 64).bfloat16(), recipe=RECIPE)


def test_small_real_gradients_behind_random_draws_of_the_activations_dtype(gen):
    """A forward that draws random numbers in its activations' dtype (noise injection, as
    DropPath draws): the float64 run draws others, so it is not taken as the judge of which
    small gradients are real; a LayerScale gradient zeroed by the FP8 path still fails."""
    class Noise(torch.nn.Module):
        def forward(self, x):
            return x + 0.1 * torch.randn_like(x)

    torch.manual_seed(0)
    model = tfp8.convert_to_fp8(torch.nn.Sequential(
        Noise(), torch.nn.Linear(256, 256), LayerScaleBlock(1e-6), torch.nn.Linear(256, 256)))
    x = randn(gen, 4, 64, 256)
    assert_fp8_parity(model, copy.deepcopy(model), x, recipe=RECIPE)
    broken = copy.deepcopy(model)
    broken[2].fc1.weight.register_hook(lambda g: g * 0.0 if current_state() is not None else g)
    with pytest.raises(AssertionError, match="grad:2.fc1.weight"):
        assert_fp8_parity(broken, copy.deepcopy(model), x, recipe=RECIPE)


def test_a_bfloat16_layer_passes_with_its_zero_key_bias_gradient(gen):
    """A bfloat16 TransformerLayer: its key-bias gradient is zero in math and holds bfloat16
    noise, measured against ten times the noise the layer shows there outside FP8 (against the
    float32-sized floor it failed at 3-6 dB)."""
    torch.manual_seed(0)
    layer = tfp8.TransformerLayer(64, 128, 4, hidden_dropout=0.0, attention_dropout=0.0,
                                  params_dtype=torch.bfloat16)
    x = randn(gen, 16, 2, 64).bfloat16()
    for reference in (copy.deepcopy(layer).float(), layer):
        assert_fp8_parity(layer, reference, x)


def test_dropout_drawn_from_an_rng_tracker_draws_the_same_masks_in_every_run(gen):
    """Attention dropout inside Transformer Engine's RNG tracker: the tracker's states are
    the same at the start of every run (they moved on at each fork: masks differed, 0-1 dB),
    and are put back afterwards."""
    from transformer_fp8.distributed import CudaRNGStatesTracker
    tracker = CudaRNGStatesTracker()
    tracker.add("model-parallel-rng", 1234)
    torch.manual_seed(0)
    layer = tfp8.TransformerLayer(64, 128, 4, hidden_dropout=0.0, attention_dropout=0.3,
                                  get_rng_state_tracker=lambda: tracker)
    before = tracker.get_states()
    report = assert_fp8_parity(layer, layer, randn(gen, 16, 2, 64), recipe=RECIPE)
    assert report["grad:self_attention.layernorm_qkv.query_weight"].sqnr_db > 15
    assert tracker.get_states() == before


def test_calibration_can_be_left_out(gen):
    """calibrate=False: the FP8 steps start from the model's scales as they are (a fresh
    layer's, 1), as training's first steps do."""
    torch.manual_seed(0)
    model = tfp8.convert_to_fp8(torch.nn.Sequential(torch.nn.Linear(64, 64)))
    x = randn(gen, 16, 64) * 1e3  # (saturates at scale 1)
    calibrated = compare_to_reference(copy.deepcopy(model), model, x, recipe=RECIPE, steps=1)
    fresh = compare_to_reference(copy.deepcopy(model), model, x, recipe=RECIPE, steps=1,
                                 calibrate=False)
    assert calibrated["output"].sqnr_db > 20 > fresh["output"].sqnr_db


def test_a_deep_model_with_a_loss_passes_with_the_default_steps(gen):
    """A correct 4-layer MLP with an MSE loss: a first FP8 step at gradient scale 1 flushed the
    small E5M2 gradients to zero, and the zeros cascaded one layer per step (0 dB for the first
    layer's gradients at steps=2). The calibrating step before the FP8 steps sets every scale."""
    torch.manual_seed(0)
    layers = []
    for _ in range(4):
        layers += [torch.nn.Linear(256, 256), torch.nn.GELU()]
    model = tfp8.convert_to_fp8(torch.nn.Sequential(*layers))
    x, y = randn(gen, 8, 64, 256), randn(gen, 8, 64, 256)
    report = assert_fp8_parity(model, copy.deepcopy(model), x,
                               loss_fn=lambda out: torch.nn.functional.mse_loss(out, y),
                               recipe=tfp8.DelayedScaling(amax_history_len=16))
    assert report["grad:0.weight"].sqnr_db > 15


def test_parity_fails_when_nothing_ran_in_fp8(gen):
    """A model that was never converted, or whose layers convert_to_fp8 skipped: its output
    inside fp8_autocast is its output outside, which must not pass as parity (also against a
    reference of another dtype, where the entries are not bit for bit the reference's)."""
    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(64, 32))
    x = randn(gen, 8, 64)
    with pytest.raises(AssertionError, match="nothing ran in FP8"):
        assert_fp8_parity(plain, copy.deepcopy(plain), x, recipe=RECIPE)
    with pytest.raises(AssertionError, match="nothing ran in FP8"):
        assert_fp8_parity(copy.deepcopy(plain).bfloat16(), plain, x.bfloat16(), recipe=RECIPE)
    converted = tfp8.convert_to_fp8(copy.deepcopy(plain))
    assert compare_to_reference(converted, plain, x, recipe=RECIPE).ran_in_fp8
    with pytest.warns(UserWarning, match="converted 0 of 1"):
        skipped = tfp8.convert_to_fp8(torch.nn.Sequential(torch.nn.Linear(50, 30)))
    with pytest.raises(AssertionError, match="nothing ran in FP8"):
        assert_fp8_parity(skipped, copy.deepcopy(skipped), randn(gen, 8, 50), recipe=RECIPE)


def test_an_output_dtype_changed_by_the_fp8_path_fails(gen):
    """A bfloat16 model whose FP8 path returns float32 (values cast to float64 for the SQNR
    compared equal): the output's dtype is compared when both runs have one parameter dtype."""
    class Widened(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = tfp8.Linear(64, 32, params_dtype=torch.bfloat16)

        def forward(self, inp):
            out = self.linear(inp)
            state = tfp8.quantization.autocast.current_state()
            return out.float() if state is not None and state.enabled else out

    model = Widened()
    x = randn(gen, 16, 64, dtype=torch.bfloat16)
    with pytest.raises(AssertionError, match=r"output dtype torch.float32 \(expected "
                                             r"torch.bfloat16\)"):
        assert_fp8_parity(model, model, x, recipe=RECIPE)


@pytest.mark.parametrize("context", ["no_grad", "inference_mode"])
def test_it_runs_under_no_grad_and_inference_mode(gen, context):
    """Called from code that turned autograd off: both runs still record their graphs."""
    torch.manual_seed(0)
    model = tfp8.Linear(64, 32)
    x = randn(gen, 16, 64)
    expected = compare_to_reference(model, model, x, recipe=RECIPE)
    torch.manual_seed(0)
    model = tfp8.Linear(64, 32)
    with getattr(torch, context)():
        report = compare_to_reference(model, model, x, recipe=RECIPE)
    assert [(e.name, e.sqnr_db) for e in report.entries] == \
        [(e.name, e.sqnr_db) for e in expected.entries]


def test_a_graph_cut_at_the_output_fails_with_every_gradient_named(gen):
    class CutAtOutput(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = tfp8.Linear(64, 32)

        def forward(self, inp):
            out = self.linear(inp)
            state = tfp8.quantization.autocast.current_state()
            return out.detach() if state is not None and state.enabled else out

    model = CutAtOutput()
    report = compare_to_reference(model, model, randn(gen, 16, 64), recipe=RECIPE)
    for name in ("input_grad[0]", "grad:linear.weight", "grad:linear.bias"):
        assert report[name].sqnr_db == -math.inf


def test_a_shape_mismatch_names_the_tensor(gen):
    import copy
    torch.manual_seed(0)
    model = torch.nn.Sequential(tfp8.Linear(64, 32))
    reference = copy.deepcopy(model)
    reference[0] = torch.nn.Linear(64, 48)  # (same parameter names, other shapes)
    with pytest.raises(ValueError, match="output: actual and expected must have the same shape"):
        compare_to_reference(model, reference, randn(gen, 16, 64), recipe=RECIPE)


# ---- the pytest plugin -------------------------------------------------------------------------

def test_pyproject_declares_the_plugin_entry_point():
    import tomllib

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)
    assert project["project"]["entry-points"]["pytest11"] == {
        "transformer_fp8": "pytest_transformer_fp8"}
    assert "pytest_transformer_fp8" in project["tool"]["setuptools"]["py-modules"]


def test_plugin_import_loads_neither_torch_nor_the_package():
    code = ("import sys, pytest_transformer_fp8; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('torch', 'transformer_fp8')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_plugin_fixture_and_ini_thresholds(tmp_path):
    (tmp_path / "pytest.ini").write_text("[pytest]\nfp8_grad_min_sqnr_db = 99\n")
    (tmp_path / "test_user.py").write_text(textwrap.dedent("""
        import copy
        import pytest
        import torch
        import transformer_fp8 as tfp8

        def model_and_reference():
            torch.manual_seed(0)
            model = tfp8.Linear(64, 32)
            return model, copy.deepcopy(model)

        def test_ini_threshold_applies(fp8_parity):
            with pytest.raises(AssertionError, match="< 99.0 dB"):
                fp8_parity(*model_and_reference(), torch.randn(16, 64))

        def test_keyword_overrides_ini(fp8_parity):
            report = fp8_parity(*model_and_reference(), torch.randn(16, 64),
                                grad_min_sqnr_db=15)
            assert report["output"].sqnr_db > 20
    """))
    _run_plugin_tests(tmp_path, "2 passed")


def _run_plugin_tests(folder, expected: str) -> None:
    """pytest on ``folder`` with the checkout's plugin, loaded by name: whether or not an
    installed package has already registered it through its pytest11 entry point (which would
    register it twice)."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                             "-p", "pytest_transformer_fp8", str(folder)],
                            cwd=folder, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert expected in result.stdout


def test_plugin_thresholds_from_pytest_9_native_toml(tmp_path):
    """pytest 9's [tool.pytest] table gives numbers, not strings: taken as thresholds."""
    if int(pytest.__version__.split(".")[0]) < 9:
        pytest.skip("pytest 9's native TOML configuration")
    (tmp_path / "pyproject.toml").write_text("[tool.pytest]\nfp8_grad_min_sqnr_db = 99\n")
    (tmp_path / "test_user.py").write_text(textwrap.dedent("""
        import copy
        import pytest
        import torch
        import transformer_fp8 as tfp8

        def test_toml_threshold_applies(fp8_parity):
            torch.manual_seed(0)
            model = tfp8.Linear(64, 32)
            with pytest.raises(AssertionError, match="< 99.0 dB"):
                fp8_parity(model, copy.deepcopy(model), torch.randn(16, 64))
    """))
    _run_plugin_tests(tmp_path, "1 passed")
