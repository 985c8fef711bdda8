"""FP8 primary weights (quantized_model_init): writing into them (copy_, in-place updates, with
which scale), checkpoints (pickle-free, bit-for-bit round trips, high-precision checkpoints both
ways), preserve_high_precision_init_val, device moves and copies, and the refusals."""
from __future__ import annotations

import copy
import io

import pytest
import torch

import transformer_fp8 as tfp8
from conftest import assert_bitwise_equal, randn
from transformer_fp8 import ops
from transformer_fp8.modules.fp8_primary_weights import SCALE_INV_SUFFIX
from transformer_fp8.quantization.fp8_weight import Fp8Weight

DELAYED = tfp8.DelayedScaling(amax_history_len=4, margin=1)
E4M3 = torch.float8_e4m3fn


def fp8_linear(recipe=DELAYED, seed=0, device="cpu", **kwargs):
    torch.manual_seed(seed)
    with tfp8.quantized_model_init(recipe=recipe, **kwargs):
        return tfp8.Linear(64, 32, device=device)


def test_copy_quantises_with_the_layers_delayed_weight_scale(device, gen):
    layer = fp8_linear(device=device)
    with tfp8.fp8_autocast(fp8_recipe=DELAYED):  # one update: the weight scale moves on
        layer(randn(gen, 16, 64, device=device)).sum().backward()
    scale, scale_inv = layer.fp8_fwd_scale[1:2].clone(), layer.fp8_fwd_scale_inv[1:2].clone()
    row0 = layer.fp8_fwd_amax_history[0].clone()
    master = randn(gen, 32, 64, device=device, scale=0.05)
    with torch.no_grad():
        layer.weight.copy_(master)
    assert_bitwise_equal(layer.weight.fp8_data, ops.cast_to_fp8(master, scale, E4M3))
    assert_bitwise_equal(layer.weight.fp8_scale_inv, scale_inv)
    assert_bitwise_equal(layer.fp8_fwd_scale[1:2], scale, "the layer's scale is unchanged")
    recorded = torch.maximum(row0[1], master.abs().max())
    assert_bitwise_equal(layer.fp8_fwd_amax_history[0, 1], recorded, "amax recorded")
    assert_bitwise_equal(layer.fp8_fwd_amax_history[0, 0], row0[0])
    assert type(layer.weight) is Fp8Weight and layer.weight.requires_grad


def test_copy_into_a_fresh_state_uses_the_values_own_scale(gen):
    """After reset_fp8_state (scale 1, no amax), a write does not cast with the fresh scale of
    1: the value's own scale is used and becomes the layer's."""
    layer = fp8_linear()
    layer.reset_fp8_state()
    master = randn(gen, 32, 64, scale=0.01)
    with torch.no_grad():
        layer.weight.copy_(master)
    own = ops.compute_scale_from_amax(master.abs().max().reshape(1), 448.0, DELAYED.margin)
    assert_bitwise_equal(layer.weight.fp8_data, ops.cast_to_fp8(master, own, E4M3))
    assert_bitwise_equal(layer.fp8_fwd_scale[1:2], own)
    assert_bitwise_equal(layer.weight.fp8_scale_inv, own.reciprocal())


def test_copy_after_updates_with_a_history_of_one_uses_the_layers_scale(gen):
    """amax_history_len=1: every update leaves the history empty, yet the state is not fresh
    (its scale moved): a write casts with the layer's delayed weight scale and leaves it
    as it is, as with longer histories."""
    recipe = tfp8.DelayedScaling(amax_history_len=1)
    layer = fp8_linear(recipe)
    for _ in range(2):
        with tfp8.fp8_autocast(fp8_recipe=recipe):
            layer(randn(gen, 16, 64)).sum().backward()
    assert not layer.fp8_fwd_amax_history.any()
    scale, scale_inv = layer.fp8_fwd_scale[1:2].clone(), layer.fp8_fwd_scale_inv[1:2].clone()
    master = randn(gen, 32, 64, scale=0.01)  # its own scale would be far larger
    with torch.no_grad():
        layer.weight.copy_(master)
    assert_bitwise_equal(layer.weight.fp8_data, ops.cast_to_fp8(master, scale, E4M3))
    assert_bitwise_equal(layer.fp8_fwd_scale[1:2], scale, "the layer's scale is unchanged")
    assert_bitwise_equal(layer.weight.fp8_scale_inv, scale_inv)


