"""A module's FP8 state is the one a directly built module has, however the module came to
exist: built on "meta" and materialised (to_empty(), or only its parameters, as accelerate's
init_empty_weights(include_buffers=False) and its loaders do), its parameters initialised
again (reset_parameters()), a checkpoint without FP8 state loaded, or the whole module cast
with Module.type(). Each case is compared with a directly built module of the same weights:
the state before training, then 3 SGD steps whose inputs change in magnitude (the delayed
scales change at every step), bit for bit (losses, gradients, FP8 state), under DelayedScaling
and Float8CurrentScaling, for every FP8 module type, on the modules' C++ steps and their
Python path. (from_pretrained into a model whose FP8 layers exist at construction:
test_huggingface.py.)"""
from __future__ import annotations

import contextlib

import pytest
import torch
from fused_step_checks import every_step_path  # noqa: F401 (the fixture below)
from integration_compare import assert_bit_identical, counting_aot_eager, step_batches, train

import transformer_fp8 as tfp8
from transformer_fp8 import DelayedScaling, Float8CurrentScaling, fp8_autocast

pytestmark = pytest.mark.usefixtures("every_step_path")

H = 32
# The recipe the modules are built for, and another model's (a shorter history).
BUILT_FOR = DelayedScaling(amax_history_len=16)
OTHER = DelayedScaling(amax_history_len=4)
RECIPES = [pytest.param(BUILT_FOR, id="delayed"),
           pytest.param(Float8CurrentScaling(), id="current")]

# name -> (build(**kwargs), run(module, x[24, H]))
MODULES = {
    "Linear": (lambda **kw: tfp8.Linear(H, H, **kw), lambda m, x: m(x)),
    "LayerNormLinear": (lambda **kw: tfp8.LayerNormLinear(H, H, **kw), lambda m, x: m(x)),
    "LayerNormMLP": (lambda **kw: tfp8.LayerNormMLP(H, 2 * H, **kw), lambda m, x: m(x)),
    "GroupedLinear": (lambda **kw: tfp8.GroupedLinear(2, H, H, **kw),
                      lambda m, x: m(x, [16, 8])),
    "TransformerLayer": (lambda **kw: tfp8.TransformerLayer(H, 2 * H, 4, hidden_dropout=0.0,
                                                            attention_dropout=0.0, **kw),
                         lambda m, x: m(x.view(6, 4, H))),
}
NAMES = list(MODULES)


@contextlib.contextmanager
def uninitialised_memory_is_nan():
    """torch.empty and to_empty() fill their memory with NaN (int: its largest value), so that
    a state left uninitialised shows, whatever the allocator hands out."""
    was = torch.are_deterministic_algorithms_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was)
        torch.utils.deterministic.fill_uninitialized_memory = fill


def build(name, **kwargs):
    torch.manual_seed(0)
    return MODULES[name][0](**kwargs)


def copy_parameters(dst, src) -> None:
    """dst's parameters take src's values (dst materialised, src built directly)."""
    with torch.no_grad():
        for (name, p), (src_name, q) in zip(dst.named_parameters(), src.named_parameters(),
                                            strict=True):
            assert name == src_name
            p.copy_(q)


def assert_same_state(got, expected) -> None:
    """The whole state_dicts (weights, FP8 state, recipe record), dtype and bits."""
    got_sd, expected_sd = got.state_dict(), expected.state_dict()
    assert got_sd.keys() == expected_sd.keys()
    for key, value in expected_sd.items():
        assert got_sd[key].dtype == value.dtype and got_sd[key].shape == value.shape, \
            f"{key}: {got_sd[key].dtype} {tuple(got_sd[key].shape)} vs {value.dtype} " \
            f"{tuple(value.shape)}"
        assert torch.equal(got_sd[key], value), f"{key}: {got_sd[key]} vs {value}"


def train_steps(name, model, recipe, dtype=torch.float32, run=None):
    batches = step_batches(torch.Generator().manual_seed(8), 3, 24, H, dtype=dtype)
    run_module = MODULES[name][1]
    return train(model, lambda x: run_module(model if run is None else run, x), batches, recipe)


def another_models_step() -> None:
    """A step of another model under another delayed recipe: a module built for its own
    recipe is no business of it."""
    other = tfp8.Linear(H, H, recipe=OTHER)
    with fp8_autocast(fp8_recipe=OTHER):
        other(torch.randn(8, H)).sum().backward()


def fresh_again(name, how, recipe):
    """A module built for ``recipe`` whose FP8 state was made fresh ``how``, with the weights
    of build(name, recipe=recipe)."""
    direct = build(name, recipe=recipe)
    if how == "meta_to_empty":
        module = build(name, recipe=recipe, device="meta")
        module.to_empty(device="cpu")
    elif how == "meta_context_to_empty":
        with torch.device("meta"):
            module = build(name, recipe=recipe)
        module.to_empty(device="cpu")
    elif how == "reset_parameters":
        module = build(name, recipe=recipe)
        for m in module.modules():
            if isinstance(m, tfp8.quantization.state.Fp8State):
                m.reset_parameters()
    else:  # a checkpoint of the weights only (no FP8 state) loaded with strict=True
        module = build(name, recipe=recipe)
        module.load_state_dict({k: v for k, v in direct.state_dict().items() if "fp8_" not in k})
    copy_parameters(module, direct)
    return module


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("how", ["meta_to_empty", "meta_context_to_empty", "reset_parameters",
                                 "plain_checkpoint"])
