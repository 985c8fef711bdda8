"""How statistics reach the collector: FP8 casts of selected layers replaced, for the logged
steps only, by ObservedCast (the same cast, then its statistics), and the block-scaled GEMMs
wrapped so that their operands are quantised once more for statistics (the quantisation is
deterministic: the same values the GEMM used).

modules/base.py asks the collector (transformer_fp8._fp8_hooks.observer, None when off) for these
once per module forward; nothing here runs when statistics are off.
"""
from __future__ import annotations

import itertools

import torch

from ..quantization.blockwise import _plan_for, _quantize
from ..ops.blockwise import BLOCK
from ..quantization.quantizer import Fp8Cast, pad_rows
from .stats import operand_stats

ROLES = ("input", "weight", "grad_output")


def gemm_names(module) -> tuple:
    """The name of each FP8 GEMM of a module: "" for a single one, else its Transformer Engine
    name (LayerNormMLP: fc1, fc2)."""
    n = module._num_gemms
    if n == 1:
        return ("",)
    if n == 2 and hasattr(module, "fc1_weight"):
        return ("fc1", "fc2")
    return tuple(f"gemm{i}" for i in range(n))


class ObservedCast(Fp8Cast):
    """An Fp8Cast that hands the collector the statistics of every tensor it casts."""

    @classmethod
    def of(cls, cast: Fp8Cast, collector, key: tuple) -> "ObservedCast":
        observed = cls.__new__(cls)
        observed.__dict__.update(cast.__dict__)
        observed.collector, observed.key = collector, key
        return observed

    def _record(self, x_hp, x_fp8, scale) -> None:
        with torch.no_grad():
            self.collector.record(self.key, operand_stats(
                x_hp, x_fp8, scale, torch.finfo(self.dtype).max))

    def cast(self, x, with_transpose=True):
        x_fp8, x_t_fp8, scale_inv, scale = super().cast(x, with_transpose)
        self._record(x, x_fp8, scale)
        return x_fp8, x_t_fp8, scale_inv, scale

    def cast_fused(self, fused, unfused, with_transpose):
        if self.is_current:  # made in high precision, then self.cast: recorded there
            return super().cast_fused(fused, unfused, with_transpose)
        x_fp8, x_t_fp8, scale_inv, scale, extra = super().cast_fused(fused, unfused,
                                                                     with_transpose)
        with torch.no_grad():
            x_hp, _ = unfused()  # the fused kernel never writes it: computed again
        self._record(x_hp, x_fp8, scale)
        return x_fp8, x_t_fp8, scale_inv, scale, extra


def observed_casts(module, name: str, casts: list, collector) -> list:
    """casts (per GEMM: input, weight, grad_output) as ObservedCasts keyed by
    (layer, gemm, tensor)."""
    gemms = gemm_names(module)
    return [tuple(ObservedCast.of(cast, collector, (name, gemms[g], role))
                  for cast, role in zip(per_gemm, ROLES))
            for g, per_gemm in enumerate(casts)]


def _block_dims(dim, cols: int) -> tuple:
    if dim == "rowwise":
        return 1, cols
    return (1, BLOCK) if dim == 1 else (BLOCK, BLOCK)


def _block_stats(t2d, dim, fp8_dtype, power_2_scale):
    q, scale_inv, _, _ = _quantize(t2d, dim, fp8_dtype, power_2_scale, False)
    block_rows, block_cols = _block_dims(dim, t2d.shape[1])
    return operand_stats(t2d, q, scale_inv.reciprocal(), torch.finfo(fp8_dtype).max,
                         block_rows, block_cols)


def observed_block_linear(module, name: str, linear, recipe, collector):
    """``linear(x, weight, bias)`` of a block-scaled module, reporting the statistics of each
    GEMM's input and weight and, in backward, of its grad_output."""
    gemms = gemm_names(module)
    counter = itertools.count()

    def run(x, weight, bias):
        gemm = gemms[next(counter)]
        plan = _plan_for(recipe, x.dtype)
        with torch.no_grad():
            x2d = pad_rows(x.detach().reshape(-1, x.shape[-1]))
            collector.record((name, gemm, "input"), _block_stats(
                x2d, plan.x_dim, plan.fwd_dtype, plan.power_2_scale))
            collector.record((name, gemm, "weight"), _block_stats(
                weight.detach(), plan.w_dim, plan.fwd_dtype, plan.power_2_scale))
        out = linear(x, weight, bias)
        if out.requires_grad:
            def on_grad(g):
                with torch.no_grad():
                    collector.record((name, gemm, "grad_output"), _block_stats(
                        pad_rows(g.reshape(-1, g.shape[-1])), plan.grad_dim, plan.bwd_dtype,
                        plan.power_2_scale))
            out.register_hook(on_grad)
        return out

    return run