def test_assigning_data_quantises_the_value(gen):
    """weight.data = value writes as copy_ does (torch.nn.utils.vector_to_parameters writes
    so); an Fp8Weight's FP8 data is taken as it is; another shape is refused, nothing
    changed."""
    layer, twin = fp8_linear(), fp8_linear()
    master = randn(gen, 32, 64, scale=0.05)
    layer.weight.data = master
    with torch.no_grad():
        twin.weight.copy_(master)
    assert type(layer.weight) is Fp8Weight and layer.weight.dtype == torch.float32
    for name in ("fp8_data", "fp8_scale_inv"):
        assert_bitwise_equal(getattr(layer.weight, name), getattr(twin.weight, name), name)
    for key, value in twin.state_dict().items():
        assert_bitwise_equal(layer.state_dict()[key], value, key)
    x = randn(gen, 8, 64)
    with tfp8.fp8_autocast(fp8_recipe=DELAYED):
        assert_bitwise_equal(layer(x), twin(x))
    layer.weight.data = master.bfloat16()  # the nominal dtype follows, as for any Parameter
    assert layer.weight.dtype == torch.bfloat16 and type(layer.weight) is Fp8Weight
    other = fp8_linear(seed=1).weight
    layer.weight.data = other
    assert_bitwise_equal(layer.weight.fp8_data, other.fp8_data)
    assert_bitwise_equal(layer.weight.fp8_scale_inv, other.fp8_scale_inv)
    before = layer.weight.fp8_data.clone()
    with pytest.raises(ValueError, match=r"keeps its shape \[32, 64\], got a value of shape"):
        layer.weight.data = torch.zeros(64, 32)
    assert_bitwise_equal(layer.weight.fp8_data, before)
    vector = torch.nn.utils.parameters_to_vector(layer.parameters())
    torch.nn.utils.vector_to_parameters(torch.zeros_like(vector), layer.parameters())
    assert not layer.weight.dequantize().any() and not layer.bias.any()


def test_module_conversions_through_data_keep_the_fp8_weight(gen):
    """Module._apply assigns weight.data while the module's FP8 state is set aside: .double()
    keeps the FP8 data bit for bit (re-quantised with the scale it holds, nothing recorded),
    and to_empty() gives an FP8 weight of the same shape, without error."""
    layer = fp8_linear()
    data, scale_inv = layer.weight.fp8_data.clone(), layer.weight.fp8_scale_inv.clone()
    state = {k: v.clone() for k, v in layer.state_dict().items() if k.startswith("fp8_")}
    layer.double()
    assert type(layer.weight) is Fp8Weight
    assert_bitwise_equal(layer.weight.fp8_data, data)
    assert_bitwise_equal(layer.weight.fp8_scale_inv, scale_inv)
    for key, value in state.items():
        assert_bitwise_equal(layer.state_dict()[key], value, key)
    layer = fp8_linear()
    layer.to_empty(device="cpu")
    assert type(layer.weight) is Fp8Weight and layer.weight.fp8_data.shape == (32, 64)


def test_current_scaling_weights_take_their_own_scale_at_every_write(gen):
    layer = fp8_linear(tfp8.Float8CurrentScaling())
    state = {k: v.clone() for k, v in layer.state_dict().items() if k.startswith("fp8_")}
    master = randn(gen, 32, 64, scale=3.0)
    with torch.no_grad():
        layer.weight.copy_(master)
    own = ops.compute_scale_from_amax(master.abs().max().reshape(1), 448.0)
    assert_bitwise_equal(layer.weight.fp8_data, ops.cast_to_fp8(master, own, E4M3))
    for key, value in state.items():
        assert_bitwise_equal(layer.state_dict()[key], value, f"{key} untouched")


