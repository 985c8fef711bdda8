"""The steps of delayed scaling kept from one training step to the next (quantization/
autocast_steps.py's kept_steps, amax_step.AmaxStep): a state belongs to one step at most and moves
with the recipe it runs under; a freed layer's state leaves its step; and the backward step's
BackwardOnce (csrc/step_ops.h), which lets only the first node of a backward pass call into
Python, is cleared after every pass, including one that failed, whose amaxes are discarded. The
C++ step and the Python path are compared bit for bit around a failed backward pass."""
from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
from conftest import assert_bitwise_equal, randn
from test_linear_ticket import OTHER, RECIPE, one_step

import transformer_fp8 as tfp8
from transformer_fp8 import DelayedScaling, fp8_autocast
from transformer_fp8.modules import linear_fused_step
from transformer_fp8.quantization.state import FP8_STATE_KEYS


def test_ticket_follows_the_state_to_another_step(gen):
    """A layer run under another recipe moves to that recipe's step (its state is updated by
    one step only) and back: the ticket of the first recipe is not taken while the state is
    covered by the other step."""
    layer = tfp8.Linear(32, 32, recipe=RECIPE)
    x, g = randn(gen, 16, 32), randn(gen, 16, 32)
    one_step(layer, x, g, RECIPE)
    fwd_state = layer._scaling_states[0]
    first_step = fwd_state.step
    one_step(layer, x * 2, g, OTHER)
    assert fwd_state.step is not first_step
    assert fwd_state.key not in first_step.states
    one_step(layer, x * 3, g, RECIPE)
    assert fwd_state.step is first_step


def test_a_freed_layer_leaves_the_kept_step(gen):
    """The steps kept from step to step hold their states weakly: a freed layer's state leaves,
    and in one process (no reduction across ranks) the plan that held its tensors goes too.
    (Where ranks reduce, the plan is kept until the states change, so that the collector's
    timing decides nothing: tests/test_reduction_layout.py.)"""
    layer = tfp8.Linear(32, 32, recipe=RECIPE)
    x, g = randn(gen, 16, 32), randn(gen, 16, 32)
    one_step(layer, x, g, RECIPE)
    one_step(layer, x, g, RECIPE)
    step = layer._scaling_states[0].step
    history = weakref.ref(layer.fp8_fwd_amax_history)
    key = layer._scaling_states[0].key
    assert key in step.states and step._plan is not None
    del layer
    gc.collect()
    assert key not in step.states
    assert step._plan is None and history() is None
    other = tfp8.Linear(32, 32, recipe=RECIPE)  # the step serves the next layers as before
    one_step(other, x, g, RECIPE)
    assert other._scaling_states[0].step is step and step._plan is not None


class _Refused(Exception):
    pass


def _steps_around_a_failed_backward(layer, gen_seed):
    """A step, a step whose backward pass raises after the layer's node ran (the input's
    gradient hook), then two steps; returns the outputs and gradients of the good ones."""
    gen = torch.Generator().manual_seed(gen_seed)
    results = []
    for step in range(4):
        x = randn(gen, 2, 16, 32, scale=4.0 ** step).requires_grad_(True)
        g = randn(gen, 2, 16, 32)
        with fp8_autocast(fp8_recipe=RECIPE):
            out = layer(x)
        if step == 1:
            def refuse(grad):
                raise _Refused("the backward pass fails")
            x.register_hook(refuse)
            with pytest.raises(_Refused):
                out.backward(g)
            layer.zero_grad(set_to_none=True)
            continue
        out.backward(g)
        results.append((out.detach(), x.grad, [p.grad.clone() for p in layer.parameters()]))
        layer.zero_grad(set_to_none=True)
    return results


def test_a_failed_backward_pass_is_discarded_and_the_next_passes_update(gen, monkeypatch):
    """The grad_output amaxes of the failed pass are discarded at the next fp8_autocast (no
    scale changes from them) and the next passes queue their updates again, as on the Python
    path, bit for bit."""
    layer = tfp8.Linear(32, 32, recipe=RECIPE)
    python_layer = copy.deepcopy(layer)
    seed = int(torch.randint(0, 2**31, (1,), generator=gen))
    fused = _steps_around_a_failed_backward(layer, seed)
    monkeypatch.setattr(linear_fused_step, "ENABLED", False)
    python = _steps_around_a_failed_backward(python_layer, seed)
    for step, (a, b) in enumerate(zip(fused, python)):
        for i, (x, y) in enumerate(zip([a[0], a[1], *a[2]], [b[0], b[1], *b[2]])):
            assert_bitwise_equal(x, y, f"step {step} tensor {i}")
    for key in FP8_STATE_KEYS:
        assert_bitwise_equal(getattr(layer, key), getattr(python_layer, key), key)
    bwd_history = layer.fp8_bwd_amax_history
    assert bool((bwd_history[0] == 0).all()), "the last pass's amaxes were updated"


