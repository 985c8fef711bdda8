"""Checkpoints: FP8 state as plain tensors, exact resume, interchange with torch.nn.Linear."""
from __future__ import annotations

import io

import pytest
import torch
from conftest import randn

import transformer_fp8 as tfp8
from transformer_fp8 import DelayedScaling, fp8_autocast

RECIPE = DelayedScaling(amax_history_len=8)


def make_model(seed=0):
    torch.manual_seed(seed)
    return tfp8.convert_to_fp8(torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16)))


def train(model, opt, batches):
    losses = []
    for x, y in batches:
        with fp8_autocast(fp8_recipe=RECIPE):
            out = model(x)
        loss = torch.nn.functional.mse_loss(out, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@torch.no_grad()
def total_loss(model, batches):
    with fp8_autocast(enabled=False):
        return sum(torch.nn.functional.mse_loss(model(x), y).item() for x, y in batches)


def roundtrip(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def test_state_dict_is_plain_tensors():
    model = make_model()
    state = model.state_dict()
    fp8_keys = [k for k in state if "fp8_" in k]
    assert len(fp8_keys) == 2 * len(tfp8.quantization.state.FP8_STATE_KEYS)
    assert all(type(v) is torch.Tensor for v in state.values())
    loaded = roundtrip(state)
    assert loaded.keys() == state.keys()


def test_resume_gives_bit_identical_losses(gen):
    teacher = randn(gen, 32, 16) * 0.2
    inputs = [randn(gen, 24, 32) for _ in range(10)]
    batches = [(x, x @ teacher) for x in inputs]
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    train(model, opt, batches[:4])
    checkpoint = roundtrip({"model": model.state_dict(), "opt": opt.state_dict()})
    loss_before = total_loss(model, batches[4:])
    expected = train(model, opt, batches[4:])

    resumed = make_model(seed=123)  # different initial weights: all must come from the file
    resumed_opt = torch.optim.Adam(resumed.parameters(), lr=1e-2)
    resumed.load_state_dict(checkpoint["model"], strict=True)
    resumed_opt.load_state_dict(checkpoint["opt"])
    assert train(resumed, resumed_opt, batches[4:]) == expected
    # The model was learning: its loss over the resumed batches fell. (One batch's loss against
    # another's would compare different data: that failed for about 2% of the seeds.)
    assert total_loss(model, batches[4:]) < loss_before


@pytest.mark.parametrize("built_for_recipe", [True, False], ids=["built_for", "built_plain"])
def test_resume_with_a_nested_recipe_keeps_each_layers_recipe(gen, built_for_recipe):
    """One layer trains under an inner recipe (history 16) nested in the model's (history 4).
    Resumed from a checkpoint, the outer context, entered first, must not adopt its recipe for
    the inner layer (which cut its loaded history to 4 rows): the resumed step is bit for bit
    the uninterrupted one."""
    import copy
    outer, inner = DelayedScaling(amax_history_len=4), DelayedScaling(amax_history_len=16)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            kwargs = ({"recipe": outer}, {"recipe": inner}) if built_for_recipe else ({}, {})
            self.p = tfp8.Linear(32, 32, **kwargs[0])
            self.q = tfp8.Linear(32, 32, **kwargs[1])

        def forward(self, x):
            with fp8_autocast(fp8_recipe=inner):
                return self.q(self.p(x))

    def step(net, x):
        with fp8_autocast(fp8_recipe=outer):
            out = net(x)
        out.square().mean().backward()

    torch.manual_seed(0)
    net = Net()
    inputs = [randn(gen, 16, 32, scale=s) for s in (40, 1, 1, 1, 1, 1, 1)]  # one large amax
    for x in inputs[:6]:
        step(net, x)
    checkpoint = roundtrip(net.state_dict())
    uninterrupted = copy.deepcopy(net)
    step(uninterrupted, inputs[6])
    resumed = Net()
    resumed.load_state_dict(checkpoint)
    step(resumed, inputs[6])
    assert resumed.q.fp8_fwd_amax_history.shape[0] == 16
    for key, value in uninterrupted.state_dict().items():
        assert torch.equal(resumed.state_dict()[key], value), key


def test_plain_linear_checkpoint_loads_strictly_with_fresh_fp8_state(gen):
    plain = torch.nn.Linear(32, 16)
    layer = tfp8.Linear(32, 16)
    with fp8_autocast(fp8_recipe=RECIPE):
        layer(randn(gen, 8, 32))  # some FP8 state to be replaced
    result = layer.load_state_dict(plain.state_dict(), strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    assert torch.equal(layer.weight, plain.weight)
    assert not layer.fp8_fwd_amax_history.any()
    assert torch.equal(layer.fp8_fwd_scale, torch.ones(2))


def test_fp8_checkpoint_loads_into_plain_linear(gen):
    layer = tfp8.Linear(32, 16)
    with fp8_autocast(fp8_recipe=RECIPE):
        layer(randn(gen, 8, 32))
    plain = torch.nn.Linear(32, 16)
    plain.load_state_dict(tfp8.strip_fp8_state(roundtrip(layer.state_dict())), strict=True)
    assert torch.equal(plain.weight, layer.weight) and torch.equal(plain.bias, layer.bias)


def test_history_of_another_length_loads(gen):
    source = tfp8.Linear(32, 16)
    with fp8_autocast(fp8_recipe=DelayedScaling(amax_history_len=3)):
        source(randn(gen, 8, 32))
    target = tfp8.Linear(32, 16)  # default length 1024
    target.load_state_dict(source.state_dict())
    assert torch.equal(target.fp8_fwd_amax_history, source.fp8_fwd_amax_history)
    assert torch.equal(target.fp8_fwd_scale, source.fp8_fwd_scale)


def test_partial_fp8_state_is_reported(gen):
    layer = tfp8.Linear(32, 16)
    with fp8_autocast(fp8_recipe=RECIPE):
        layer(randn(gen, 8, 32))
    state = layer.state_dict()
    del state["fp8_fwd_scale_inv"]
    with pytest.raises(RuntimeError, match="fp8_fwd_scale_inv"):
        tfp8.Linear(32, 16).load_state_dict(state, strict=True)


def test_wrong_fp8_state_shape_is_reported():
    state = tfp8.Linear(32, 16).state_dict()
    state["fp8_fwd_scale"] = torch.ones(5)
    with pytest.raises(RuntimeError, match="fp8_fwd_scale"):
        tfp8.Linear(32, 16).load_state_dict(state)


# ---- a corrupt FP8 state is refused, naming the key, and leaves the module as it was ----------

def _trained_layer_state():
    """The state_dict of a Linear trained one step (scales away from 1), as independent copies."""
    layer = tfp8.Linear(32, 32)
    with fp8_autocast(fp8_recipe=RECIPE):
        layer(torch.randn(16, 32) * 100).sum().backward()
    return {k: v.clone() for k, v in layer.state_dict().items()}


CORRUPTIONS = {
    "scale_nan": ("fp8_fwd_scale", float("nan")),
    "scale_inf": ("fp8_fwd_scale", float("inf")),
    "scale_zero": ("fp8_fwd_scale", 0.0),
    "scale_negative": ("fp8_bwd_scale", -2.0),
    "scale_inv_nan": ("fp8_fwd_scale_inv", float("nan")),
    "scale_inv_zero": ("fp8_bwd_scale_inv", 0.0),
    "scale_inv_negative": ("fp8_fwd_scale_inv", -0.5),
    "pair_mismatch": ("fp8_fwd_scale_inv", 0.123),
    "history_negative": ("fp8_fwd_amax_history", -1.0),
}


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "nonstrict"])
@pytest.mark.parametrize("corruption", CORRUPTIONS, ids=list(CORRUPTIONS))
def test_corrupt_fp8_state_is_refused_naming_the_key(corruption, strict):
    key, value = CORRUPTIONS[corruption]
    state = _trained_layer_state()
    state[key].view(-1)[0] = value
    layer = tfp8.Linear(32, 32)
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    with pytest.raises(RuntimeError, match=key):
        layer.load_state_dict(state, strict=strict)
    for k, v in layer.state_dict().items():
        assert torch.equal(v, before[k]), f"{k} changed by a refused load"


@pytest.mark.parametrize("scale", [1e-50, 1e50], ids=["underflows", "overflows"])
def test_a_float64_scale_float32_cannot_hold_is_refused(scale):
    """A float64 scale and scale_inv that are finite, positive and paired in float64 but give 0
    and inf (or inf and 0) in the float32 state: checked as the state would hold them (they
    loaded, and the first FP8 forward gave NaN)."""
    state = {k: v.double() if k.startswith("fp8_") and v.is_floating_point() else v
             for k, v in _trained_layer_state().items()}
    state["fp8_fwd_scale"][0], state["fp8_fwd_scale_inv"][0] = scale, 1 / scale
    layer = tfp8.Linear(32, 32)
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    with pytest.raises(RuntimeError, match="fp8_fwd_scale.*finite and positive"):
        layer.load_state_dict(state)
    for k, v in layer.state_dict().items():
        assert torch.equal(v, before[k]), f"{k} changed by a refused load"


def test_scale_missing_with_strict_false_is_not_paired_with_a_loaded_scale_inv():
    """strict=False with fp8_fwd_scale absent would pair the module's fresh scale (1) with the
    checkpoint's scale_inv: the first step would dequantise with the wrong factor."""
    state = _trained_layer_state()
    del state["fp8_fwd_scale"]
    layer = tfp8.Linear(32, 32)
    with pytest.raises(RuntimeError, match="fp8_fwd_scale .*not in the checkpoint"):
        layer.load_state_dict(state, strict=False)


def test_valid_states_still_load():
    """A trained state, a fresh one, and scales clamped to FLT_MAX (scale_inv subnormal) load."""
    state = _trained_layer_state()
    tfp8.Linear(32, 32).load_state_dict(state)
    tfp8.Linear(32, 32).load_state_dict(tfp8.Linear(32, 32).state_dict())
    flt_max = torch.finfo(torch.float32).max
    state["fp8_fwd_scale"][0] = flt_max
    state["fp8_fwd_scale_inv"][0] = 1.0 / torch.tensor(flt_max)
    layer = tfp8.Linear(32, 32)
    layer.load_state_dict(state)
    assert layer.fp8_fwd_scale[0] == flt_max


def test_assign_true_takes_non_contiguous_fp8_state(gen):
    """load_state_dict(assign=True) of histories and scales that are strided views (every
    other column of a wider tensor): the layer trains as one loaded by copy (every step
    raised 'must be a contiguous float32 tensor')."""
    source = tfp8.Linear(32, 16, recipe=RECIPE)
    for _ in range(2):
        with fp8_autocast(fp8_recipe=RECIPE):
            source(randn(gen, 8, 32)).sum().backward()
    checkpoint = {k: v.clone() for k, v in source.state_dict().items()}
    for key in ("fp8_fwd_amax_history", "fp8_bwd_amax_history", "fp8_fwd_scale"):
        value = checkpoint[key]
        checkpoint[key] = torch.stack([value, torch.zeros_like(value)], dim=-1)[..., 0]
    assert not any(checkpoint[k].is_contiguous() for k in
                   ("fp8_fwd_amax_history", "fp8_bwd_amax_history", "fp8_fwd_scale"))
    assigned, copied = tfp8.Linear(32, 16, recipe=RECIPE), tfp8.Linear(32, 16, recipe=RECIPE)
    assigned.load_state_dict(checkpoint, assign=True)
    copied.load_state_dict(checkpoint)
    _assert_trains_as(assigned, copied, [randn(gen, 8, 32) for _ in range(3)])


def _assert_trains_as(layer, twin, inputs) -> None:
    """An FP8 training step of both on each input: equal outputs, then equal state_dicts."""
    for x in inputs:
        with fp8_autocast(fp8_recipe=RECIPE):
            out, expected = layer(x), twin(x)
        assert torch.equal(out, expected)
        out.sum().backward()
        expected.sum().backward()
    for key, value in twin.state_dict().items():
        assert torch.equal(layer.state_dict()[key], value), key


def test_assign_true_keeps_the_fp8_state_usable(gen):
    """load_state_dict(assign=True) takes the checkpoint's tensors as they are: float64 FP8
    state is held in float32 (values kept), and a layer built on "meta" given a plain
    checkpoint gets a fresh FP8 state on its parameters' device; both then train as a layer
    loaded by copy does."""
    source = tfp8.Linear(32, 16, recipe=RECIPE)
    with fp8_autocast(fp8_recipe=RECIPE):
        source(randn(gen, 8, 32)).sum().backward()
    checkpoint = {k: v.double() if k.startswith("fp8_") and v.is_floating_point() else v.clone()
                  for k, v in source.state_dict().items()}
    assigned, copied = tfp8.Linear(32, 16, recipe=RECIPE), tfp8.Linear(32, 16, recipe=RECIPE)
    assigned.load_state_dict(checkpoint, assign=True)
    copied.load_state_dict(checkpoint)
    plain = torch.nn.Linear(32, 16)
    with torch.device("meta"):
        from_meta = tfp8.Linear(32, 16, recipe=RECIPE)
    from_meta.load_state_dict(plain.state_dict(), assign=True)
    fresh = tfp8.Linear(32, 16, recipe=RECIPE)
    fresh.load_state_dict(plain.state_dict())
    x = randn(gen, 8, 32)
    for layer, twin in ((assigned, copied), (from_meta, fresh)):
        for key, value in twin.state_dict().items():
            assert layer.state_dict()[key].dtype == value.dtype, key
            assert layer.state_dict()[key].device == value.device, key
        _assert_trains_as(layer, twin, [x])


def test_resume_under_another_recipe_with_torch_compile(gen):
    """A checkpoint saved under one recipe (history 8) trains on under another (history 4)
    with torch.compile: the fp8_autocast entered first adopts the new recipe for the loaded
    layer, eagerly, so that the compiled forward resizes nothing; the amaxes kept are the
    newest that fit, and the step is bit for bit the eager one."""
    saved_under, trained_under = (DelayedScaling(amax_history_len=8),
                                  DelayedScaling(amax_history_len=4))
    layer = tfp8.Linear(32, 32, recipe=saved_under)
    for scale in (4.0, 2.0, 1.0):
        with fp8_autocast(fp8_recipe=saved_under):
            layer(randn(gen, 16, 32, scale=scale)).sum().backward()
    checkpoint = roundtrip(layer.state_dict())
    eager, compiled = (tfp8.Linear(32, 32, recipe=trained_under) for _ in range(2))
    for module in (eager, compiled):
        module.load_state_dict(checkpoint)
    compiled_fn = torch.compile(compiled, backend="aot_eager", fullgraph=True)
    x = randn(gen, 16, 32)
    with fp8_autocast(fp8_recipe=trained_under):
        expected = eager(x)
    with fp8_autocast(fp8_recipe=trained_under):
        out = compiled_fn(x)
    assert torch.equal(out, expected)
    assert compiled.fp8_fwd_amax_history.shape[0] == 4
    for key, value in eager.state_dict().items():
        assert torch.equal(compiled.state_dict()[key], value), key
    # (the newest amaxes of the loaded history kept, this step's in the last row)
    assert torch.equal(compiled.fp8_fwd_amax_history[1:3],
                       checkpoint["fp8_fwd_amax_history"][6:8])


UNLOADABLE = {
    "scale_int64": ("fp8_fwd_scale", lambda t: t.to(torch.int64)),
    "history_int32": ("fp8_bwd_amax_history", lambda t: t.to(torch.int32)),
    "scale_meta": ("fp8_bwd_scale", lambda t: t.to("meta")),
    "history_meta_other_length": ("fp8_fwd_amax_history",
                                  lambda t: torch.empty(8, t.shape[1], device="meta")),
    "scale_inv_list": ("fp8_fwd_scale_inv", lambda t: t.tolist()),
}


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "nonstrict"])
@pytest.mark.parametrize("entry", UNLOADABLE, ids=list(UNLOADABLE))
def test_unloadable_fp8_state_is_refused_naming_the_key(entry, strict):
    """An integer tensor (copy_ would cast it: a zero scale passed unchecked), a meta tensor (no
    values: a history re-sized for it was left uninitialised) or a non-tensor is refused by
    name, and the module keeps its state."""
    key, make = UNLOADABLE[entry]
    state = _trained_layer_state()
    state[key] = make(state[key])
    layer = tfp8.Linear(32, 32)
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    with pytest.raises(RuntimeError, match=key):
        layer.load_state_dict(state, strict=strict)
    after = layer.state_dict()
    for k, v in after.items():
        assert torch.equal(v, before[k]), f"{k} changed by a refused load"


