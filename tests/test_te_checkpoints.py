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
    cases = {"recipe Float8CurrentScaling": te_extra_state(
                 {"recipe": Float8CurrentScalingTE(), "extra_fp8_variables": {}}),
             "not that of 1 GEMM": te_extra_state(
                 {"recipe": DelayedScalingTE(), "scale_fwd": torch.ones(6),
                  "amax_history_fwd": torch.ones(4, 6), "scale_bwd": torch.ones(4),
                  "amax_history_bwd": torch.ones(4, 4)}),
             "could not be read": torch.tensor([1, 2, 3], dtype=torch.uint8)}
    for reason, extra in cases.items():
        fresh = te.Linear(32, 16)
        with pytest.warns(UserWarning, match=reason):
            fresh.load_state_dict({**checkpoint, "_extra_state": extra}, strict=True)
        assert torch.all(fresh.fp8_fwd_scale == 1) and torch.all(fresh.fp8_fwd_amax_history == 0)
    # A payload that would run code is refused by the reader (and ignored with a warning).
    evil = torch.frombuffer(bytearray(pickle.dumps({"x": print})), dtype=torch.uint8)
    with pytest.warns(UserWarning, match="builtins.print is not allowed"):
        te.Linear(32, 16).load_state_dict({**checkpoint, "_extra_state": evil})


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
