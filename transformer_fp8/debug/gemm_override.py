"""Per-GEMM precision (Transformer Engine's DisableFP8GEMM): chosen GEMMs of a module run in
high precision while the others stay FP8.

Each GEMM reads one orientation of two operands (quantizer.Quantized: data, or the transpose
data_t):
  fprop  input.data    . weight.data
  dgrad  grad.data     . weight.data_t
  wgrad  grad.data_t   . input.data_t
so a high-precision GEMM is two high-precision operand orientations: HighPrecisionOrientations
wraps a role's quantizer and leaves those orientations unquantised (the tensor itself, or its
transposed view); the orientations that other GEMMs read are quantised as before, amaxes
recorded as before. The GEMM of two high-precision operands is torch's matmul in the output
dtype; the other GEMMs are the recipe's, unchanged. (A norm's or activation's output with an
unquantised orientation is made in high precision first: in a bfloat16 model the other GEMMs'
FP8 operand is then cast from the rounded output, not inside the fused kernel from float32.)
"""
from __future__ import annotations

import collections.abc
from typing import List, Optional

import torch

from ..quantization.quantizer import Quantized, Quantizer

GEMM_KINDS = ("fprop", "dgrad", "wgrad")
# Which (role, orientation) each GEMM reads: orientation 0 is data, 1 is data_t.
_OPERANDS = {"fprop": (("input", 0), ("weight", 0)),
             "dgrad": (("grad_output", 0), ("weight", 1)),
             "wgrad": (("grad_output", 1), ("input", 1))}
ROLES = ("input", "weight", "grad_output")


def _is_fp8(t: torch.Tensor) -> bool:
    return t.element_size() == 1


class HighPrecisionOrientations(Quantizer):
    """``inner`` with the orientations in ``high_precision`` (0: data, 1: data_t) unquantised."""

    def __init__(self, inner: Quantizer, high_precision: frozenset):
        self.inner, self.high_precision = inner, high_precision
        note = getattr(inner, "note_unquantised", None)  # (statistics: debug/observer.py)
        if note is not None:
            note(high_precision)
        self.dtype = inner.dtype
        # An unquantised orientation needs the tensor itself: made in high precision first.
        self.fuses_cast = inner.fuses_cast and not high_precision
        self.cache_key = ("high_precision", tuple(sorted(high_precision))) + inner.cache_key
        inner_gemm = inner.gemm

        def gemm(a, a_scale_inv, b, b_scale_inv, out_dtype, bias=None, fast_accum=False):
            if _is_fp8(a) and _is_fp8(b):
                return inner_gemm(a, a_scale_inv, b, b_scale_inv, out_dtype, bias, fast_accum)
            if _is_fp8(a) or _is_fp8(b):
                raise RuntimeError("a GEMM of an FP8 and a high-precision operand: the "
                                   "per-GEMM override covers both operands of a GEMM")
            a, b = a.to(out_dtype), b.to(out_dtype)
            if torch.compiler.is_compiling():
                # The scale_invs of the operands' FP8 orientations (opaque copies,
                # ops.scale_inverse) go
                # through this GEMM, making them forward values: a copy no forward value used
                # was moved into the traced backward, which read the scale rewritten since.
                kept = [s for s in (a_scale_inv, b_scale_inv) if s is not None]
                return _linear_keeping(a, b, bias, kept)
            return torch.nn.functional.linear(a, b, bias)

        self.gemm = gemm

    def _cast_in_kernel(self, fused, with_transpose: bool):
        return self.inner._cast_in_kernel(fused, with_transpose)

    def cast_fused(self, fused, unfused, with_transpose):
        if self.fuses_cast:  # (no orientation unquantised: the inner cast as it is, so that
            # an inner ObservedQuantizer records it: its statistics lost this operand)
            return self.inner.cast_fused(fused, unfused, with_transpose)
        return super().cast_fused(fused, unfused, with_transpose)

    def cast(self, x: torch.Tensor, with_transpose: bool = True) -> Quantized:
        fp8_data = 0 not in self.high_precision
        fp8_data_t = with_transpose and 1 not in self.high_precision
        # A role with an FP8 orientation is cast even when no gradient asks for its transpose
        # now (an input that needs none; a reentrant checkpoint's first forward), as the plain
        # run casts it: its amax recorded, and the scale a replay makes the transpose with.
        has_fp8 = self.high_precision != {0, 1}
        q = self.inner.cast(x, with_transpose=fp8_data_t) if has_fp8 else None
        if q is None:  # nothing quantised (no scale_inv: the GEMMs of x are torch's)
            return Quantized(x, x.t() if with_transpose else None, None, None, None)
        # The scale_invs are kept even beside a high-precision orientation (its GEMM ignores
        # them): a replay repeats the cast from them.
        data = q.data if fp8_data else x
        data_t = None if not with_transpose else (q.data_t if fp8_data_t else x.t())
        return Quantized(data, data_t, q.scale_inv, q.scale_inv_t, q.scale)

    def for_replay(self, used: Quantized) -> "Quantizer":
        if used.scale_inv is None:
            return self  # nothing was quantised: nothing to repeat
        return HighPrecisionOrientations(self.inner.for_replay(used), self.high_precision)

    def block_dims(self, cols: int) -> tuple:
        return self.inner.block_dims(cols)


