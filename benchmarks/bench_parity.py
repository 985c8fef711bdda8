"""SQNR of FP8 models against float32 copies, behind assert_fp8_parity's default thresholds.

For each reference model, over several seeds: transformer_fp8.testing.compare_to_reference
(HYBRID delayed scaling, 2 steps, the default random grad_output) against a float32 deepcopy;
reported: the minimum over seeds of the output SQNR, of the input gradient's and of the worst
parameter gradient's (dB), and the FP8 GEMMs chained between input and output. Models: one
Linear (one GEMM), LayerNormLinear (one), LayerNormMLP gelu (two chained), two Linear layers
with a GELU between them (two), a TransformerLayer (four, two of them chained on the attention
path). The TransformerLayer's output and input gradient include its residual (identity) path,
which carries x through unquantised, so their SQNR is not comparable with the single-GEMM rows';
its weight gradients are. Numerics are device-independent; this runs on the CPU kernels unless
--device says otherwise. (assert_fp8_parity: transformer_fp8.testing.)

    python benchmarks/bench_parity.py [--smoke] [--out DIR]
"""
from __future__ import annotations

import copy
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import transformer_fp8 as tfp8  # noqa: E402
from transformer_fp8.testing import (DEFAULT_GRAD_MIN_SQNR_DB, DEFAULT_MIN_SQNR_DB,  # noqa: E402
                                     compare_to_reference)

NAME = "bench_parity"
TITLE, WHAT = common.doc_summary(__doc__)
RECIPE = tfp8.DelayedScaling(fp8_format=tfp8.Format.HYBRID, amax_history_len=16)

COLUMNS = [
    ["model", "model", "{}"],
    ["gemms", "chained FP8 GEMMs", "{}"],
    ["output_db", "output SQNR, min (dB)", "{:.1f}"],
    ["input_grad_db", "input grad SQNR, min (dB)", "{:.1f}"],
    ["param_grad_db", "worst parameter grad SQNR, min (dB)", "{:.1f}"],
]


def models(hidden: int, device) -> dict:
    """name -> (chained GEMMs, builder, input shape without the hidden size)."""
    return {
        "Linear": (1, lambda: tfp8.Linear(hidden, hidden, device=device), (64,)),
        "LayerNormLinear": (1, lambda: tfp8.LayerNormLinear(hidden, hidden, device=device),
                            (64,)),
        "LayerNormMLP (gelu)": (2, lambda: tfp8.LayerNormMLP(hidden, 4 * hidden,
                                                             device=device), (64,)),
        "Linear-GELU-Linear": (2, lambda: torch.nn.Sequential(
            tfp8.Linear(hidden, 4 * hidden, device=device), torch.nn.GELU(),
            tfp8.Linear(4 * hidden, hidden, device=device)), (64,)),
        "TransformerLayer": (4, lambda: tfp8.TransformerLayer(
            hidden, 4 * hidden, max(1, hidden // 32), hidden_dropout=0.0,
            attention_dropout=0.0, device=device), (16, 4)),
    }


def measure(build, lead_shape, hidden: int, device, seeds: int) -> dict:
    worst = {"output_db": float("inf"), "input_grad_db": float("inf"),
             "param_grad_db": float("inf")}
    for seed in range(seeds):
        torch.manual_seed(seed)
        model = build()
        reference = copy.deepcopy(model).float()
        x = torch.randn(*lead_shape, hidden, device=device)
        report = compare_to_reference(model, reference, x, recipe=RECIPE)
        params = [e.sqnr_db for e in report.entries if e.kind == "param_grad"
                  and not e.name.endswith("bias")]  # bias gradients are not FP8 GEMMs
        for key, value in (("output_db", report["output"].sqnr_db),
                           ("input_grad_db", report["input_grad[0]"].sqnr_db),
                           ("param_grad_db", min(params))):
            worst[key] = min(worst[key], value)
    return worst


def plot(ax, payload):
    rows = payload["rows"]
    keys = ("output_db", "input_grad_db", "param_grad_db")
    width = 0.8 / len(keys)
    for i, key in enumerate(keys):
        ax.bar([j + i * width for j in range(len(rows))], [r[key] for r in rows], width,
               label=key.replace("_db", ""))
    ax.axhline(DEFAULT_MIN_SQNR_DB, color="tab:red", linestyle="--", label="output bound")
    ax.axhline(DEFAULT_GRAD_MIN_SQNR_DB, color="tab:purple", linestyle=":", label="grad bound")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(rows))])
    ax.set_xticklabels([r["model"] for r in rows], fontsize=7)
    ax.set_ylabel("min SQNR over seeds (dB)")
    ax.set_title("FP8 (HYBRID, delayed) against float32", fontsize=10)
    ax.legend(fontsize=7)


def main(argv=None) -> dict:
    args = common.parse_args(TITLE, argv)
    hidden, seeds = (32, 2) if args.smoke else (256, 8)
    rows = []
    for name, (gemms, build, lead_shape) in models(hidden, args.device).items():
        rows.append({"model": name, "gemms": gemms,
                     **measure(build, lead_shape, hidden, args.device, seeds)})
    notes = [f"hidden size {hidden}, {seeds} seeds, input N(0, 1), float32 parameters; the "
             "reference is a float32 deepcopy",
             f"assert_fp8_parity defaults: output {DEFAULT_MIN_SQNR_DB} dB, gradients "
             f"{DEFAULT_GRAD_MIN_SQNR_DB} dB"]
    return common.report(args, NAME, TITLE, WHAT, COLUMNS, rows, plot=plot, notes=notes)


if __name__ == "__main__":
    main()
