"""Statistics of one FP8 GEMM operand, computed on its device from the high-precision tensor
and its quantised form, as a vector of float64 partial sums that combine across microbatches
and ranks by the reduction named for each field, and the figures derived from them.

Definitions (x the high-precision operand, q its FP8 data, s the scale that multiplied x before
the saturating cast, per tensor or per block; only x's non-zero values count, so zero padding
and exact zeros change no fraction):
  amax               max |x|
  scale_min/max      the smallest and largest scale used (equal for per-tensor scaling)
  underflow_frac     non-zero x with q == 0 (flushed to zero), over the non-zero x
  saturation_frac    x with |x * s| > fp8_max (clamped to +-max), over the non-zero x
  dynamic_range_log2 log2(amax / min |x| over the non-zero x)
  sqnr_db            10 log10(sum x^2 / sum (x - q / s)^2)   (inf when exact)
  per block (block recipes; one block for per-tensor scaling): the number of blocks, the
  smallest block amax and the worst block's SQNR.
"""
from __future__ import annotations

import math

import torch

# (name, how partial values of several casts or ranks combine)
FIELDS = (("amax", "max"), ("scale_min", "min"), ("scale_max", "max"), ("nonzero", "sum"),
          ("underflow", "sum"), ("saturated", "sum"), ("min_nonzero", "min"),
          ("signal", "sum"), ("noise", "sum"), ("blocks", "sum"), ("block_amax_min", "min"),
          ("block_worst_noise_ratio", "max"))
FIELD_INDEX = {name: i for i, (name, _) in enumerate(FIELDS)}
_OPS = tuple(op for _, op in FIELDS)
SUM_FIELDS = [i for i, op in enumerate(_OPS) if op == "sum"]
MAX_FIELDS = [i for i, op in enumerate(_OPS) if op == "max"]
MIN_FIELDS = [i for i, op in enumerate(_OPS) if op == "min"]


def _expand_blocks(per_block: torch.Tensor, rows: int, cols: int, block_rows: int,
                   block_cols: int) -> torch.Tensor:
    return per_block.repeat_interleave(block_rows, 0).repeat_interleave(block_cols, 1)[
        :rows, :cols]


def _block_sums(t: torch.Tensor, block_rows: int, block_cols: int) -> torch.Tensor:
    """Sums of t [rows, cols] over each block_rows x block_cols block (edge blocks partial)."""
    rows, cols = t.shape
    padded = torch.nn.functional.pad(t, (0, -cols % block_cols, 0, -rows % block_rows))
    r, c = padded.shape
    return padded.reshape(r // block_rows, block_rows, c // block_cols, block_cols).sum((1, 3))


def operand_stats(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, fp8_max: float,
                  block_rows: int = 0, block_cols: int = 0) -> torch.Tensor:
    """The FIELDS vector (float64, on x's device) of x [rows, cols] quantised to q with
    ``scale``: a 1-element tensor (per-tensor scaling; block dims 0) or one scale per
    block_rows x block_cols block of x ([ceil(rows/br), ceil(cols/bc)])."""
    rows = min(x.shape[0], q.shape[0])  # a fused cast's rows may be padded further
    xf = x[:rows].float()
    qf = q[:rows].float()
    ax = xf.abs()
    nonzero = xf != 0
    if block_rows:
        s = _expand_blocks(scale.float(), rows, xf.shape[1], block_rows, block_cols)
    else:
        s = scale.float().reshape(1, 1).expand_as(xf) if xf.dim() == 2 else scale.float()
    err = xf - qf / s
    sq, err_sq = xf.double().square(), err.double().square()
    if block_rows:
        block_signal = _block_sums(sq, block_rows, block_cols)
        block_noise = _block_sums(err_sq, block_rows, block_cols)
        block_amax = torch.nn.functional.pad(
            ax, (0, -ax.shape[1] % block_cols, 0, -rows % block_rows)).reshape(
            -(-rows // block_rows), block_rows, -1, block_cols).amax((1, 3))
        with_signal = block_signal > 0
        ratio = torch.where(with_signal, block_noise / block_signal.clamp_min(1e-300), 0)
        blocks = float(block_amax.numel())
        block_amax_min, worst = block_amax.amin().double(), ratio.amax()
        signal, noise = block_signal.sum(), block_noise.sum()
    else:
        signal, noise = sq.sum(), err_sq.sum()
        blocks, block_amax_min = 1.0, None
        worst = torch.where(signal > 0, noise / signal.clamp_min(1e-300), 0)
    amax = ax.amax().double()
    values = [amax, s.amin().double(), s.amax().double(),
              nonzero.sum().double(), (nonzero & (qf == 0)).sum().double(),
              ((xf * s).abs() > fp8_max).sum().double(),
              torch.where(nonzero, ax, math.inf).amin().double(), signal, noise,
              torch.tensor(blocks, dtype=torch.float64, device=x.device),
              amax if block_amax_min is None else block_amax_min, worst.double()]
    return torch.stack([v.reshape(()) for v in values])


def combine(stacked: torch.Tensor) -> torch.Tensor:
    """Partial FIELDS vectors [n, F] of the same operand combined into one [F]."""
    out = stacked[0].clone()
    out[SUM_FIELDS] = stacked[:, SUM_FIELDS].sum(0)
    out[MAX_FIELDS] = stacked[:, MAX_FIELDS].amax(0)
    out[MIN_FIELDS] = stacked[:, MIN_FIELDS].amin(0)
    return out


def _db(signal: float, noise: float) -> float:
    if noise == 0:
        return math.inf
    return -math.inf if signal == 0 else 10 * math.log10(signal / noise)


def derive(values) -> dict:
    """The reported figures (see the module docstring) from a combined FIELDS vector."""
    v = {name: float(values[i]) for name, i in FIELD_INDEX.items()}
    nonzero = v["nonzero"]
    worst = v["block_worst_noise_ratio"]
    return {
        "amax": v["amax"], "scale_min": v["scale_min"], "scale_max": v["scale_max"],
        "nonzero": int(nonzero),
        "underflow_frac": v["underflow"] / nonzero if nonzero else 0.0,
        "saturation_frac": v["saturated"] / nonzero if nonzero else 0.0,
        "dynamic_range_log2": (math.log2(v["amax"] / v["min_nonzero"])
                               if nonzero and math.isfinite(v["amax"]) else 0.0),
        "sqnr_db": _db(v["signal"], v["noise"]),
        "blocks": int(v["blocks"]), "block_amax_min": v["block_amax_min"],
        "block_min_sqnr_db": math.inf if worst == 0 else -10 * math.log10(worst),
    }
