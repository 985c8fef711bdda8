"""Transformer Engine checkpoints of particular versions and recipes: 2.0-2.3's pickled None
for a module that never ran in FP8, 1.x's torch.save payloads, the update that 0.x-1.5 still owe
when they save, recipes with margins this library does not take or a callable amax algorithm,
and a load of the _extra_state alone. (The payloads are written as Transformer Engine writes
them, without it installed: te_extra_state in test_te_checkpoints.py.)"""
from __future__ import annotations

import io
import pickle
import warnings

import pytest
import torch
from test_te_checkpoints import DelayedScalingTE, te_extra_state

import transformer_fp8 as te
from transformer_fp8 import DelayedScaling, ops


def _linear_checkpoint(extra):
    torch.manual_seed(0)
    checkpoint = te.strip_fp8_state(te.Linear(32, 16).state_dict())
    checkpoint["_extra_state"] = extra
    return checkpoint


def _is_fresh(module) -> bool:
    return bool(torch.all(module.fp8_fwd_scale == 1)
                and torch.all(module.fp8_fwd_amax_history == 0))


def test_a_pickled_none_is_an_empty_state_without_a_warning():
    """Transformer Engine 2.0-2.3 write pickle.dumps(None) for a module that never ran in FP8:
    no FP8 state, and nothing to warn about (it warned 'could not be read' for every module)."""
    none = torch.frombuffer(bytearray(pickle.dumps(None)), dtype=torch.uint8)
    layer = te.Linear(32, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        layer.load_state_dict(_linear_checkpoint(none), strict=True)
    assert _is_fresh(layer)
    torch.manual_seed(0)
    source = te.TransformerLayer(64, 128, 4)
    checkpoint = te.strip_fp8_state(source.state_dict())
    for prefix in ("self_attention.layernorm_qkv.", "self_attention.proj.",
                   "self_attention.core_attention.", "layernorm_mlp."):
        checkpoint[prefix + "_extra_state"] = none
    layer = te.TransformerLayer(64, 128, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        layer.load_state_dict(checkpoint, strict=True)
    x = torch.randn(6, 2, 64)
    assert torch.equal(layer.eval()(x), source.eval()(x))


def test_attention_state_warns_only_when_attention_ran_in_fp8():
    """DotProductAttention keeps no FP8 state here. Transformer Engine's holds FP8 metadata
    whenever its model trained in FP8; only one saved with fp8_dpa=True (attention in FP8
    there, in high precision here) is worth a warning."""
    torch.manual_seed(0)
    source = te.TransformerLayer(64, 128, 4)
    key = "self_attention.core_attention._extra_state"
    for fp8_dpa in (False, True):
        checkpoint = te.strip_fp8_state(source.state_dict())
        checkpoint[key] = te_extra_state({
            "recipe": DelayedScalingTE(fp8_dpa=fp8_dpa), "scale_fwd": torch.ones(3),
            "amax_history_fwd": torch.ones(4, 3), "scale_bwd": torch.ones(2),
            "amax_history_bwd": torch.ones(4, 2)})
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            te.TransformerLayer(64, 128, 4).load_state_dict(checkpoint, strict=True)
        said = [str(w.message) for w in caught if key in str(w.message)]
        assert (len(said) == 1 and "fp8_dpa=True" in said[0]) if fp8_dpa else not said, said


def _te_1x_state(update_flag):
    """A Linear's state as Transformer Engine 1.5 saved it between two steps: the window's
    amaxes made the scales, the last step's amaxes wait in row 0 (input 4.0 against a window
    max of 1.0: the activations grew), its update still owed."""
    history_fwd = torch.tensor([[4.0, 0.3, 0.0], [1.0, 0.2, 0.0], [0.5, 0.1, 0.0],
                                [0.7, 0.2, 0.0]])
    scale_fwd = torch.tensor([448.0 / 1.0, 448.0 / 0.2, 1.0])
    history_bwd = torch.tensor([[2.0, 0.0], [1.0, 0.0], [0.5, 0.0], [0.25, 0.0]])
    scale_bwd = torch.tensor([57344.0 / 1.0, 1.0])
    extra = {"num_gemms": 1, "fp8_checkpoint": True}
    if update_flag is not None:
        extra["update_amax_and_scale_fwd"] = update_flag
    return {"scale_fwd": scale_fwd, "scale_inv_fwd": scale_fwd.reciprocal(),
            "amax_history_fwd": history_fwd, "scale_bwd": scale_bwd,
            "scale_inv_bwd": scale_bwd.reciprocal(), "amax_history_bwd": history_bwd,
            "extra_fp8_variables": extra}


def _bytes_io(state) -> io.BytesIO:
    """Transformer Engine 1.x's format: torch.save of the dict into a BytesIO."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return buffer


@pytest.mark.parametrize("update_flag", [True, False, None],
                         ids=["te1.5-after-training-step", "te1.5-after-eval", "te1.6+"])
def test_the_update_a_te_1_5_checkpoint_owes_runs_before_the_first_cast(update_flag):
    """Transformer Engine up to 1.5 updated lazily, at the next forward (when the last one
    trained) and at the start of every backward. Resumed from its checkpoint, the first FP8
    forward casts with the scales that update makes of the saved row 0, as Transformer Engine
    did; it used the saved scale (448 where 112 was due: the grown input saturated). From 1.6
    (no flag in the state) the checkpoint owes nothing."""
    state = _te_1x_state(update_flag)
    recipe = DelayedScaling(amax_history_len=4)
    layer = te.Linear(32, 16)
    layer.load_state_dict(_linear_checkpoint(_bytes_io(state)))
    # The expected state after the owed update: the update operator on the saved tensors.
    expected = {}
    for role, fp8_max in (("fwd", 448.0), ("bwd", 57344.0)):
        columns = [0, 1] if role == "fwd" else [0]
        history = state[f"amax_history_{role}"][:, columns].clone()
        scale = state[f"scale_{role}"][columns].clone()
        scale_inv = scale.reciprocal()
        owed = role == "bwd" and update_flag is not None or update_flag is True
        if owed:
            ops.update_delayed_scaling([history], [scale], [scale_inv], [fp8_max])
        expected[role] = (history, scale, scale_inv)
    if update_flag is True:
        assert expected["fwd"][1][0].item() == 112.0  # 448 / 4.0
    reference = te.Linear(32, 16)
    with warnings.catch_warnings():  # (its state_dict says the update is owed: see below)
        warnings.simplefilter("ignore")
        reference.load_state_dict(layer.state_dict())
    with torch.no_grad():
        for role, (history, scale, scale_inv) in expected.items():
            getattr(reference, f"fp8_{role}_amax_history").copy_(history)
            getattr(reference, f"fp8_{role}_scale").copy_(scale)
            getattr(reference, f"fp8_{role}_scale_inv").copy_(scale_inv)
    x = torch.randn(64, 32)
    x = x / x.abs().max() * 4.0
    grad = torch.randn(64, 16)
    outputs = []
    for module in (layer, reference):
        with te.fp8_autocast(fp8_recipe=recipe):
            out = module(x)
        out.backward(grad)
        outputs.append(out)
    assert torch.equal(outputs[0], outputs[1])
    assert torch.equal(layer.weight.grad, reference.weight.grad)
    for key, value in reference.state_dict().items():
        assert torch.equal(layer.state_dict()[key], value), key
    # Owed once: a later load of the module's own state owes nothing.
    again = te.Linear(32, 16)
    again.load_state_dict(_linear_checkpoint(_bytes_io(state)))
    again.load_state_dict(layer.state_dict())
    assert again._te_pending_update == ()


@pytest.mark.parametrize("margin", [-1, 40])
def test_a_margin_outside_ours_loads_the_scales_without_the_recipe_record(margin):
    """Transformer Engine does not bound the margin; ours is in [0, 32]. Such a checkpoint's
    scales and histories load (it raised 'corrupt FP8 state' and loaded none of the module)."""
    gen = torch.Generator().manual_seed(0)
    state = {"recipe": DelayedScalingTE(margin=margin, amax_history_len=4),
             "scale_fwd": torch.rand(3, generator=gen) + 1,
             "amax_history_fwd": torch.rand(4, 3, generator=gen),
             "scale_bwd": torch.rand(2, generator=gen) + 1,
             "amax_history_bwd": torch.rand(4, 2, generator=gen)}
    layer = te.Linear(32, 16)
    layer.load_state_dict(_linear_checkpoint(te_extra_state(state)), strict=True)
    assert torch.equal(layer.fp8_fwd_scale, state["scale_fwd"][[0, 1]])
    assert torch.equal(layer.fp8_bwd_amax_history, state["amax_history_bwd"][:, [0]])
    assert layer.fp8_recipe_fields.tolist() == [-1, -1, -1, -1]


def a_users_amax_algorithm(history):  # (module level: pickled by reference)
    return history.amax(0)


def test_a_recipe_with_a_callable_amax_algorithm_loads_its_state():
    """A recipe's callable (amax_compute_algo, as Transformer Engine allows) is read as an inert
    record, not imported or called; the state loads (it was dropped whole)."""
    gen = torch.Generator().manual_seed(0)
    state = {"recipe": DelayedScalingTE(amax_compute_algo=a_users_amax_algorithm,
                                        amax_history_len=4),
             "scale_fwd": torch.rand(3, generator=gen) + 1,
             "amax_history_fwd": torch.rand(4, 3, generator=gen),
             "scale_bwd": torch.rand(2, generator=gen) + 1,
             "amax_history_bwd": torch.rand(4, 2, generator=gen)}
    layer = te.Linear(32, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        layer.load_state_dict(_linear_checkpoint(te_extra_state(state)), strict=True)
    assert torch.equal(layer.fp8_fwd_scale, state["scale_fwd"][[0, 1]])
    assert layer.fp8_recipe_fields.tolist() == [0, 2, 4, 2]  # algo 2: another algorithm


class _Calls:
    """Pickles as a call of print: loading the payload would print."""

    def __reduce__(self):
        return print, ("payload code ran",)


def test_a_payload_that_would_run_code_runs_nothing(capsys):
    evil = torch.frombuffer(bytearray(pickle.dumps({"x": _Calls()})), dtype=torch.uint8)
    layer = te.Linear(32, 16)
    with pytest.warns(UserWarning, match="ignored"):
        layer.load_state_dict(_linear_checkpoint(evil))
    assert "payload code ran" not in capsys.readouterr().out
    assert _is_fresh(layer)


@pytest.mark.parametrize("content", [[1, 2], torch.ones(3)], ids=["list", "tensor"])
def test_a_bytes_io_payload_without_a_dict_is_ignored_with_a_warning(content):
    layer = te.Linear(32, 16)
    with pytest.warns(UserWarning, match="could not be read"):
        layer.load_state_dict(_linear_checkpoint(_bytes_io(content)))
    assert _is_fresh(layer)


def test_an_extra_state_alone_leaves_no_fp8_key_missing():
    """strict=False with only the module's _extra_state: its FP8 state loads, and the FP8 keys
    it gave are not reported missing (the parameters are)."""
    gen = torch.Generator().manual_seed(0)
    state = {"recipe": DelayedScalingTE(amax_history_len=4),
             "scale_fwd": torch.rand(3, generator=gen) + 1,
             "amax_history_fwd": torch.rand(4, 3, generator=gen),
             "scale_bwd": torch.rand(2, generator=gen) + 1,
             "amax_history_bwd": torch.rand(4, 2, generator=gen)}
    layer = te.Linear(32, 16)
    result = layer.load_state_dict({"_extra_state": te_extra_state(state)}, strict=False)
    assert sorted(result.missing_keys) == ["bias", "weight"]
    assert torch.equal(layer.fp8_fwd_scale, state["scale_fwd"][[0, 1]])


def test_a_failed_first_step_still_owes_the_update():
    """The update a 1.5 checkpoint owes runs at the module's first FP8 forward. If that step
    fails, its recipe adoption is undone and so is the update (in place), which runs again at
    the next step: the steps after are those of a run without the failed step (one left the
    checkpoint's last amax out of the window, a stale scale for a step)."""
    def run(fail_first, length):
        recipe = DelayedScaling(amax_history_len=length)
        layer = te.Linear(32, 16)
        layer.load_state_dict(_linear_checkpoint(_bytes_io(_te_1x_state(True))))
        if fail_first:
            try:
                with te.fp8_autocast(fp8_recipe=recipe):
                    layer(torch.randn(64, 32) * 0.01)
                    raise RuntimeError("CUDA out of memory (simulated)")
            except RuntimeError:
                pass
        scales = []
        for step in range(9):
            x = torch.randn(64, 32, generator=torch.Generator().manual_seed(step)) * 0.01
            with te.fp8_autocast(fp8_recipe=recipe):
                out = layer(x)
            out.sum().backward()
            scales.append(layer.fp8_fwd_scale.clone())
        return scales, layer.state_dict()

    for length in (4, 8):  # (the checkpoint's history length, and another)
        got, expected = run(True, length), run(False, length)
        for a, b in zip(got[0], expected[0]):
            assert torch.equal(a, b), length
        for key, value in expected[1].items():
            assert torch.equal(got[1][key], value), (length, key)


@pytest.mark.parametrize("where", ["built", "loaded_inside_autocast"])
def test_the_owed_update_takes_the_recipes_window(where):
    """Transformer Engine 1.5 sized the history for the resuming recipe first, then ran the
    owed update: a shorter recipe's window leaves the old large amax out (scale 448 for the
    first cast). Here too for a module built for the recipe, or loaded inside an active
    fp8_autocast (there the update ran over the whole saved history: its first forward cast
    the input with a scale 100 times too small): the first output is that of a module loaded
    before the context, which adopts the recipe's length first."""
    history = torch.zeros(8, 3)
    history[:, 0] = torch.tensor([1.0, 0.5, 0.5, 0.5, 100.0, 0.5, 0.5, 0.5])
    history[:, 1] = 0.25
    state = dict(_te_1x_state(True), amax_history_fwd=history,
                 scale_fwd=torch.tensor([448.0, 448.0 / 0.25, 1.0]))
    state["scale_inv_fwd"] = state["scale_fwd"].reciprocal()
    recipe = DelayedScaling(amax_history_len=4)
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(0))
    x = x / x.abs().max() * 0.5

    def first_output(built, inside):
        layer = te.Linear(32, 16, **({"recipe": recipe} if built else {}))
        if not inside:
            layer.load_state_dict(_linear_checkpoint(_bytes_io(state)))
        with te.fp8_autocast(fp8_recipe=recipe):
            if inside:
                layer.load_state_dict(_linear_checkpoint(_bytes_io(state)))
            return layer(x).detach()

    expected = first_output(False, False)
    got = first_output(where == "built", where == "loaded_inside_autocast")
    assert torch.equal(got, expected)


@pytest.mark.parametrize("where", ["built", "inside"])
def test_a_failed_first_step_after_a_load_inside_a_context_keeps_the_loaded_state(where):
    """A 1.5 checkpoint loaded into a module built for the recipe, or inside the context of
    the step that then fails: the steps after are those of a run without the failed step
    (the undo put back the fresh state from before the load: a forward scale of 10922 where
    112 was due)."""
    def run(fail_first, length):
        recipe = DelayedScaling(amax_history_len=length)
        layer = te.Linear(32, 16, **({"recipe": recipe} if where == "built" else {}))
        checkpoint = _linear_checkpoint(_bytes_io(_te_1x_state(True)))
        if where == "built":
            layer.load_state_dict(checkpoint)
        scales = []
        for step in range(-1 if fail_first else 0, 5):
            x = torch.randn(64, 32, generator=torch.Generator().manual_seed(max(step, 0)))
            try:
                with te.fp8_autocast(fp8_recipe=recipe):
                    if where == "inside" and step == (-1 if fail_first else 0):
                        layer.load_state_dict(checkpoint)
                    out = layer(x * 0.01)
                    if step == -1:
                        raise RuntimeError("CUDA out of memory (simulated)")
            except RuntimeError:
                continue
            out.sum().backward()
            scales.append((layer.fp8_fwd_scale.clone(), layer.fp8_bwd_scale.clone()))
        return scales, layer.state_dict()

    for length in (2, 4, 8):
        got, expected = run(True, length), run(False, length)
        for (a_fwd, a_bwd), (e_fwd, e_bwd) in zip(got[0], expected[0]):
            assert torch.equal(a_fwd, e_fwd) and torch.equal(a_bwd, e_bwd), length
        for key, value in expected[1].items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(got[1][key], value), (length, key)


def test_a_checkpoint_without_a_recipe_is_not_rescaled_for_the_built_one():
    """A Transformer Engine 1.x state names no recipe. Loaded into a module built for an E4M3
    recipe and run under HYBRID, its scales are taken as they are (its recipe unknown), not as
    made for E4M3 and rescaled for HYBRID (the grad_output scale went from 8 to 1024 and the
    weight gradient saturated): the same as loading it into a module built for no recipe."""
    state = _te_1x_state(None)
    state["scale_bwd"] = torch.tensor([8.0, 1.0])
    state["scale_inv_bwd"] = state["scale_bwd"].reciprocal()
    results = []
    for kwargs in ({}, {"recipe": DelayedScaling(fp8_format=te.Format.E4M3)}):
        torch.manual_seed(0)
        layer = te.Linear(32, 16, **kwargs)
        layer.load_state_dict(_linear_checkpoint(_bytes_io(state)))
        assert layer.fp8_recipe_fields.tolist() == [-1, -1, -1, -1]
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(1))
        with te.fp8_autocast(fp8_recipe=DelayedScaling()):
            out = layer(x)
        out.sum().backward()
        results.append((layer.weight.grad.clone(), layer.fp8_bwd_scale.clone()))
    assert torch.equal(results[0][0], results[1][0])
    assert torch.equal(results[0][1], results[1][1])


def test_saving_a_state_that_still_owes_its_update_warns():
    """A state_dict has no record of the update a 1.5 checkpoint owes (it is lost in a
    re-saved copy): saving before the first FP8 step says so; after a step nothing is owed."""
    layer = te.Linear(32, 16)
    layer.load_state_dict(_linear_checkpoint(_bytes_io(_te_1x_state(True))))
    assert layer._te_pending_update
    with pytest.warns(UserWarning, match="still owes the delayed-scaling update"):
        layer.state_dict()
    with te.fp8_autocast(fp8_recipe=DelayedScaling(amax_history_len=4)):
        layer(torch.randn(64, 32))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        layer.state_dict()
