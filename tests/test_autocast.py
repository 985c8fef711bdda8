"""fp8_autocast: when amaxes are reduced and scales updated, and that state stays consistent."""
from __future__ import annotations

import warnings

import pytest
import torch
from conftest import randn

import transformer_fp8 as tfp8
from transformer_fp8 import DelayedScaling, fp8_autocast, ops
from transformer_fp8.quantization import update_plan

RECIPE = DelayedScaling(amax_history_len=8)


def make_model(gen, device, widths=(32, 48, 64, 16)):
    layers = [tfp8.Linear(a, b, device=device) for a, b in zip(widths[:-1], widths[1:])]
    with torch.no_grad():
        for layer in layers:
            layer.weight.copy_(randn(gen, *layer.weight.shape, device=device) * 0.2)
    return torch.nn.Sequential(*layers)


def fp8_state(model):
    return [t.clone() for layer in model for t in (
        layer.fp8_fwd_amax_history, layer.fp8_fwd_scale, layer.fp8_fwd_scale_inv,
        layer.fp8_bwd_amax_history, layer.fp8_bwd_scale, layer.fp8_bwd_scale_inv)]


def assert_state_equal(before, after):
    assert all(torch.equal(a, b) for a, b in zip(before, after))


def assert_scales_follow_histories(model, recipe=RECIPE):
    """Every scale is its role's fp8_max (HYBRID: 448 forward, 57344 for grad_output) over the
    max of its history, and every scale_inv its inverse."""
    fwd_max, bwd_max = recipe.fp8_format.max_fwd, recipe.fp8_format.max_bwd
    for i, layer in enumerate(model):
        for history, scale, scale_inv, fp8_max, role in (
                (layer.fp8_fwd_amax_history, layer.fp8_fwd_scale, layer.fp8_fwd_scale_inv,
                 fwd_max, "fwd"),
                (layer.fp8_bwd_amax_history, layer.fp8_bwd_scale, layer.fp8_bwd_scale_inv,
                 bwd_max, "bwd")):
            expected = fp8_max / history.amax(0)
            torch.testing.assert_close(scale, expected, rtol=1e-6, atol=0,
                                       msg=f"layer {i} {role} scale")
            torch.testing.assert_close(scale_inv, 1 / expected, rtol=1e-6, atol=0,
                                       msg=f"layer {i} {role} scale_inv")


@pytest.fixture
def update_calls(monkeypatch):
    """Counts the update calls of the step machinery (and the tensors each one updated): those
    of ops.update_delayed_scaling and of the prepared batches (update_plan.py) alike."""
    calls = []
    real = ops.update_delayed_scaling

    def counting(histories, *args, **kwargs):
        calls.append(len(histories))
        return real(histories, *args, **kwargs)

    class CountingBatch:
        def __init__(self, *lists):
            self.batch = real_batch(*lists)

        def update(self, *args):
            calls.append(len(self.batch))
            return self.batch.update(*args)

    monkeypatch.setattr(ops, "update_delayed_scaling", counting)
    real_batch = update_plan._BATCH
    if real_batch is not None:
        monkeypatch.setattr(update_plan, "_BATCH", CountingBatch)
    return calls


def test_one_update_per_step_forward_and_backward(gen, device, update_calls):
    model = make_model(gen, device)
    x = randn(gen, 16, 32, device=device)
    with fp8_autocast(fp8_recipe=RECIPE):
        out = model(x)
        assert update_calls == [], "nothing is updated before the context exits"
    assert update_calls == [3], "one call for the forward states of the three layers"
    assert model[0].fp8_fwd_amax_history[-1, 0] == x.abs().max()
    for layer in model:
        assert layer.fp8_fwd_amax_history[-1, 1] == layer.weight.abs().max()
    out.sum().backward()
    assert update_calls == [3, 3], "one call for the backward states, after the backward pass"
    for layer in model:
        assert not layer.fp8_bwd_amax_history[0].any()
        assert layer.fp8_bwd_amax_history[-1].all()
    # The last layer's grad_output is all ones: amax 1, scale 57344 (E5M2's max).
    assert model[-1].fp8_bwd_amax_history[-1, 0] == 1.0
    assert model[-1].fp8_bwd_scale.item() == 57344.0
    assert_scales_follow_histories(model)


