"""Memory-bound FP8 kernels against the device's copy bandwidth.

Measures amax, cast_to_fp8 (with the amax fused, as Linear calls it), cast_transpose_to_fp8
(amax fused) and cast_from_fp8 on a bf16 tensor of 16384 x 8192 (and a smaller one). For each:
the time per call (CUDA events around 10 back-to-back calls, median), the bandwidth (bytes read +
bytes written, divided by
the time), that bandwidth as a percentage of ``dst.copy_(src)`` on a 1 GiB buffer measured in
the same run (the practical ceiling of a kernel that streams memory), and the speedup over the
eager pure-torch expression of the same operation (transformer_fp8.reference).

    python benchmarks/bench_cast.py [--smoke] [--out DIR]
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from transformer_fp8 import ops, reference  # noqa: E402

NAME = "bench_cast"
TITLE, WHAT = common.doc_summary(__doc__)
SHAPES = [(4096, 8192), (16384, 8192)]
SMOKE_SHAPES = [(128, 256)]
FP8 = torch.float8_e4m3fn

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
    """(op, bytes moved, kernel call, eager pure-torch call) for one bf16 input x."""
    device, n = x.device, x.numel()
    scale = torch.tensor([2.0], device=device)
    amax_slot = torch.zeros(1, device=device)
    x_fp8 = ops.cast_to_fp8(x, scale, FP8)
    in_bytes = n * x.element_size()

    def eager_cast_transpose():
        out = reference.cast_to_fp8_reference(x, scale, FP8, amax_slot)
        return out, out.t().contiguous()

    return [
        # amax reads x; its 4-byte result is negligible.
        ("amax", in_bytes,
         lambda: ops.amax(x), lambda: reference.amax_reference(x)),
        # reads x, writes the fp8 copy (1 byte per element).
        ("cast_to_fp8 (+amax)", in_bytes + n,
         lambda: ops.cast_to_fp8(x, scale, FP8, amax_slot),
         lambda: reference.cast_to_fp8_reference(x, scale, FP8, amax_slot)),
        # reads x once, writes the fp8 copy and its fp8 transpose.
        ("cast_transpose_to_fp8 (+amax)", in_bytes + 2 * n,
         lambda: ops.cast_transpose_to_fp8(x, scale, FP8, amax_slot), eager_cast_transpose),
        # reads the fp8 tensor, writes bf16.
        ("cast_from_fp8", n + in_bytes,
         lambda: ops.cast_from_fp8(x_fp8, scale, torch.bfloat16),
         lambda: reference.cast_from_fp8_reference(x_fp8, scale, torch.bfloat16)),
    ]


def plot(ax, payload):
    rows = payload["rows"]
    common.bar_plot(ax, [f"{r['op']}\n{r['shape']}" for r in rows], [r["pct_copy"] for r in rows],
                    "% of copy bandwidth", "FP8 casts: bandwidth vs device copy", reference=100.0,
                    reference_label="dst.copy_(src)")


def main(argv=None) -> dict:
    args = common.parse_args(TITLE, argv)
    # 10 back-to-back calls per timed repetition: the launch overhead of one call would
    # otherwise count as device time at the smaller shape.
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
    notes = [f"copy bandwidth (dst.copy_(src), read+write) measured in this run: "
             f"{copy_gbps:.0f} GB/s", "input bf16; fp8 = float8_e4m3fn; eager = the pure-torch "
             "reference of transformer_fp8.reference"]
    return common.report(args, NAME, TITLE, WHAT, COLUMNS, rows, plot=plot, notes=notes,
                         extra={"copy_gbps": copy_gbps})


if __name__ == "__main__":
    main()
