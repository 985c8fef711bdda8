"""The quantizer layer (quantization/quantizer.py, blockwise.py, roles.py): every recipe's
quantizer returns one operand type that dequantises to its input; the fused modules run on it
under every recipe, block-scaled ones included; a recipe is added by registering one quantizer.
"""
from __future__ import annotations

import pytest
import torch
from conftest import DEVICE_PARAMS, randn

import transformer_fp8 as tfp8
from transformer_fp8 import Float8BlockScaling, Float8CurrentScaling, Float8RowwiseScaling
from transformer_fp8.ops import fused as fused_ops
from transformer_fp8.quantization import roles
from transformer_fp8.quantization.blockwise import BlockQuantizer
from transformer_fp8.quantization.quantizer import Quantized, TensorQuantizer
from transformer_fp8.testing import sqnr

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
BLOCK_RECIPES = [pytest.param(Float8BlockScaling(), id="1x128_128x128"),
                 pytest.param(Float8BlockScaling(w_block_scaling_dim=1), id="1x128"),
                 pytest.param(Float8BlockScaling(x_block_scaling_dim=2, w_block_scaling_dim=1),
                              id="128x128_input"),
                 pytest.param(Float8RowwiseScaling(), id="rowwise")]
QUANTIZERS = [pytest.param(lambda: TensorQuantizer.current(E4M3, None), id="tensor_e4m3"),
              pytest.param(lambda: TensorQuantizer.current(E5M2, None), id="tensor_e5m2"),
              pytest.param(lambda: BlockQuantizer(1, E4M3, True), id="1x128"),
              pytest.param(lambda: BlockQuantizer(2, E4M3, False), id="128x128"),
              pytest.param(lambda: BlockQuantizer("rowwise", E5M2, True), id="rowwise")]


