"""The prepared delayed-scaling update: the C++ DelayedScalingBatch (lists checked once, then one
call per step) and the plans of the step machinery (update_plan.py), reused while the states
they cover are unchanged and made again after a change (a device move, load_state_dict, an
assigned buffer, a new module, a reset). Every update is compared bit for bit with the
reference update applied to a copy of the state taken just before it."""
from __future__ import annotations

import gc

import pytest
import torch
from conftest import DEVICE_PARAMS, assert_bitwise_equal
from test_delayed_scaling import assert_states_equal, clone_states, make_state, run_reference

import transformer_fp8 as tfp8
from transformer_fp8 import reference as ref
from transformer_fp8.quantization import scaling_state

Batch = tfp8._C.DelayedScalingBatch
RECIPE = tfp8.DelayedScaling(amax_history_len=4)


def batch_of(states, fp8_maxes):
    hs, ss, sis = zip(*states)
    return Batch(list(hs), list(ss), list(sis), fp8_maxes)


# ---------------------------------------------------------------- DelayedScalingBatch (C++)

@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_batch_matches_reference_over_steps(device, gen, algo):
    states = [make_state(gen, L, n, "mixed", True, device) for L, n in
              [(1, 1), (4, 2), (16, 3), (1024, 2), (7, 5)] * 3]
    maxes = [448.0, 57344.0, 448.0] * 5
    batch = batch_of(states, maxes)
    assert len(batch) == len(states)
    for step in range(3):
        expected = run_reference(states, maxes, margin=step, amax_compute_algo=algo)
        batch.update(step, algo)
        assert_states_equal(clone_states(states), expected)
        for (h, _, _), (fresh, _, _) in zip(states, [make_state(gen, h.shape[0], h.shape[1],
                                                                "mixed", False) for h, _, _ in
                                                     states]):
            h[0].copy_(fresh[0])  # the next step's recorded amaxes


def test_batch_checks_as_the_operator(gen):
    h, s, si = make_state(gen, 4, 2, "mixed", False)
    with pytest.raises(RuntimeError, match="'amax_histories' must be a non-empty list"):
        Batch([], [], [], [])
    with pytest.raises(RuntimeError, match="must have the same length, got 1, 1, 1 and 2"):
        Batch([h], [s], [si], [448.0, 448.0])
    with pytest.raises(RuntimeError, match=r"'scales\[0\]' must be a contiguous float32"):
        Batch([h], [s.double()], [si], [448.0])
    with pytest.raises(RuntimeError, match="shares memory"):
        Batch([h, h.clone()], [s, s], [si, si.clone()], [448.0, 448.0])
    batch = Batch([h], [s], [si], [448.0])
    before = clone_states([(h, s, si)])
    with pytest.raises(RuntimeError, match="argument 'margin' must be an integer in"):
        batch.update(-1, "max")
    with pytest.raises(RuntimeError, match="'amax_compute_algo' must be \"max\" or"):
        batch.update(0, "min")
    assert_states_equal([(h, s, si)], before)  # a refused call changes nothing


def test_batch_checks_again_memory_swapped_behind_it(gen):
    """A tensor given new memory after the batch was made (.data = ...) is updated in its new
    memory, and memory that now overlaps another tensor is refused, changing no state."""
    states = [make_state(gen, 4, 2, "normal", False) for _ in range(2)]
    batch = batch_of(states, [448.0, 448.0])
    h0, s0, si0 = states[0]
    s0.data = s0.clone()  # same values, new memory
    expected = run_reference(states, [448.0, 448.0])
    batch.update(0, "max")
    assert_states_equal(clone_states(states), expected)
    states[1][0][0].fill_(3.0)
    s0.data = states[1][0][1]  # row 1 of the other history: overlapping memory
    before = clone_states(states)
    with pytest.raises(RuntimeError, match="shares memory"):
        batch.update(0, "max")
    assert_states_equal(clone_states(states), before)


# ---------------------------------------------------------------- plans of the step machinery

def layers_of(model):
    return [m for m in model.modules() if isinstance(m, tfp8.Linear)]


