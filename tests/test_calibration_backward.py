"""Calibration with a backward: a training step under fp8_autocast(enabled=False,
calibrating=True) records every GEMM's grad_output amax too and updates the grad_output scales
at the end of its backward pass, so the first FP8 step after it casts gradients with calibrated
scales instead of 1.0 (which flushes every gradient below E5M2's 2^-16 to zero). The forward half
of calibration: tests/test_te_compat.py."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import transformer_fp8 as te
from transformer_fp8 import DelayedScaling
from conftest import CUDA_SKIP
from integration_compare import sqnr_db

E5M2_MAX = 57344.0
RECIPE = DelayedScaling(amax_history_len=4)
MODULES = {"linear": lambda: te.Linear(32, 48),
           "layernorm_linear": lambda: te.LayerNormLinear(32, 48),
           "layernorm_mlp": lambda: te.LayerNormMLP(32, 64, activation="relu"),
           "grouped": lambda: te.GroupedLinear(2, 32, 48)}
SPLITS = [5, 11]


def _call(module, x):
    return module(x, SPLITS) if isinstance(module, te.GroupedLinear) else module(x)


def _grad_output_amaxes(kind, module, x, g):
    """Per GEMM, max |dL/d(GEMM output)| of the high-precision module, from its parts."""
    if kind in ("linear", "layernorm_linear"):
        return [g.abs().max()]
    if kind == "grouped":
        return [g[:SPLITS[0]].abs().max(), g[SPLITS[0]:].abs().max()]
    h = F.linear(module._norm_hp(x), module.fc1_weight, module.fc1_bias)
    return [((g @ module.fc2_weight) * (h > 0)).abs().max(), g.abs().max()]


@pytest.mark.parametrize("kind", list(MODULES))
def test_a_calibrating_training_step_calibrates_the_grad_output_scales(kind):
    torch.manual_seed(0)
    module = MODULES[kind]()
    reference = copy.deepcopy(module)
    x = torch.randn(16, 32)
    g = torch.randn(16, 48 if kind != "layernorm_mlp" else 32) * 1e-3
    x_ref, x_cal = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    out_ref = _call(reference, x_ref)
    out_ref.backward(g)
    with te.fp8_autocast(enabled=False, calibrating=True, fp8_recipe=RECIPE):
        out = _call(module, x_cal)
    assert torch.all(module.fp8_bwd_amax_history == 0), "recorded in backward, not before"
    out.backward(g)
    # The step is the high-precision one, bit for bit.
    assert torch.equal(out, out_ref) and torch.equal(x_cal.grad, x_ref.grad)
    for (name, p), p_ref in zip(module.named_parameters(), reference.parameters()):
        assert torch.equal(p.grad, p_ref.grad), name
    # At the end of the backward pass the history rolled and the scales are E5M2_MAX / amax.
    want = torch.stack([a.float() for a in _grad_output_amaxes(kind, module, x, g)])
    assert torch.equal(module.fp8_bwd_amax_history[-1], want)
    assert torch.equal(module.fp8_bwd_amax_history[0], torch.zeros_like(want))
    assert torch.equal(module.fp8_bwd_scale, (E5M2_MAX / want.double()).float())
    assert torch.equal(module.fp8_bwd_scale_inv, 1 / module.fp8_bwd_scale)


def _small_gradient_step(model, x, calibrated_first: bool):
    """One FP8 training step whose gradients lie below E5M2's smallest subnormal (2^-16) at
    scale 1.0, after a calibrating step on the same batch if ``calibrated_first``. Returns
    the FP8 step's weight gradient."""
    def loss_of(out):
        return out.float().square().sum() * 1e-9

    if calibrated_first:
        with te.fp8_autocast(enabled=False, calibrating=True, fp8_recipe=RECIPE):
            loss = loss_of(model(x))
        loss.backward()
        model.zero_grad(set_to_none=True)
    with te.fp8_autocast(fp8_recipe=RECIPE):
        loss = loss_of(model(x))
    loss.backward()
    return model.weight.grad


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA_SKIP)])
def test_the_first_fp8_step_after_a_calibrating_step_keeps_small_gradients(device):
    torch.manual_seed(0)
    base = te.Linear(64, 64, device=device)
    x = torch.randn(32, 64, device=device)
    reference = copy.deepcopy(base)
    (reference(x).square().sum() * 1e-9).backward()
    assert reference.weight.grad.abs().max() > 0
    # (the output gradients, 2e-9 * out, are far below 2^-16 = 1.5e-5)
    uncalibrated = _small_gradient_step(copy.deepcopy(base), x, calibrated_first=False)
    assert torch.count_nonzero(uncalibrated) == 0, "scale 1.0 flushes every gradient to zero"
    calibrated = _small_gradient_step(copy.deepcopy(base), x, calibrated_first=True)
    assert sqnr_db(reference.weight.grad, calibrated) > 20


def test_a_calibrating_step_through_a_transformer_layer_calibrates_every_fp8_gemm():
    torch.manual_seed(0)
    layer = te.TransformerLayer(32, 64, 2, hidden_dropout=0.0, attention_dropout=0.0)
    x = torch.randn(8, 2, 32, requires_grad=True)
    with te.fp8_autocast(enabled=False, calibrating=True, fp8_recipe=RECIPE):
        out = layer(x)
    out.square().mean().backward()
    scales = {name: b for name, b in layer.named_buffers() if name.endswith("fp8_bwd_scale")}
    assert len(scales) >= 3  # qkv, proj, the MLP's two GEMMs
    for name, scale in scales.items():
        assert torch.all(torch.isfinite(scale) & (scale > 1)), name


