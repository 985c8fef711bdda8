"""Where the host time of 24 FP8 Linear layers goes (null kernels, thread CPU time): the same
24 layers' C++ operator called directly from minimal modules, with and without delayed
scaling's bookkeeping, against the full module path and nn.Linear, interleaved as bench_host.

    python benchmarks/results/2026-11-26-cpu-host-cxx-module-steps/decompose_linear_stack.py
"""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import bench_host as bh  # noqa: E402

bh.load_null_kernels()
import transformer_fp8 as tfp8  # noqa: E402
from transformer_fp8 import _C  # noqa: E402
from transformer_fp8.modules import linear_fused_step  # noqa: E402
from transformer_fp8.quantization import autocast  # noqa: E402

torch.set_num_threads(1)
x = torch.randn(16, 16)
recipe = tfp8.DelayedScaling(amax_history_len=16)
layers = bh.stack(tfp8.Linear, 24, 16, recipe=recipe)
fwd_dtype, bwd_dtype = recipe.fp8_format.fwd_dtype, recipe.fp8_format.bwd_dtype


class Direct(torch.nn.Module):
    """The layer's C++ operator with its states registered and the backward hook attached."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer
        layer._adopt_recipe(recipe)
        self.slices = linear_fused_step._state_slices(layer, recipe.fp8_format)

    def forward(self, inp):
        layer = self.layer
        step = autocast.record_forward(autocast.current_state(), *layer._scaling_states)
        return _C.linear_delayed(inp, layer.weight, layer.bias, *self.slices, fwd_dtype,
                                 bwd_dtype, torch.float32, step)


class DirectUnrecorded(Direct):
    """The C++ operator only: nothing registered, no hook (so no update either)."""

    def forward(self, inp):
        layer = self.layer
        return _C.linear_delayed(inp, layer.weight, layer.bias, *self.slices, fwd_dtype,
                                 bwd_dtype, torch.float32, None)


def in_context(model):
    def step():
        with tfp8.fp8_autocast(fp8_recipe=recipe):
            out = model(x)
        out.sum().backward()
    return step


cases = {"nn.Linear": bh.linear_step(bh.stack(torch.nn.Linear, 24, 16), x),
         "tfp8.Linear (module path)": bh.linear_step(layers, x, recipe),
         "C++ operator + registration + hook": in_context(
             torch.nn.Sequential(*[Direct(layer) for layer in layers])),
         "C++ operator only": in_context(
             torch.nn.Sequential(*[DirectUnrecorded(layer) for layer in layers]))}
for _ in range(3):
    times = bh.thread_time_per_call(cases, 200)
    print("  ".join(f"{name}: {t * 1e6:.0f} µs" for name, t in times.items()))
