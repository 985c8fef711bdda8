"""Transformer Engine 2.x spellings: autocast(enabled, recipe, amax_reduction_group),
quantized_model_init (and 1.x's fp8_model_init), and is_fp8_available()."""
from __future__ import annotations

import pytest
import torch

import transformer_fp8 as tfp8
from transformer_fp8 import DelayedScaling


def test_autocast_is_fp8_autocast_with_te2_argument_names():
    torch.manual_seed(0)
    a, b = tfp8.Linear(32, 16), tfp8.Linear(32, 16)
    b.load_state_dict(a.state_dict())
    recipe = DelayedScaling(amax_history_len=4)
    x = torch.randn(8, 32)
    with tfp8.fp8_autocast(enabled=True, fp8_recipe=recipe, fp8_group=None):
        out_a = a(x)
    with tfp8.autocast(enabled=True, recipe=recipe, amax_reduction_group=None):
        out_b = b(x)
    assert torch.equal(out_a, out_b)
    for key, value in a.state_dict().items():
        assert torch.equal(value, b.state_dict()[key]), key
    with tfp8.autocast(enabled=False):
        assert torch.equal(b(x), torch.nn.functional.linear(x, b.weight, b.bias))


@pytest.mark.parametrize("init", [tfp8.quantized_model_init, tfp8.fp8_model_init])
def test_quantized_model_init_builds_layers_for_its_recipe(init):
    recipe = DelayedScaling(amax_history_len=8, margin=1)
    with init(recipe=recipe):
        layer = tfp8.Linear(32, 16)
        converted = tfp8.convert_to_fp8(torch.nn.Sequential(torch.nn.Linear(32, 16)))[0]
        own = tfp8.Linear(32, 16, recipe=DelayedScaling(amax_history_len=4))
    for built in (layer, converted):
        assert built.fp8_fwd_amax_history.shape == (8, 2)
        assert built.fp8_recipe_fields.tolist()[:3] == [1, 2, 8]
        assert built.weight.dtype == torch.float32, "the weights' nominal dtype"
    # Built inside: an FP8 weight (Transformer Engine's meaning, test_fp8_primary_weights.py);
    # converted inside: the weight stays the high-precision Parameter it was.
    assert type(layer.weight).__name__ == "Fp8Weight"
    assert type(converted.weight) is torch.nn.Parameter
    assert own.fp8_fwd_amax_history.shape == (4, 2), "a layer's own recipe= wins"
    with init(enabled=False, recipe=recipe):
        assert tfp8.Linear(32, 16).fp8_fwd_amax_history.shape == (1024, 2)
    assert tfp8.Linear(32, 16).fp8_fwd_amax_history.shape == (1024, 2), "the context ended"
    with pytest.raises(TypeError, match="recipe must be None, a DelayedScaling"):
        with init(recipe="delayed"):
            pass


@pytest.mark.cuda_branch
def test_is_fp8_available_returns_a_reason():
    available, reason = tfp8.is_fp8_available()
    assert isinstance(available, bool) and isinstance(reason, str)
    if not torch.cuda.is_available():
        assert not available and "CUDA" in reason
    elif torch.cuda.get_device_capability() >= (8, 9) and tfp8.build_info()["cuda"]:
        assert available and reason == ""
    else:
        assert not available and reason
