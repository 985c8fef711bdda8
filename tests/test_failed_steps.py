"""A step that fails (an exception leaves the outermost fp8_autocast: a simulated out-of-memory
after some FP8 layers ran, the training loop skipping the batch) or an evaluation forward
leaves the FP8 state as it found it: the following steps are bit for bit those of a run in
which the failed step never happened. Two ways it did not: a failed first step under a recipe
of another amax history length kept its resize of the histories, and a discarded step erased
the weight amaxes that FP8 primary weights recorded at the optimizer step before it."""
from __future__ import annotations

import copy

import torch

import transformer_fp8 as tfp8
from transformer_fp8 import DelayedScaling, Float8CurrentScaling, fp8_autocast


class _OutOfMemory(RuntimeError):
    pass


def _fp8_state(model) -> dict:
    return {k: v.clone() for k, v in model.state_dict().items() if "fp8_" in k}


def _train(model, steps, gen_seed=1):
    """Run ``steps`` [(recipe, kind)], kind "train", "fail" (an exception after the model's
    forward, caught: the batch is skipped), "eval" (a forward under no_grad) or "skip"; SGD
    with weights written by copy_ (so FP8 primary weights record their amax there). Returns
    the losses of the training steps and the FP8 state after the last step."""
    gen = torch.Generator().manual_seed(gen_seed)
    losses = []
    for recipe, kind in steps:
        x = torch.randn(16, 32, generator=gen) * 2
        if kind == "skip":
            continue
        if kind == "eval":
            with torch.no_grad(), fp8_autocast(fp8_recipe=recipe):
                model(x)
            continue
        try:
            with fp8_autocast(fp8_recipe=recipe):
                out = model(x)
                if kind == "fail":
                    raise _OutOfMemory("CUDA out of memory (simulated)")
        except _OutOfMemory:
            continue
        loss = out.float().pow(2).mean()
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p - 0.1 * p.grad)
                p.grad = None
        losses.append(loss.detach())
    return losses, _fp8_state(model)


def _same_run(make, steps_with_failure):
    """The run with the failed (or evaluation) step, and the same run with it skipped, first
    (a context's entry may adopt its recipe for every module of the process waiting for one:
    the expected results are taken before the failing run can touch that model)."""
    base = make()
    failing, plain = copy.deepcopy(base), copy.deepcopy(base)
    skipped = [(recipe, "skip" if kind in ("fail", "eval") else kind)
               for recipe, kind in steps_with_failure]
    expected = _train(plain, skipped)
    got = _train(failing, steps_with_failure)
    for g, e in zip(got[0], expected[0]):
        assert torch.equal(g, e)
    assert got[1].keys() == expected[1].keys()
    for key in expected[1]:
        assert torch.equal(got[1][key], expected[1][key]), key


def _two_layers(recipe=None):
    torch.manual_seed(0)
    return torch.nn.Sequential(tfp8.Linear(32, 32, recipe=recipe), torch.nn.GELU(),
                               tfp8.Linear(32, 16, recipe=recipe))


def test_a_failed_step_under_another_history_length_keeps_the_histories():
    """Built for 8 rows, a failing step under a recipe of 2 rows: the resize it made (which
    drops the oldest amaxes) is undone with the step (the later input scales were 66 for 16)."""
    long, short = DelayedScaling(amax_history_len=8), DelayedScaling(amax_history_len=2)
    steps = [(long, "train")] * 3 + [(short, "fail")] + [(long, "train")] * 3
    _same_run(lambda: _two_layers(long), steps)


def test_a_failed_delayed_step_leaves_a_current_scaling_model_unchanged():
    """A model that trains under Float8CurrentScaling, given one failing DelayedScaling step:
    its histories and recipe record stay as they were (they took the failed recipe's)."""
    current, short = Float8CurrentScaling(), DelayedScaling(amax_history_len=2)
    steps = [(current, "train")] * 2 + [(short, "fail")] + [(current, "train")] * 2
    _same_run(_two_layers, steps)


def _fp8_weight_layers():
    recipe = DelayedScaling(amax_history_len=4)
    with tfp8.quantized_model_init(recipe=recipe):
        return _two_layers(recipe)