def test_in_place_updates_quantise_the_updated_value(gen):
    layer = fp8_linear(tfp8.Float8CurrentScaling())
    w = layer.weight
    before, delta = w.dequantize(), randn(gen, 32, 64, scale=0.01)
    with torch.no_grad():
        w.add_(delta, alpha=-2.0)
    expected = before - 2.0 * delta
    own = ops.compute_scale_from_amax(expected.abs().max().reshape(1), 448.0)
    assert_bitwise_equal(w.fp8_data, ops.cast_to_fp8(expected, own, E4M3))
    alias = w.detach()  # aliases share the FP8 data: a write through one is seen by both
    with torch.no_grad():
        alias.zero_()
    assert not w.dequantize().any() and type(alias) is Fp8Weight
    with torch.no_grad():
        torch._foreach_add_([w], [torch.ones(32, 64)])
    assert torch.equal(w.dequantize(), torch.ones(32, 64))
    with torch.no_grad():
        w.copy_(torch.tensor(0.5))  # copy_ broadcasts its source
    assert w.fp8_data.shape == (32, 64) and torch.equal(w.dequantize(), torch.full((32, 64), 0.5))


def test_every_other_use_sees_the_dequantised_value(gen):
    w = fp8_linear().weight
    value = w.dequantize()
    x = randn(gen, 8, 64)
    for got, want in ((w.clone(), value), (w * 2, value * 2), (w.float(), value),
                      (w.t(), value.t()), (torch.nn.functional.linear(x, w), x @ value.t())):
        assert_bitwise_equal(torch.as_tensor(got).detach() if type(got) is torch.Tensor
                             else got.dequantize(), want)
    assert type(w.clone()) is torch.Tensor, "a copy of the value: a plain tensor"
    assert "Fp8Weight(" in repr(w) and "float8_e4m3fn" in repr(w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_dict_round_trip_is_bit_for_bit_and_pickle_free(dtype, gen):
    torch.manual_seed(0)
    with tfp8.quantized_model_init(recipe=DELAYED):
        layer = tfp8.LayerNormMLP(64, 128, params_dtype=dtype)
    x = randn(gen, 16, 64, dtype=dtype)
    for _ in range(2):  # scales that moved on since the weights were written
        with tfp8.fp8_autocast(fp8_recipe=DELAYED):
            layer(x).float().sum().backward()
    buffer = io.BytesIO()
    torch.save(layer.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    torch.manual_seed(1)  # other initial values
    with tfp8.quantized_model_init(recipe=DELAYED):
        loaded = tfp8.LayerNormMLP(64, 128, params_dtype=dtype)
    loaded.load_state_dict(state, strict=True)
    for name in ("fc1_weight", "fc2_weight"):
        w, w_loaded = getattr(layer, name), getattr(loaded, name)
        assert type(w_loaded) is Fp8Weight
        assert_bitwise_equal(w_loaded.fp8_data, w.fp8_data, name)
        assert_bitwise_equal(w_loaded.fp8_scale_inv, w.fp8_scale_inv, name)
    with tfp8.fp8_autocast(fp8_recipe=DELAYED):
        assert_bitwise_equal(loaded(x), layer(x))


def test_checkpoints_cross_with_high_precision_modules(gen):
    layer = fp8_linear()
    # FP8 weights -> a high-precision module (strict): the dequantised weights.
    hp = tfp8.Linear(64, 32, recipe=DELAYED)
    hp.load_state_dict(layer.state_dict(), strict=True)
    assert_bitwise_equal(hp.weight.detach(), layer.weight.dequantize())
    plain = torch.nn.Linear(64, 32)
    plain.load_state_dict(tfp8.strip_fp8_state(layer.state_dict()), strict=True)
    assert_bitwise_equal(plain.weight.detach(), layer.weight.dequantize())
    # A high-precision checkpoint -> FP8 weights: each quantised with its own scale.
    source = torch.nn.Linear(64, 32)
    with torch.no_grad():
        source.weight.mul_(40.0)  # far outside the built weight's range
    layer.load_state_dict(source.state_dict(), strict=True)
    own = ops.compute_scale_from_amax(source.weight.abs().max().reshape(1), 448.0,
                                      DELAYED.margin)
    assert_bitwise_equal(layer.weight.fp8_data, ops.cast_to_fp8(source.weight.detach(), own,
                                                                E4M3))
    assert_bitwise_equal(layer.weight.fp8_scale_inv, own.reciprocal())


@pytest.mark.parametrize("bad", [torch.tensor([0.0]), torch.tensor([float("nan")]),
                                 torch.tensor([-1.0]), torch.ones(2)],
                         ids=["zero", "nan", "negative", "two-elements"])
def test_a_bad_saved_scale_inv_is_refused_and_the_weight_kept(bad):
    layer = fp8_linear()
    before = (layer.weight.fp8_data.clone(), layer.weight.fp8_scale_inv.clone())
    state = fp8_linear(seed=3).state_dict()
    state["weight" + SCALE_INV_SUFFIX] = bad
    with pytest.raises(RuntimeError, match="weight_fp8_scale_inv: expected a"):
        layer.load_state_dict(state)
    assert_bitwise_equal(layer.weight.fp8_data, before[0])
    assert_bitwise_equal(layer.weight.fp8_scale_inv, before[1])


def test_preserve_high_precision_init_val():
    torch.manual_seed(5)
    reference = tfp8.Linear(64, 32)
    kept = fp8_linear(seed=5, preserve_high_precision_init_val=True).weight
    init = kept.get_high_precision_init_val()
    assert init.device.type == "cpu" and type(init) is torch.Tensor
    assert_bitwise_equal(init, reference.weight.detach())
    assert kept.detach().get_high_precision_init_val() is init, "shared by aliases"
    kept.clear_high_precision_init_val()
    assert kept.get_high_precision_init_val() is None
    assert fp8_linear().weight.get_high_precision_init_val() is None, "not kept unless asked"
    with pytest.raises(TypeError, match="preserve_high_precision_init_val must be True or"):
        with tfp8.quantized_model_init(preserve_high_precision_init_val=1):
            pass


def test_device_and_dtype_moves_and_copies_keep_fp8_weights(gen):
    layer = fp8_linear()
    data = layer.weight.fp8_data.clone()
    layer.to("cpu")
    assert type(layer.weight) is Fp8Weight
    twin = copy.deepcopy(layer)
    assert type(twin.weight) is Fp8Weight and twin.weight.fp8_data is not layer.weight.fp8_data
    with torch.no_grad():
        twin.weight.copy_(randn(gen, 32, 64))
    assert_bitwise_equal(layer.weight.fp8_data, data, "the original is untouched")
    assert not torch.equal(twin.fp8_fwd_amax_history, layer.fp8_fwd_amax_history), \
        "the copy's write recorded into the copy's state"
    layer.to(torch.bfloat16)
    assert type(layer.weight) is Fp8Weight and layer.weight.dtype == torch.bfloat16
    assert_bitwise_equal(layer.weight.fp8_data, data, "the same FP8 data")


def _torch_save_round_trip(model):
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def _pickle_round_trip(model):
    import pickle
    return pickle.loads(pickle.dumps(model))  # (a float8 tensor's plain pickle failed to load)


@pytest.mark.parametrize("round_trip", [_torch_save_round_trip, _pickle_round_trip],
                         ids=["torch_save", "pickle"])
@pytest.mark.parametrize("recipe", [DELAYED, tfp8.Float8CurrentScaling()],
                         ids=["delayed", "current"])
def test_a_pickled_model_trains_on_as_the_original(recipe, round_trip, gen):
    """torch.save(model) / torch.load(weights_only=False) of a model of FP8 weights (it was
    refused; Transformer Engine's FP8 tensors pickle), or pickle.dumps / loads: the loaded
    weights hold the same FP8 data and scales, cast into the loaded model's state, and
    training goes on bit for bit as the original's (the original untouched by the copy's
    steps)."""
    from integration_compare import assert_bit_identical, train

    with tfp8.quantized_model_init(recipe=recipe):
        torch.manual_seed(0)
        model = torch.nn.Sequential(tfp8.Linear(64, 96), torch.nn.GELU(),
                                    tfp8.LayerNormMLP(96, 128), tfp8.Linear(96, 32))
    batches = [randn(gen, 16, 64, scale=s) for s in (1.0, 4.0, 0.5, 2.0, 8.0, 1.0)]
    train(model, model, batches[:2], recipe)
    loaded = round_trip(model)
    weights = [(n, p) for n, p in loaded.named_parameters() if isinstance(p, Fp8Weight)]
    assert len(weights) == 4 and all(isinstance(p, torch.nn.Parameter) for _, p in weights)
    originals = dict(model.named_parameters())
    for name, weight in weights:
        assert_bitwise_equal(weight.fp8_data, originals[name].fp8_data, name)
        assert weight.fp8_data.data_ptr() != originals[name].fp8_data.data_ptr()
    model[0].weight.main_grad = torch.zeros(96, 64)  # (a tensor's own attribute: kept)
    assert torch.equal(round_trip(model)[0].weight.main_grad, torch.zeros(96, 64))
    del model[0].weight.main_grad
    twin = copy.deepcopy(model)
    got = train(loaded, loaded, batches[2:], recipe)
    expected = train(twin, twin, batches[2:], recipe)
    assert_bit_identical(got, expected)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    train(loaded, loaded, batches[:3], recipe)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def test_refusals():
    block = tfp8.Float8BlockScaling()
    with pytest.raises(ValueError, match="one scale per weight .* got Float8BlockScaling"):
        with tfp8.quantized_model_init(recipe=block):
            tfp8.Linear(128, 128)
    tfp8.Linear(128, 128, recipe=block)  # what the message suggests works
    for kwargs in (dict(parameters_split=["query", "key"]),
                   dict(fuse_wgrad_accumulation=True), dict(delay_wgrad_compute=True)):
        with pytest.raises(ValueError, match="cannot keep this module's weights in FP8"):
            with tfp8.quantized_model_init(recipe=DELAYED):
                tfp8.Linear(64, 32, **kwargs)
    with pytest.raises(ValueError, match="cannot keep this module's weights in FP8"):
        with tfp8.quantized_model_init(recipe=DELAYED):
            tfp8.TransformerLayer(64, 128, 4)  # parameters_split for q, k, v
    with tfp8.quantized_model_init(recipe=DELAYED):
        layer = tfp8.TransformerLayer(64, 128, 4, fuse_qkv_params=True)
    assert sum(isinstance(p, Fp8Weight) for p in layer.parameters()) == 4
    with pytest.raises(ValueError, match="cannot be built on the 'meta' device"):
        with tfp8.quantized_model_init(recipe=DELAYED):
            tfp8.Linear(64, 32, device="meta")
    with pytest.raises(ValueError, match="fp8_all_gather=True .* does not combine"):
        with tfp8.quantized_model_init(recipe=DELAYED):
            tfp8.Linear(64, 32, fp8_all_gather=True)
    with tfp8.quantized_model_init(recipe=DELAYED):  # converted layers keep their weights
        converted = tfp8.convert_to_fp8(torch.nn.Sequential(torch.nn.Linear(64, 32)))
    assert type(converted[0].weight) is torch.nn.Parameter


def test_a_weight_deep_copied_on_its_own_writes_into_no_module_state(gen):
    """copy.deepcopy of the parameters alone (a common way to make master copies) gives FP8
    weights that cast new values with their own scale: a write into such a copy used to record
    its amax into the ORIGINAL layer's history (x100 there moved the layer's weight scale 100x
    at the next update) and was clipped to the layer's range."""
    layer = fp8_linear()
    state = {k: v.clone() for k, v in layer.state_dict().items()}
    copies = copy.deepcopy(list(layer.parameters()))
    weight = copies[0]
    assert isinstance(weight, Fp8Weight)
    value = layer.weight.dequantize() * 100
    with torch.no_grad():
        weight.mul_(100.0)
    for key, t in layer.state_dict().items():
        assert_bitwise_equal(t, state[key], key)
    own = ops.compute_scale_from_amax(ops.amax(value).reshape(1), 448.0, DELAYED.margin)
    expected = ops.cast_from_fp8(ops.cast_to_fp8(value, own, torch.float8_e4m3fn),
                                 own.reciprocal(), torch.float32)
    assert_bitwise_equal(weight.dequantize(), expected, "the copy, cast with its own scale")
    # A model deep-copied whole keeps its weights cast with the copy's own layer state.
    model = copy.deepcopy(torch.nn.Sequential(layer))
    assert model[0].weight._fp8.cast._module() is model[0]


def test_copy_from_a_weight_of_another_fp8_dtype_shares_nothing(gen):
    """copy_ of an FP8 weight of another FP8 format took the source's tensors: a later write
    into the source changed the destination too."""
    source = fp8_linear(tfp8.DelayedScaling(fp8_format=tfp8.Format.E5M2), seed=1)
    target = fp8_linear(seed=0)
    with torch.no_grad():
        target.weight.copy_(source.weight)
    before = target.weight.dequantize().clone()
    with torch.no_grad():
        source.weight.mul_(0.5)
    assert_bitwise_equal(target.weight.dequantize(), before, "the destination after a write "
                         "into the source")


def test_a_dtype_copy_of_a_weight_writes_into_no_module_state(gen):
    """p.float() of a bfloat16 FP8 weight (a master made the plain-tensor way) is an FP8 copy;
    a write into it recorded its amax into the layer's history (x100 moved the layer's weight
    scale 100x at the next update). Now it casts with its own scale, touching no state; the
    module's own .float() keeps the weight bound to the module."""
    with tfp8.quantized_model_init(recipe=DELAYED):
        layer = tfp8.Linear(64, 32, params_dtype=torch.bfloat16)
    state = {k: v.clone() for k, v in layer.state_dict().items()}
    copy_ = layer.weight.detach().float()
    with torch.no_grad():
        copy_.mul_(100.0)
    for key, t in layer.state_dict().items():
        assert_bitwise_equal(t, state[key], key)
    layer.float()
    assert layer.weight._fp8.cast._module() is layer


def _fp8_weight_model(seed, fp8_weights=True):
    torch.manual_seed(seed)
    with tfp8.quantized_model_init(enabled=fp8_weights, recipe=DELAYED):
        return torch.nn.Sequential(tfp8.Linear(64, 64), torch.nn.GELU(),
                                   tfp8.LayerNormMLP(64, 96))


def _train_step(models, x_of, evaluate=False):
    """One step of ``models`` in ONE fp8_autocast (each model's input from ``x_of(model)``),
    then SGD written into each weight with copy_ (the optimizer-write pattern: FP8 weights
    record the written value's amax there), or a forward under no_grad (``evaluate``)."""
    if evaluate:
        with torch.no_grad(), tfp8.fp8_autocast(fp8_recipe=DELAYED):
            for model in models:
                model(x_of(model))
        return []
    with tfp8.fp8_autocast(fp8_recipe=DELAYED):
        losses = [model(x_of(model)).float().pow(2).mean() for model in models]
    for model, loss in zip(models, losses):
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p - 0.1 * p.grad)
                p.grad = None
    return [loss.detach() for loss in losses]


def _everything(model, losses) -> dict:
    """The losses, the FP8 state tensors, the FP8 data of each weight and the rest of the
    state_dict (the dequantised weights and their scale_invs), for a bit-for-bit comparison."""
    found = {f"loss{i}": loss for i, loss in enumerate(losses)}
    found.update({k: v.clone() for k, v in model.state_dict().items()})
    found.update({name + ".fp8_data": p.fp8_data.clone()
                  for name, p in model.named_parameters() if isinstance(p, Fp8Weight)})
    return found


@pytest.mark.parametrize("b_weights", ["fp8", "plain"])
@pytest.mark.parametrize("schedule", ["alternately", "after_an_evaluation", "in_one_context"])
def test_another_models_steps_leave_an_fp8_weight_models_state(schedule, b_weights):
    """Model A (FP8 weights, written by the optimizer after each step) trained alternately with
    model B (FP8 or plain weights) under the same recipe object, B's steps in contexts of their
    own (also after an evaluation forward of A, whose amaxes are discarded), or both in one
    context: each model's losses, weights and FP8 state are bit for bit those of it trained
    alone. (A write records the value's amax into the weight's history row 0, for the next
    update of a step its layer runs in; the update at the exit of B's own context, which covers
    every state of the recipe in the thread, rolled A's weight columns and set A's weight scale:
    an extra roll per step of any other model, an EMA or evaluation model, a GAN's other
    half.)"""
    base_a, base_b = _fp8_weight_model(0), _fp8_weight_model(1, b_weights == "fp8")

    def inputs(seed):  # (each model draws its own inputs, whatever runs in between)
        gen = torch.Generator().manual_seed(seed)
        return lambda: torch.randn(16, 64, generator=gen) * 2

    alone = []
    for base, seed in ((base_a, 10), (base_b, 11)):
        model, draw, losses = copy.deepcopy(base), inputs(seed), []
        for _ in range(5):
            losses += _train_step([model], lambda _: draw())
        alone.append(_everything(model, losses))

    a, b = copy.deepcopy(base_a), copy.deepcopy(base_b)
    draws = {a: inputs(10), b: inputs(11)}

    def x_of(model):
        return draws[model]()

    losses = {a: [], b: []}
    for _ in range(5):
        if schedule == "in_one_context":
            loss_a, loss_b = _train_step([a, b], x_of)
            losses[a].append(loss_a)
            losses[b].append(loss_b)
            continue
        losses[a] += _train_step([a], x_of)
        if schedule == "after_an_evaluation":
            _train_step([a], lambda _: torch.ones(16, 64), evaluate=True)
        losses[b] += _train_step([b], x_of)
    for name, model, expected in (("A", a, alone[0]), ("B", b, alone[1])):
        got = _everything(model, losses[model])
        assert got.keys() == expected.keys()
        for key in expected:
            assert_bitwise_equal(got[key], expected[key], f"model {name}: {key}")


def _single_rank_broadcast(rank, out_dir):
    import torch.distributed as dist
    with tfp8.quantized_model_init(recipe=tfp8.DelayedScaling()):
        layer = tfp8.Linear(64, 96)
    before = layer.weight.dequantize().clone()
    with pytest.raises(RuntimeError, match="cannot take part in a collective"):
        dist.broadcast(layer.weight, 0)
    with torch.no_grad(), pytest.raises(RuntimeError, match="cannot take part in a collective"):
        dist.all_reduce(layer.weight[:8])  # (a view of it, made under no_grad, too)
    assert torch.equal(layer.weight.dequantize(), before)


def test_a_collective_on_an_fp8_weight_is_refused(tmp_path):
    """A collective on an FP8 weight (or a view of it), which holds no storage of its own: gloo
    read and wrote through a null pointer. Refused by name, the weight unchanged. (torch's
    parallelize_module scatters the weight's chunks outside the operator dispatcher and still
    crashes: README, FP8 weights.)"""
    from multiprocess import run_ranks
    run_ranks(_single_rank_broadcast, (str(tmp_path),), tmp_path, world=1)
