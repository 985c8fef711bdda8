"""Transformer Engine 2.x spellings: autocast(enabled, recipe, amax_reduction_group),
quantized_model_init (and 1.x's fp8_model_init), is_fp8_available() and its siblings, and
get_default_recipe()."""
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
def test_is_fp8_available_returns_a_bool_or_a_reason():
    """Transformer Engine 2.x's spelling: a bool (so `if tfp8.is_fp8_available():` tests what
    it says; a (bool, reason) tuple was always true), the reason with return_reason=True."""
    available, reason = tfp8.is_fp8_available(return_reason=True)
    assert isinstance(available, bool) and isinstance(reason, str)
    assert tfp8.is_fp8_available() is available
    if not torch.cuda.is_available():
        assert not available and "CUDA" in reason
    elif torch.cuda.get_device_capability() >= (8, 9) and tfp8.build_info()["cuda"]:
        assert available and reason == ""
    else:
        assert not available and reason
    with pytest.raises(TypeError, match="return_reason must be a bool"):
        tfp8.is_fp8_available("yes")


@pytest.mark.parametrize("name", ["is_fp8_available", "is_fp8_block_scaling_available",
                                  "is_mxfp8_available", "is_nvfp4_available",
                                  "is_bf16_available"])
def test_availability_answers_agree_with_their_reasons(name):
    check = getattr(tfp8, name)
    available, reason = check(return_reason=True)
    assert check() is available and check(False) is available
    assert (reason == "") == available, reason
    if name in ("is_mxfp8_available", "is_nvfp4_available"):
        assert not available and "no " in reason and "recipe" in reason


class _FakeDevice:
    """A CUDA device of the given compute capability and a build for the given archs, as the
    availability checks see them."""

    def __init__(self, monkeypatch, capability, archs=("8.9", "9.0"), cuda_version="13.0",
                 cuda=True):
        from transformer_fp8 import availability

        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "FakeGPU")
        monkeypatch.setattr(availability, "build_info", lambda: {
            "cuda": cuda, "cuda_archs": list(archs), "cuda_version": cuda_version})


@pytest.mark.parametrize("capability,archs,cuda_version,fp8,block", [
    ((9, 0), ("8.9", "9.0"), "13.0", True, True),          # Hopper, the default build
    ((8, 9), ("8.9", "9.0"), "13.0", True, False),         # Ada: no block-scaled GEMM
    ((8, 6), ("8.6", "8.9"), "13.0", False, False),        # Ampere: no FP8 tensor cores
    ((10, 0), ("8.9", "9.0"), "13.0", False, False),       # Blackwell, no kernels built for it
    ((10, 0), ("8.9", "9.0+PTX"), "13.0", True, True),     # ... PTX the driver compiles
    ((9, 0), ("8.9",), "13.0", False, False),              # sm_89 machine code: not on 9.0
    ((12, 1), ("12.0",), "13.0", True, True),              # same major, higher minor
    ((9, 0), ("8.9", "9.0"), "12.8", True, False),         # built before cuBLASLt 12.9
    ((9, 0), ("9.0a",), "13.0", True, True),               # arch-specific: that one only
    ((10, 0), ("9.0a",), "13.0", False, False),
    ((9, 0), ("8.9 9.0",), "13.0", True, True),            # torch's other spellings
    ((9, 0), ("Hopper",), "13.0", True, True),
    ((10, 3), ("10.0f",), "13.0", True, True),             # family-specific
    ((9, 0), ("sm_90",), "13.0", False, False),            # not understood: not claimed
])
def test_availability_follows_device_and_build(monkeypatch, capability, archs, cuda_version,
                                               fp8, block):
    _FakeDevice(monkeypatch, capability, archs, cuda_version)
    assert tfp8.is_fp8_available() is fp8
    assert tfp8.is_fp8_block_scaling_available() is block
    assert tfp8.get_device_compute_capability() == capability
    assert tfp8.is_bf16_available() is (capability >= (8, 0))
    if not fp8:
        reason = tfp8.is_fp8_available(return_reason=True)[1]
        assert ("compute capabilit" in reason), reason
    if fp8 and not block:
        reason = tfp8.is_fp8_block_scaling_available(return_reason=True)[1]
        assert "9.0" in reason or "12.9" in reason, reason


def test_availability_of_a_cpu_only_build(monkeypatch):
    _FakeDevice(monkeypatch, (9, 0), cuda=False)
    available, reason = tfp8.is_fp8_available(return_reason=True)
    assert not available and "without its CUDA kernels" in reason
    assert not tfp8.is_fp8_block_scaling_available()


def test_get_default_recipe_is_fp8_autocasts_default():
    """The recipe fp8_autocast() takes when given none: a layer's FP8 state after a step under
    each is the same."""
    assert isinstance(tfp8.get_default_recipe(), DelayedScaling)
    torch.manual_seed(0)
    a, b = tfp8.Linear(32, 16), tfp8.Linear(32, 16)
    b.load_state_dict(a.state_dict())
    x = torch.randn(8, 32)
    for layer, kwargs in ((a, {}), (b, {"fp8_recipe": tfp8.get_default_recipe()})):
        with tfp8.fp8_autocast(**kwargs):
            layer(x).sum().backward()
    for key, value in a.state_dict().items():
        assert torch.equal(value, b.state_dict()[key]), key


def test_get_device_compute_capability_says_when_there_is_no_device():
    if torch.cuda.is_available():
        assert tfp8.get_device_compute_capability() == torch.cuda.get_device_capability()
    else:
        with pytest.raises(RuntimeError, match="no CUDA device is available"):
            tfp8.get_device_compute_capability()