def dequantise(data: torch.Tensor, scale_inv: torch.Tensor, block_dims: tuple) -> torch.Tensor:
    """data * scale_inv, each scale repeated over its block (the whole tensor for (0, 0))."""
    rows, cols = data.shape
    block_rows, block_cols = block_dims
    if block_rows == 0:
        return data.float() * scale_inv.float()
    s = scale_inv.float().repeat_interleave(block_rows, 0).repeat_interleave(block_cols, 1)
    return data.float() * s[:rows, :cols]


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("make", QUANTIZERS)
def test_every_quantizer_gives_an_operand_and_its_transpose(gen, device, make):
    quantizer = make()
    rows, cols = 272, 384  # several blocks each way, a partial row block
    x = randn(gen, rows, cols, device=device) * torch.logspace(-3, 3, cols, device=device)
    q = quantizer.cast(x, with_transpose=True)
    assert isinstance(q, Quantized)
    assert q.data.shape == (rows, cols) and q.data_t.shape == (cols, rows)
    assert q.data.dtype == q.data_t.dtype == quantizer.dtype
    min_db = 14 if quantizer.dtype == E5M2 else 20
    if isinstance(quantizer, TensorQuantizer):
        assert q.scale_inv_t is q.scale_inv  # one scale for the tensor and its transpose
        assert torch.equal(q.data_t.view(torch.uint8), q.data.t().view(torch.uint8))
    assert sqnr(x, dequantise(q.data, q.scale_inv, quantizer.block_dims(cols))) >= min_db
    assert sqnr(x.t(), dequantise(q.data_t, q.scale_inv_t, quantizer.block_dims(rows))) \
        >= min_db
    without = quantizer.cast(x, with_transpose=False)
    assert without.data_t is None
    assert torch.equal(without.data.view(torch.uint8), q.data.view(torch.uint8))


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("recipe", BLOCK_RECIPES)
def test_layernorm_linear_under_block_recipes_is_linear_on_its_norm_output(gen, device,
                                                                          recipe):
    """The norm runs in the module's own autograd function (no torch composition) and its
    high-precision output is quantised as Linear would quantise it: bit for bit."""
    torch.manual_seed(3)
    m = tfp8.LayerNormLinear(256, 128, return_layernorm_output=True, device=device)
    linear = tfp8.Linear(256, 128, device=device)
    with torch.no_grad():
        linear.weight.copy_(m.weight)
        linear.bias.copy_(m.bias)
        m.layer_norm_weight.copy_(1 + 0.1 * randn(gen, 256, device=device))
    x = randn(gen, 40, 256, device=device)
    g = randn(gen, 40, 128, device=device)
    with tfp8.fp8_autocast(fp8_recipe=recipe):
        out, ln_out = m(x.requires_grad_(True))
        expected = linear(ln_out.detach())
    assert out.grad_fn.name().endswith("_LayerNormLinearFunctionBackward")
    out.backward(g)
    expected.backward(g)
    assert torch.equal(out, expected)
    assert torch.equal(m.weight.grad, linear.weight.grad)
    assert torch.equal(m.bias.grad, linear.bias.grad)
    assert x.grad is not None and torch.isfinite(x.grad).all()


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("recipe", BLOCK_RECIPES)
def test_layernorm_mlp_under_block_recipes_is_its_linears_on_its_norm_output(gen, device,
                                                                            recipe):
    """fc1, the activation and fc2 as two Linear layers around the same activation op: the
    same output and fc2 gradients, bit for bit."""
    torch.manual_seed(4)
    m = tfp8.LayerNormMLP(128, 256, activation="gelu", return_layernorm_output=True,
                          device=device)
    fc1, fc2 = tfp8.Linear(128, 256, device=device), tfp8.Linear(256, 128, device=device)
    with torch.no_grad():
        for linear, name in ((fc1, "fc1"), (fc2, "fc2")):
            linear.weight.copy_(getattr(m, f"{name}_weight"))
            linear.bias.copy_(getattr(m, f"{name}_bias"))
    x = randn(gen, 40, 128, device=device)
    g = randn(gen, 40, 128, device=device)
    with tfp8.fp8_autocast(fp8_recipe=recipe):
        out, ln_out = m(x.requires_grad_(True))
        with torch.no_grad():
            act = fused_ops.activation_fwd(fc1(ln_out), "gelu")
        expected = fc2(act)
    assert out.grad_fn.name().endswith("_LayerNormMLPFunctionBackward")
    out.backward(g)
    expected.backward(g)
    assert torch.equal(out, expected)
    assert torch.equal(m.fc2_weight.grad, fc2.weight.grad)
    assert torch.equal(m.fc2_bias.grad, fc2.bias.grad)


class _CountingQuantizer(TensorQuantizer):
    """Current scaling that counts the tensors it casts, by role."""

    casts: list = []

    def __init__(self, dtype, role):
        super().__init__(dtype)
        self.role = role

    def cast(self, x, with_transpose=True):
        _CountingQuantizer.casts.append(self.role)
        return super().cast(x, with_transpose)


class _CountingRecipe(Float8CurrentScaling):
    """A new recipe: only its quantizers are registered (roles.QUANTIZERS)."""


def _counting_quantizers(recipe, fp8_state, autocast_state):
    fmt = recipe.fp8_format
    return [(_CountingQuantizer(fmt.fwd_dtype, "input"), _CountingQuantizer(fmt.fwd_dtype,
                                                                            "weight"),
             _CountingQuantizer(fmt.bwd_dtype, "grad_output"))
            for _ in range(fp8_state._num_gemms)], None


def test_a_recipe_is_added_by_registering_its_quantizers(gen, monkeypatch):
    monkeypatch.setitem(roles.QUANTIZERS, _CountingRecipe, _counting_quantizers)
    monkeypatch.setattr(_CountingQuantizer, "casts", [])
    torch.manual_seed(5)
    layer = tfp8.Linear(64, 32)
    x = randn(gen, 24, 64)
    outs, grads = [], []
    for recipe in (_CountingRecipe(), Float8CurrentScaling()):
        layer.zero_grad()
        with tfp8.fp8_autocast(fp8_recipe=recipe):
            out = layer(x)
        out.sum().backward()
        outs.append(out)
        grads.append(layer.weight.grad.clone())
    # bias gradients come with the grad_output cast (cast_fused -> cast here: current scaling)
    assert _CountingQuantizer.casts == ["input", "weight", "grad_output"]
    assert torch.equal(outs[0], outs[1]) and torch.equal(grads[0], grads[1])


