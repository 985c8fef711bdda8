"""Activation checkpointing (torch.utils.checkpoint, reentrant and not) of FP8 layers: the
recomputation repeats the original forward's FP8 casts with the same scales and records no
amax twice, so losses, gradients and FP8 state are bit-identical to a run without it."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from conftest import DEVICE_PARAMS, assert_bitwise_equal
from integration_compare import assert_bit_identical, record_step, step_batches, train

import transformer_fp8 as tfp8
from transformer_fp8 import (DelayedScaling, Float8BlockScaling, Float8CurrentScaling,
                             Float8RowwiseScaling, fp8_autocast)



class Block(torch.nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.fc1 = tfp8.Linear(width, 2 * width)
        self.fc2 = tfp8.Linear(2 * width, width)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))


class Model(torch.nn.Module):
    """Blocks run through torch.utils.checkpoint when ``checkpoint`` says how (the way
    HuggingFace's gradient_checkpointing_enable() wraps its layers)."""

    def __init__(self, width=32, depth=3):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(width) for _ in range(depth))
        self.checkpoint = None  # None, "reentrant" or "non_reentrant"

    def forward(self, x):
        for block in self.blocks:
            if self.checkpoint is None:
                x = block(x)
            elif self.checkpoint == "te_checkpoint":  # Transformer Engine's signature
                x = tfp8.checkpoint(block, x)
            else:
                x = torch_checkpoint.checkpoint(
                    block, x, use_reentrant=self.checkpoint == "reentrant")
        return x


def assert_runs_equal(expected_run, got_run) -> None:
    """Two runs (per step, a list of tensors) bit for bit the same."""
    for step, (expected, got) in enumerate(zip(expected_run, got_run)):
        for a, b in zip(got, expected):
            assert torch.equal(a, b), step


def run_both(recipe, device, mode, steps=3):
    """The same steps without and with checkpointing: (checkpointed model, got, expected)."""
    torch.manual_seed(0)
    plain = Model().to(device)
    checkpointed = copy.deepcopy(plain)
    checkpointed.checkpoint = mode
    batches = step_batches(torch.Generator().manual_seed(0), steps, 24, 32, device=device)
    expected = train(plain, plain, batches, recipe)
    got = train(checkpointed, checkpointed, batches, recipe)
    return checkpointed, got, expected


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("mode", ["reentrant", "non_reentrant", "te_checkpoint"])
@pytest.mark.parametrize("recipe", [DelayedScaling(amax_history_len=4), Float8CurrentScaling(),
                                    Float8BlockScaling(), Float8RowwiseScaling()],
                         ids=["delayed", "current", "block", "rowwise"])
def test_checkpointed_training_is_bit_identical(device, mode, recipe):
    checkpointed, got, expected = run_both(recipe, device, mode)
    assert_bit_identical(got, expected)
    if isinstance(recipe, DelayedScaling):
        history = checkpointed.blocks[0].fc1.fp8_fwd_amax_history
        assert history[-3:].all() and not history[:1].any(), "one amax per step, rolled"
    for block in checkpointed.blocks:
        assert not block.fc1._replay_records and not block.fc2._replay_records


def test_recomputation_outside_fp8_autocast_still_runs_fp8():
    """The recomputation runs during backward, after fp8_autocast exited: it must not fall back
    to high precision (which would give different gradients)."""
    torch.manual_seed(0)
    model = Model()
    model.checkpoint = "reentrant"
    x = torch.randn(16, 32, requires_grad=True)
    with fp8_autocast(fp8_recipe=DelayedScaling()):
        out = model(x)
    out.sum().backward()
    high_precision = copy.deepcopy(model)
    x.grad = None
    high_precision(x).sum().backward()  # outside fp8_autocast: nn.Linear numerics
    assert not torch.equal(model.blocks[0].fc1.weight.grad,
                           high_precision.blocks[0].fc1.weight.grad)
    # (the state_dict runs the backward update that the reentrant mode holds back)
    history = model.state_dict()["blocks.0.fc1.fp8_bwd_amax_history"]
    assert history[-1].item() > 0 and history[0].item() == 0, "grad amax recorded and rolled"