def test_nested_contexts_update_at_outermost_exit(gen, device, update_calls):
    model = make_model(gen, device)
    x = randn(gen, 16, 32, device=device)
    with fp8_autocast(fp8_recipe=RECIPE):
        with fp8_autocast(fp8_recipe=RECIPE):
            model(x)
        assert update_calls == []
        recorded = [layer.fp8_fwd_amax_history[0].clone() for layer in model]
        with fp8_autocast(enabled=False):
            hp = model(x * 7)  # the innermost context decides: high precision, nothing recorded
        for layer, before in zip(model, recorded):
            assert torch.equal(layer.fp8_fwd_amax_history[0], before)
    assert update_calls == [3]
    expected = x * 7
    for layer in model:
        expected = torch.nn.functional.linear(expected, layer.weight, layer.bias)
    assert torch.equal(hp, expected)


def test_inner_exception_caught_inside_keeps_the_step(gen, device):
    model = make_model(gen, device)
    x = randn(gen, 16, 32, device=device)
    with fp8_autocast(fp8_recipe=RECIPE):
        try:
            with fp8_autocast(fp8_recipe=RECIPE):
                model(x)
                raise KeyError("handled")
        except KeyError:
            pass
    assert model[0].fp8_fwd_amax_history[-1, 0] == x.abs().max()


def test_every_backward_pass_updates_once(gen, device, update_calls):
    """Microbatches: several forwards in one context, one backward pass each."""
    model = make_model(gen, device)
    xs = [randn(gen, 16, 32, device=device) * (i + 1) for i in range(3)]
    with fp8_autocast(fp8_recipe=RECIPE):
        outs = [model(x) for x in xs]
    assert update_calls == [3]
    for i, out in enumerate(outs):
        out.square().mean().backward()
        assert update_calls == [3] + [3] * (i + 1)
        for layer in model:
            assert not layer.fp8_bwd_amax_history[0].any(), "row 0 consumed by the update"
    assert model[0].fp8_bwd_amax_history[-3:].all()
    assert_scales_follow_histories(model)


def test_frozen_first_layer_still_updates_backward_state(gen, device):
    model = make_model(gen, device)
    model[0].requires_grad_(False)
    x = randn(gen, 16, 32, device=device)
    with fp8_autocast(fp8_recipe=RECIPE):
        model(x).sum().backward()
    for layer in model[1:]:
        assert layer.fp8_bwd_amax_history[-1].all() and not layer.fp8_bwd_amax_history[0].any()
        assert layer.fp8_bwd_scale.item() != 1.0


def test_contexts_are_per_thread(gen):
    import threading
    layer = tfp8.Linear(32, 16)
    x = randn(gen, 8, 32)
    seen = {}

    def other_thread():
        seen["out"] = layer(x)  # this thread entered no fp8_autocast: high precision

    with fp8_autocast(fp8_recipe=RECIPE):
        thread = threading.Thread(target=other_thread)
        thread.start()
        thread.join()
        assert not layer.fp8_fwd_amax_history.any()
    assert torch.equal(seen["out"], torch.nn.functional.linear(x, layer.weight, layer.bias))


def test_exception_inside_leaves_state_unchanged(gen, device):
    model = make_model(gen, device)
    x = randn(gen, 16, 32, device=device)
    with fp8_autocast(fp8_recipe=RECIPE):
        model(x)  # a first step sets histories and scales
    before = fp8_state(model)
    with pytest.raises(RuntimeError, match="boom"):
        with fp8_autocast(fp8_recipe=RECIPE):
            model(x * 3)
            raise RuntimeError("boom")
    assert_state_equal(before, fp8_state(model))
    with fp8_autocast(fp8_recipe=RECIPE):  # and the next step is a normal one
        model(x)
    assert torch.equal(model[0].fp8_fwd_amax_history[-1], model[0].fp8_fwd_amax_history[-2])


def test_module_outside_any_context_touches_no_state(gen, device):
    model = make_model(gen, device)
    with fp8_autocast(fp8_recipe=RECIPE):
        model(randn(gen, 16, 32, device=device))
    before = fp8_state(model)
    model(randn(gen, 16, 32, device=device) * 5).sum().backward()
    assert_state_equal(before, fp8_state(model))