def test_a_module_whose_load_fails_keeps_its_whole_fp8_state():
    """A checkpoint whose FP8 state is valid (a history of another length) but whose weight
    has the wrong shape: load_state_dict raises, and the module's FP8 state is all as it was
    (the history had been re-sized and loaded, its scales loaded: half a checkpoint)."""
    state = _trained_layer_state()
    state["fp8_fwd_amax_history"] = torch.rand(8, state["fp8_fwd_amax_history"].shape[1])
    state["weight"] = torch.randn(32, 31)
    layer = tfp8.Linear(32, 32)
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    with pytest.raises(RuntimeError, match="weight"):
        layer.load_state_dict(state)
    for k, v in layer.state_dict().items():
        if k.startswith("fp8_"):  # (its parameters load as torch loads them)
            assert v.shape == before[k].shape and torch.equal(v, before[k]), k
    with fp8_autocast(fp8_recipe=RECIPE):  # and it trains
        layer(torch.randn(4, 32)).sum().backward()


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "nonstrict"])
def test_an_amax_history_without_rows_is_refused_naming_the_key(strict):
    """A history of 0 rows loaded, then every later fp8_autocast raised IndexError."""
    state = _trained_layer_state()
    state["fp8_fwd_amax_history"] = torch.zeros(0, state["fp8_fwd_amax_history"].shape[1])
    layer = tfp8.Linear(32, 32)
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    with pytest.raises(RuntimeError, match="fp8_fwd_amax_history: an amax history needs at "
                                           "least one row"):
        layer.load_state_dict(state, strict=strict)
    for k, v in layer.state_dict().items():
        assert torch.equal(v, before[k]), k
    with fp8_autocast(fp8_recipe=RECIPE):
        layer(torch.randn(4, 32)).sum().backward()