def test_a_replaced_registration_is_used_from_the_next_forward(gen, monkeypatch):
    """QUANTIZERS[Float8CurrentScaling] replaced after forwards that looked the old one up
    (registered_quantizers keeps its answers): the next forward uses the new function, and the
    old one again once it is put back."""
    monkeypatch.setattr(_CountingQuantizer, "casts", [])
    layer = tfp8.Linear(64, 32)
    x = randn(gen, 24, 64)
    recipe = Float8CurrentScaling()

    def step():
        with tfp8.fp8_autocast(fp8_recipe=recipe):
            layer(x).sum().backward()

    step()
    with monkeypatch.context() as patch:
        patch.setitem(roles.QUANTIZERS, Float8CurrentScaling, _counting_quantizers)
        step()
        assert _CountingQuantizer.casts == ["input", "weight", "grad_output"]
    step()  # the original registration again: nothing counted
    assert _CountingQuantizer.casts == ["input", "weight", "grad_output"]


def test_a_pickled_module_holds_no_quantizer(gen, tmp_path):
    """Whole-module pickles (torch.save(model)) carry the state, not the caches made from it:
    no quantizer or quantised weight, so they load whatever those classes become."""
    import pickle
    recipe = tfp8.DelayedScaling(amax_history_len=4)
    layer = tfp8.Linear(32, 32, recipe=recipe)
    x = randn(gen, 16, 32)
    with tfp8.fp8_autocast(fp8_recipe=recipe):
        layer(x, is_first_microbatch=True).sum().backward()
    assert layer._delayed_cast_cache is not None and layer._weight_cache[0] is not None
    data = pickle.dumps(layer)
    assert b"Quantizer" not in data and b"Quantized" not in data
    loaded = pickle.loads(data)
    with tfp8.fp8_autocast(fp8_recipe=recipe):
        assert torch.equal(loaded(x), layer(x))


@pytest.mark.parametrize("recipe", BLOCK_RECIPES)
def test_grouped_linear_under_block_recipes_is_a_linear_per_expert(gen, recipe):
    """Each expert's rows through Linear's function with the expert's weight, empty experts
    included: bit for bit what a Linear of that expert gives."""
    torch.manual_seed(6)
    grouped = tfp8.GroupedLinear(3, 128, 32)
    splits = [24, 0, 40]
    x = randn(gen, sum(splits), 128)
    with tfp8.fp8_autocast(fp8_recipe=recipe):
        out = grouped(x, splits)
    start = 0
    for i, rows in enumerate(splits):
        expert = tfp8.Linear(128, 32)
        with torch.no_grad():
            expert.weight.copy_(getattr(grouped, f"weight{i}"))
            expert.bias.copy_(getattr(grouped, f"bias{i}"))
        if rows:
            with tfp8.fp8_autocast(fp8_recipe=recipe):
                expected = expert(x[start:start + rows])
            assert torch.equal(out[start:start + rows], expected), f"expert {i}"
        start += rows


@pytest.mark.parametrize("recipe", BLOCK_RECIPES)
def test_layernorm_mlp_keeps_its_block_quantised_weights_across_microbatches(gen, recipe):
    torch.manual_seed(7)
    m = tfp8.LayerNormMLP(128, 256)
    x1, x2 = randn(gen, 16, 128), randn(gen, 16, 128)
    with tfp8.fp8_autocast(fp8_recipe=recipe):
        first = m(x1, is_first_microbatch=True)
        kept = [cached for cached in m._weight_cache]
        second = m(x2, is_first_microbatch=False)
        reused = list(m._weight_cache)
        fresh = m(x2)  # quantised again: the same values, the weights have not changed
    assert all(c is not None for c in kept)
    assert all(a is b for a, b in zip(reused, kept))  # reused, not quantised again
    assert torch.equal(second, fresh) and first.shape == second.shape
