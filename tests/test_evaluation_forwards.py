"""Evaluation forwards inside fp8_autocast between training steps: under no_grad or
inference_mode (the grad mode at the outermost exit, as in Transformer Engine) their amaxes are
forgotten and no scale changes, so the training run is bit for bit the one without them. (They
rolled the histories and moved the scales: a few evaluation batches of small activations gave
the next training step a scale that saturated its inputs.) Calibration, which runs under
no_grad too, still updates."""
from __future__ import annotations

import copy

import pytest
import torch
from conftest import DEVICE_PARAMS
from integration_compare import assert_bit_identical, fp8_state, step_batches, train

import transformer_fp8 as tfp8
from transformer_fp8 import DelayedScaling, fp8_autocast


def make_model(device):
    torch.manual_seed(0)
    return torch.nn.Sequential(tfp8.Linear(32, 64), torch.nn.GELU(), tfp8.LayerNormMLP(64, 128),
                               tfp8.LayerNormLinear(64, 32)).to(device)


GRAD_FREE = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("mode", list(GRAD_FREE))
@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_evaluation_between_training_steps_changes_nothing(device, mode, algo):
    recipe = DelayedScaling(amax_history_len=4, amax_compute_algo=algo)
    plain, evaluated = make_model(device), make_model(device)
    gen = torch.Generator().manual_seed(1)
    batches = step_batches(gen, 6, 16, 32, device=device)
    evaluation = [(torch.randn(16, 32, generator=gen) * scale).to(device)
                  for scale in (0.01, 30.0, 0.5)]
    expected, got = [], []
    for step in range(3):
        expected += train(plain, plain, batches[2 * step:2 * step + 2], recipe)
        got += train(evaluated, evaluated, batches[2 * step:2 * step + 2], recipe)
        before = fp8_state(evaluated)
        for x in evaluation:
            with GRAD_FREE[mode](), fp8_autocast(fp8_recipe=recipe):
                out = evaluated(x)
            assert torch.isfinite(out).all()
        after = fp8_state(evaluated)
        for key in before:
            assert torch.equal(before[key], after[key]), (step, key)
    assert_bit_identical(got, expected)


def test_evaluation_output_uses_the_training_scales():
    """The evaluation forward casts with the scales the last training step left (it is the
    forward that step's model would run), whatever the evaluation batch's own amaxes."""
    recipe = DelayedScaling(amax_history_len=2)
    model = make_model("cpu")
    train(model, model, step_batches(torch.Generator().manual_seed(2), 2, 16, 32), recipe)
    x = torch.randn(16, 32) * 50  # (far above the training amaxes: it saturates, as a
    twin = copy.deepcopy(model)   # training forward with these scales would)
    with torch.no_grad(), fp8_autocast(fp8_recipe=recipe):
        first = model(x)
        second = model(x)  # (inside the same context: still the same scales)
    with torch.no_grad(), fp8_autocast(fp8_recipe=recipe):
        third = model(x)
    with fp8_autocast(fp8_recipe=recipe):
        training = twin(x)
    assert torch.equal(first, second) and torch.equal(first, third)
    assert torch.equal(first, training.detach())


def test_calibration_under_no_grad_still_sets_the_scales():
    recipe = DelayedScaling(amax_history_len=4)
    model = make_model("cpu")
    x = torch.randn(16, 32) * 20
    with torch.no_grad(), fp8_autocast(enabled=False, calibrating=True, fp8_recipe=recipe):
        model(x)
    first = model[0]
    assert first.fp8_fwd_scale[0].item() == pytest.approx(448 / x.abs().max().item(), rel=1e-6)
    # (and a calibrating context inside an FP8 one under no_grad updates too)
    model = make_model("cpu")
    with torch.no_grad(), fp8_autocast(fp8_recipe=recipe):
        with fp8_autocast(enabled=False, calibrating=True, fp8_recipe=recipe):
            model(x)
    assert model[0].fp8_fwd_scale[0].item() == pytest.approx(448 / x.abs().max().item(),
                                                             rel=1e-6)


def test_grad_mode_at_the_exit_decides():
    """As in Transformer Engine: no_grad entered inside the context (grad enabled again at its
    exit) updates as a training forward does; a context entered inside no_grad does not."""
    recipe = DelayedScaling(amax_history_len=4)
    x = torch.randn(16, 32) * 7
    inside, outside = make_model("cpu"), make_model("cpu")
    with fp8_autocast(fp8_recipe=recipe), torch.no_grad():
        inside(x)
    with torch.no_grad(), fp8_autocast(fp8_recipe=recipe):
        outside(x)
    assert inside[0].fp8_fwd_scale[0].item() == pytest.approx(448 / x.abs().max().item(),
                                                              rel=1e-6)
    assert outside[0].fp8_fwd_scale[0].item() == 1.0
    assert not outside[0].fp8_fwd_amax_history.any(), "nothing kept for the next step"