def test_a_calibrating_forward_without_gradients_leaves_the_grad_output_state():
    torch.manual_seed(0)
    module = te.Linear(32, 48)
    x = torch.randn(16, 32, requires_grad=True)
    with torch.no_grad(), te.fp8_autocast(enabled=False, calibrating=True, fp8_recipe=RECIPE):
        module(x)
    assert torch.all(module.fp8_fwd_scale != 1)
    assert torch.all(module.fp8_bwd_amax_history == 0) and torch.all(module.fp8_bwd_scale == 1)


def test_a_failed_calibrating_backward_changes_no_grad_output_scale():
    """A backward pass that raises after grad_output amaxes were recorded: its queued update
    never runs, and the next outermost fp8_autocast discards the amaxes, as an FP8 backward's."""
    torch.manual_seed(0)
    first, second = te.Linear(32, 48), te.Linear(48, 48)

    def fail(grad):
        raise RuntimeError("a failing hook")

    with te.fp8_autocast(enabled=False, calibrating=True, fp8_recipe=RECIPE):
        hidden = first(torch.randn(16, 32))
        hidden.register_hook(fail)  # (after the calibration's own hook: both layers record)
        out = second(hidden)
    with pytest.raises(RuntimeError, match="a failing hook"):
        out.sum().backward()
    for module in (first, second):
        assert module.fp8_bwd_amax_history[0].item() > 0, "recorded before the failure"
    with te.fp8_autocast(fp8_recipe=RECIPE):
        pass
    for module in (first, second):
        assert torch.all(module.fp8_bwd_amax_history == 0), "the failed pass's amaxes discarded"
        assert torch.all(module.fp8_bwd_scale == 1)


@pytest.mark.parametrize("mode", ["reentrant", "non_reentrant"])
def test_a_checkpointed_calibrating_step_calibrates_as_without_checkpointing(mode):
    torch.manual_seed(0)
    base = torch.nn.Sequential(te.LayerNormMLP(32, 64), te.Linear(32, 32))
    x = torch.randn(16, 32)
    runs = []
    for checkpointed in (False, True):
        model = copy.deepcopy(base)
        x_in = x.clone().requires_grad_(True)
        with te.fp8_autocast(enabled=False, calibrating=True, fp8_recipe=RECIPE):
            if checkpointed:
                out = torch.utils.checkpoint.checkpoint(
                    model, x_in, use_reentrant=mode == "reentrant")
            else:
                out = model(x_in)
        out.square().mean().backward()
        runs.append([x_in.grad] + [p.grad for p in model.parameters()]
                    + [b for name, b in model.named_buffers() if "fp8_" in name])
        for name, scale in model.named_buffers():
            if name.endswith("fp8_bwd_scale"):
                assert torch.all(scale != 1), f"{name}: the grad_output scales were calibrated"
    for got, want in zip(runs[1], runs[0]):
        assert torch.equal(got, want)


@pytest.mark.parametrize("checkpointed", [None, "reentrant", "non_reentrant"])
def test_a_compiled_calibrating_step_calibrates_as_eagerly(checkpointed):
    """Also inside a checkpoint (a reentrant one: its first forward runs without gradients,
    and the compiled module kept no record for its recomputation to record them by)."""
    torch.manual_seed(0)
    base = te.LayerNormMLP(32, 64)
    x = torch.randn(16, 32, requires_grad=True)
    states = []
    for compiled in (False, True):
        torch._dynamo.reset()
        model = copy.deepcopy(base)
        run = torch.compile(model, backend="aot_eager") if compiled else model
        with te.fp8_autocast(enabled=False, calibrating=True, fp8_recipe=RECIPE):
            if checkpointed is None:
                out = run(x)
            else:
                out = torch.utils.checkpoint.checkpoint(
                    run, x, use_reentrant=checkpointed == "reentrant")
        out.square().mean().backward()
        assert torch.all(model.fp8_bwd_scale != 1), "the grad_output scales were calibrated"
        states.append([b.clone() for name, b in model.named_buffers() if "fp8_bwd" in name]
                      + [p.grad for p in model.parameters()])
    for got, want in zip(states[1], states[0]):
        assert torch.equal(got, want)


def test_compiled_fp8_steps_after_a_compiled_calibrating_step_of_layers_of_two_widths():
    """A compiled model whose FP8 layers differ in width (Linear 32 -> 48, LayerNormMLP of
    48): the calibrating step's graph breaks compile the dispatch frames for both widths, so
    torch.compile makes the width dynamic there, and the next FP8 step traced
    LayerNormMLP's Function with a symbolic width against its static weights (Dynamo's
    AssertionError). Now the FP8 steps train as eagerly, bit for bit."""
    from integration_compare import assert_bit_identical, step_batches, train

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(te.Linear(32, 48), torch.nn.GELU(), te.LayerNormMLP(48, 64))

    records = []
    for compiled in (False, True):
        torch._dynamo.reset()
        layers = model()
        run = torch.compile(layers, backend="aot_eager") if compiled else layers
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(1), requires_grad=True)
        with te.fp8_autocast(enabled=False, calibrating=True, fp8_recipe=RECIPE):
            out = run(x)
        out.square().mean().backward()
        layers.zero_grad(set_to_none=True)
        batches = step_batches(torch.Generator().manual_seed(2), 3, 16, 32)
        records.append(train(layers, run, batches, RECIPE))
    assert_bit_identical(records[1], records[0])
