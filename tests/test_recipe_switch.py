"""A delayed-scaling state carried over to a recipe of another fp8_format
(quantization/recipe_switch.py): the scales made for the old format are rescaled to the new one
when the module first runs under it, so the first step does not cast with a scale made for
another format (HYBRID -> E4M3 left grad_output's E5M2 scale, 128x too large: the first backward
saturated, gradients 0.977 off, silently)."""
from __future__ import annotations

import copy
import io

import pytest
import torch

import transformer_fp8 as tfp8
from conftest import CUDA_SKIP
from transformer_fp8 import DelayedScaling, Format

HYBRID = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=4)
E4M3 = DelayedScaling(fp8_format=Format.E4M3, amax_history_len=4)
E4M3_MARGIN2 = DelayedScaling(fp8_format=Format.E4M3, amax_history_len=4, margin=2)


def _data(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(64, 32, generator=gen), torch.randn(64, 48, generator=gen)


def _trained(recipe, steps=3, module=None):
    torch.manual_seed(0)
    layer = module if module is not None else tfp8.Linear(32, 48)
    x, g = _data()
    for _ in range(steps):
        with tfp8.fp8_autocast(fp8_recipe=recipe):
            layer(x).backward(g)
        layer.weight.grad = layer.bias.grad = None
    return layer


def _step_error(layer, recipe):
    """Relative errors of one FP8 step's input and weight gradients against high precision."""
    x, g = _data()
    xi = x.clone().requires_grad_()
    with tfp8.fp8_autocast(fp8_recipe=recipe):
        layer(xi).backward(g)
    fp8 = (xi.grad, layer.weight.grad)
    reference = copy.deepcopy(layer)
    reference.weight.grad = None
    xr = x.clone().requires_grad_()
    reference(xr).backward(g)
    layer.weight.grad = layer.bias.grad = None
    return [((a - b).norm() / b.norm()).item() for a, b in zip(fp8, (xr.grad,
                                                                     reference.weight.grad))]


def _scales(layer):
    return {name: getattr(layer, name).clone() for name in
            ("fp8_fwd_scale", "fp8_fwd_scale_inv", "fp8_bwd_scale", "fp8_bwd_scale_inv")}


@pytest.mark.parametrize("old,new,fwd_factor,bwd_factor", [
    (HYBRID, E4M3, 1.0, 2.0 ** -7),        # grad_output: E5M2 max 57344 -> E4M3 max 448
    (E4M3, HYBRID, 1.0, 2.0 ** 7),
    (E4M3, E4M3_MARGIN2, 1.0, 1.0),  # a margin takes effect at the next update (no clipping)
])
def test_switch_in_process_rescales_the_scales(old, new, fwd_factor, bwd_factor):
    layer = _trained(old)
    before = _scales(layer)
    hooked = {}
    x, g = _data()
    with tfp8.fp8_autocast(fp8_recipe=new):
        out = layer(x)
        hooked.update(_scales(layer))  # after the adoption, before this step's update
    out.backward(g)
    factors = {"fp8_fwd_scale": fwd_factor, "fp8_bwd_scale": bwd_factor}
    for name, factor in factors.items():
        assert torch.equal(hooked[name], before[name] * factor), name
        assert torch.equal(hooked[name + "_inv"], hooked[name].reciprocal()), name


def test_first_step_after_hybrid_to_e4m3_is_not_saturated():
    layer = _trained(HYBRID)
    first = _step_error(layer, E4M3)
    control = _step_error(_trained(E4M3), E4M3)
    assert max(first) < 0.1, first  # 0.977 before the rescale
    assert max(first) < 2 * max(control) + 0.01


def test_checkpoint_saved_under_hybrid_resumed_under_e4m3():
    saved = _trained(HYBRID)
    buffer = io.BytesIO()
    torch.save(saved.state_dict(), buffer)
    buffer.seek(0)
    torch.manual_seed(1)
    resumed = tfp8.Linear(32, 48)
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    errors = _step_error(resumed, E4M3)
    assert max(errors) < 0.1, errors


@pytest.mark.parametrize("saved_under,runs_under", [(E4M3, HYBRID), (HYBRID, E4M3)])
@pytest.mark.parametrize("left_out", ["fwd", "bwd"])
def test_a_partial_load_rescales_only_the_direction_it_loaded(saved_under, runs_under, left_out):
    """strict=False with one direction's FP8 state left out of the checkpoint: the module keeps
    its own scales there, made for the recipe it trained under. They were taken as made for
    the checkpoint's format and rescaled at the next forward (an E5M2 grad_output scale
    multiplied by 2**7: the backward saturated, dgrad 98% off)."""
    checkpoint = _trained(saved_under).state_dict()
    partial = {k: v for k, v in checkpoint.items() if not k.startswith(f"fp8_{left_out}_")}
    layer = _trained(runs_under, steps=2, module=tfp8.Linear(32, 48))
    own = _scales(layer)
    result = layer.load_state_dict(partial, strict=False)
    assert sorted(result.missing_keys) == sorted(
        f"fp8_{left_out}_{n}" for n in ("amax_history", "scale", "scale_inv"))
    loaded = "bwd" if left_out == "fwd" else "fwd"
    x, _ = _data()
    with tfp8.fp8_autocast(fp8_recipe=runs_under):
        layer(x)  # (adopts runs_under: rescales what was made for another format)
        used = _scales(layer)
    factor = 1.0 if loaded == "fwd" else (2.0 ** 7 if runs_under is HYBRID else 2.0 ** -7)
    assert torch.equal(used[f"fp8_{left_out}_scale"], own[f"fp8_{left_out}_scale"]), "its own"
    assert torch.equal(used[f"fp8_{loaded}_scale"], checkpoint[f"fp8_{loaded}_scale"] * factor)
    errors = _step_error(layer, runs_under)
    assert max(errors) < 0.1, errors


def test_a_partial_load_of_the_recipe_record_alone_rescales_nothing():
    """strict=False with only fp8_recipe_fields (saved under E4M3) into a layer trained under
    HYBRID: its own scales stay as made for HYBRID (they were taken as made for E4M3 and the
    grad_output scale multiplied by 2**7); and a checkpoint without the record loads its scales
    with their format unknown (not the module's own: nothing rescaled)."""
    checkpoint = _trained(E4M3).state_dict()
    layer = _trained(HYBRID, steps=2, module=tfp8.Linear(32, 48))
    own = _scales(layer)
    layer.load_state_dict({"fp8_recipe_fields": checkpoint["fp8_recipe_fields"]}, strict=False)
    x, _ = _data()
    with tfp8.fp8_autocast(fp8_recipe=HYBRID):
        layer(x)
        assert all(torch.equal(getattr(layer, k), v) for k, v in own.items())
    without_record = {k: v for k, v in _trained(HYBRID).state_dict().items()
                      if k != "fp8_recipe_fields"}
    layer = _trained(E4M3, steps=2, module=tfp8.Linear(32, 48))
    layer.load_state_dict(without_record, strict=False)
    with tfp8.fp8_autocast(fp8_recipe=E4M3):
        layer(x)
        assert torch.equal(layer.fp8_bwd_scale, without_record["fp8_bwd_scale"]), "unknown"


def test_a_column_without_amax_keeps_its_scale():
    """Training forwards under HYBRID and no backward: the backward history is empty and its
    scale (1, as built) is not rescaled; the forward's (E4M3 in both formats) are unchanged."""
    torch.manual_seed(0)
    layer = tfp8.Linear(32, 48)
    x, _ = _data()
    for _ in range(2):
        with tfp8.fp8_autocast(fp8_recipe=HYBRID):
            layer(x)
    before = _scales(layer)
    assert (before["fp8_fwd_scale"] != 1).all() and (before["fp8_bwd_scale"] == 1).all()
    assert (layer.fp8_bwd_amax_history == 0).all()
    with tfp8.fp8_autocast(fp8_recipe=E4M3):
        layer(x)
        after = _scales(layer)
    for name in before:
        assert torch.equal(after[name], before[name]), name


def test_loaded_state_run_under_its_own_recipe_nested_in_another_is_not_rescaled():
    """An outer context under E4M3 adopts a loaded HYBRID state without running it; the module
    then runs under its own recipe (nested HYBRID): its scales are the loaded ones."""
    saved = _trained(HYBRID)
    state = copy.deepcopy(saved.state_dict())
    resumed = tfp8.Linear(32, 48)
    resumed.load_state_dict(state)
    x, g = _data()
    with tfp8.fp8_autocast(fp8_recipe=E4M3):
        with tfp8.fp8_autocast(fp8_recipe=HYBRID):
            resumed(x)
            scales = _scales(resumed)
    for name in scales:
        assert torch.equal(scales[name], state[name]), name


def test_a_failed_step_leaves_the_scales_as_they_were():
    layer = _trained(HYBRID)
    before = copy.deepcopy(layer.state_dict())
    x, g = _data()
    with pytest.raises(ValueError, match="planted"):
        with tfp8.fp8_autocast(fp8_recipe=E4M3):
            layer(x)
            raise ValueError("planted")
    for name, value in layer.state_dict().items():
        assert torch.equal(value, before[name]), name
    # and the next step under HYBRID is the step the module would have made without the try
    twin = _trained(HYBRID)
    for module in (layer, twin):
        with tfp8.fp8_autocast(fp8_recipe=HYBRID):
            module(x).backward(g)
    assert torch.equal(layer.weight.grad, twin.weight.grad)
    for name, value in layer.state_dict().items():
        assert torch.equal(value, twin.state_dict()[name]), name


def test_under_torch_compile_a_switch_is_refused_with_the_state_unchanged():
    layer = _trained(HYBRID)
    before = copy.deepcopy(layer.state_dict())
    torch._dynamo.reset()
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    x, _ = _data()
    with pytest.raises(Exception, match="another fp8_format"):
        with tfp8.fp8_autocast(fp8_recipe=E4M3):
            compiled(x)
    for name, value in layer.state_dict().items():
        assert torch.equal(value, before[name]), name


def test_a_history_of_length_one_is_rescaled_too():
    """With amax_history_len=1 the update leaves the history empty: the scale (not 1) still
    tells that an update made it."""
    one_hybrid = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=1)
    one_e4m3 = DelayedScaling(fp8_format=Format.E4M3, amax_history_len=1)
    layer = _trained(one_hybrid)
    assert (layer.fp8_bwd_amax_history == 0).all() and (layer.fp8_bwd_scale != 1).all()
    before = layer.fp8_bwd_scale.clone()
    x, g = _data()
    with tfp8.fp8_autocast(fp8_recipe=one_e4m3):
        out = layer(x)
        assert torch.equal(layer.fp8_bwd_scale, before * 2.0 ** -7)
    out.backward(g)
    layer.weight.grad = layer.bias.grad = None
    assert max(_step_error(layer, one_e4m3)) < 0.1