def test_a_failed_load_of_a_plain_checkpoint_names_no_fp8_key_missing():
    """A plain nn.Linear checkpoint (complete without FP8 keys) with a weight of the wrong
    shape: the error names the weight, and no FP8 key as missing."""
    state = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 16)).state_dict()
    state["1.weight"] = torch.zeros(16, 31)
    model = torch.nn.Sequential(tfp8.Linear(32, 32), tfp8.Linear(32, 16))
    with pytest.raises(RuntimeError, match="size mismatch for 1.weight") as raised:
        model.load_state_dict(state)
    assert "fp8_" not in str(raised.value)


def test_load_fp8_state_takes_a_layer_held_under_two_names():
    """A model holding one Linear at two places (its state_dict has both names): its own
    state_dict loads (it was refused: 'FP8 state for layers the model does not have')."""

    class Shared(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = tfp8.Linear(32, 32)
            self.b = self.a

    source = Shared()
    source.a.load_state_dict(_trained_layer_state())
    target = Shared()
    loaded = tfp8.load_fp8_state(target, source.state_dict())
    assert sorted(loaded) == ["a", "b"]
    for key, value in source.state_dict().items():
        if "fp8_" in key:
            assert torch.equal(target.state_dict()[key], value), key


def test_load_fp8_state_takes_a_model_that_is_itself_an_fp8_layer():
    """The model an FP8 layer (its name ""): it looked for ".fp8_fwd_scale" and refused."""
    source = tfp8.Linear(32, 32)
    source.load_state_dict(_trained_layer_state())
    target = tfp8.Linear(32, 32)
    assert tfp8.load_fp8_state(target, source.state_dict()) == [""]
    for key, value in source.state_dict().items():
        if key.startswith("fp8_"):
            assert torch.equal(target.state_dict()[key], value), key


@pytest.mark.parametrize("fields", [[0, 9, 4, 0], [-5, 2, 4, 0], [0, 2, 0, 0], [0, 2, 4, 7],
                                    [0.0, 2.0, 4.0, 0.0], [0, 2, 4]],
                         ids=["format", "margin", "length", "algo", "float", "short"])
def test_a_corrupt_recipe_record_is_refused_naming_the_key(fields):
    """fp8_recipe_fields is a record of the recipe (margin, format, amax_history_len, algo): a
    value no recipe has (or a float / wrong-length tensor, which copy_ would take) is refused,
    the layer's FP8 state unchanged (it loaded silently)."""
    state = _trained_layer_state()
    state["fp8_recipe_fields"] = torch.tensor(fields)
    layer = tfp8.Linear(32, 32)
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    with pytest.raises(RuntimeError, match="fp8_recipe_fields"):
        layer.load_state_dict(state)
    for k, v in layer.state_dict().items():
        assert torch.equal(v, before[k]), k
    state["fp8_recipe_fields"] = torch.tensor([-1, -1, -1, -1])  # (a state never used)
    layer.load_state_dict(state)


@pytest.mark.parametrize("partial", ["empty", "other_layer", "adapter_keys"])
def test_a_partial_load_leaves_the_fp8_state_of_layers_it_holds_nothing_of(gen, partial):
    """load_state_dict(strict=False) of a state_dict that holds nothing of a layer (a LoRA
    adapter's, another layer's weights: peft's from_pretrained / load_adapter, Trainer's resume
    of a peft model) leaves that layer's FP8 state as it was: training goes on bit for bit as
    without the load (every such layer was reset to scale 1). A layer whose own weights load
    without FP8 state starts afresh, as from a plain checkpoint."""
    teacher = randn(gen, 32, 16) * 0.2
    batches = [(x, x @ teacher) for x in (randn(gen, 24, 32) * s for s in (1, 4, 0.5, 2, 8))]
    model, twin = make_model(), make_model()
    opts = [torch.optim.SGD(m.parameters(), lr=1e-2) for m in (model, twin)]
    for m, opt in zip((model, twin), opts):
        train(m, opt, batches[:2])
    fp8_before = {k: v.clone() for k, v in model.state_dict().items() if "fp8_" in k}
    assert any(not torch.all(v == 1) for k, v in fp8_before.items() if k.endswith("fp8_fwd_scale"))
    state = {"empty": {}, "other_layer": {"2.weight": model[2].weight.detach().clone()},
             "adapter_keys": {"0.lora_A.default.weight": torch.zeros(4, 32)}}[partial]
    model.load_state_dict(state, strict=False)
    for key, value in model.state_dict().items():
        if "fp8_" not in key:
            continue
        if partial == "other_layer" and key.startswith("2."):  # its weights loaded: fresh
            if "scale" in key:
                assert torch.all(value == 1), key
            elif "history" in key:
                assert not value.any(), key
        else:
            assert torch.equal(value, fp8_before[key]), key
    if partial != "other_layer":
        assert train(model, opts[0], batches[2:]) == train(twin, opts[1], batches[2:])


def test_a_checkpoint_loads_alike_into_a_trained_and_a_fresh_layer():
    """A state_dict taken inside fp8_autocast after the forward holds that step's amaxes in
    history row 0. Loaded into a layer that trained before (so a step kept from then covered
    it) and into a freshly built one, it must give the same state through another model's
    steps that neither layer runs in: the trained one's history was rolled, its saved row 0
    folded in as the other model's step."""
    recipe = DelayedScaling(amax_history_len=4)
    torch.manual_seed(0)
    source = tfp8.Linear(32, 32)
    for step in range(2):
        with fp8_autocast(fp8_recipe=recipe):
            y = source(torch.randn(16, 32) * 3)
            if step == 1:
                saved = {k: v.clone() for k, v in source.state_dict().items()}
        y.sum().backward()
    assert saved["fp8_fwd_amax_history"][0].abs().sum() > 0  # (row 0 holds amaxes)
    fresh = tfp8.Linear(32, 32)
    fresh.load_state_dict(saved)
    trained = tfp8.Linear(32, 32)
    with fp8_autocast(fp8_recipe=recipe):
        trained(torch.randn(16, 32)).sum().backward()
    trained.load_state_dict(saved)
    other = tfp8.Linear(32, 32)
    for _ in range(2):
        with fp8_autocast(fp8_recipe=recipe):
            other(torch.randn(16, 32)).sum().backward()
    for key, value in fresh.state_dict().items():
        if "fp8_" in key:
            assert torch.equal(trained.state_dict()[key], value), key
            # (a layer that did not run: unchanged, in one process; where ranks reduce, every
            # state of the recipe is in the reduction's layout, and both layers alike fold
            # the saved row 0 in)
            assert torch.equal(value, saved[key]), key
    # Both join a step again when they run, and then train alike.
    for layer in (fresh, trained):
        torch.manual_seed(5)
        with fp8_autocast(fp8_recipe=recipe):
            layer(torch.randn(16, 32)).sum().backward()
    for key, value in fresh.state_dict().items():
        if "fp8_" in key:
            assert torch.equal(trained.state_dict()[key], value), key


@pytest.mark.parametrize("inside,compiled_elsewhere", [(False, False), (True, False),
                                                       (False, True)],
                         ids=["after_the_context", "inside_it", "a_linear_compiled_elsewhere"])
def test_a_load_between_a_forward_and_its_backward_keeps_the_loaded_state(inside,
                                                                         compiled_elsewhere):
    """A forward, a load_state_dict, then that forward's backward: the backward recorded its
    grad_output amax into the loaded history's row 0, which no update covered, and the next
    step folded it in as its own (a grad_output scale 68000x too small). Row 0 is put back to
    what was loaded by that backward's update (which covers the loaded state where a class was
    compiled, or ranks reduce): the next step is that of a layer loaded before it, bit for
    bit."""
    recipe = DelayedScaling(amax_history_len=4)
    if compiled_elsewhere:  # (compiled classes' states are covered by every step)
        other = torch.compile(tfp8.Linear(32, 16, recipe=recipe), backend="aot_eager")
        with fp8_autocast(fp8_recipe=recipe):
            other(torch.randn(16, 32))
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    source = tfp8.Linear(32, 16, recipe=recipe)
    for _ in range(2):
        with fp8_autocast(fp8_recipe=recipe):
            out = source(torch.randn(8, 32, generator=gen))
        out.backward(torch.randn(8, 16, generator=gen) * 0.01)
    saved = {k: v.clone() for k, v in source.state_dict().items()}
    x_next, g_next = torch.randn(8, 32, generator=gen), torch.randn(8, 16, generator=gen) * 0.01

    torch.manual_seed(1)
    layer = tfp8.Linear(32, 16, recipe=recipe)
    with fp8_autocast(fp8_recipe=recipe):
        out = layer(torch.randn(8, 32, generator=gen))
        if inside:
            layer.load_state_dict(saved)
    if not inside:
        layer.load_state_dict(saved)
    out.backward(torch.randn(8, 16, generator=gen) * 1000)  # the stale backward
    reference = tfp8.Linear(32, 16, recipe=recipe)
    reference.load_state_dict(saved)
    for module in (layer, reference):
        module.weight.grad = module.bias.grad = None
        with fp8_autocast(fp8_recipe=recipe):
            out = module(x_next)
        out.backward(g_next)
    for key, value in reference.state_dict().items():
        assert torch.equal(layer.state_dict()[key], value), key