def test_module_called_twice_records_the_max(gen, device):
    layer = tfp8.Linear(32, 32, device=device)
    small, large = randn(gen, 16, 32, device=device), randn(gen, 16, 32, device=device) * 4
    with fp8_autocast(fp8_recipe=RECIPE):
        layer(small)
        layer(large)
        layer(small)
    recorded = layer.fp8_fwd_amax_history[-1, 0].item()
    assert recorded == large.abs().max().item()


def test_invalid_arguments():
    with pytest.raises(TypeError, match="fp8_recipe"):
        with fp8_autocast(fp8_recipe="delayed"):
            pass
    with pytest.raises(TypeError, match="enabled"):
        with fp8_autocast(enabled=1):
            pass
    with pytest.raises(TypeError, match="fp8_group"):
        with fp8_autocast(fp8_group=3):
            pass


def test_context_object_reused_nested_and_as_decorator(gen, device, update_calls):
    """One fp8_autocast object entered again after it was left, entered inside itself (only
    the outermost entry updates), and decorating a function that recurses: each use is one
    step with one update at its outermost exit, as with a new context each time."""
    model = make_model(gen, device)
    x = randn(gen, 16, 32, device=device)
    context = fp8_autocast(fp8_recipe=RECIPE)
    with context:
        model(x)
    assert update_calls == [3]
    with context:
        with context:
            model(x * 2)
        assert update_calls == [3], "the inner exit of the same object does not update"
    assert update_calls == [3, 3]
    assert model[0].fp8_fwd_amax_history[-1, 0] == (x * 2).abs().max()

    @fp8_autocast(fp8_recipe=RECIPE)
    def forward(t, depth):
        return forward(t, depth - 1) if depth else model(t)

    forward(x * 3, 2)
    assert update_calls == [3, 3, 3]
    assert model[0].fp8_fwd_amax_history[-1, 0] == (x * 3).abs().max()
    assert tfp8.quantization.autocast.current_state() is None


def test_callable_recipe_algorithms(gen, device):
    recipe = DelayedScaling(amax_history_len=4, amax_compute_algo=lambda history: history[0],
                            scaling_factor_compute_algo=lambda amax, scale, fp8_max, r:
                            torch.full_like(scale, 0.25))
    layer = tfp8.Linear(32, 16, device=device)
    with fp8_autocast(fp8_recipe=recipe):
        layer(randn(gen, 16, 32, device=device))
    assert torch.equal(layer.fp8_fwd_scale.cpu(), torch.tensor([0.25, 0.25]))
    assert layer.fp8_fwd_amax_history[-1].all() and not layer.fp8_fwd_amax_history[0].any()


def test_recipe_fields_are_recorded(gen):
    layer = tfp8.Linear(16, 16)
    assert layer.fp8_recipe_fields.tolist() == [-1, -1, -1, -1]
    with fp8_autocast(fp8_recipe=DelayedScaling(margin=2, amax_history_len=5,
                                                amax_compute_algo="most_recent")):
        layer(randn(gen, 4, 16))
    assert layer.fp8_recipe_fields.tolist() == [2, 2, 5, 1]  # margin, HYBRID, length, most_recent
    assert layer.fp8_fwd_amax_history.shape == (5, 2)


def test_a_deep_copy_is_a_layer_of_its_own(gen):
    import copy
    layer = tfp8.Linear(32, 16)
    twin = copy.deepcopy(layer)
    x = randn(gen, 8, 32)
    with fp8_autocast(fp8_recipe=RECIPE):
        layer(x)
        twin(2 * x)
    assert layer.fp8_fwd_amax_history[-1, 0] == x.abs().max()
    assert twin.fp8_fwd_amax_history[-1, 0] == (2 * x).abs().max()
    assert torch.equal(layer.fp8_fwd_scale[0] / twin.fp8_fwd_scale[0], torch.tensor(2.0))