def snapshot(layers, role):
    """Copies of the layers' (history, scale, scale_inv) of ``role``, read from the modules'
    buffers (not from the states the step machinery holds)."""
    names = [f"fp8_{role}_{name}" for name in ("amax_history", "scale", "scale_inv")]
    return [tuple(getattr(layer, name).detach().clone() for name in names) for layer in layers]


def expected_after(states, role):
    fp8_max = RECIPE.fp8_format.max_fwd if role == "fwd" else RECIPE.fp8_format.max_bwd
    expected = clone_states(states)
    for h, s, si in expected:
        ref.update_delayed_scaling_reference(h, s, si, fp8_max, RECIPE.margin,
                                             RECIPE.amax_compute_algo)
    return expected


def checked_step(model, x, ran=None):
    """One training step; asserts that both updates equal the reference update of the state
    held just before each, for the layers that ran (``ran``, default all) and that the others
    are unchanged."""
    layers = layers_of(model)
    ran = layers if ran is None else ran
    idle = [layer for layer in layers if layer not in ran]
    idle_before = [snapshot(idle, role) for role in ("fwd", "bwd")]
    seen = {}
    x = x.detach().requires_grad_()

    def keep_bwd_state(grad):  # x's gradient: every grad_output amax of the pass is recorded
        seen.setdefault("bwd", snapshot(ran, "bwd"))
    x.register_hook(keep_bwd_state)
    with tfp8.fp8_autocast(fp8_recipe=RECIPE):
        out = model(x)
        fwd_before = snapshot(ran, "fwd")
    assert_states_equal(snapshot(ran, "fwd"), expected_after(fwd_before, "fwd"))
    out.float().pow(2).sum().backward()
    assert_states_equal(snapshot(ran, "bwd"), expected_after(seen["bwd"], "bwd"))
    for role, before in zip(("fwd", "bwd"), idle_before):
        assert_states_equal(snapshot(idle, role), before)


def plan_of(layer, role="fwd"):
    """The plan of the step that covers the layer's state of ``role``."""
    return layer._scaling_states[0 if role == "fwd" else 1].step._plan


def make_model(gen, device, depth=3):
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    return torch.nn.Sequential(*[tfp8.Linear(32, 32, recipe=RECIPE) for _ in range(depth)]).to(
        device)


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_steps_reuse_their_plan(device, gen):
    model = make_model(gen, device)
    x = torch.randn(16, 32, generator=gen).to(device)
    checked_step(model, x)
    plans = [plan_of(layer, role) for layer in layers_of(model) for role in ("fwd", "bwd")]
    for _ in range(3):
        checked_step(model, x * 3)
    assert [plan_of(layer, role) for layer in layers_of(model)
            for role in ("fwd", "bwd")] == plans  # the same objects: nothing rebuilt


CHANGES = ["device_move", "load_state_dict", "load_state_dict_assign", "assign_buffer",
           "buffers_dict_write", "history_length", "reset", "new_module", "deepcopy"]


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("change", CHANGES)
def test_plan_made_again_after_a_change(device, gen, change):
    model = make_model(gen, device)
    x = torch.randn(16, 32, generator=gen).to(device)
    checked_step(model, x)
    checked_step(model, x * 2)
    old_plan = plan_of(layers_of(model)[0])
    first = layers_of(model)[0]
    if change == "device_move":
        other = "cpu" if device == "cuda" else "meta"
        model.to(other)
        if other == "meta":
            model.to_empty(device=device)
            torch.manual_seed(0)
            for layer in layers_of(model):
                layer.reset_parameters()
        else:
            model.to(device)
    elif change in ("load_state_dict", "load_state_dict_assign"):
        trained = make_model(gen, device)
        checked_step(trained, x * 5)
        model.load_state_dict({k: v.clone() for k, v in trained.state_dict().items()},
                              assign=change == "load_state_dict_assign")
    elif change == "assign_buffer":
        first.fp8_fwd_scale = first.fp8_fwd_scale.clone() * 2
        first.fp8_fwd_scale_inv = 1 / first.fp8_fwd_scale
    elif change == "buffers_dict_write":  # behind the module's __setattr__
        first._buffers["fp8_fwd_scale"] = first.fp8_fwd_scale.clone() * 2
        first._buffers["fp8_bwd_amax_history"] = first.fp8_bwd_amax_history.clone()
    elif change == "history_length":
        sd = model.state_dict()
        sd["0.fp8_fwd_amax_history"] = torch.rand(9, 2, generator=gen).to(device)
        model.load_state_dict(sd)
        assert first.fp8_fwd_amax_history.shape[0] == 9
    elif change == "reset":
        first.reset_fp8_state()
    elif change == "new_module":
        model.append(tfp8.Linear(32, 32, recipe=RECIPE).to(device))
    elif change == "deepcopy":
        import copy
        model = copy.deepcopy(model)
        assert model[0]._scaling_states[0] is not first._scaling_states[0]
    checked_step(model, x * 7)
    assert plan_of(layers_of(model)[0]) is not old_plan
    checked_step(model, x * 11)  # and the plan made again is right in the step after