def test_an_evaluation_amax_is_not_folded_into_the_next_training_step():
    """The evaluation's amaxes are not folded into the next training step's (a larger
    evaluation amax would otherwise set that step's scale)."""
    recipe = DelayedScaling(amax_history_len=1)
    plain, evaluated = make_model("cpu"), make_model("cpu")
    with torch.no_grad(), fp8_autocast(fp8_recipe=recipe):
        evaluated(torch.randn(16, 32) * 1000)
    batches = step_batches(torch.Generator().manual_seed(3), 3, 16, 32)
    assert_bit_identical(train(evaluated, evaluated, batches, recipe),
                         train(plain, plain, batches, recipe))


@pytest.mark.parametrize("mode", ["reentrant", "non_reentrant"])
def test_a_context_inside_a_checkpointed_function_is_a_training_forward(mode):
    """fp8_autocast entered inside the checkpointed function (its outermost context): a
    reentrant checkpoint runs that forward under no_grad, yet it trains: the scales update as
    without checkpointing (they stayed 1.0: the exit took it for an evaluation)."""
    import torch.utils.checkpoint as torch_checkpoint
    from integration_compare import assert_bit_identical, record_step

    recipe = DelayedScaling(amax_history_len=1)
    runs = []
    for checkpointed in (False, True):
        model = make_model("cpu")

        def inner(x):
            with fp8_autocast(fp8_recipe=recipe):
                return model(x)

        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        steps = []
        for x in step_batches(torch.Generator().manual_seed(7), 3, 16, 32):
            x = x.clone().requires_grad_(True)
            out = (torch_checkpoint.checkpoint(inner, x, use_reentrant=mode == "reentrant")
                   if checkpointed else inner(x))
            loss = out.square().mean()
            loss.backward()
            steps.append(record_step(loss, model, {"input": x}))
            opt.step()
            opt.zero_grad()
        runs.append(steps)
    assert runs[1][-1].fp8_state["0.fp8_fwd_scale"][0].item() != 1.0
    assert_bit_identical(runs[1], runs[0])


RECIPES = {"delayed": lambda: DelayedScaling(amax_history_len=4),
           "current": tfp8.Float8CurrentScaling, "block": tfp8.Float8BlockScaling}


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("first", ["context_only", "forward", "first_microbatch"])
def test_inference_mode_before_training_leaves_the_model_trainable(device, recipe, first):
    """An fp8_autocast entered under torch.inference_mode before any training step (a
    validation sanity check, generation): the history it resized, the FP8 weight it kept for
    is_first_microbatch, were inference tensors, which training can never write or save again
    ('Inplace update to inference tensor outside InferenceMode'). Training afterwards is bit
    for bit the training without it."""
    fp8_recipe = RECIPES[recipe]()
    # (built without recipe=: the first fp8_autocast resizes the histories to 4)
    plain, evaluated = make_model(device), make_model(device)
    x_eval = torch.randn(16, 32, device=device)
    with torch.inference_mode(), fp8_autocast(fp8_recipe=fp8_recipe):
        if first == "forward":
            evaluated(x_eval)
        elif first == "first_microbatch":
            for layer in evaluated:
                if isinstance(layer, tfp8.Linear):
                    x_eval = layer(x_eval, is_first_microbatch=True)
    assert not any(t.is_inference() for t in evaluated.state_dict().values())
    batches = step_batches(torch.Generator().manual_seed(3), 4, 16, 32, device=device)
    if first == "first_microbatch":  # the training step reuses the FP8 weight kept under it
        def run_reusing(model):
            def run(x):
                x = model[0](x, is_first_microbatch=False)
                return model[3](model[2](model[1](x)))
            return run
        with torch.no_grad(), fp8_autocast(fp8_recipe=fp8_recipe):
            plain[0](torch.randn(16, 32, device=device), is_first_microbatch=True)
        # (the kept weight is reused as it is at every step, by both models alike)
        expected = train(plain, run_reusing(plain), batches[:3], fp8_recipe)
        got = train(evaluated, run_reusing(evaluated), batches[:3], fp8_recipe)
        assert_bit_identical(got, expected)
        return
    expected = train(plain, plain, batches, fp8_recipe)
    got = train(evaluated, evaluated, batches, fp8_recipe)
    assert_bit_identical(got, expected)
    with torch.no_grad(), fp8_autocast(fp8_recipe=fp8_recipe):  # (an evaluation wrote them too)
        evaluated(x_eval)