@pytest.mark.parametrize("name", NAMES)
def test_a_fresh_state_keeps_the_recipe_the_module_was_built_for(name, how, recipe):
    """to_empty() from "meta", reset_parameters() and a checkpoint without FP8 state give the
    state of the module as built for its recipe (recipe=...): its record and history length,
    so another model's step under another recipe leaves it alone (it adopted that recipe and
    had its histories resized, and torch.compile then refused to resize them back)."""
    expected_model = build(name, recipe=recipe)
    with uninitialised_memory_is_nan():
        model = fresh_again(name, how, recipe)
    assert_same_state(model, expected_model)
    another_models_step()
    assert_same_state(model, expected_model)
    assert_bit_identical(train_steps(name, model, recipe),
                         train_steps(name, expected_model, recipe))


@pytest.mark.parametrize("recipe", RECIPES)
def test_convert_to_fp8_on_meta_keeps_its_recipe(recipe):
    """convert_to_fp8(model, recipe=...) of a model on "meta", then to_empty(): the recipe
    record of a model converted on the CPU."""
    torch.manual_seed(0)
    expected_model = tfp8.convert_to_fp8(torch.nn.Sequential(torch.nn.Linear(H, H)),
                                         recipe=recipe)
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(H, H))
    tfp8.convert_to_fp8(model, recipe=recipe)
    with uninitialised_memory_is_nan():
        model.to_empty(device="cpu")
    copy_parameters(model, expected_model)
    assert_same_state(model, expected_model)
    another_models_step()
    assert_same_state(model, expected_model)
    assert_bit_identical(train(model, model, step_batches(torch.Generator().manual_seed(8), 3,
                                                          24, H), recipe),
                         train(expected_model, expected_model,
                               step_batches(torch.Generator().manual_seed(8), 3, 24, H), recipe))


@pytest.mark.parametrize("how", ["meta_to_empty", "reset_parameters"])
@pytest.mark.parametrize("name", ["Linear", "LayerNormMLP"])
def test_a_fresh_state_compiles_after_another_recipes_step(name, how, every_step_path):
    """The same under torch.compile(fullgraph=True): the compiled steps of the module built for
    its recipe run (no history to resize), bit for bit the eager steps of the directly built
    module (aot_eager runs the same kernels)."""
    if every_step_path == "python_path":
        pytest.skip("a compiled step runs the Python path in both")
    expected_model = build(name, recipe=BUILT_FOR)
    model = fresh_again(name, how, BUILT_FOR)
    another_models_step()
    backend, graphs = counting_aot_eager()
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    assert_bit_identical(train_steps(name, model, BUILT_FOR, run=compiled),
                         train_steps(name, expected_model, BUILT_FOR))
    assert len(graphs) == 1, f"recompiled: {len(graphs)} graphs"


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("name", NAMES)
def test_state_buffers_assigned_off_meta_start_fresh(name, recipe):
    """Buffers materialised by assignment (``setattr(module, name, torch.empty_like(buffer,
    device=...))``, as transformers' from_pretrained does for the keys its checkpoint lacks):
    the fresh state of a directly built module, which the module trains as."""
    expected_model = build(name, recipe=recipe)
    with torch.device("meta"):
        model = build(name, recipe=recipe)
    with uninitialised_memory_is_nan():
        for key, value in list(model.named_parameters()) + list(model.named_buffers()):
            owner, _, leaf = key.rpartition(".")
            placeholder = torch.empty_like(value, device="cpu")
            if isinstance(value, torch.nn.Parameter):
                placeholder = torch.nn.Parameter(placeholder)
            setattr(model.get_submodule(owner), leaf, placeholder)
    copy_parameters(model, expected_model)
    assert_same_state(model, expected_model)
    assert_bit_identical(train_steps(name, model, recipe),
                         train_steps(name, expected_model, recipe))


def test_a_partly_loaded_state_off_meta_starts_fresh_with_a_warning():
    """Part of the FP8 state loaded by assignment (marked loaded, as transformers marks them)
    and the rest missing: an incomplete state (a scale without its scale_inv), which starts
    fresh as a whole, with a warning naming what was loaded."""
    expected_model = build("Linear", recipe=BUILT_FOR)
    trained = build("Linear", recipe=BUILT_FOR)
    train_steps("Linear", trained, BUILT_FOR)
    model = build("Linear", recipe=BUILT_FOR, device="meta")
    for key in ("weight", "bias"):
        setattr(model, key, torch.nn.Parameter(getattr(expected_model, key).detach().clone()))
    with uninitialised_memory_is_nan(), pytest.warns(
            UserWarning, match="fp8_fwd_scale loaded and the rest missing"):
        for key, value in model.named_buffers():
            if key == "fp8_fwd_scale":
                placeholder = trained.fp8_fwd_scale.clone()
                placeholder._is_hf_initialized = True
            else:
                placeholder = torch.empty_like(value, device="cpu")
            setattr(model, key, placeholder)
    assert_same_state(model, expected_model)