def test_an_evaluation_first_then_training_then_a_switch():
    """A validation pass (no gradients) before training made the module take the recipe with
    its forward scales only in use: its backward scales are still rescaled at the switch."""
    torch.manual_seed(0)
    layer = tfp8.Linear(32, 48)
    x, _ = _data()
    with torch.no_grad(), tfp8.fp8_autocast(fp8_recipe=HYBRID):
        layer(x)
    layer = _trained(HYBRID, module=layer)
    errors = _step_error(layer, E4M3)
    assert max(errors) < 0.1, errors


def test_a_compiled_layer_is_rescaled():
    """torch.compile (no fullgraph): the adoption runs eagerly at a graph break."""
    torch.manual_seed(0)
    layer = tfp8.Linear(32, 48)
    torch._dynamo.reset()
    compiled = torch.compile(layer, backend="aot_eager")
    _trained(HYBRID, module=compiled)
    before = layer.fp8_bwd_scale.clone()
    x, g = _data()
    with tfp8.fp8_autocast(fp8_recipe=E4M3):
        out = compiled(x)
        assert torch.equal(layer.fp8_bwd_scale, before * 2.0 ** -7)
    out.backward(g)


def test_a_loaded_module_taken_by_a_context_before_it_runs_is_rescaled_once():
    """A module loaded from a HYBRID checkpoint takes E4M3 when a context is entered (it has no
    recipe yet), before it runs: its scales are rescaled then (so that a step's update, which
    on other ranks may make them for E4M3 from the reduced amaxes, is not rescaled again), and
    not again when it first runs."""
    saved = _trained(HYBRID)
    state = copy.deepcopy(saved.state_dict())
    torch.manual_seed(1)
    loaded, other = tfp8.Linear(32, 48), tfp8.Linear(32, 48)
    loaded.load_state_dict(state)
    x, g = _data()
    with tfp8.fp8_autocast(fp8_recipe=E4M3):
        assert torch.equal(loaded.fp8_bwd_scale, state["fp8_bwd_scale"] * 2.0 ** -7)
        other(x).backward(g)  # the step's layer; `loaded` did not run
    with tfp8.fp8_autocast(fp8_recipe=E4M3):
        loaded(x)
        assert torch.equal(loaded.fp8_bwd_scale, state["fp8_bwd_scale"] * 2.0 ** -7)


