"""Fused norm / activation / dbias operators against the device's copy bandwidth.

Measures layernorm_fwd_fp8 and rmsnorm_fwd_fp8 (FP8 y + transpose + amax, as LayerNormLinear
calls them), layernorm_bwd, activation_fwd_fp8 (gelu, swiglu), activation_bwd_fp8 (with
transpose and dbias) and cast_transpose_dbias on bf16 inputs of 16384 rows. For each: the time
per call (CUDA events around 10 back-to-back calls, median), the bandwidth (bytes read + bytes
written over the time), that bandwidth as a percentage of ``dst.copy_(src)`` on a 1 GiB buffer
measured in the same run, and the speedup over the eager pure-torch reference
(transformer_fp8.reference) of the same operation.

    python benchmarks/bench_fused.py [--smoke] [--out DIR]
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from transformer_fp8 import fused_ops, reference  # noqa: E402

NAME = "bench_fused"
TITLE, WHAT = common.doc_summary(__doc__)
SHAPES = [(16384, 4096)]
SMOKE_SHAPES = [(64, 128)]
FP8 = torch.float8_e4m3fn
GRAD_FP8 = torch.float8_e5m2

COLUMNS = [
    ["op", "op", "{}"],
    ["shape", "shape", "{}"],
    ["time_us", "time (µs)", "{:.1f}"],
    ["gbps", "GB/s (read+write)", "{:.0f}"],
    ["pct_copy", "% of copy BW", "{:.1f}"],
    ["eager_us", "eager torch (µs)", "{:.1f}"],
    ["speedup", "speedup vs eager", "{:.2f}x"],
]


def cases(x: torch.Tensor):
    """(op, bytes moved, kernel call, eager pure-torch call) for one bf16 input x [M, N]."""
    device = x.device
    rows, cols = x.shape
    n, hp = x.numel(), x.element_size()
    w = torch.ones(cols, device=device, dtype=x.dtype)
    scale = torch.tensor([2.0], device=device)
    slot = torch.zeros(1, device=device)
    _, mean, rstd = fused_ops.layernorm_fwd(x, w, w, 1e-5)
    dy = torch.randn_like(x)
    half = x[:, : cols // 2].contiguous()
    return [
        # reads x, writes y_fp8 and its transpose (1 byte each) and mean / rstd.
        ("layernorm_fwd_fp8 (+T, amax)", n * hp + 2 * n + 8 * rows,
         lambda: fused_ops.layernorm_fwd_fp8(x, w, w, 1e-5, False, scale, FP8, slot, True),
         lambda: reference.layernorm_fwd_fp8_reference(x, w, w, 1e-5, False, scale, FP8, slot,
                                                       True)),
        ("rmsnorm_fwd_fp8 (+T, amax)", n * hp + 2 * n + 4 * rows,
         lambda: fused_ops.rmsnorm_fwd_fp8(x, w, 1e-5, False, scale, FP8, slot, True),
         lambda: reference.rmsnorm_fwd_fp8_reference(x, w, 1e-5, False, scale, FP8, slot,
                                                     True)),
        # reads dy and x, writes dx: each once (the kernel's second read of dy and x, for the
        # column sums, is not useful traffic and not counted, as the note says).
        ("layernorm_bwd", 3 * n * hp,
         lambda: fused_ops.layernorm_bwd(dy, x, mean, rstd, w),
         lambda: reference.layernorm_bwd_reference(dy, x, mean, rstd, w)),
        # reads x, writes the fp8 result.
        ("activation_fwd_fp8 gelu", n * hp + n,
         lambda: fused_ops.activation_fwd_fp8(x, "gelu", scale, FP8, slot),
         lambda: reference.activation_fwd_fp8_reference(x, "gelu", scale, FP8, slot)),
        ("activation_fwd_fp8 swiglu", n * hp + n // 2,
         lambda: fused_ops.activation_fwd_fp8(x, "swiglu", scale, FP8, slot),
         lambda: reference.activation_fwd_fp8_reference(x, "swiglu", scale, FP8, slot)),
        # reads dy [M, N/2] and x, writes dx_fp8 and its transpose; dbias is small.
        ("activation_bwd_fp8 swiglu (+T, dbias)", n * hp // 2 + n * hp + 2 * n,
         lambda: fused_ops.activation_bwd_fp8(half, x, "swiglu", scale, GRAD_FP8, slot, True,
                                              True),
         lambda: reference.activation_bwd_fp8_reference(half, x, "swiglu", scale, GRAD_FP8,
                                                        slot, True, True)),
        # reads x, writes the fp8 copy and its transpose; dbias is small.
        ("cast_transpose_dbias", n * hp + 2 * n,
         lambda: fused_ops.cast_transpose_dbias(dy, scale, GRAD_FP8, slot),
         lambda: reference.cast_transpose_dbias_reference(dy, scale, GRAD_FP8, slot)),
    ]


def plot(ax, payload):
    rows = payload["rows"]
    common.bar_plot(ax, [f"{r['op']}\n{r['shape']}" for r in rows], [r["pct_copy"] for r in rows],
                    "% of copy bandwidth", "Fused norm / activation ops: bandwidth vs device copy",
                    reference=100.0, reference_label="dst.copy_(src)")


def main(argv=None) -> dict:
    args = common.parse_args(TITLE, argv)
    reps, warmup, inner = (2, 1, 1) if args.smoke else (20, 5, 10)
    copy_gbps = common.copy_bandwidth(args.device)
    rows = []
    for shape in SMOKE_SHAPES if args.smoke else SHAPES:
        x = torch.randn(shape, device=args.device, dtype=torch.bfloat16)
        for op, nbytes, kernel, eager in cases(x):
            t = common.time_fn(kernel, args.device, warmup=warmup, reps=reps, inner=inner)
            t_eager = common.time_fn(eager, args.device, warmup=warmup, reps=reps, inner=inner)
            gbps = nbytes / t.median_s / 1e9
            rows.append({"op": op, "shape": "x".join(map(str, shape)), "bytes": nbytes,
                         "time_us": t.us, "gbps": gbps, "pct_copy": 100 * gbps / copy_gbps,
                         "eager_us": t_eager.us, "speedup": t_eager.median_s / t.median_s})
        del x
    notes = [(f"copy bandwidth (dst.copy_(src), read+write) measured in this run: "
              f"{copy_gbps:.0f} GB/s"),
             ("input bf16; forward fp8 = float8_e4m3fn, gradients float8_e5m2; eager = the "
              "pure-torch reference of transformer_fp8.reference; bytes count each tensor once "
              "(the transpose's second read of the FP8 bytes and layernorm_bwd's second read "
              "of x and dy are not useful traffic)")]
    return common.report(args, NAME, TITLE, WHAT, COLUMNS, rows, plot=plot, notes=notes,
                         extra={"copy_gbps": copy_gbps})


if __name__ == "__main__":
    main()