@torch.library.custom_op("transformer_fp8_debug::linear_keeping", mutates_args=())
def _linear_keeping(a: torch.Tensor, b: torch.Tensor, bias: Optional[torch.Tensor],
                    kept: List[torch.Tensor]) -> torch.Tensor:
    """F.linear(a, b, bias); ``kept`` is unused: under torch.compile, values the forward keeps."""
    return torch.nn.functional.linear(a, b, bias)


@_linear_keeping.register_fake
def _linear_keeping_fake(a, b, bias, kept):
    return a.new_empty((a.shape[0], b.shape[0]))


def gemm_list(gemms) -> tuple:
    """override()'s gemms= as a tuple of names, read once (an iterator serves every module)."""
    if isinstance(gemms, (bytes, bytearray)) or not isinstance(gemms, collections.abc.Iterable):
        raise TypeError("gemms must be a GEMM name or an iterable of them (strings such as "
                        f"'wgrad' or 'fc2.wgrad'), got {type(gemms).__name__} {gemms!r}")
    gemms = (gemms,) if isinstance(gemms, str) else tuple(gemms)
    for item in gemms:
        if not isinstance(item, str):
            raise TypeError(f"gemms must hold strings (GEMM names such as 'wgrad'), got "
                            f"{type(item).__name__} {item!r}")
    if not gemms:  # (not "the whole layer": that is override(..., fp8=False) without gemms)
        raise ValueError("gemms must name at least one GEMM (e.g. ['wgrad']), got none; to "
                         "run the whole layer in high precision, leave gemms out")
    return gemms


def parse_gemms(gemms: tuple, gemm_names: tuple, owner: str) -> frozenset:
    """{(gemm index, GEMM kind)} from names "fprop" / "dgrad" / "wgrad" (every GEMM of the
    module) or "<gemm>.<kind>" (one GEMM, e.g. "fc2.wgrad" of a LayerNormMLP)."""
    chosen = set()
    for item in gemms:
        gemm, dot, kind = item.rpartition(".")
        if kind not in GEMM_KINDS:
            raise ValueError(f"gemms: {item!r} names no GEMM kind; expected one of {GEMM_KINDS}"
                             ", optionally after a GEMM name and a dot (e.g. 'fc2.wgrad')")
        if dot and not gemm:
            raise ValueError(f"gemms: {item!r} has no GEMM name before the dot; write "
                             f"{kind!r} for every GEMM of the module")
        if gemm and gemm not in gemm_names:
            raise ValueError(f"gemms: {owner} has no GEMM {gemm!r} (its GEMMs: "
                             f"{[n for n in gemm_names if n] or 'one, unnamed'})")
        indices = [gemm_names.index(gemm)] if gemm else range(len(gemm_names))
        chosen.update((index, kind) for index in indices)
    return frozenset(chosen)


def with_high_precision_gemms(quantizers: list, chosen: frozenset) -> list:
    """Per GEMM (input, weight, grad_output) quantizers with the (gemm index, kind) pairs in
    ``chosen`` run in high precision."""
    result = []
    for index, per_gemm in enumerate(quantizers):
        kinds = {kind for gemm, kind in chosen if gemm == index}
        if not kinds:
            result.append(per_gemm)
            continue
        orientations = {role: set() for role in ROLES}
        for kind in kinds:
            for role, orientation in _OPERANDS[kind]:
                orientations[role].add(orientation)
        # All three wrapped: plan.gemm (the input quantizer's) must take high-precision
        # operands whichever GEMM they are for.
        result.append(tuple(HighPrecisionOrientations(q, frozenset(orientations[role]))
                            for q, role in zip(per_gemm, ROLES)))
    return result