def test_fp8_primary_weights_keep_their_amax_through_an_evaluation_forward():
    """FP8 primary weights record the written weight's amax at the optimizer step (outside
    any context), for the next update; an evaluation forward between two training steps, whose
    amaxes are discarded, erased it too."""
    recipe = DelayedScaling(amax_history_len=4)
    steps = [(recipe, "train")] * 3 + [(recipe, "eval")] + [(recipe, "train")] * 3
    _same_run(_fp8_weight_layers, steps)


def test_fp8_primary_weights_keep_their_amax_through_a_failed_step():
    recipe = DelayedScaling(amax_history_len=4)
    steps = [(recipe, "train")] * 3 + [(recipe, "fail")] + [(recipe, "train")] * 3
    _same_run(_fp8_weight_layers, steps)


def test_a_failed_step_under_two_recipes_discards_what_ran_under_the_first():
    """In the failed step the module first records under its own recipe (8 rows), then runs in
    a nested context of another length (a resized copy): the undo puts the 8-row history back,
    without that step's amax in its row 0 (it stayed: a scale 82x off for 8 steps)."""
    long, short = DelayedScaling(amax_history_len=8), DelayedScaling(amax_history_len=2)

    class Nested(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = tfp8.Linear(32, 16, recipe=long)

        def forward(self, x):
            out = self.layer(x * 100)  # a large amax, recorded under the 8-row recipe
            with fp8_autocast(fp8_recipe=short):
                return out + self.layer(x)

    model = Nested()
    gen = torch.Generator().manual_seed(0)
    plain = copy.deepcopy(model)
    expected = _train(plain.layer, [(long, "train")] * 4)
    try:
        with fp8_autocast(fp8_recipe=long):
            model(torch.randn(16, 32, generator=gen))
            raise _OutOfMemory("CUDA out of memory (simulated)")
    except _OutOfMemory:
        pass
    assert model.layer.fp8_fwd_amax_history.shape[0] == 8
    got = _train(model.layer, [(long, "train")] * 4)
    for key in expected[1]:
        assert torch.equal(got[1][key], expected[1][key]), key


class _FailingOnce:
    """A scaling_factor_compute_algo that raises at its next call when armed (a NaN check):
    the step's update fails at the context's exit."""

    armed = False

    def __call__(self, amax, scale, fp8_max, recipe):
        if _FailingOnce.armed:
            _FailingOnce.armed = False
            raise FloatingPointError("update failed (simulated)")
        return torch.where(amax > 0, fp8_max / amax, scale)


def test_a_step_whose_update_raises_undoes_its_adoption():
    """The exit's update raising (a recipe callable, a failed collective) is a failed step: its
    amaxes were discarded, and now so is its recipe adoption (the resize to 2 rows stayed)."""
    long = DelayedScaling(amax_history_len=8)
    short = DelayedScaling(amax_history_len=2, scaling_factor_compute_algo=_FailingOnce())
    model = _two_layers(long)
    plain = copy.deepcopy(model)
    _train(plain, [(long, "train")] * 3)
    expected = _train(plain, [(long, "train")] * 3, gen_seed=2)
    _train(model, [(long, "train")] * 3)
    _FailingOnce.armed = True
    try:
        with fp8_autocast(fp8_recipe=short):
            model(torch.randn(16, 32))
    except FloatingPointError:
        pass
    assert not _FailingOnce.armed, "the update ran and raised"
    got = _train(model, [(long, "train")] * 3, gen_seed=2)
    for key in expected[1]:
        assert torch.equal(got[1][key], expected[1][key]), key


def test_an_exception_while_entering_leaves_nothing_behind(monkeypatch):
    """An interrupt inside fp8_autocast's entry, after the waiting modules took its recipe:
    the adoption is undone and no record of the step stays open."""
    from transformer_fp8.quantization import adoption_undo
    from transformer_fp8.quantization import autocast as autocast_module

    layer = tfp8.Linear(32, 16)  # no recipe yet: takes the one of the next delayed context
    real = autocast_module._prepare_steps

    def interrupted(state):
        monkeypatch.setattr(autocast_module, "_prepare_steps", real)
        raise KeyboardInterrupt

    monkeypatch.setattr(autocast_module, "_prepare_steps", interrupted)
    try:
        with fp8_autocast(fp8_recipe=DelayedScaling(amax_history_len=2)):
            pass
    except KeyboardInterrupt:
        pass
    assert layer.fp8_fwd_amax_history.shape[0] == 1024
    assert layer.fp8_recipe_fields.tolist() == [-1, -1, -1, -1]
    assert adoption_undo._LOCAL.frames == []