def test_backward_once_is_cleared_after_every_pass(gen):
    """Every backward pass through a model of C++ steps calls on_backward once (its first
    node), and the flag is clear again after the pass: with retain_graph each pass updates."""
    model = torch.nn.Sequential(*[tfp8.Linear(32, 32, recipe=RECIPE) for _ in range(3)])
    x = randn(gen, 16, 32)
    with fp8_autocast(fp8_recipe=RECIPE):
        out = model(x)
    backward = model[0]._scaling_states[1].step
    from transformer_fp8.quantization import autocast
    kept = [steps[1] for steps in autocast._LOCAL.kept_steps.values()
            if steps[1].step is backward]
    assert len(kept) == 1
    backward_step = kept[0]
    calls = []
    on_backward = backward_step.on_backward
    backward_step.on_backward = lambda: calls.append(1) or on_backward()
    rolled = []
    for scale in (1.0, 3.0):
        before = model[0].fp8_bwd_amax_history.clone()
        (out * scale).sum().backward(retain_graph=True)
        rolled.append(not torch.equal(before, model[0].fp8_bwd_amax_history))
        assert backward_step._once.task is None
    del backward_step.on_backward
    assert calls == [1, 1], "one call per pass, from its first node"
    assert rolled == [True, True], "each pass updated the grad_output state"


@pytest.mark.parametrize("path", ["cxx", "python"])
def test_a_pass_after_a_failed_one_queues_its_own_update(path, gen, monkeypatch):
    """Two forward passes; the first one's backward pass fails, then the second one's runs
    before any other fp8_autocast: the second pass still updates the grad_output state (the
    failed pass's amaxes are discarded first), on both paths."""
    if path == "python":
        monkeypatch.setattr(linear_fused_step, "ENABLED", False)
    layer = tfp8.Linear(32, 32, recipe=RECIPE)
    xs = [randn(gen, 8, 32).requires_grad_(True) for _ in range(2)]
    outs = []
    for x in xs:
        with fp8_autocast(fp8_recipe=RECIPE):
            outs.append(layer(x))

    def refuse(grad):
        raise _Refused("the backward pass fails")
    xs[0].register_hook(refuse)
    with pytest.raises(_Refused):
        outs[0].backward(randn(gen, 8, 32, scale=5.0))
    g = randn(gen, 8, 32, scale=7.0)
    outs[1].backward(g)
    amax = g.abs().max().float()
    assert torch.equal(layer.fp8_bwd_amax_history[-1], amax.reshape(1)), \
        "the second pass's amax is in the history: its update ran"
    assert bool((layer.fp8_bwd_amax_history[0] == 0).all())
    assert float(layer.fp8_bwd_scale) != 1.0


def test_threads_training_their_own_models_match_one_thread(gen):
    """Each thread keeps its own steps (and its own backward passes' flags): two threads
    training two copies of a model under one recipe, interleaved, end where each copy ends when
    trained alone, bit for bit."""
    import sys
    import threading
    base = torch.nn.Sequential(tfp8.Linear(32, 32, recipe=RECIPE),
                               tfp8.Linear(32, 32, recipe=RECIPE))
    data = [[(randn(gen, 8, 32, scale=3.0 ** (s % 5)), randn(gen, 8, 32)) for s in range(12)]
            for _ in range(2)]

    def train(model, steps):
        outs = []
        for x, g in steps:
            with fp8_autocast(fp8_recipe=RECIPE):
                out = model(x)
            out.backward(g)
            outs.append(out.detach())
        return outs

    alone = [copy.deepcopy(base) for _ in range(2)]
    expected = [train(model, steps) for model, steps in zip(alone, data)]
    threaded, got = [copy.deepcopy(base) for _ in range(2)], [None, None]

    def run(i):
        got[i] = train(threaded[i], data[i])
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # (switch threads often: interleave the steps)
    try:
        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
    for i in range(2):
        for step, (a, b) in enumerate(zip(got[i], expected[i])):
            assert_bitwise_equal(a, b, f"thread {i} step {step}")
        for (name, a), b in zip(threaded[i].state_dict().items(), alone[i].state_dict().values()):
            assert_bitwise_equal(a, b, f"thread {i} {name}")


