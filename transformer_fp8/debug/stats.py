"""Statistics of one FP8 GEMM operand, computed on its device from the high-precision tensor
and its quantised form, as a vector of float64 partial sums that combine across microbatches
and ranks by the reduction named for each field, and the figures derived from them.

Definitions (x the high-precision operand, q its FP8 data, s the scale that multiplied x before
the saturating cast, per tensor or per block; only x's non-zero values count, so zero padding
and exact zeros change no fraction):
  amax               max |x|
  scale_min/max      the smallest and largest scale used (equal for per-tensor scaling)
  underflow_frac     non-zero x with q == 0 (flushed to zero), over the non-zero x
  saturation_frac    x the cast's clamp to +-fp8_max changed, over the non-zero x: |x * s|
                     rounds past fp8_max (saturation_bound; sub-step overshoots round to max)
  dynamic_range_log2 log2(amax / min |x| over the non-zero x)
  sqnr_db            10 log10(sum x^2 / sum (x - q / s)^2)   (inf when exact)
  per block (block recipes; one block for per-tensor scaling): the number of blocks, the
  smallest block amax and the worst block's SQNR.
"""
from __future__ import annotations

import math
import struct

import torch

from ..ops.operand_stats import fp8_operand_stats

# (name, how partial values of several casts or ranks combine), grouped by that combination so
# that each group is one slice of the vector; the first five are reduced in float32 (the
# operand's magnitudes and scales), the others in float64.
FIELDS = (("scale_min", "min"), ("min_nonzero", "min"), ("block_amax_min", "min"),
          ("amax", "max"), ("scale_max", "max"), ("block_worst_noise_ratio", "max"),
          ("underflow", "sum"), ("nonzero", "sum"), ("saturated", "sum"),
          ("signal", "sum"), ("noise", "sum"), ("blocks", "sum"))
FIELD_INDEX = {name: i for i, (name, _) in enumerate(FIELDS)}
NEUTRAL = {"min": math.inf, "max": -math.inf, "sum": 0.0}


def _group(op: str) -> slice:
    where = [i for i, (_, o) in enumerate(FIELDS) if o == op]
    assert where == list(range(where[0], where[-1] + 1)), f"the {op} fields must be adjacent"
    return slice(where[0], where[-1] + 1)


MIN_FIELDS, MAX_FIELDS, SUM_FIELDS = _group("min"), _group("max"), _group("sum")
# operand_stats writes the vector in five parts: the float32 minima and maxima, the worst
# block's noise ratio, the three counts, the two sums of squares, the number of blocks.
_OUT_PARTS = (5, 1, 3, 2, 1)


def neutral(device) -> torch.Tensor:
    """The FIELDS vector of no values (combines with any other to that other; blocks 0)."""
    out = torch.empty(len(FIELDS), dtype=torch.float64, device=device)
    for op, group in (("min", MIN_FIELDS), ("max", MAX_FIELDS), ("sum", SUM_FIELDS)):
        out[group].fill_(NEUTRAL[op])
    return out


def _has_operator() -> bool:
    try:
        return hasattr(torch.ops.transformer_fp8, "fp8_operand_stats")
    except (AttributeError, RuntimeError):
        return False


_HAS_OPERATOR = _has_operator()  # (False with a library built before it existed)
_OPERATOR_X_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_OPERATOR_Q_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def saturation_bound(fp8_max: float, fp8_dtype: torch.dtype) -> float:
    """The largest |x * s| the cast's clamp leaves unchanged. The cast clamps to +-fp8_max,
    then rounds to nearest even, so the clamp matters only past fp8_max plus half the format's
    step there (E4M3: 448 + 16; E5M2: 57344 + 4096). The tie itself rounds to the even
    neighbour: E4M3's max (mantissa 110) keeps it, E5M2's (mantissa 11) does not. (As
    csrc/checks/stats_checks.h computes it for the operator.)"""
    e4m3 = fp8_dtype == torch.float8_e4m3fn
    _, exponent = math.frexp(fp8_max)  # fp8_max = m * 2^exponent, m in [0.5, 1)
    tie = fp8_max + math.ldexp(1.0, exponent - 2 - (3 if e4m3 else 2))
    tie_bits = struct.unpack("<I", struct.pack("<f", tie))[0]  # (as a float32)
    return struct.unpack("<f", struct.pack("<I", tie_bits - (0 if e4m3 else 1)))[0]


def operand_stats(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, fp8_max: float,
                  block_rows: int = 0, block_cols: int = 0) -> torch.Tensor:
    """The FIELDS vector (float64, on x's device) of x [rows, cols] quantised to q with
    ``scale``: a 1-element tensor (per-tensor scaling; block dims 0) or one scale per
    block_rows x block_cols block of x ([ceil(rows/br), ceil(cols/bc)]).

    On the CPU and CUDA, one operator (two kernel launches: fp8_operand_stats); elsewhere, or
    for other dtypes, the pure-torch reference below. No value goes to or comes from the host.
    """
    if (_HAS_OPERATOR and x.device.type in ("cpu", "cuda") and x.dim() == 2
            and x.dtype in _OPERATOR_X_DTYPES and q.dtype in _OPERATOR_Q_DTYPES):
        return fp8_operand_stats(x, q, scale, fp8_max, block_rows, block_cols)
    return operand_stats_reference(x, q, scale, fp8_max, block_rows, block_cols)


