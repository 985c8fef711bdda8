"""Transformer Engine's MMParams on Float8CurrentScaling and Float8BlockScaling
(fp8_gemm_fprop / fp8_gemm_dgrad / fp8_gemm_wgrad): each FP8 GEMM of Linear, LayerNormLinear,
LayerNormMLP and GroupedLinear runs with the accumulation its recipe asks for (fast
accumulation where use_split_accumulator is False). On the CPU the kernels always accumulate in
float32, so the flags are read where the GEMM operator is called, and the numbers are those of
the default recipe bit for bit."""
from __future__ import annotations

import pytest
import torch

import transformer_fp8 as tfp8
from transformer_fp8 import ops
from transformer_fp8.recipe import Float8BlockScaling, Float8CurrentScaling, MMParams

SPLIT = MMParams(use_split_accumulator=True)
FAST = MMParams(use_split_accumulator=False)
# fprop split, dgrad fast, wgrad split: fast_accum (False, True, False), every role different
# from Transformer Engine's default (True, False, False)
SWAPPED = Float8CurrentScaling(fp8_gemm_fprop=SPLIT, fp8_gemm_dgrad=FAST, fp8_gemm_wgrad=SPLIT)


def test_defaults_and_checks_are_transformer_engines():
    current, block = Float8CurrentScaling(), Float8BlockScaling()
    assert (current.fp8_gemm_fprop, current.fp8_gemm_dgrad, current.fp8_gemm_wgrad) == (
        FAST, SPLIT, SPLIT)
    assert (block.fp8_gemm_fprop, block.fp8_gemm_dgrad, block.fp8_gemm_wgrad) == (
        SPLIT, SPLIT, SPLIT)
    assert MMParams() == SPLIT
    with pytest.raises(ValueError, match="use_split_accumulator must be True or False"):
        MMParams(use_split_accumulator=1)
    with pytest.raises(TypeError, match="fp8_gemm_dgrad must be an MMParams, got bool"):
        Float8CurrentScaling(fp8_gemm_dgrad=True)
    with pytest.raises(ValueError, match="fp8_gemm_wgrad=MMParams.use_split_accumulator=False. "
                                         "is not supported"):
        Float8BlockScaling(fp8_gemm_wgrad=FAST)
    assert SWAPPED != current and hash(SWAPPED) != hash(current)


class _Recorded:
    """ops.fp8_gemm's use_fast_accum per call, with the output's shape."""

    def __init__(self, monkeypatch):
        self.calls = []
        inner = ops.fp8_gemm

        def gemm(a, a_scale_inv, b, b_scale_inv, out_dtype, bias=None, use_fast_accum=False):
            out = inner(a, a_scale_inv, b, b_scale_inv, out_dtype, bias, use_fast_accum)
            self.calls.append((tuple(out.shape), use_fast_accum))
            return out
        monkeypatch.setattr(ops, "fp8_gemm", gemm)


def _modules():
    torch.manual_seed(0)
    return {"Linear": tfp8.Linear(32, 48),
            "LayerNormLinear": tfp8.LayerNormLinear(32, 48),
            "LayerNormMLP": tfp8.LayerNormMLP(32, 48),
            "GroupedLinear": tfp8.GroupedLinear(2, 32, 48)}


def _step(module, recipe, x, first_microbatch=None):
    x = x.clone().requires_grad_()
    extra = ([8, 8],) if isinstance(module, tfp8.GroupedLinear) else ()
    kwargs = {} if first_microbatch is None else {"is_first_microbatch": first_microbatch}
    with tfp8.fp8_autocast(fp8_recipe=recipe):
        out = module(x, *extra, **kwargs)
    out.backward(torch.linspace(-1, 1, out.numel()).reshape(out.shape))
    return [out, x.grad] + [p.grad for p in module.parameters()]


# The GEMMs by output shape (M = 16 rows; GroupedLinear's 8-row blocks padded to 16).
ROLES = {(16, 48): "fprop", (16, 32): "dgrad", (48, 32): "wgrad"}


@pytest.mark.parametrize("name", ["Linear", "LayerNormLinear", "LayerNormMLP", "GroupedLinear"])
@pytest.mark.parametrize("recipe,expected", [
    (SWAPPED, {"fprop": False, "dgrad": True, "wgrad": False}),
    (Float8CurrentScaling(), {"fprop": True, "dgrad": False, "wgrad": False}),
], ids=["swapped", "default"])
def test_each_gemm_accumulates_as_its_recipe_asks(monkeypatch, name, recipe, expected):
    """(The default recipe through the Python path, is_first_microbatch=True: its C++ steps
    call the GEMM from C++.)"""
    module, reference = _modules()[name], _modules()[name]
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(1))
    recorded = _Recorded(monkeypatch)
    got = _step(module, recipe, x, first_microbatch=True)
    if name == "LayerNormMLP":  # fc1 (32 -> 48) and fc2 (48 -> 32): 2 forward, 4 backward
        assert len(recorded.calls) == 6
        assert [fast for _, fast in recorded.calls[:2]] == [expected["fprop"]] * 2
        backward = [(shape, fast) for shape, fast in recorded.calls[2:]]
        wgrads = [fast for shape, fast in backward if shape in ((32, 48), (48, 32))]
        dgrads = [fast for shape, fast in backward if shape in ((16, 48), (16, 32))]
        assert wgrads == [expected["wgrad"]] * 2 and dgrads == [expected["dgrad"]] * 2
    else:
        roles = [ROLES[shape] for shape, _ in recorded.calls]
        assert sorted(set(roles)) == ["dgrad", "fprop", "wgrad"], recorded.calls
        for (shape, fast), role in zip(recorded.calls, roles):
            assert fast is expected[role], (role, shape)
    monkeypatch.undo()
    default = _step(reference, Float8CurrentScaling(), x)  # (the C++ steps)
    for a, b in zip(got, default):
        assert torch.equal(a, b), "the CPU accumulates in float32 either way"


def test_other_gemm_params_take_the_python_path(monkeypatch):
    """The C++ steps run Transformer Engine's default accumulation; a recipe asking for other
    MMParams runs the Python path, whose GEMMs take them."""
    from transformer_fp8.modules import linear_fused_step
    layer = _modules()["Linear"]
    x = torch.randn(16, 32)
    state = type("State", (), {"recipe": SWAPPED})()
    assert linear_fused_step._runs_fused(layer, state, None) is None
    state.recipe = Float8CurrentScaling()
    assert linear_fused_step._runs_fused(layer, state, None) is False  # (its C++ step)
    recorded = _Recorded(monkeypatch)
    _step(layer, SWAPPED, x)
    assert len(recorded.calls) == 3