@pytest.mark.parametrize("corruption", ["nan_scale", "unpaired_scale"])
def test_a_corrupt_state_loaded_by_assignment_is_refused(corruption):
    """Every FP8 buffer assigned its loaded value (transformers' from_pretrained marks them
    loaded): checked as load_state_dict checks a state (a NaN scale loaded this way gave a
    NaN first step, with no error)."""
    trained = build("Linear", recipe=BUILT_FOR)
    train_steps("Linear", trained, BUILT_FOR)
    loaded = {key: value.clone() for key, value in trained.named_buffers()}
    if corruption == "nan_scale":
        loaded["fp8_fwd_scale"][0] = float("nan")
    else:
        loaded["fp8_bwd_scale"] *= 4  # (no longer 1 / scale_inv)
    model = build("Linear", recipe=BUILT_FOR, device="meta")
    with pytest.raises(RuntimeError, match="FP8 state as loaded from the checkpoint .*invalid: "
                                           "fp8_(fwd|bwd)_scale"):
        for key, value in loaded.items():
            value._is_hf_initialized = True
            setattr(model, key, value)


@contextlib.contextmanager
def empty_parameters():
    """accelerate's init_empty_weights(include_buffers=False), its default: each parameter is
    put on "meta" as it is registered; buffers are made where they would be (the CPU)."""
    register = torch.nn.Module.register_parameter

    def on_meta(module, name, param):
        register(module, name, param)
        if param is not None:
            param = module._parameters[name]
            module._parameters[name] = type(param)(param.to("meta"), **param.__dict__)

    torch.nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def set_parameters(module, src) -> None:
    """accelerate's set_module_tensor_to_device for each parameter: a new Parameter written
    into its module's _parameters (no setattr, no buffer touched)."""
    for name, value in src.named_parameters():
        owner, _, leaf = name.rpartition(".")
        owner = module.get_submodule(owner)
        owner._parameters[leaf] = torch.nn.Parameter(value.detach().clone(),
                                                     requires_grad=value.requires_grad)


@pytest.mark.parametrize("then", ["train", "to_cpu", "state_dict"])
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("name", NAMES)
def test_parameters_materialised_alone_get_a_fresh_state(name, recipe, then):
    """Built with only its parameters on "meta" and then given them (the FP8 state followed the
    weight there): the first FP8 forward, a device move (model.to("cpu"), which could not copy
    out of "meta") or state_dict() makes the fresh state on the parameters' device, and the
    module trains as one built directly."""
    expected_model = build(name)
    with empty_parameters():
        model = build(name)
    assert all(p.is_meta for p in model.parameters())
    set_parameters(model, expected_model)
    if then == "to_cpu":
        model.to("cpu")
    elif then == "state_dict":
        assert_same_state(model, expected_model)
    assert_bit_identical(train_steps(name, model, recipe),
                         train_steps(name, expected_model, recipe))
    assert not any(b.is_meta for b in model.buffers())


def test_parameters_materialised_alone_are_refused_clearly_under_compile(every_step_path):
    """Under torch.compile the FP8 state cannot be made in the trace: the error says why and
    what to do."""
    if every_step_path == "python_path":
        pytest.skip("the same compiled path")
    with empty_parameters():
        model = build("Linear")
    set_parameters(model, build("Linear"))
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match=r"FP8 state is on \"meta\" while its parameters are on "
                                        r"cpu.*call model.to\(device\)"):
        with fp8_autocast(fp8_recipe=BUILT_FOR):
            compiled(torch.randn(8, H))
    model.to("cpu")  # what the error says
    torch._dynamo.reset()
    with fp8_autocast(fp8_recipe=BUILT_FOR):
        compiled(torch.randn(8, H)).sum().backward()
    assert torch.isfinite(model.fp8_fwd_scale).all()


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("name", NAMES)
def test_module_type_keeps_the_fp8_state_types(name, recipe):
    """Module.type(torch.bfloat16) casts every tensor, integers included: the FP8 state stays
    float32 and its recipe record int64, as under .bfloat16(); the module trains as one cast
    with .bfloat16() and its state_dict loads."""
    expected_model = build(name, recipe=recipe).bfloat16()
    model = build(name, recipe=recipe).type(torch.bfloat16)
    assert_same_state(model, expected_model)
    assert_bit_identical(train_steps(name, model, recipe, dtype=torch.bfloat16),
                         train_steps(name, expected_model, recipe, dtype=torch.bfloat16))
    model.load_state_dict(model.state_dict())