def test_one_context_object_entered_by_two_threads_at_once():
    """A shared fp8_autocast object (a decorator, a module-level context) entered by two
    threads whose entries interleave: each thread's outermost context is its own. (The object
    once kept a stack of 'outermost' flags: thread A, nested, popped thread B's flag and ran
    its update in the middle of its step, and B's exit skipped its own.)"""
    import threading

    recipe = DelayedScaling(amax_history_len=2)
    shared = fp8_autocast(fp8_recipe=recipe)
    layers = [tfp8.Linear(16, 16, recipe=recipe) for _ in range(2)]
    x = torch.randn(4, 16)
    a_entered, b_entered, a_exited = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def thread_a():
        with fp8_autocast(fp8_recipe=recipe):
            layers[0](x)
            with shared:
                a_entered.set()
                b_entered.wait(5)
            a_exited.set()
            # Still inside A's outermost context: its update has not run yet.
            seen["a_before_exit"] = layers[0].fp8_fwd_scale.clone()
        seen["a_after_exit"] = layers[0].fp8_fwd_scale.clone()

    def thread_b():
        a_entered.wait(5)
        with shared:
            layers[1](x)
            b_entered.set()
            a_exited.wait(5)
        seen["b_after_exit"] = layers[1].fp8_fwd_scale.clone()

    threads = [threading.Thread(target=thread_a), threading.Thread(target=thread_b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    ones = torch.ones(2)
    assert torch.equal(seen["a_before_exit"], ones), "A's update ran before its context's exit"
    assert not torch.equal(seen["a_after_exit"], ones), "A's update did not run at its exit"
    assert not torch.equal(seen["b_after_exit"], ones), "B's update did not run at its exit"


@pytest.mark.parametrize("old_len,new_len", [(4, 8), (8, 3), (5, 1), (1, 6)])
def test_a_new_history_length_keeps_the_recorded_amaxes(old_len, new_len, gen):
    """A recipe with another amax_history_len resizes the histories as if they had always had
    that length: from the switch on, they are those of a layer that ran every step under the
    new length, bit for bit, less the amaxes the old length had already let go (a resize once
    emptied them: the first update's 'max' forgot every earlier amax)."""
    old, new = DelayedScaling(amax_history_len=old_len), DelayedScaling(amax_history_len=new_len)
    torch.manual_seed(0)
    layer = tfp8.Linear(32, 16, recipe=old)
    always = tfp8.Linear(32, 16, recipe=new)
    with torch.no_grad():
        always.weight.copy_(layer.weight)
        always.bias.copy_(layer.bias)
    switch = 5
    first_kept = switch + 1 - old_len  # the oldest step the old histories hold at the switch
    for i in range(switch + 3):
        x = randn(gen, 8, 32, scale=4.0 / (i + 1))  # falling amaxes: the oldest is the max
        for module, recipe in ((layer, old if i < switch else new), (always, new)):
            with fp8_autocast(fp8_recipe=recipe):
                module(x).sum().backward()
        if i < switch:
            continue
        for name in ("fp8_fwd_amax_history", "fp8_bwd_amax_history"):
            expected = getattr(always, name).clone()  # row r (>= 1) holds step i - (L-1-r)
            for row in range(1, new_len):
                if i - (new_len - 1 - row) < first_kept:
                    expected[row] = 0
            assert torch.equal(getattr(layer, name), expected), (i, name)
            assert getattr(layer, name)[1:].any() == (new_len > 1), "amaxes kept"
        if new_len <= old_len:  # shortened: the same windows, so the same scales
            for name in ("fp8_fwd_scale", "fp8_bwd_scale"):
                assert torch.equal(getattr(layer, name), getattr(always, name)), (i, name)


# ------------------------------------------------------------- torch.func transforms: refused

FUNC_TRANSFORMS = {
    "grad": lambda f, x: torch.func.grad(lambda t: f(t).square().sum())(x),
    "vmap": lambda f, x: torch.func.vmap(f)(x),
}


def _func_layer(module):
    torch.manual_seed(0)
    if module == "Linear":
        return tfp8.Linear(32, 48)
    return tfp8.LayerNormMLP(32, 64)


def _train_steps(layer, recipe, steps=3):
    records = []
    for step in range(steps):
        x = (torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(step))
             * 4.0 ** step).requires_grad_(True)
        with fp8_autocast(fp8_recipe=recipe):
            out = layer(x)
        out.square().sum().backward()
        records.append([out.detach(), x.grad] + [p.grad.clone() for p in layer.parameters()]
                       + [b.clone() for b in layer.buffers()])
        layer.zero_grad(set_to_none=True)
    return records


@pytest.mark.parametrize("warm", [False, True], ids=["fresh", "warm"])
@pytest.mark.parametrize("context", ["inside", "outside"])
@pytest.mark.parametrize("transform", list(FUNC_TRANSFORMS))
@pytest.mark.parametrize("module", ["Linear", "LayerNormMLP"])
def test_torch_func_transforms_are_refused_and_leave_the_state_alone(module, transform,
                                                                      context, warm):
    """An FP8 forward under torch.func.grad / vmap raises, the layer's state is as before, and
    training goes on as if the call had not been made. (A fresh layer's amax history was
    resized inside the transform before functorch refused an in-place write: the buffer kept
    a dead functorch wrapper and the next step crashed with a segmentation fault.)"""
    recipe = DelayedScaling(amax_history_len=4)  # (the fresh layer's history is resized)
    layer = _func_layer(module)
    reference = _func_layer(module)
    if warm:
        _train_steps(layer, recipe, 1)
        _train_steps(reference, recipe, 1)
    def snapshot():
        return {k: v.clone() for k, v in layer.state_dict().items() if torch.is_tensor(v)}

    def forward(t):
        if context == "inside":
            with fp8_autocast(fp8_recipe=recipe):
                return layer(t)
        return layer(t)

    x = torch.randn(2, 8, 32)
    # Where the context is entered inside the transform, or a fresh layer first meets its
    # recipe there, the refusal is transformer_fp8's; a warm layer under a context entered
    # outside gets torch.func's own refusal of its in-place FP8 operators.
    message = "torch.func transform" if context == "inside" or not warm else None
    if context == "outside":
        with fp8_autocast(fp8_recipe=recipe):  # (its entry gives a fresh layer the recipe)
            before = snapshot()
            with pytest.raises(RuntimeError, match=message):
                FUNC_TRANSFORMS[transform](forward, x)
    else:
        before = snapshot()
        with pytest.raises(RuntimeError, match=message):
            FUNC_TRANSFORMS[transform](forward, x)
    after = snapshot()
    assert before.keys() == after.keys()
    for key in before:
        assert torch.equal(before[key], after[key]), key
    for got, expected in zip(_train_steps(layer, recipe), _train_steps(reference, recipe)):
        for g, e in zip(got, expected):
            assert torch.equal(g, e)


def test_a_recipe_made_anew_at_every_step_keeps_no_state_per_step():
    """A new lambda at every step makes a recipe unequal to the last: the autocast states and
    steps kept for it stay bounded (they grew by one per step, never freed), and training
    is bit for bit that of one recipe object."""
    from transformer_fp8.quantization import autocast as autocast_module

    torch.manual_seed(0)
    fresh, single = tfp8.Linear(32, 16), tfp8.Linear(32, 16)
    single.load_state_dict(fresh.state_dict())
    one = DelayedScaling(amax_history_len=2, amax_compute_algo=lambda h: h.max(dim=0).values)
    steps = autocast_module.MAX_KEPT_RECIPES + 20
    for step in range(steps):
        x = torch.randn(8, 32) * (step % 5 + 1)
        recipe = DelayedScaling(amax_history_len=2,
                                amax_compute_algo=lambda h: h.max(dim=0).values)
        for layer, r in ((fresh, recipe), (single, one)):
            with fp8_autocast(fp8_recipe=r):
                out = layer(x)
            out.square().sum().backward()
    assert len(autocast_module._STATES) <= autocast_module.MAX_KEPT_RECIPES
    assert len(autocast_module._STEP_KEYS) <= autocast_module.MAX_KEPT_RECIPES
    assert len(autocast_module._LOCAL.kept_steps) <= autocast_module.MAX_KEPT_RECIPES
    assert torch.equal(fresh.weight.grad, single.weight.grad)
    for name, buf in fresh.named_buffers():
        assert torch.equal(buf, dict(single.named_buffers())[name]), name


def test_rank_local_fp8_state_with_several_ranks_warns_about_ddp_broadcast(monkeypatch):
    """reduce_amax=False with several ranks: one warning that DistributedDataParallel needs
    broadcast_buffers=False (its default overwrote every rank's FP8 state with rank 0's at
    each forward: 4-8 dB wrong gradients, silently)."""
    from transformer_fp8.quantization import amax_step

    monkeypatch.setattr(amax_step, "world_size", lambda group: 2)
    monkeypatch.setattr(amax_step, "_WARNED_RANK_LOCAL", [False])
    with pytest.warns(UserWarning, match="broadcast_buffers=False"):
        amax_step.AmaxStep(DelayedScaling(reduce_amax=False), None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        amax_step.AmaxStep(DelayedScaling(reduce_amax=False), None)  # (once)
        amax_step.AmaxStep(DelayedScaling(), None)