def test_layer_pickles_with_replay_records_pending(tmp_path):
    """A checkpointed forward whose backward has not run yet leaves records: copies and
    pickles of the model drop them rather than fail."""
    model = Model()
    model.checkpoint = "non_reentrant"
    with fp8_autocast(fp8_recipe=DelayedScaling()):
        out = model(torch.randn(16, 32, requires_grad=True))
    assert model.blocks[0].fc1._replay_records
    torch.save(model, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    assert not loaded.blocks[0].fc1._replay_records
    assert not copy.deepcopy(model).blocks[0].fc1._replay_records
    del out  # the graph, and with it the checkpointed regions: their records go too
    assert not model.blocks[0].fc1._replay_records


class SharedBlockModel(torch.nn.Module):
    """One block applied twice, each application in its own checkpointed region."""

    def __init__(self, checkpoint=None):
        super().__init__()
        self.block = Block(32)
        self.checkpoint = checkpoint

    def forward(self, x):
        for _ in range(2):
            x = (self.block(x) if self.checkpoint is None else torch_checkpoint.checkpoint(
                self.block, x, use_reentrant=self.checkpoint == "reentrant"))
        return x


@pytest.mark.parametrize("mode", ["reentrant", "non_reentrant"])
def test_layer_called_twice_replays_each_call_with_its_own_scales(mode):
    """Regions are recomputed last first: the second call's record must serve the second
    call's recomputation. Delayed scaling with history length 1 makes the two calls' scales
    differ (the second call's scale is its own step's input amax)."""
    torch.manual_seed(0)
    plain = SharedBlockModel()
    checkpointed = copy.deepcopy(plain)
    checkpointed.checkpoint = mode
    recipe = DelayedScaling(amax_history_len=1)
    warm_up = torch.randn(16, 32) * 10
    for model in (plain, checkpointed):  # a step so that the scales are not all 1
        with fp8_autocast(fp8_recipe=recipe):
            out = model(warm_up.clone().requires_grad_(True))
        out.sum().backward()
        model.zero_grad()
    batches = step_batches(torch.Generator().manual_seed(0), 3, 16, 32)
    expected, got = train(plain, plain, batches, recipe), train(checkpointed, checkpointed,
                                                                batches, recipe)
    assert_bit_identical(got, expected)


@pytest.mark.parametrize("mode", ["reentrant", "non_reentrant"])
def test_first_checkpointed_layers_of_a_process_hold_the_nested_update(mode, monkeypatch):
    """The end of a reentrant checkpoint's nested backward pass is found by a walk up the stack
    that is skipped until an FP8 layer has kept a replay record in the process
    (checkpoint_stack.in_reentrant_backward): as in a fresh process, the first checkpointed
    layers must still be found."""
    from transformer_fp8.quantization import checkpoint_stack
    monkeypatch.setattr(checkpoint_stack, "KEPT_ANY", [False])
    test_layer_called_twice_replays_each_call_with_its_own_scales(mode)
    assert checkpoint_stack.KEPT_ANY[0]


@pytest.mark.parametrize("mode", ["reentrant", "non_reentrant"])
def test_forward_passes_backpropagated_in_order_pipeline_style(mode):
    """Two forward passes, then their backward passes in the same order (as a pipeline
    schedule does), per step: each recomputation replays its own pass, and each backward pass
    updates the grad_output scales at its end, as without checkpointing (the reentrant mode's
    nested passes held the update for the next fp8_autocast: the second pass cast its
    grad_output with the scale from before the first)."""
    torch.manual_seed(0)
    plain = Model()
    checkpointed = copy.deepcopy(plain)
    checkpointed.checkpoint = mode
    recipe = DelayedScaling(amax_history_len=4)
    batches = step_batches(torch.Generator().manual_seed(1), 6, 16, 32)
    records = {}
    for name, model in (("plain", plain), ("checkpointed", checkpointed)):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        records[name] = []
        for step in range(3):
            losses = []
            for x in batches[2 * step:2 * step + 2]:
                with fp8_autocast(fp8_recipe=recipe):
                    losses.append(model(x.clone().requires_grad_(True)).square().mean())
            for loss in losses:
                loss.backward()
            records[name].append(record_step(sum(losses), model))
            opt.step()
            opt.zero_grad()
    assert_bit_identical(records["checkpointed"], records["plain"])


def test_te_checkpoint_refuses_tensor_parallel_options():
    block = Block(32)
    x = torch.randn(4, 32, requires_grad=True)
    with pytest.raises(ValueError, match="distribute_saved_activations"):
        tfp8.checkpoint(block, x, distribute_saved_activations=True)
    # get_rng_state_tracker is taken (tests/test_rng_tracker.py); what it returns must be one.
    with pytest.raises(TypeError, match="get_rng_state_tracker"):
        tfp8.checkpoint(block, x, get_rng_state_tracker=lambda: None)
    out = tfp8.checkpoint(block, x, use_reentrant=False)
    assert torch.equal(out, block(x))


def test_te_checkpoint_recognises_the_old_positional_form():
    """checkpoint(function, distribute_saved_activations, get_rng_state_tracker, tp_group,
    *args), Transformer Engine's deprecated form (Megatron-LM's): the three options are read
    as options, as Transformer Engine reads them, not passed to the function (a module
    failed with 'Boolean value of Tensor is ambiguous'; a function taking *args got them)."""
    x = torch.randn(4, 32, requires_grad=True)
    received = []

    def function(*args):
        received.append(args)
        return args[-1] * 2

    with pytest.warns(DeprecationWarning, match="positional"):
        with pytest.raises(TypeError, match="get_rng_state_tracker"):
            tfp8.checkpoint(Block(32), False, lambda: None, None, x)
    tracker = tfp8.CudaRNGStatesTracker()
    with pytest.warns(DeprecationWarning, match="positional"):
        out = tfp8.checkpoint(function, False, lambda: tracker, None, x)
    assert torch.equal(out, x * 2) and len(received) == 1 and received[0][0] is x
    received.clear()
    with pytest.warns(DeprecationWarning, match="positional"):
        with pytest.raises(ValueError, match="distribute_saved_activations"):
            tfp8.checkpoint(function, True, lambda: None, None, x)
    assert not received
    # A function whose own first argument is a bool is called as it is (the second is a
    # tensor, not a callable: not the old form).
    flag_first = tfp8.checkpoint(lambda flag, a, b, c: a * 2 if flag else c, True, x, x, x)
    assert torch.equal(flag_first, x * 2)


@pytest.mark.parametrize("mode", ["reentrant", "non_reentrant"])
@pytest.mark.parametrize("dtype", ["bf16_params", "autocast_bf16"])
@pytest.mark.parametrize("module", ["LayerNormMLP", "LayerNormLinear"])
@pytest.mark.parametrize("recipe", [DelayedScaling(amax_history_len=4), Float8CurrentScaling()],
                         ids=["delayed", "current"])
def test_fused_modules_checkpointed_in_bfloat16_are_bit_identical(mode, dtype, module, recipe):
    """A current-scaling cast of a norm's (or activation's) output takes that output rounded
    to bfloat16; the recomputation repeats it so (its replay once cast the float32 output in
    the fused kernel: gradients 21-46 dB off). Losses, every gradient and the FP8 state over
    steps whose scales change, against the same module without checkpointing."""
    torch.manual_seed(0)
    build = {"LayerNormMLP": lambda: tfp8.LayerNormMLP(32, 64),
             "LayerNormLinear": lambda: tfp8.LayerNormLinear(32, 48)}[module]
    plain = build()
    if dtype == "bf16_params":
        plain = plain.to(torch.bfloat16)
    checkpointed = copy.deepcopy(plain)
    input_dtype = torch.bfloat16 if dtype == "bf16_params" else torch.float32
    gen = torch.Generator().manual_seed(1)
    for step in range(3):
        x = (torch.randn(24, 32, generator=gen) * (step + 1)).to(input_dtype)
        results = []
        for layer, wrap in ((plain, False), (checkpointed, True)):
            x_in = x.clone().requires_grad_()
            with torch.autocast("cpu", dtype=torch.bfloat16,
                                enabled=dtype == "autocast_bf16"):
                with fp8_autocast(fp8_recipe=recipe):
                    out = torch_checkpoint.checkpoint(
                        layer, x_in, use_reentrant=mode == "reentrant") if wrap else layer(x_in)
            out.float().square().sum().backward()
            results.append((out, x_in.grad, {n: p.grad.clone() for n, p in
                                             layer.named_parameters()}))
        (out_a, dx_a, grads_a), (out_b, dx_b, grads_b) = results
        assert torch.equal(out_a, out_b) and torch.equal(dx_a, dx_b), step
        for name, grad in grads_a.items():
            assert torch.equal(grads_b[name], grad), (step, name)
        for key, value in plain.state_dict().items():
            assert torch.equal(checkpointed.state_dict()[key], value), (step, key)


@pytest.mark.parametrize("mode", ["reentrant", "non_reentrant"])
@pytest.mark.parametrize("no_grad", ["outside", "inside"])
@pytest.mark.parametrize("recipe", [DelayedScaling(amax_history_len=4), Float8CurrentScaling(),
                                    Float8BlockScaling()], ids=["delayed", "current", "block"])
def test_an_evaluation_forward_between_steps_leaves_no_replay_record(mode, no_grad, recipe):
    """A no_grad evaluation forward through the checkpointed model, inside fp8_autocast, between
    training steps: it is never recomputed, so it keeps no replay record (its records were
    taken by the next step's recomputation, which replayed the evaluation's scales: gradients
    down to 3.5 dB). Every gradient and loss bit for bit those of the same steps without
    checkpointing."""
    torch.manual_seed(0)
    base = torch.nn.Sequential(tfp8.Linear(64, 64), torch.nn.GELU(), tfp8.Linear(64, 32))
    runs = []
    for checkpointed in (False, True):
        model = copy.deepcopy(base)
        run = (lambda t, m=model: torch_checkpoint.checkpoint(
            m, t, use_reentrant=mode == "reentrant")) if checkpointed else model
        gen = torch.Generator().manual_seed(1)
        steps = []
        for scale in (1.0, 8.0, 0.25, 2.0):
            x = (torch.randn(32, 64, generator=gen) * scale).requires_grad_()
            with fp8_autocast(fp8_recipe=recipe):
                loss = run(x).square().mean()
            loss.backward()
            steps.append((loss.detach(), x.grad, [p.grad.clone() for p in model.parameters()]))
            with torch.no_grad():
                model.zero_grad()
                for p in model.parameters():
                    p.sub_(0.1 * p)  # (a step that changes the weights)
            evaluation = torch.randn(16, 64, generator=gen) * 5
            if no_grad == "outside":
                with torch.no_grad(), fp8_autocast(fp8_recipe=recipe):
                    run(evaluation)
            else:
                with fp8_autocast(fp8_recipe=recipe), torch.no_grad():
                    run(evaluation)
        runs.append(steps)
        if checkpointed:
            assert not any(m._replay_records for m in model if isinstance(m, tfp8.Linear))
    for step, (expected, got) in enumerate(zip(*runs)):
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1]), step
        for a, b in zip(got[2], expected[2]):
            assert torch.equal(a, b), step