def test_another_threads_context_leaves_a_running_backward_pass_alone(gen):
    """Thread A's backward pass has queued its update and is still running when thread B
    enters an outermost fp8_autocast: B discards and flushes only its own steps' passes, so A's
    pass updates as it would alone."""
    import threading
    torch.manual_seed(0)
    layer = tfp8.Linear(32, 32, recipe=RECIPE)
    alone = copy.deepcopy(layer)
    other = tfp8.Linear(32, 32, recipe=RECIPE)
    x, g = randn(gen, 8, 32, scale=3.0), randn(gen, 8, 32, scale=50.0)

    def step(model, pause=None):
        inp = x.detach().requires_grad_(True)
        with fp8_autocast(fp8_recipe=RECIPE):
            out = model(inp)
        if pause is not None:
            inp.register_hook(pause)  # runs after the layer's node: its update is queued
        out.backward(g)

    step(alone)
    queued, resume = threading.Event(), threading.Event()

    def pause(grad):
        queued.set()
        assert resume.wait(30), "thread B did not go on"
        return grad

    thread = threading.Thread(target=step, args=(layer, pause))
    thread.start()
    assert queued.wait(30)
    step(other)  # thread B: an outermost context (and a step of its own) meanwhile
    resume.set()
    thread.join()
    for (name, a), b in zip(layer.state_dict().items(), alone.state_dict().values()):
        assert_bitwise_equal(a, b, name)


class _FailingAlgo:
    """A recipe's amax_compute_algo (Transformer Engine's callable form) that raises when
    armed; else the max over the window."""

    def __init__(self):
        self.armed = False

    def __call__(self, history):
        if self.armed:
            self.armed = False
            raise _Refused("the recipe's callable fails")
        return history.amax(dim=0)


def _good_steps(model, recipe, seed, steps=3, other=None):
    gen = torch.Generator().manual_seed(seed)
    records = []
    for step in range(steps):
        x = randn(gen, 4, 32, scale=3.0 ** step).requires_grad_(True)
        with fp8_autocast(fp8_recipe=recipe):
            out = model(x)
            if other is not None:  # a second model under a nested context of its own recipe
                with fp8_autocast(fp8_recipe=other[1]):
                    out = out + other[0](x)
        (out * 2.0 ** -step).sum().backward()
        records.append([out.detach(), x.grad] + [p.grad.clone() for p in model.parameters()]
                       + [b.clone() for b in model.buffers()])
        model.zero_grad(set_to_none=True)
    return records


@pytest.mark.parametrize("where", ["forward_update", "backward_update", "outer_of_two"])
def test_an_update_that_raises_discards_its_steps_amaxes(where):
    """A delayed-scaling update that raises (here the recipe's callable; a failed collective or
    an interrupt alike) discards the amaxes of its step, and of the steps still to update in
    the same context, as a failed step does: the next steps are bit for bit those of a model
    that never ran the failed one (the amaxes stayed in history row 0, and the next step's
    were folded into them: outputs 1.3 apart)."""
    algo = _FailingAlgo()
    recipe = DelayedScaling(amax_history_len=4, amax_compute_algo=algo)
    inner = DelayedScaling(amax_history_len=3)

    def build():
        torch.manual_seed(0)
        return (torch.nn.Sequential(tfp8.Linear(32, 32), torch.nn.GELU(), tfp8.Linear(32, 32)),
                tfp8.Linear(32, 32))

    (failing, failing_other), (reference, reference_other) = build(), build()
    x = torch.randn(4, 32) * 300
    algo.armed = where != "backward_update"
    with pytest.raises(_Refused):
        with fp8_autocast(fp8_recipe=recipe):
            out = failing(x)
            if where == "outer_of_two":
                with fp8_autocast(fp8_recipe=inner):
                    out = out + failing_other(x)
        if where == "backward_update":
            algo.armed = True
            (out * 1000).sum().backward()
    failing.zero_grad(set_to_none=True)
    failing_other.zero_grad(set_to_none=True)
    if where == "backward_update":  # (its forward's update ran: the reference's runs too)
        with fp8_autocast(fp8_recipe=recipe):
            reference(x)
    other = where == "outer_of_two"
    got = _good_steps(failing, recipe, 1, other=(failing_other, inner) if other else None)
    expected = _good_steps(reference, recipe, 1,
                           other=(reference_other, inner) if other else None)
    for step, (g_step, e_step) in enumerate(zip(got, expected)):
        for i, (g, e) in enumerate(zip(g_step, e_step)):
            assert_bitwise_equal(g, e, f"step {step} tensor {i}")
    for a, b in zip(failing_other.buffers(), reference_other.buffers()):
        assert_bitwise_equal(a, b, "the inner recipe's model")
