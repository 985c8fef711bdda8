"""In-place changes to an FP8 module's output, as torch.nn.Linear's output takes them
(``out += residual``, ``dropout(inplace=True)``): the same values and gradients as the
out-of-place computation, on every recipe, for 2-D and 3-D inputs, rows a multiple of 16 or not.

Before, the output of every FP8 autograd function with a 3-D input or padded rows was a view of
the GEMM's result, and autograd refused any in-place change to it."""
from __future__ import annotations

import copy

import pytest
import torch
from conftest import DEVICE_PARAMS, assert_bitwise_equal, randn

import transformer_fp8 as tfp8

RECIPES = {"delayed": tfp8.DelayedScaling(amax_history_len=4),
           "current": tfp8.Float8CurrentScaling(),
           "block": tfp8.Float8BlockScaling()}
MODULES = {
    "Linear": lambda: tfp8.Linear(32, 48),
    "Linear_no_bias": lambda: tfp8.Linear(32, 48, bias=False),
    "LayerNormLinear": lambda: tfp8.LayerNormLinear(32, 48),
    "LayerNormLinear_ln_out": lambda: tfp8.LayerNormLinear(32, 48,
                                                           return_layernorm_output=True),
    "LayerNormMLP": lambda: tfp8.LayerNormMLP(32, 64),
    "GroupedLinear": None,  # takes m_splits: see test_grouped_linear_output_in_place
}
SHAPES = [(2, 16, 32), (5, 32), (32, 32), (3, 7, 32)]


def _outputs(result):
    return result if isinstance(result, tuple) else (result,)


def _step(module, x, recipe, in_place: bool, gen_seed: int, steps: int = 3):
    """A few steps (the delayed scales move); each output gets a residual added, in place or
    not, then a weighted sum is backpropagated. Returns outputs and gradients of every step."""
    gen = torch.Generator().manual_seed(gen_seed)
    results = []
    for _ in range(steps):
        x = x.detach().requires_grad_(True)
        with tfp8.fp8_autocast(fp8_recipe=recipe):
            outs = _outputs(module(x))
        total = 0
        changed = []
        for out in outs:
            residual = randn(gen, *out.shape, device=out.device)
            weight = randn(gen, *out.shape, device=out.device)
            if in_place:
                out.add_(residual)
                out.mul_(2.0)
            else:
                out = (out + residual) * 2.0
            changed.append(out.detach().clone())
            total = total + (out * weight).sum()
        total.backward()
        grads = [x.grad] + [p.grad.clone() for p in module.parameters()]
        module.zero_grad(set_to_none=True)
        results.append((changed, grads))
    return results


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("module", [m for m in MODULES if MODULES[m] is not None])
def test_output_changed_in_place_matches_out_of_place(module, recipe, shape, device, gen):
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    reference = MODULES[module]().to(device)
    tested = copy.deepcopy(reference)
    x = randn(gen, *shape, device=device)
    seed = int(torch.randint(0, 2**31, (1,), generator=gen))
    expected = _step(reference, x, RECIPES[recipe], in_place=False, gen_seed=seed)
    got = _step(tested, x, RECIPES[recipe], in_place=True, gen_seed=seed)
    for step, ((outs, grads), (ref_outs, ref_grads)) in enumerate(zip(got, expected)):
        for i, (out, ref) in enumerate(zip(outs, ref_outs)):
            assert_bitwise_equal(out, ref, f"step {step} output {i}")
        for i, (grad, ref) in enumerate(zip(grads, ref_grads)):
            assert_bitwise_equal(grad, ref, f"step {step} gradient {i}")


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_grouped_linear_output_in_place(recipe, gen):
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    reference = tfp8.GroupedLinear(2, 32, 48)
    tested = copy.deepcopy(reference)
    x = randn(gen, 40, 32)

    def run(module, in_place):
        xi = x.clone().requires_grad_(True)
        with tfp8.fp8_autocast(fp8_recipe=RECIPES[recipe]):
            out = module(xi, [24, 16])
        out = out.add_(1.0) if in_place else out + 1.0
        (out * out).sum().backward()
        return out.detach(), xi.grad

    for got, ref in zip(run(tested, True), run(reference, False)):
        assert_bitwise_equal(got, ref)
