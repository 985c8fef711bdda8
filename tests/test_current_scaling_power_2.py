"""Float8CurrentScaling(use_power_2_scales=True), Transformer Engine's power-of-two current
scales (also from NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES=1): every scale fp8_max / amax with
its mantissa bits cleared. A Linear's forward is the FP8 GEMM of its operands cast with those
scales, bit for bit; LayerNormMLP and FP8 primary weights cast with them too; C++ steps are
not taken; FSDP2 gathers such weights in high precision."""
from __future__ import annotations

import pytest
import torch

import transformer_fp8 as tfp8
from transformer_fp8 import ops
from transformer_fp8.quantization.quantizer import TensorQuantizer, power_2_floor

POW2 = tfp8.Float8CurrentScaling(use_power_2_scales=True)
E4M3 = torch.float8_e4m3fn


def test_power_2_floor_clears_the_mantissa_exactly():
    values = torch.tensor([1.0, 1.5, 3.999, 448.0, 2.0 ** -100, 3.4e38, 1e-38 * 3],
                          dtype=torch.float32)
    out = power_2_floor(values)
    assert torch.equal(out, torch.exp2(torch.floor(torch.log2(values.double()))).float())
    assert ((out <= values) & (out * 2 > values)).all()


def test_the_quantizer_casts_with_the_power_2_scale():
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(0)) * 3
    q = TensorQuantizer.current(E4M3, power_2=True).cast(x, with_transpose=False)
    own = ops.compute_scale_from_amax(ops.amax(x).reshape(1), 448.0)
    assert torch.equal(q.scale, power_2_floor(own)) and not torch.equal(q.scale, own)
    assert torch.equal(q.data.view(torch.uint8),
                       ops.cast_to_fp8(x, q.scale, E4M3).view(torch.uint8))
    assert torch.equal(q.scale_inv, 1.0 / q.scale)


def test_a_linear_forward_is_the_gemm_of_its_power_2_casts():
    torch.manual_seed(0)
    layer = tfp8.Linear(64, 32)
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(1)) * 3
    with tfp8.fp8_autocast(fp8_recipe=POW2):
        out = layer(x)
    quantizer = TensorQuantizer.current(E4M3, power_2=True)
    x_q = quantizer.cast(x, with_transpose=False)
    w_q = quantizer.cast(layer.weight.detach(), with_transpose=False)
    expected = ops.fp8_gemm(x_q.data, x_q.scale_inv, w_q.data, w_q.scale_inv, torch.float32,
                            bias=layer.bias.detach())
    assert torch.equal(out, expected)
    with tfp8.fp8_autocast(fp8_recipe=tfp8.Float8CurrentScaling()):
        plain = layer(x)
    assert not torch.equal(out, plain)  # (other scales: other FP8 values)


@pytest.mark.parametrize("make", [lambda: tfp8.Linear(64, 64),
                                  lambda: tfp8.LayerNormMLP(64, 128)],
                         ids=["Linear", "LayerNormMLP"])
def test_training_steps_close_to_high_precision(make):
    """Forward and backward (grad_output cast with power-of-two E5M2 scales) within FP8's
    error of high precision."""
    from conftest import sqnr
    torch.manual_seed(0)
    module = make()
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(2), requires_grad=True)
    reference = module(x)
    grad = torch.randn(reference.shape, generator=torch.Generator().manual_seed(3))
    ref_grads = torch.autograd.grad(reference, [x, *module.parameters()], grad)
    with tfp8.fp8_autocast(fp8_recipe=POW2):
        out = module(x)
    grads = torch.autograd.grad(out, [x, *module.parameters()], grad)
    assert sqnr(out, reference) > 20
    for got, expected in zip(grads, ref_grads):
        assert sqnr(got, expected) > 15


def test_fp8_primary_weights_take_power_2_scales():
    """A weight held in FP8 (quantized_model_init) is cast with the power-of-two scale of its
    own amax, at construction and when written."""
    with tfp8.quantized_model_init(recipe=POW2):
        layer = tfp8.Linear(64, 64)
    for _ in range(2):
        scale = 1.0 / layer.weight.fp8_scale_inv.reshape(1)
        assert torch.equal(scale, power_2_floor(scale))
        # (the largest power of two that does not saturate: amax * scale in (224, 448], up
        # to the FP8 rounding of the largest element, which the dequantised amax holds)
        reach = (ops.amax(layer.weight.dequantize()) * scale).item()
        assert 448 / 2 * 0.9 < reach <= 448
        with torch.no_grad():
            layer.weight.copy_(torch.randn(64, 64) * 5)


def test_the_environment_variable_turns_it_on(monkeypatch):
    monkeypatch.setenv("NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES", "1")
    assert tfp8.Float8CurrentScaling().use_power_2_scales is True
    assert tfp8.Float8CurrentScaling() != tfp8.Float8CurrentScaling(use_power_2_scales=False)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_forward_and_gradients_are_eagers(backend):
    """The mantissa mask (an integer view of the scales) under torch.compile: output and
    gradients bit for bit eager's."""
    torch.manual_seed(0)
    layer = tfp8.Linear(64, 64)
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(4), requires_grad=True)
    with tfp8.fp8_autocast(fp8_recipe=POW2):
        eager = layer(x)
    expected = torch.autograd.grad(eager.sum(), [x, layer.weight])
    compiled = torch.compile(layer, backend=backend, fullgraph=True)
    with tfp8.fp8_autocast(fp8_recipe=POW2):
        out = compiled(x)
    got = torch.autograd.grad(out.sum(), [x, layer.weight])
    assert torch.equal(out, eager)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


def test_fsdp2_weights_gathered_in_another_form_are_cast_again(tmp_path):
    """FSDP2 left the weight gathered in FP8 under another recipe (an evaluation forward with
    reshard_after_forward=False): the power-of-two layer multiplied those FP8 data with their
    scale (0.22 off); it now casts the gathered high-precision weight, bit for bit the unsharded
    layer."""
    from current_scaling_power_2_cases import worker
    from multiprocess import rank_results
    result = rank_results(worker, tmp_path, world=1, timeout_s=300)[0]
    for name, (got, expected) in result.items():
        assert torch.equal(got, expected), name