def test_a_checkpoint_saved_after_an_evaluation_under_another_format_resumes_exactly():
    """Training under HYBRID, one evaluation forward under E4M3 (which rescales the forward's
    scales only), then a checkpoint: its one recipe record says E4M3 for both directions, so
    the saved grad_output scales are saved as made for E4M3. Resumed under HYBRID, the loaded
    layer trains as the original does, bit for bit (its first backward cast grad_output with a
    scale 128x too large)."""
    layer = _trained(HYBRID)
    x, g = _data(1)
    with torch.no_grad(), tfp8.fp8_autocast(fp8_recipe=E4M3):
        layer(x)
    held = _scales(layer)
    buffer = io.BytesIO()
    torch.save(layer.state_dict(), buffer)
    assert all(torch.equal(v, held[k]) for k, v in _scales(layer).items()), "saving changes none"
    buffer.seek(0)
    resumed = tfp8.Linear(32, 48)
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    for step in range(3):
        x, g = _data(2 + step)
        grads = []
        for module in (layer, resumed):
            xi = x.clone().requires_grad_()
            with tfp8.fp8_autocast(fp8_recipe=HYBRID):
                module(xi).backward(g)
            grads.append((xi.grad, module.weight.grad, module.bias.grad))
            module.weight.grad = module.bias.grad = None
        for got, want in zip(grads[1], grads[0]):
            assert torch.equal(got, want), step
        for key, value in layer.state_dict().items():
            assert torch.equal(resumed.state_dict()[key], value), (step, key)