@pytest.mark.parametrize("mode", ["reentrant", "non_reentrant"])
def test_a_layer_called_twice_in_one_region_replays_its_calls_in_order(mode):
    """Float8CurrentScaling gives each call its own scale: a recomputation, which repeats the
    region's calls in the order they first ran, takes the region's records in that order (it
    took the latest first: gradients down to 6 dB). Bit for bit a run without checkpointing."""
    torch.manual_seed(0)
    layer = tfp8.Linear(32, 32)
    recipe = Float8CurrentScaling()
    runs = []
    for checkpointed in (False, True):
        model = copy.deepcopy(layer)

        def fn(t, model=model):  # the same layer twice, on tensors of different magnitudes
            return model(torch.nn.functional.gelu(model(t)) * 3)

        gen = torch.Generator().manual_seed(1)
        steps = []
        for _ in range(3):
            x = torch.randn(16, 32, generator=gen).requires_grad_()
            with fp8_autocast(fp8_recipe=recipe):
                out = torch_checkpoint.checkpoint(fn, x, use_reentrant=mode == "reentrant") \
                    if checkpointed else fn(x)
            out.square().sum().backward()
            steps.append((out.detach(), x.grad, model.weight.grad.clone(),
                          model.bias.grad.clone()))
            model.zero_grad()
        runs.append(steps)
    assert_runs_equal(*runs)


