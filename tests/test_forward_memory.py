"""What an FP8 forward leaves alive for its backward: the transposed FP8 copies the dgrad and
wgrad GEMMs read (input^T, weight^T per GEMM), not the FP8 operands of the forward GEMM (held by
the plan for checkpoint replay, they doubled the FP8 activations kept until backward)."""
from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import transformer_fp8 as tfp8
from transformer_fp8 import (DelayedScaling, Float8BlockScaling, Float8CurrentScaling,
                             Float8RowwiseScaling, fp8_autocast)

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


class FP8Outputs(TorchDispatchMode):
    """Weak references to every FP8 tensor an operator returns."""

    def __init__(self):
        super().__init__()
        self.refs = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dtype in FP8_DTYPES:
                self.refs.append((str(func), tuple(t.shape), weakref.ref(t)))
        return out


MODULES = {
    "linear": (lambda: tfp8.Linear(64, 32), 1),
    "layernorm_linear": (lambda: tfp8.LayerNormLinear(64, 32), 1),
    "layernorm_mlp": (lambda: tfp8.LayerNormMLP(64, 128), 2),
}


@pytest.mark.parametrize("recipe", [DelayedScaling(), Float8CurrentScaling(),
                                    Float8BlockScaling(), Float8RowwiseScaling()],
                         ids=["delayed", "current", "block", "rowwise"])
@pytest.mark.parametrize("module", list(MODULES))
def test_forward_keeps_only_the_transposed_copies(module, recipe):
    make, gemms = MODULES[module]
    torch.manual_seed(0)
    layer = make()
    x = torch.randn(16, 64, requires_grad=True)
    with fp8_autocast(fp8_recipe=recipe):
        layer(x)  # (a first step: the state sized and the scales set)
        tracked = FP8Outputs()
        with tracked:
            out = layer(x)
    gc.collect()
    live = [(func, shape) for func, shape, ref in tracked.refs if ref() is not None]
    # per GEMM: input^T [K, M] and weight^T [K, N] (columns first)
    assert len(live) == 2 * gemms, live
    assert all(shape[-1] in (16, 32, 64, 128) and shape[0] in (64, 128) for _, shape in live)
    out.sum().backward()  # (and backward still has what it needs)
    assert x.grad is not None and torch.isfinite(x.grad).all()
