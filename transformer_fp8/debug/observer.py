"""How statistics reach the collector: the quantizers of selected layers wrapped, for the logged
steps only, by ObservedQuantizer (the same cast, then its statistics, per tensor or per block).

modules/base.py asks transformer_fp8._fp8_hooks.observer (None when off; else collector._DISPATCH,
for every enabled collector) for these once per module forward; nothing here runs when statistics
are off.
"""
from __future__ import annotations

import torch

from ..quantization.quantizer import Quantized, Quantizer
from .stats import operand_stats

ROLES = ("input", "weight", "grad_output")
# Under block scaling the transposed operands (wgrad's input and grad_output, dgrad's weight)
# have scales of their own: recorded under these names.
TRANSPOSED_ROLES = tuple(role + "_t" for role in ROLES)


def gemm_names(module) -> tuple:
    """The name of each FP8 GEMM of a module: "" for a single one, else its Transformer Engine
    name (LayerNormMLP: fc1, fc2)."""
    n = module._num_gemms
    if n == 1:
        return ("",)
    if n == 2 and hasattr(module, "fc1_weight"):
        return ("fc1", "fc2")
    return tuple(f"gemm{i}" for i in range(n))


class ObservedQuantizer(Quantizer):
    """A quantizer that casts as ``inner`` does and hands the statistics of every tensor it
    casts to its watchers, ((collector, key), ...): computed once, recorded by each."""

    def __init__(self, inner: Quantizer, watchers: tuple, transposes_only: bool = False):
        self.inner, self.watchers = inner, watchers
        self.dtype, self.fuses_cast = inner.dtype, inner.fuses_cast
        self.cache_key, self.gemm = inner.cache_key, inner.gemm
        # Orientations no GEMM reads in FP8 (debug.override's gemms=: 0 the data, 1 the
        # transpose), set by gemm_override.HighPrecisionOrientations; a block-scaled cast's
        # rows are then not recorded (its transposes have blocks of their own).
        self.unquantised = frozenset()
        self.transposes_only = transposes_only  # (a recomputation: see for_replay)
        self.made_transpose = False

    def note_unquantised(self, orientations: frozenset) -> None:
        self.unquantised = frozenset(orientations)

    def _block_scaled(self) -> bool:
        return self.inner.block_dims(1) != (0, 0)

    def _active(self) -> list:
        # A collector disabled since this forward (its backward runs later) records nothing.
        return [(c, key) for c, key in self.watchers if c._enabled]

    def _record(self, x_hp: torch.Tensor, q: Quantized) -> None:
        watchers = self._active()
        if not watchers:
            return
        block_rows, block_cols = self.inner.block_dims(x_hp.shape[1])
        # The operand's own rows: not the zero rows pad_rows added for the GEMM (operand_stats
        # takes as many of q's rows and of the block scales' as x_hp has).
        rows = getattr(x_hp, "real_rows", x_hp.shape[0])
        x_hp = x_hp[:rows]
        fp8_max = torch.finfo(self.dtype).max
        with torch.no_grad():
            if not self.transposes_only and not (0 in self.unquantised
                                                 and self._block_scaled()):
                stats = operand_stats(x_hp, q.data, self.inner.dequant_scale(q), fp8_max,
                                      block_rows, block_cols)
                for collector, key in watchers:
                    collector.record(key, stats)
            if (rows and q.data_t is not None and q.scale is None
                    and q.scale_inv_t is not q.scale_inv):  # (an empty operand: no blocks)
                # Block scaling: the transpose's own blocks and scales (its columns are x's
                # rows, the padding last), the operand of wgrad or dgrad.
                t_rows, t_cols = self.inner.block_dims(rows)
                stats = operand_stats(x_hp.t().contiguous(), q.data_t[:, :rows].contiguous(),
                                      q.scale_inv_t.reciprocal(), fp8_max, t_rows, t_cols)
                for collector, (name, gemm, role) in watchers:
                    collector.record((name, gemm, role + "_t"), stats)

    def cast(self, x, with_transpose=True):
        q = self.inner.cast(x, with_transpose)
        self.made_transpose = self.made_transpose or q.data_t is not None
        self._record(x, q)
        return q

    def _cast_in_kernel(self, fused, with_transpose):
        return self.inner._cast_in_kernel(fused, with_transpose)

    def cast_fused(self, fused, unfused, with_transpose):
        if not self.fuses_cast:  # made in high precision, then self.cast: recorded there
            return super().cast_fused(fused, unfused, with_transpose)
        q, extra = self.inner.cast_fused(fused, unfused, with_transpose)
        if not self._active():
            return q, extra
        self.made_transpose = self.made_transpose or q.data_t is not None
        with torch.no_grad():
            x_hp, _ = unfused()  # the fused kernel never writes it: computed again
        self._record(x_hp, q)
        return q, extra

    def for_replay(self, used):
        """The cast a checkpoint's recomputation repeats, unobserved (its forward recorded it):
        except, under block scaling, the transposes a forward without gradients did not make
        (a reentrant checkpoint's first forward), which the recomputation makes for the
        backward GEMMs: those are recorded then."""
        replay = self.inner.for_replay(used)
        if self.made_transpose or not self._block_scaled():
            return replay
        return ObservedQuantizer(replay, self.watchers, transposes_only=True)

    def block_dims(self, cols):
        return self.inner.block_dims(cols)


def observed_quantizers(module, watchers: list, quantizers: list) -> list:
    """quantizers (per GEMM: input, weight, grad_output) as ObservedQuantizers recording into
    each (collector, the module's name there) of ``watchers``, keyed by (layer, gemm, tensor)."""
    gemms = gemm_names(module)
    return [tuple(ObservedQuantizer(quantizer, tuple((collector, (name, gemms[g], role))
                                                     for collector, name in watchers))
                  for quantizer, role in zip(per_gemm, ROLES))
            for g, per_gemm in enumerate(quantizers)]