@pytest.mark.parametrize("mode", ["reentrant", "non_reentrant"])
def test_two_checkpointed_forwards_in_one_context_backpropagated_in_forward_order(mode):
    """Two microbatches through one checkpointed region in one fp8_autocast, their losses
    backpropagated in the order they ran: each recomputation replays its own forward's scales
    (the second's were taken for the first). Bit for bit a run without checkpointing."""
    torch.manual_seed(0)
    base = torch.nn.Sequential(tfp8.Linear(32, 32), torch.nn.GELU(), tfp8.Linear(32, 16))
    recipe = Float8CurrentScaling()
    runs = []
    for checkpointed in (False, True):
        model = copy.deepcopy(base)
        gen = torch.Generator().manual_seed(1)
        results = []
        for _ in range(2):
            xs = [(torch.randn(16, 32, generator=gen) * s).requires_grad_() for s in (1, 9)]
            with fp8_autocast(fp8_recipe=recipe):
                outs = [torch_checkpoint.checkpoint(model, x, use_reentrant=mode == "reentrant")
                        if checkpointed else model(x) for x in xs]
            for out in outs:  # (forward order)
                out.square().sum().backward()
            results.append([x.grad for x in xs] + [p.grad.clone() for p in model.parameters()])
            model.zero_grad()
        runs.append(results)
    assert_runs_equal(*runs)