def test_a_state_dict_loaded_under_inference_mode_trains():
    """load_state_dict under torch.inference_mode of a checkpoint with another history length:
    the resized history was an inference tensor, so the first training step failed."""
    recipe = DelayedScaling(amax_history_len=8)
    source = make_model("cpu")
    train(source, source, step_batches(torch.Generator().manual_seed(4), 2, 16, 32), recipe)
    loaded, expected = make_model("cpu"), make_model("cpu")
    with torch.inference_mode():
        loaded.load_state_dict(source.state_dict())
    expected.load_state_dict(source.state_dict())
    assert not loaded[0].fp8_fwd_amax_history.is_inference()
    batches = step_batches(torch.Generator().manual_seed(5), 3, 16, 32)
    assert_bit_identical(train(loaded, loaded, batches, recipe),
                         train(expected, expected, batches, recipe))


# An evaluation forward under another delayed recipe than training's, run between a training
# forward and its backward: it registered the layer's backward state with its own recipe's
# backward step, which no backward pass follows, so the training backward's grad_output update
# never ran (the amax left in history row 0, the scale stale for the next step's cast).
TRAIN_RECIPE = DelayedScaling(amax_history_len=4)
OTHER_RECIPES = {
    "margin": DelayedScaling(amax_history_len=4, margin=1),
    "most_recent": DelayedScaling(amax_history_len=4, amax_compute_algo="most_recent"),
    "reduce_amax": DelayedScaling(amax_history_len=4, reduce_amax=False),
}
LAYERS = {"Linear": lambda: tfp8.Linear(32, 32),
          "LayerNormMLP": lambda: tfp8.LayerNormMLP(32, 64)}
PATHS = {"cpp": None, "python": ("ENABLED", "NORM_ENABLED", "NORM_MLP_ENABLED")}


def _train_with_evaluation(layer, batches, eval_recipe, mode, at_step=(1, 2)):
    from integration_compare import record_step
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    records = []
    for step, x in enumerate(batches):
        x = x.detach().requires_grad_(True)
        with fp8_autocast(fp8_recipe=TRAIN_RECIPE):
            loss = layer(x).float().square().mean()
        if eval_recipe is not None and step in at_step:
            with GRAD_FREE[mode](), fp8_autocast(fp8_recipe=eval_recipe):
                layer(torch.randn(8, 32, generator=torch.Generator().manual_seed(step)) * 7)
        loss.backward()
        records.append(record_step(loss, layer, {"x": x}))
        opt.step()
        opt.zero_grad()
    return records


def _runs(layer_name, path, eval_recipe, mode, monkeypatch):
    if PATHS[path] is not None:
        from transformer_fp8.modules import linear_fused_step
        for switch in PATHS[path]:
            monkeypatch.setattr(linear_fused_step, switch, False)
    batches = step_batches(torch.Generator().manual_seed(3), 5, 16, 32)
    results = []
    for recipe in (None, eval_recipe):
        torch.manual_seed(0)
        results.append(_train_with_evaluation(LAYERS[layer_name](), batches, recipe, mode))
    return results


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("layer_name", list(LAYERS))
@pytest.mark.parametrize("mode", list(GRAD_FREE))
@pytest.mark.parametrize("other", list(OTHER_RECIPES))
def test_evaluation_under_another_recipe_between_forward_and_backward(other, mode, layer_name,
                                                                      path, monkeypatch):
    """Losses, gradients and the FP8 state bit for bit the plain run's. (fp8_recipe_fields,
    the record of the recipe last adopted, shows the evaluation's until the next training
    forward adopts the training recipe again: not compared.)"""
    expected, got = _runs(layer_name, path, OTHER_RECIPES[other], mode, monkeypatch)
    for record in got + expected:
        del record.fp8_state["fp8_recipe_fields"]
    assert_bit_identical(got, expected)


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("layer_name", list(LAYERS))
@pytest.mark.parametrize("mode", list(GRAD_FREE))
@pytest.mark.parametrize("length", [2, 8])
def test_evaluation_under_another_length_between_forward_and_backward(length, mode,
                                                                      layer_name, path,
                                                                      monkeypatch):
    """Another amax_history_len is adopted (README): the histories are resized, so the state
    is not the plain run's; but the training backward's grad_output update still runs: the
    amax is rolled out of row 0 at the end of every backward (the scale, computed over the
    resized history, may differ from the plain run's)."""
    eval_recipe = DelayedScaling(amax_history_len=length)
    expected, got = _runs(layer_name, path, eval_recipe, mode, monkeypatch)
    for step, g in enumerate(got):
        hist = g.fp8_state["fp8_bwd_amax_history"]
        assert torch.all(hist[0] == 0), (step, hist)
        assert hist.abs().amax() > 0, step
