"""FP8 GEMM throughput against bf16 and torch._scaled_mm.

Measures out[M, N] = a[M, K] @ b[N, K].T in bf16 output for M x K x N = 8192^3, 16384 x 8192 x
8192 and 16384 x 8192 x 28672: transformer_fp8's fp8_gemm (E4M3 x E4M3, with and without fast
accumulation), torch.matmul on the bf16 tensors of the same shapes, and torch._scaled_mm on the
very same FP8 operands and scales (fast accumulation; 'n/a' where it fails), and the
block-scaled fp8_gemm_blockwise (split accumulation, as the recipes run it) with 1x128 x 128x128
(forward of Float8BlockScaling), 1x128 x 1x128 (its backward GEMMs) and row-wise x row-wise
scales (Float8RowwiseScaling) on operands quantised from the same bf16 tensors. Reported: time per
GEMM (CUDA events around 10 back-to-back calls, median; the implementations timed in turns over
4 rounds, so that the GPU's warming up weighs on all alike), TFLOP/s = 2 M N K / time, and the
speedups over bf16 and over torch._scaled_mm, all measured in the same run.

    python benchmarks/bench_gemm.py [--smoke] [--out DIR]
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from transformer_fp8 import blockwise_ops, ops  # noqa: E402

NAME = "bench_gemm"
TITLE, WHAT = common.doc_summary(__doc__)
SHAPES = [(8192, 8192, 8192), (16384, 8192, 8192), (16384, 8192, 28672)]  # (M, K, N)
SMOKE_SHAPES = [(64, 128, 96)]
FP8 = torch.float8_e4m3fn
INNER = 10  # back-to-back calls per timed repetition

COLUMNS = [
    ["shape", "M x K x N", "{}"],
    ["impl", "implementation", "{}"],
    ["time_ms", "time (ms)", "{:.3f}"],
    ["tflops", "TFLOP/s", "{:.1f}"],
    ["vs_bf16", "speedup vs bf16", "{:.2f}x"],
    ["vs_scaled_mm", "speedup vs _scaled_mm", "{:.2f}x"],
]


def operands(m: int, k: int, n: int, device: torch.device):
    """bf16 a [M, K], b [N, K] and their E4M3 casts with per-tensor scales."""
    a_hp = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    b_hp = torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.05
    a_scale = ops.compute_scale_from_amax(ops.amax(a_hp).reshape(1), 448.0)
    b_scale = ops.compute_scale_from_amax(ops.amax(b_hp).reshape(1), 448.0)
    a_lp, b_lp = ops.cast_to_fp8(a_hp, a_scale, FP8), ops.cast_to_fp8(b_hp, b_scale, FP8)
    return a_hp, b_hp, a_lp, 1.0 / a_scale, b_lp, 1.0 / b_scale


def implementations(a_hp, b_hp, a_lp, a_scale_inv, b_lp, b_scale_inv):
    """name -> zero-argument call; all compute the same product."""
    def scaled_mm():
        return torch._scaled_mm(a_lp, b_lp.t(), scale_a=a_scale_inv, scale_b=b_scale_inv,
                                out_dtype=torch.bfloat16, use_fast_accum=True)

    def fp8_gemm(fast):
        return lambda: ops.fp8_gemm(a_lp, a_scale_inv, b_lp, b_scale_inv, torch.bfloat16,
                                    use_fast_accum=fast)

    return {
        "bf16 torch.matmul": lambda: torch.matmul(a_hp, b_hp.t()),
        "torch._scaled_mm (fast accum)": scaled_mm,
        "fp8_gemm (fast accum)": fp8_gemm(True),
        "fp8_gemm (fp32 accum)": fp8_gemm(False),
        **blockwise_implementations(a_hp, b_hp),
    }


def blockwise_implementations(a_hp, b_hp):
    """fp8_gemm_blockwise with the scale modes of the block recipes; the operands are quantised
    here, outside the timed calls."""
    k = a_hp.shape[1]

    def quantised(x, block_rows, block_cols):
        q, s, _, _ = blockwise_ops.quantize_blockwise(x, block_rows, block_cols, FP8, True)
        return q, s

    cases = {"blockwise 1x128 x 128x128": ((1, 128), (128, 128)),
             "blockwise 1x128 x 1x128": ((1, 128), (1, 128)),
             "rowwise x rowwise": ((1, k), (1, k))}
    fns = {}
    for name, (a_blocks, b_blocks) in cases.items():
        a_q, a_s = quantised(a_hp, *a_blocks)
        b_q, b_s = quantised(b_hp, *b_blocks)
        fns[name] = (lambda a_q=a_q, a_s=a_s, b_q=b_q, b_s=b_s:
                     blockwise_ops.fp8_gemm_blockwise(a_q, a_s, b_q, b_s, torch.bfloat16))
    return fns


def works(fn) -> bool:
    """False, with the reason printed, when the call fails (e.g. _scaled_mm)."""
    try:
        fn()
        return True
    except Exception as exc:
        print(f"(not measured: {type(exc).__name__}: {str(exc).splitlines()[0][:160]})")
        return False


def plot(ax, payload):
    rows = payload["rows"]
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    width = 0.8 / len(impls)
    for i, impl in enumerate(impls):
        values = [next((r["tflops"] or 0.0 for r in rows
                        if r["shape"] == s and r["impl"] == impl), 0.0) for s in shapes]
        ax.bar([j + i * width for j in range(len(shapes))], values, width, label=impl)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(shapes))])
    ax.set_xticklabels(shapes, fontsize=8)
    ax.set_ylabel("TFLOP/s")
    ax.set_title("GEMM throughput (bf16 out)", fontsize=10)
    ax.legend(fontsize=7)


def main(argv=None) -> dict:
    args = common.parse_args(TITLE, argv)
    # 10 back-to-back calls per pair of CUDA events: with one, the host's time to issue the
    # call (Python wrapper, dispatcher, cuBLASLt setup: 13.5 us for fp8_gemm, 21.5 us for
    # _scaled_mm on the 2026-11-22 H100) counted as GEMM time, 1-3% of an 8192^3 GEMM and
    # not the same for every implementation.
    reps, inner = (2, 2) if args.smoke else (20, INNER)
    rows = []
    for m, k, n in SMOKE_SHAPES if args.smoke else SHAPES:
        shape = f"{m}x{k}x{n}"
        fns = {name: fn if works(fn) else None for name, fn in
               implementations(*operands(m, k, n, args.device)).items()}
        timings = common.time_interleaved(fns, args.device, warmup=2 if args.smoke else 5,
                                          reps=reps, rounds=1 if args.smoke else 4, inner=inner)
        seconds = {name: t.median_s if t else None for name, t in timings.items()}
        for name, s in seconds.items():
            rows.append({"shape": shape, "impl": name, "time_ms": s * 1e3 if s else None,
                         "tflops": common.ratio(2 * m * n * k / 1e12, s),
                         "vs_bf16": common.ratio(seconds["bf16 torch.matmul"], s),
                         "vs_scaled_mm": common.ratio(seconds["torch._scaled_mm (fast accum)"],
                                                      s)})
        if args.device.type == "cuda":
            torch.cuda.empty_cache()
    notes = ["operands: a ~ N(0, 1), b ~ N(0, 0.05^2), cast to float8_e4m3fn with per-tensor "
             "scales from their amax; b is [N, K] (K contiguous, the TN layout)",
             "blockwise rows: the same bf16 tensors quantised per block (power-of-two scales); "
             "times are of the GEMM alone, quantisation excluded",
             f"time per GEMM: CUDA events around {inner} back-to-back calls, median over "
             f"{reps} repetitions"]
    return common.report(args, NAME, TITLE, WHAT, COLUMNS, rows, plot=plot, notes=notes)


if __name__ == "__main__":
    main()
