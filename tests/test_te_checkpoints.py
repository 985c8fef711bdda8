"""Checkpoints written by Transformer Engine load after `import transformer_fp8 as te`: its
parameter names, and the FP8 state in its ``_extra_state`` entries (written here the way it
writes them, without Transformer Engine installed)."""
from __future__ import annotations

import enum
import pickle
import sys
import types
import warnings
from dataclasses import dataclass
from typing import NamedTuple

import pytest
import torch

import transformer_fp8 as te
from transformer_fp8 import DelayedScaling


# ---- 7. checkpoints written by Transformer Engine -------------------------------------------

class _FormatHelper(NamedTuple):
    max_fwd: float
    max_bwd: float


class Format(enum.Enum):
    E4M3 = _FormatHelper(max_fwd=448, max_bwd=448)
    E5M2 = _FormatHelper(max_fwd=57344, max_bwd=57344)
    HYBRID = _FormatHelper(max_fwd=448, max_bwd=57344)


@dataclass
class DelayedScalingTE:
    margin: int = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"
    scaling_factor_compute_algo: object = None
    reduce_amax: bool = True
    fp8_dpa: bool = False
    fp8_mha: bool = False


@dataclass
class Float8CurrentScalingTE:
    fp8_format: Format = Format.HYBRID


def te_extra_state(state: dict) -> torch.Tensor:
    """What a Transformer Engine module writes as ``_extra_state``: the pickled dict in a uint8
    tensor, its recipe an object of transformer_engine.common.recipe (classes of that module
    path and structure, registered only while pickling: loading must not need them)."""
    module = types.ModuleType("transformer_engine.common.recipe")
    names = {"_FormatHelper": _FormatHelper, "Format": Format,
             "DelayedScaling": DelayedScalingTE, "Float8CurrentScaling": Float8CurrentScalingTE}
    saved = {cls: (cls.__module__, cls.__qualname__) for cls in names.values()}
    for name, cls in names.items():
        cls.__module__, cls.__qualname__ = module.__name__, name
        setattr(module, name, cls)
    packages = {"transformer_engine": types.ModuleType("transformer_engine"),
                "transformer_engine.common": types.ModuleType("transformer_engine.common"),
                module.__name__: module}
    assert not set(packages) & set(sys.modules), "Transformer Engine itself is imported"
    sys.modules.update(packages)
    try:
        data = pickle.dumps(state)
    finally:
        for name in packages:
            del sys.modules[name]
        for cls, (mod, qual) in saved.items():
            cls.__module__, cls.__qualname__ = mod, qual
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def test_a_transformer_engine_checkpoint_loads_with_its_fp8_state():
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    length = 8
    te_state = {"recipe": DelayedScalingTE(margin=1, amax_history_len=length),
                "scale_fwd": torch.rand(6, generator=gen) + 1,
                "amax_history_fwd": torch.rand(length, 6, generator=gen),
                "scale_bwd": torch.rand(4, generator=gen) + 1,
                "amax_history_bwd": torch.rand(length, 4, generator=gen),
                "extra_fp8_variables": {"num_gemms": 2, "fp8_checkpoint": True}}
    # Slot 1 (GRAD_INPUT1) is one this version's LayerNormMLP never records into.
    te_state["scale_bwd"][1], te_state["amax_history_bwd"][:, 1] = 1.0, 0.0
    source = te.LayerNormMLP(32, 64)
    checkpoint = te.strip_fp8_state(source.state_dict())
    checkpoint["_extra_state"] = te_extra_state(te_state)
    assert "transformer_engine.common.recipe" not in sys.modules
    module = te.LayerNormMLP(32, 64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not module.load_state_dict(checkpoint, strict=True).missing_keys
    assert torch.equal(module.fc1_weight, source.fc1_weight)
    fwd, bwd = [0, 1, 3, 4], [0, 2]  # TE: 3 forward / 2 backward slots per GEMM
    assert torch.equal(module.fp8_fwd_amax_history, te_state["amax_history_fwd"][:, fwd])
    assert torch.equal(module.fp8_bwd_amax_history, te_state["amax_history_bwd"][:, bwd])
    assert torch.equal(module.fp8_fwd_scale, te_state["scale_fwd"][fwd])
    assert torch.equal(module.fp8_fwd_scale_inv, te_state["scale_fwd"][fwd].reciprocal())
    assert torch.equal(module.fp8_bwd_scale, te_state["scale_bwd"][bwd])
    assert module.fp8_recipe_fields.tolist() == [1, 2, length, 0]
    # The next FP8 step casts with the loaded scales (its output equals one from a module
    # given the same state our way).
    ours = te.LayerNormMLP(32, 64)
    ours.load_state_dict(module.state_dict())
    x = torch.randn(16, 32)
    recipe = DelayedScaling(margin=1, amax_history_len=length)
    with te.fp8_autocast(fp8_recipe=recipe):
        assert torch.equal(module(x), ours(x))


def test_transformer_engine_extra_state_that_does_not_map_is_ignored_with_a_warning():
    layer = te.Linear(32, 16)
    checkpoint = te.strip_fp8_state(layer.state_dict())
    # A stateless recipe's payload (Float8CurrentScaling's) has nothing to load: no warning.
    fresh = te.Linear(32, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fresh.load_state_dict({**checkpoint, "_extra_state": te_extra_state(
            {"recipe": Float8CurrentScalingTE(), "extra_fp8_variables": {}})}, strict=True)
    cases = {"not that of 1 GEMM": te_extra_state(
                 {"recipe": DelayedScalingTE(), "scale_fwd": torch.ones(6),
                  "amax_history_fwd": torch.ones(4, 6), "scale_bwd": torch.ones(4),
                  "amax_history_bwd": torch.ones(4, 4)}),
             "could not be read": torch.tensor([1, 2, 3], dtype=torch.uint8)}
    for reason, extra in cases.items():
        fresh = te.Linear(32, 16)
        with pytest.warns(UserWarning, match=reason):
            fresh.load_state_dict({**checkpoint, "_extra_state": extra}, strict=True)
        assert torch.all(fresh.fp8_fwd_scale == 1) and torch.all(fresh.fp8_fwd_amax_history == 0)
    # (A payload that would run code: test_te_checkpoint_formats.py.)


def test_a_transformer_engine_transformer_layer_checkpoint_loads():
    torch.manual_seed(0)
    source = te.TransformerLayer(64, 128, 4, num_gqa_groups=2, normalization="RMSNorm",
                                 activation="swiglu", bias=False)
    checkpoint = te.strip_fp8_state(source.state_dict())
    empty = torch.empty(0, dtype=torch.uint8)  # modules that never ran in FP8
    for prefix in ("self_attention.layernorm_qkv.", "self_attention.proj.",
                   "self_attention.core_attention.", "layernorm_mlp."):
        checkpoint[prefix + "_extra_state"] = empty
    layer = te.TransformerLayer(64, 128, 4, num_gqa_groups=2, normalization="RMSNorm",
                                activation="swiglu", bias=False)
    layer.load_state_dict(checkpoint, strict=True)
    x = torch.randn(6, 2, 64)
    assert torch.equal(layer.eval()(x), source.eval()(x))


# ---- the slots of LayerNormMLP and GroupedLinear moved between Transformer Engine versions ----

# Where each Transformer Engine version keeps our columns: forward (each GEMM's input, weight),
# backward (each GEMM's grad_output), in states of 3 forward and 2 backward slots per GEMM.
def _by_gemm(n):
    return [c for g in range(n) for c in (3 * g, 3 * g + 1)], [2 * g for g in range(n)]


def _by_role(n):
    return [c for g in range(n) for c in (g, n + g)], list(range(n))


LAYOUTS = {
    # LayerNormMLP: fc1's and fc2's grad_output in GRAD_OUTPUT2 / GRAD_OUTPUT1 (1.x),
    # GRAD_INPUT1 / GRAD_OUTPUT1 (2.0-2.3), GRAD_OUTPUT1 / GRAD_OUTPUT2 (2.4 on).
    "mlp-1.x": ("mlp", True, lambda n: (_by_gemm(n)[0], [2, 0])),
    "mlp-2.0-2.3": ("mlp", False, lambda n: (_by_gemm(n)[0], [1, 0])),
    "mlp-2.4+": ("mlp", False, _by_gemm),
    # GroupedLinear: slots by role up to 2.2, by GEMM from 2.3.
    "grouped-1.x": ("grouped", True, _by_role),
    "grouped-2.0-2.2": ("grouped", False, _by_role),
    "grouped-2.3+": ("grouped", False, _by_gemm),
}


def _trained(kind, length):
    """A module after three FP8 steps (every scale moved), its state, and a step function."""
    torch.manual_seed(0)
    recipe = DelayedScaling(amax_history_len=length)
    if kind == "mlp":
        module, gemms = te.LayerNormMLP(32, 64), 2
        def step(m, x):
            with te.fp8_autocast(fp8_recipe=recipe):
                out = m(x)
            (out * 100).square().sum().backward()  # grad_outputs far from 1
            return out
    else:
        module, gemms = te.GroupedLinear(3, 32, 16), 3
        def step(m, x):
            with te.fp8_autocast(fp8_recipe=recipe):
                out = m(x, [8, 16, 8])
            (out * 100).square().sum().backward()
            return out
    for i in range(3):
        step(module, torch.randn(32, 32) * (i + 1))
    return module, gemms, step


def _te_state(module, gemms, layout, te_1x, length):
    """The module's state as that Transformer Engine version writes it: every slot no GEMM
    records into at scale 1 with an empty history."""
    fwd, bwd = layout
    state = {"scale_fwd": torch.ones(3 * gemms), "amax_history_fwd": torch.zeros(length, 3 * gemms),
             "scale_bwd": torch.ones(2 * gemms), "amax_history_bwd": torch.zeros(length, 2 * gemms),
             "extra_fp8_variables": {"num_gemms": gemms}}
    state["scale_fwd"][fwd] = module.fp8_fwd_scale
    state["amax_history_fwd"][:, fwd] = module.fp8_fwd_amax_history
    state["scale_bwd"][bwd] = module.fp8_bwd_scale
    state["amax_history_bwd"][:, bwd] = module.fp8_bwd_amax_history
    if te_1x:  # 1.x: scale_inv too, no recipe
        state["scale_inv_fwd"] = state["scale_fwd"].reciprocal()
        state["scale_inv_bwd"] = state["scale_bwd"].reciprocal()
    else:
        state["recipe"] = DelayedScalingTE(amax_history_len=length)
    return state


@pytest.mark.parametrize("version", list(LAYOUTS))
def test_layernorm_mlp_and_grouped_linear_checkpoints_of_every_version_load(version):
    """A trained module's FP8 state, written in the layout of each Transformer Engine version,
    loads back bit for bit (no warning), and the next step is bit for bit the trained one's."""
    kind, te_1x, layout_of = LAYOUTS[version]
    length = 8
    source, gemms, step = _trained(kind, length)
    assert torch.all(source.fp8_bwd_scale != 1) and torch.all(source.fp8_fwd_scale != 1)
    checkpoint = te.strip_fp8_state(source.state_dict())
    checkpoint["_extra_state"] = te_extra_state(
        _te_state(source, gemms, layout_of(gemms), te_1x, length))
    module = type(source)(*((32, 64) if kind == "mlp" else (3, 32, 16)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        module.load_state_dict(checkpoint, strict=True)
    for name in ("fp8_fwd_amax_history", "fp8_fwd_scale", "fp8_fwd_scale_inv",
                 "fp8_bwd_amax_history", "fp8_bwd_scale", "fp8_bwd_scale_inv"):
        assert torch.equal(getattr(module, name), getattr(source, name)), name
    x = torch.randn(32, 32)
    source.zero_grad()
    assert torch.equal(step(module, x), step(source, x))
    for (name, p), q in zip(module.named_parameters(), source.parameters()):
        assert torch.equal(p.grad, q.grad), name


@pytest.mark.parametrize("case", ["both_slots", "one_slot"])
def test_a_layernorm_mlp_state_of_no_certain_version_is_ignored_with_a_warning(case):
    """A 2.x LayerNormMLP state whose recorded backward slots fit neither 2.x layout (both
    GRAD_INPUT1 and GRAD_OUTPUT2), or fit both with different values (only GRAD_OUTPUT1: fc2's
    grad_output up to 2.3, fc1's after), is ignored with a warning: the module keeps a fresh
    state."""
    length = 4
    source, gemms, _ = _trained("mlp", length)
    state = _te_state(source, gemms, _by_gemm(gemms), False, length)
    if case == "both_slots":
        state["scale_bwd"][1], state["amax_history_bwd"][0, 1] = 3.0, 2.0
        reason = "fit no layout"
    else:
        state["scale_bwd"][2], state["amax_history_bwd"][:, 2] = 1.0, 0.0
        reason = "cannot be told"
    checkpoint = te.strip_fp8_state(source.state_dict())
    checkpoint["_extra_state"] = te_extra_state(state)
    module = te.LayerNormMLP(32, 64)
    with pytest.warns(UserWarning, match=reason):
        module.load_state_dict(checkpoint, strict=True)
    assert torch.all(module.fp8_fwd_scale == 1) and torch.all(module.fp8_bwd_amax_history == 0)


@pytest.mark.parametrize("bad", ["zero_scale", "nan_scale", "negative_scale", "negative_amax"])
def test_a_corrupt_transformer_engine_state_is_refused_naming_it(bad):
    """A Transformer Engine state that maps but holds a scale that is zero, NaN or negative (or
    a negative amax) is refused as a corrupt checkpoint of ours is: load_state_dict raises,
    naming the entry, and the module keeps its FP8 state."""
    length = 4
    state = {"recipe": DelayedScalingTE(amax_history_len=length),
             "scale_fwd": torch.tensor([2.0, 3.0, 1.0]), "amax_history_fwd": torch.rand(length, 3),
             "scale_bwd": torch.tensor([5.0, 1.0]), "amax_history_bwd": torch.rand(length, 2),
             "extra_fp8_variables": {"num_gemms": 1}}
    state["amax_history_bwd"][:, 1] = 0.0
    if bad == "negative_amax":
        state["amax_history_fwd"][2, 1] = -1.0
    else:
        state["scale_fwd"][0] = {"zero_scale": 0.0, "nan_scale": float("nan"),
                                 "negative_scale": -2.0}[bad]
    layer = te.Linear(32, 16)
    with te.fp8_autocast(fp8_recipe=DelayedScaling(amax_history_len=length)):
        layer(torch.randn(8, 32)).sum().backward()
    before = {k: v.clone() for k, v in layer.state_dict().items() if k.startswith("fp8_")}
    checkpoint = te.strip_fp8_state(layer.state_dict())
    checkpoint["_extra_state"] = te_extra_state(state)
    match = "amaxes are never negative" if bad == "negative_amax" else "finite and positive"
    with pytest.raises(RuntimeError, match=rf"Linear '\.': Transformer Engine's FP8 state "
                                           rf"\(_extra_state\) read as .*{match}"):
        layer.load_state_dict(checkpoint, strict=True)
    for key, value in before.items():
        assert torch.equal(layer.state_dict()[key], value), key


def test_a_failed_load_leaves_the_fp8_state_of_transformer_engine_extra_state_unapplied():
    """A checkpoint whose weight has the wrong shape: load_state_dict raises, and the module's
    FP8 state is as before (the extra state was applied even though the load failed)."""
    length = 4
    te_state = {"recipe": DelayedScalingTE(margin=0, amax_history_len=length),
                "scale_fwd": torch.full((3,), 2.0), "amax_history_fwd": torch.rand(length, 3),
                "scale_bwd": torch.full((2,), 3.0), "amax_history_bwd": torch.rand(length, 2),
                "extra_fp8_variables": {"num_gemms": 1, "fp8_checkpoint": True}}
    checkpoint = te.strip_fp8_state(te.Linear(32, 16).state_dict())
    checkpoint["weight"] = torch.zeros(16, 31)
    checkpoint["_extra_state"] = te_extra_state(te_state)
    module = te.Linear(32, 16)
    before = {k: v.clone() for k, v in module.state_dict().items() if "fp8_" in k}
    with pytest.raises(RuntimeError, match="size mismatch for weight"):
        module.load_state_dict(checkpoint)
    for key, value in before.items():
        assert torch.equal(module.state_dict()[key], value), key