@CUDA_SKIP
def test_histories_kept_aside_follow_the_module_to_another_device():
    """A loaded layer taken by a context of another history length without running keeps its
    loaded histories aside (on the CPU, where it was); moved to CUDA, then run under the
    recipe it was saved under, it gets them back on CUDA, as loaded (they came back on the
    CPU under CUDA scales)."""
    saved = _trained(HYBRID)
    state = copy.deepcopy(saved.state_dict())
    longer = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=8)
    resumed = tfp8.Linear(32, 48)
    resumed.load_state_dict(state)
    with tfp8.fp8_autocast(fp8_recipe=longer):
        tfp8.Linear(32, 48)(_data()[0])  # (another layer runs: the loaded one is taken)
    resumed.cuda()
    x, g = (t.cuda() for t in _data())
    with tfp8.fp8_autocast(fp8_recipe=HYBRID):
        out = resumed(x)
        for name in ("fp8_fwd_amax_history", "fp8_bwd_amax_history"):
            history = getattr(resumed, name)
            assert history.device.type == "cuda", name
            assert torch.equal(history[1:].cpu(), state[name][1:]), name
    out.backward(g)
    assert torch.isfinite(resumed.weight.grad).all()


@pytest.mark.parametrize("kind", ["Linear", "LayerNormLinear", "LayerNormMLP"])
def test_training_after_an_evaluation_under_the_new_format_rescales_on_the_cpp_step(kind):
    """HYBRID training, an evaluation under E4M3 (it rescales the forward's scales only), then
    E4M3 training: the C++ step reused the state it had sliced at the evaluation and skipped the
    adoption that rescales the backward scales (grad_output cast with a scale made for E5M2,
    128x too large: 0.2 dB). Bit for bit the Python path's, every step."""
    from transformer_fp8.modules import linear_fused_step
    build = {"Linear": lambda: tfp8.Linear(32, 48),
             "LayerNormLinear": lambda: tfp8.LayerNormLinear(32, 48),
             "LayerNormMLP": lambda: tfp8.LayerNormMLP(32, 48)}[kind]
    torch.manual_seed(0)
    layers = {"cpp_step": build()}
    layers["python_path"] = copy.deepcopy(layers["cpp_step"])
    switches = ("ENABLED", "NORM_ENABLED", "NORM_MLP_ENABLED")
    results = {}
    for path, layer in layers.items():
        saved = {name: getattr(linear_fused_step, name) for name in switches}
        try:
            for name in switches:
                setattr(linear_fused_step, name, path == "cpp_step")
            grads = []
            for step, (recipe, training) in enumerate(
                    [(HYBRID, True), (HYBRID, True), (E4M3, False), (E4M3, True), (E4M3, True)]):
                x, g = _data(step)
                xi = x.clone().requires_grad_(training)
                with torch.set_grad_enabled(training), tfp8.fp8_autocast(fp8_recipe=recipe):
                    out = layer(xi)
                if training:
                    out.backward(g[:, :out.shape[-1]])  # (the MLP's output has 32 features)
                    grads.append(xi.grad)
                    layer.zero_grad(set_to_none=True)
            results[path] = (grads, {k: v.clone() for k, v in layer.state_dict().items()})
        finally:
            for name, value in saved.items():
                setattr(linear_fused_step, name, value)
    for got, want in zip(results["cpp_step"][0], results["python_path"][0]):
        assert torch.equal(got, want)
    for key, value in results["python_path"][1].items():
        assert torch.equal(results["cpp_step"][1][key], value), key