@pytest.mark.parametrize("mode", ["reentrant", "non_reentrant"])
@pytest.mark.parametrize("module", ["Linear", "LayerNormMLP"])
def test_a_failed_backward_pass_through_a_checkpoint_is_discarded(mode, module):
    """A backward pass that raises after a checkpointed region's backward ran (a hook on the
    region's input): its grad_output amaxes are discarded, as without checkpointing (the
    reentrant mode's nested pass had held its update back, and the next fp8_autocast ran it:
    the failed pass's grad_output of 1000 went into the scales)."""
    recipe = DelayedScaling(amax_history_len=4)

    def build():
        torch.manual_seed(0)
        return tfp8.Linear(32, 32) if module == "Linear" else tfp8.LayerNormMLP(32, 64)

    def steps(model, checkpointed):
        gen = torch.Generator().manual_seed(3)
        records = []
        for step in range(4):
            x = (torch.randn(8, 32, generator=gen) * 2.0 ** step).requires_grad_(True)
            with fp8_autocast(fp8_recipe=recipe):
                out = (torch_checkpoint.checkpoint(model, x, use_reentrant=mode == "reentrant")
                       if checkpointed else model(x))
            if step == 1:
                def refuse(grad):
                    raise RuntimeError("the backward pass fails")
                x.register_hook(refuse)
                with pytest.raises(RuntimeError, match="the backward pass fails"):
                    (out * 1000).sum().backward()
                model.zero_grad(set_to_none=True)
                continue
            out.square().sum().backward()
            records.append(record_step(out, model, {"input": x}))
            model.zero_grad(set_to_none=True)
        return records

    assert_bit_identical(steps(build(), True), steps(build(), False))


@pytest.mark.parametrize("recipe", [DelayedScaling(amax_history_len=4), Float8CurrentScaling()],
                         ids=["delayed", "current"])
def test_a_retained_graph_backpropagated_twice_replays_the_same_casts(recipe):
    """loss.backward(retain_graph=True) then a second backward: the reentrant mode recomputes
    each region twice, and both recomputations replay the original forward's casts (the
    second ran the layers' full FP8 forward: other scales, gradients wrong). Bit for bit a run
    without checkpointing, over steps where the scales change."""
    torch.manual_seed(0)
    plain = Model()
    checkpointed = copy.deepcopy(plain)
    checkpointed.checkpoint = "reentrant"
    batches = step_batches(torch.Generator().manual_seed(2), 3, 24, 32)

    def backward_twice(loss):
        loss.backward(retain_graph=True)
        (loss * 3).backward()

    assert_bit_identical(train(checkpointed, checkpointed, batches, recipe,
                               backward=backward_twice),
                         train(plain, plain, batches, recipe, backward=backward_twice))


# ---- regions whose forward ran in high precision ----------------------------------------------