def operand_stats_reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                            fp8_max: float, block_rows: int = 0,
                            block_cols: int = 0) -> torch.Tensor:
    """operand_stats in torch operators: the reference of the fp8_operand_stats kernels.

    The element-wise quantities are computed on stacked tensors and reduced together: the
    same number of operators whatever the shape (tests/test_debug_stats_cost.py counts them)."""
    rows = min(x.shape[0], q.shape[0])  # a fused cast's rows may be padded further
    x, q = x[:rows], q[:rows]
    device = x.device
    if x.numel() == 0:
        return neutral(device)
    if block_rows:
        cols = x.shape[1]
        br, bc, nr, nc = block_rows, block_cols, -(-rows // block_rows), -(-cols // block_cols)
        s = scale.float()[:nr, :nc]
        shape = (nr * br, nc * bc)
    else:  # per-tensor scaling: one block, the whole tensor
        br, bc, nr, nc = 1, x.numel(), 1, 1
        s = scale.float().reshape(1, 1)
        shape = x.shape
    padded = shape != x.shape
    out = torch.empty(len(FIELDS), dtype=torch.float64, device=device)
    out_f32, out_worst, out_counts, out_squares, out_blocks = out.split(_OUT_PARTS)

    # q, x and x * s in float32, zero padded to whole blocks (zeros count nowhere).
    v = (torch.zeros if padded else torch.empty)((3, *shape), dtype=torch.float32,
                                                  device=device)
    vq, vx, _ = v.unbind()
    (vq[:rows, :cols] if padded else vq).copy_(q)
    (vx[:rows, :cols] if padded else vx).copy_(x)
    s_blocked = s.reshape(nr, 1, nc, 1)
    bq, bx, bxs = v.view(3, nr, br, nc, bc).unbind()
    torch.mul(bx, s_blocked, out=bxs)
    flags = torch.empty(v.shape, dtype=torch.bool, device=device)
    torch.ne(v[:2], 0, out=flags[:2])          # q != 0, x != 0
    underflow, nonzero, saturated = flags.unbind()
    torch.gt(nonzero, underflow, out=underflow)  # x != 0 and q == 0: flushed to zero
    abs_x, abs_xs = v[1:].abs().unbind()
    torch.gt(abs_xs, saturation_bound(fp8_max, q.dtype), out=saturated)  # clamped by the cast
    torch.sum(flags.view(3, -1), 1, dtype=torch.float64, out=out_counts)

    f32 = torch.empty(5, dtype=torch.float32, device=device)  # out_f32, in FIELDS order
    scale_min, min_nonzero, block_amax_min, amax, scale_max = f32.unbind()
    torch.amin(torch.where(nonzero, abs_x, math.inf), out=min_nonzero)
    torch.aminmax(abs_x.view(nr, br, nc, bc).amax((1, 3)), out=(block_amax_min, amax))
    torch.aminmax(s, out=(scale_min, scale_max))
    out_f32.copy_(f32)

    # x - q / s in float32 (as the GEMM sees q), then x^2 and the error^2 in float64.
    torch.addcdiv(bx, bq, s_blocked, value=-1, out=bxs)
    squares = v[1:].double().square_()
    if nr * nc == 1:  # one block: its sums are the totals
        block_squares = torch.sum(squares.view(2, -1), 1, out=out_squares)
    else:
        block_squares = squares.view(2, nr, br, nc, bc).sum((2, 4))
        torch.sum(block_squares.view(2, -1), 1, out=out_squares)
    signal, noise = block_squares.unbind()
    # (signal >= 0: != 0 also lets a block whose signal is NaN, an operand holding a NaN,
    # give NaN: the worst block)
    torch.amax(torch.where(signal != 0, noise / signal, 0), out=out_worst.view(()))
    out_blocks.fill_(nr * nc)
    return out


def combine(stacked: torch.Tensor) -> torch.Tensor:
    """Partial FIELDS vectors [..., n, F] of the same operand combined into one [..., F]."""
    return torch.cat([stacked[..., MIN_FIELDS].amin(-2), stacked[..., MAX_FIELDS].amax(-2),
                      stacked[..., SUM_FIELDS].sum(-2)], dim=-1)


def _db(signal: float, noise: float) -> float:
    if noise == 0:
        return math.inf
    return -math.inf if signal == 0 else 10 * math.log10(signal / noise)


def derive(values) -> dict:
    """The reported figures (see the module docstring) from a combined FIELDS vector."""
    if isinstance(values, torch.Tensor):
        values = values.tolist()
    v = {name: float(values[i]) for name, i in FIELD_INDEX.items()}
    nonzero = v["nonzero"]
    worst = v["block_worst_noise_ratio"]
    return {
        "amax": v["amax"], "scale_min": v["scale_min"], "scale_max": v["scale_max"],
        "nonzero": int(nonzero),
        "underflow_frac": v["underflow"] / nonzero if nonzero else 0.0,
        "saturation_frac": v["saturated"] / nonzero if nonzero else 0.0,
        # (inf for an infinite amax, NaN for a NaN one: not 0.0, which reads as healthy)
        "dynamic_range_log2": math.log2(v["amax"] / v["min_nonzero"]) if nonzero else 0.0,
        "sqnr_db": _db(v["signal"], v["noise"]),
        "blocks": int(v["blocks"]), "block_amax_min": v["block_amax_min"],
        "block_min_sqnr_db": math.inf if worst == 0 else -10 * math.log10(worst),
    }