def test_a_step_of_fewer_modules_leaves_the_others_untouched(gen):
    """Steps over different sets of states (a branch not taken) each get their own plan."""
    model = make_model(gen, "cpu", depth=4)
    x = torch.randn(16, 32, generator=gen)
    checked_step(model, x)
    short = torch.nn.Sequential(*list(model)[:2])
    checked_step(short, x * 3, ran=layers_of(short))
    # the full model again: its states' plans were replaced by the short model's
    checked_step(model, x * 5)
    checked_step(short, x * 7, ran=layers_of(short))


def test_states_are_registered_not_modules(gen):
    layer = tfp8.Linear(32, 32, recipe=RECIPE)
    fwd, bwd = layer._scaling_states
    assert scaling_state.find(layer._fp8_index, "fwd") is fwd
    assert scaling_state.find(layer._fp8_index, "bwd") is bwd
    assert fwd.history is layer.fp8_fwd_amax_history and bwd.scale is layer.fp8_bwd_scale
    index, before = layer._fp8_index, scaling_state.generation()
    del layer, fwd, bwd
    gc.collect()
    assert scaling_state.find(index, "fwd") is None
    # The collector frees a state at a moment that differs between ranks: no plan is made
    # again for it (the reduction's layout changes only when every rank makes its plans again).
    assert scaling_state.generation() == before


def test_update_without_the_prepared_batch_is_the_same(gen, monkeypatch):
    """A library without DelayedScalingBatch falls back to the list operator: same numbers."""
    from transformer_fp8.quantization import update_plan
    model = make_model(gen, "cpu")
    x = torch.randn(16, 32, generator=gen)
    monkeypatch.setattr(update_plan, "_BATCH", None)
    checked_step(model, x)
    checked_step(model, x * 3)


def test_callable_recipe_uses_the_list_path(gen):
    """A recipe with a callable amax algorithm updates through the torch-ops path (the batch
    runs only the built-in algorithms): the same numbers as the reference."""
    algo = lambda window: window.amax(dim=0)  # noqa: E731
    recipe = tfp8.DelayedScaling(amax_history_len=4, amax_compute_algo=algo)
    layer = tfp8.Linear(32, 32, recipe=recipe)
    x = torch.randn(16, 32, generator=gen)
    for scale in (1.0, 4.0):
        with tfp8.fp8_autocast(fp8_recipe=recipe):
            layer(x * scale)
            h, s, si = (t.clone() for t in (layer.fp8_fwd_amax_history, layer.fp8_fwd_scale,
                                            layer.fp8_fwd_scale_inv))
        ref.update_delayed_scaling_reference(h, s, si, recipe.fp8_format.max_fwd, 0, algo)
        for got, want, what in zip((layer.fp8_fwd_amax_history, layer.fp8_fwd_scale,
                                    layer.fp8_fwd_scale_inv), (h, s, si),
                                   ("history", "scale", "scale_inv")):
            assert_bitwise_equal(got, want, what)