# One module of each kind that goes through base.py's dispatch, [24, 32] -> [24, ...].
class GroupedHead(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.grouped = tfp8.GroupedLinear(2, 32, 16)

    def forward(self, x):
        return self.grouped(x, [8, 16])


LAYERS = {"Linear": lambda: tfp8.Linear(32, 16),
          "LayerNormLinear": lambda: tfp8.LayerNormLinear(32, 16),
          "LayerNormMLP": lambda: tfp8.LayerNormMLP(32, 64),
          "GroupedLinear": GroupedHead}
# torch.utils.checkpoint and tfp8.checkpoint, each in both modes.
HP_MODES = ["reentrant", "non_reentrant", "te_reentrant", "te_non_reentrant"]
HP_RECIPES = [DelayedScaling(amax_history_len=4), Float8CurrentScaling(), Float8BlockScaling()]
HP_RECIPE_IDS = ["delayed", "current", "block"]


def checkpointed(function, x, mode):
    """function(x), checkpointed as ``mode`` says (None: not checkpointed)."""
    if mode is None:
        return function(x)
    if mode.startswith("te_"):
        return tfp8.checkpoint(function, x, use_reentrant=mode == "te_reentrant")
    return torch_checkpoint.checkpoint(function, x, use_reentrant=mode == "reentrant")


class HighPrecisionHead(torch.nn.Module):
    """An FP8 body and a head kept in high precision by a nested fp8_autocast(enabled=False)
    (the usual way to keep an LM head in high precision), each in a checkpointed region of its
    own when ``checkpoint`` says how."""

    def __init__(self, head="Linear", calibrating=False):
        super().__init__()
        self.body = Block(32)
        self.head = LAYERS[head]()
        self.calibrating = calibrating
        self.checkpoint = None

    def forward(self, x):
        x = checkpointed(self.body, x, self.checkpoint)
        with fp8_autocast(enabled=False, calibrating=self.calibrating):
            return checkpointed(self.head, x, self.checkpoint)


def train_backward_inside(model, batches, recipe, backward_inside: bool) -> list:
    """integration_compare.train's SGD steps, with the backward inside the fp8_autocast
    (``backward_inside``, where the recomputation runs in the enabled context) or after it."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    records = []
    for batch in batches:
        x = batch.clone().requires_grad_(True)
        with fp8_autocast(fp8_recipe=recipe):
            loss = model(x).float().square().mean()
            if backward_inside:
                loss.backward()
        if not backward_inside:
            loss.backward()
        records.append(record_step(loss, model, {"input": x}))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return records


def compare_high_precision_head(recipe, mode, backward, head="Linear", calibrating=False):
    torch.manual_seed(0)
    plain = HighPrecisionHead(head, calibrating)
    ckpt = copy.deepcopy(plain)
    ckpt.checkpoint = mode
    batches = step_batches(torch.Generator().manual_seed(0), 4, 24, 32)
    inside = backward == "inside"
    expected = train_backward_inside(plain, batches, recipe, inside)
    got = train_backward_inside(ckpt, batches, recipe, inside)
    assert_bit_identical(got, expected)
    assert not any(m._replay_records for m in ckpt.modules() if hasattr(m, "_replay_records"))
    return ckpt


@pytest.mark.parametrize("backward", ["inside", "outside"])
@pytest.mark.parametrize("mode", HP_MODES)
@pytest.mark.parametrize("recipe", HP_RECIPES, ids=HP_RECIPE_IDS)
def test_a_high_precision_head_is_recomputed_in_high_precision(recipe, mode, backward):
    """An FP8 body and a head under a nested fp8_autocast(enabled=False), both checkpointed,
    over steps whose scales change: the head's recomputation runs in high precision, also when
    the backward runs inside the enabled context (it ran in FP8 there: the reentrant mode gave
    FP8 gradients and moved the head's scales, which never ran in FP8; the non-reentrant mode
    raised CheckpointError). Losses, every gradient and every FP8 state tensor bit for bit those
    of the same steps without checkpointing."""
    model = compare_high_precision_head(recipe, mode, backward)
    assert not model.head.fp8_fwd_amax_history.any(), "the head recorded no amax"


@pytest.mark.parametrize("mode", HP_MODES)
@pytest.mark.parametrize("head", ["LayerNormLinear", "LayerNormMLP", "GroupedLinear"])
@pytest.mark.parametrize("recipe", HP_RECIPES, ids=HP_RECIPE_IDS)
def test_a_high_precision_head_of_each_kind_is_recomputed_in_high_precision(recipe, head,
                                                                            mode):
    """The same, backward inside the context, for each other module kind as the head (the
    fused C++ steps of LayerNormLinear and LayerNormMLP included)."""
    model = compare_high_precision_head(recipe, mode, "inside", head)
    assert not any(t.any() for name, t in model.head.state_dict().items()
                   if "fwd_amax_history" in name), "the head recorded no amax"


@pytest.mark.parametrize("backward", ["inside", "outside"])
@pytest.mark.parametrize("mode", ["reentrant", "non_reentrant"])
def test_a_calibrating_head_is_recomputed_without_recording(mode, backward):
    """The head under a nested fp8_autocast(enabled=False, calibrating=True): its first forward
    records its amaxes, its recomputation runs in high precision and records nothing."""
    compare_high_precision_head(DelayedScaling(amax_history_len=4), mode, backward,
                                calibrating=True)


@pytest.mark.parametrize("mode", HP_MODES)
@pytest.mark.parametrize("layer", list(LAYERS))
@pytest.mark.parametrize("recipe", HP_RECIPES, ids=HP_RECIPE_IDS)
def test_a_region_run_outside_fp8_autocast_is_recomputed_in_high_precision(recipe, layer,
                                                                           mode):
    """Per step, a checkpointed forward with no fp8_autocast, then one inside an enabled
    fp8_autocast, and the backward of both inside it (as a pipeline schedule runs an earlier
    microbatch's backward inside a later one's context): the first region's recomputation
    runs in high precision, as its forward did. Every loss, gradient and FP8 state tensor bit
    for bit those of the same steps without checkpointing, over steps whose scales change;
    a calibrating context around the backward records nothing for the recomputation either."""
    torch.manual_seed(0)
    base = LAYERS[layer]()
    batches = step_batches(torch.Generator().manual_seed(1), 8, 24, 32)
    runs = []
    for mode_or_none in (None, mode):
        model = copy.deepcopy(base)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        records = []
        for step in range(4):
            x_hp, x_fp8 = (b.clone().requires_grad_(True) for b in batches[2 * step:2 * step + 2])
            out_hp = checkpointed(model, x_hp, mode_or_none)  # no fp8_autocast
            if step == 3:  # (a calibrating context: its recomputation must not record)
                with fp8_autocast(enabled=False, calibrating=True,
                                  fp8_recipe=DelayedScaling(amax_history_len=4)):
                    out_hp.square().mean().backward()
                loss = out_hp.detach().square().mean()
            else:
                with fp8_autocast(fp8_recipe=recipe):
                    out = checkpointed(model, x_fp8, mode_or_none)
                    loss = out_hp.square().mean() + out.square().mean()
                    loss.backward()
            records.append(record_step(loss, model, {"x_hp": x_hp, "x_fp8": x_fp8}))
            opt.step()
            opt.zero_grad(set_to_none=True)
        runs.append(records)
        assert not any(m._replay_records for m in model.modules()
                       if hasattr(m, "_replay_records"))
    assert_bit_identical(runs[1], runs[0])


@pytest.mark.parametrize("backward_inside", [False, True], ids=["backward_outside", "inside"])
def test_an_inference_mode_layer_inside_a_reentrant_region_replays_its_fp8_forward(
        backward_inside):
    """A gate run under torch.inference_mode inside a reentrant checkpoint: its recomputation
    replays the FP8 forward it ran (an early exit of the record keeping took inference_mode
    for an evaluation forward; the backward outside the context then recomputed the gate in
    high precision: other gradients). Bit for bit the run without checkpointing."""
    recipe = tfp8.DelayedScaling()

    def train(checkpointed):
        torch.manual_seed(0)
        gate, body = tfp8.Linear(64, 64), tfp8.Linear(64, 64)

        def region(x):
            with torch.inference_mode():
                g = torch.sigmoid(gate(x))
            return body(x) * g.clone()  # (cloned outside inference_mode: a normal tensor)

        gen, out = torch.Generator().manual_seed(1), []
        for _ in range(2):
            x = torch.randn(32, 64, generator=gen).requires_grad_()
            with tfp8.fp8_autocast(fp8_recipe=recipe):
                y = (torch.utils.checkpoint.checkpoint(region, x, use_reentrant=True)
                     if checkpointed else region(x))
                if backward_inside:
                    y.square().mean().backward()
            if not backward_inside:
                y.square().mean().backward()
            out += [x.grad, body.weight.grad.clone()]
            body.zero_grad()
        return out + [gate.fp8_fwd_amax_history.clone(), gate.fp8_fwd_scale.clone()]

    for got, expected in zip(train(True), train(False)):
        assert_bitwise_equal(got, expected)
