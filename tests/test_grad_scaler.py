"""float16 training with torch.amp.GradScaler over FP8 layers (CPU): the loss scale makes the
float16 grad_output overflow. The FP8 casts saturate (inf becomes the E5M2 max), so the input
and weight gradients stay finite; the scaler sees the overflow only through a gradient that
carries it (here the biases); the FP8 scales stay finite, and the grad_output scale follows the
largest finite amax of its history, also while an inf is still in it."""
from __future__ import annotations

import pytest
import torch
from conftest import FP8_MAX

import transformer_fp8 as tfp8

RECIPE = tfp8.DelayedScaling(amax_history_len=4)   # HYBRID: grad_output in E5M2


def fp8_scales_are_finite(model) -> bool:
    return all(bool(torch.isfinite(b).all() and (b > 0).all())
               for n, b in model.named_buffers() if n.endswith(("_scale", "_scale_inv")))


def scaled_step(model, scaler, opt, gen):
    x = torch.randn(16, 32, generator=gen).requires_grad_()
    with torch.autocast("cpu", dtype=torch.float16):
        with tfp8.fp8_autocast(fp8_recipe=RECIPE):
            y = model(x)
        loss = y.float().pow(2).sum()
    scaler.scale(loss).backward()
    before = [p.detach().clone() for p in model.parameters()]
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
    stepped = any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
    return x.grad, grads, stepped


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
def test_an_overflowed_float16_grad_output_under_a_grad_scaler(gen, bias):
    model = torch.nn.Sequential(tfp8.Linear(32, 32, bias=bias), tfp8.Linear(32, 32, bias=bias))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    x_grad, grads, stepped = scaled_step(model, scaler, opt, gen)

    # the scaled float16 grad_output overflowed: the grad_output casts recorded inf ...
    for layer in model:
        assert torch.isinf(layer.fp8_bwd_amax_history).any()
    # ... and saturated it: the input and weight gradients are finite
    assert torch.isfinite(x_grad).all()
    assert all(torch.isfinite(g).all() for n, g in grads.items() if n.endswith("weight"))
    if bias:
        # the bias gradients carry the overflow: the scaler skips the step, halves its scale
        assert not all(torch.isfinite(g).all() for n, g in grads.items() if n.endswith("bias"))
        assert not stepped and scaler.get_scale() == 2.0**15
    else:
        # nothing carries it: the scaler takes the step on the saturated gradients
        assert stepped and scaler.get_scale() == 2.0**16
    assert fp8_scales_are_finite(model)

    # a step without overflow: the grad_output scale comes from its finite amax, while the
    # inf of the step before is still in the history
    scaler.update(1.0)
    scaled_step(model, scaler, opt, gen)
    for layer in model:
        history = layer.fp8_bwd_amax_history[:, 0]
        assert torch.isinf(history).any()
        finite = history[torch.isfinite(history)]
        expected = torch.tensor(FP8_MAX[torch.float8_e5m2]) / finite.max()
        torch.testing.assert_close(layer.fp8_bwd_scale[0], expected, rtol=1e-6, atol=0)
    assert fp8_scales_are_finite(model)
