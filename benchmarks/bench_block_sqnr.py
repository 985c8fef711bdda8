"""Quantisation SQNR per recipe on tensors with outliers: why per-block scaling exists.

Each tensor is quantised to E4M3 four ways (per-tensor current scaling, 1x128 tiles, 128x128
blocks, one scale per row; block scales are powers of two, as the recipes default to) and
dequantised; reported: the SQNR (dB) over the whole tensor, over its ordinary values only (the
outliers excluded), the fraction of ordinary non-zero values flushed to zero, and the SQNR of a
GEMM output x @ w^T (w an ordinary weight, zero on the outliers' channels so that the output is
the ordinary values' product) with x and w quantised as a recipe pairs them, named in the
table: per-tensor x per-tensor; 1x128 x 1x128 (Float8BlockScaling's backward GEMMs); on the
128x128 row, Float8BlockScaling's forward, x (the activation) in 1x128 tiles and w (the weight)
in 128x128 blocks, so that row's GEMM does not quantise x in 128x128 blocks as its other columns
do; row-wise x row-wise (Float8RowwiseScaling). Tensors: gaussian (no
outliers), outlier columns (4 channels 10**3 or 10**5 larger, as large-model activations have),
an outlier 128x128 block (10**5 larger). Numerics are device-independent; this runs on the CPU
kernels unless --device says otherwise.

    python benchmarks/bench_block_sqnr.py [--smoke] [--out DIR]
"""
from __future__ import annotations

import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from transformer_fp8 import ops  # noqa: E402
from transformer_fp8.ops.blockwise import quantize_blockwise  # noqa: E402
from transformer_fp8.reference import dequantize_blockwise_reference  # noqa: E402

NAME = "bench_block_sqnr"
TITLE, WHAT = common.doc_summary(__doc__)
FP8 = torch.float8_e4m3fn
RECIPES = ("per-tensor", "1x128", "128x128", "rowwise")

COLUMNS = [
    ["tensor", "tensor", "{}"],
    ["recipe", "scaling", "{}"],
    ["sqnr_all", "SQNR all (dB)", "{:.1f}"],
    ["sqnr_ordinary", "SQNR ordinary values (dB)", "{:.1f}"],
    ["flushed", "ordinary values flushed to 0", "{:.1%}"],
    ["gemm_pairing", "GEMM: x scaling x w scaling", "{}"],
    ["sqnr_gemm", "SQNR of x @ w.T, w 0 on outlier channels (dB)", "{:.1f}"],
]
# How each row's GEMM quantises (x, w): as the recipes pair them. Float8BlockScaling quantises
# activations in 1x128 tiles and weights in 128x128 blocks (forward), and both operands of its
# backward GEMMs in 1x128 tiles.
GEMM_PAIRING = {"per-tensor": ("per-tensor", "per-tensor"), "1x128": ("1x128", "1x128"),
                "128x128": ("1x128", "128x128"), "rowwise": ("rowwise", "rowwise")}


def sqnr(ref: torch.Tensor, out: torch.Tensor) -> float:
    ref, out = ref.double().cpu(), out.double().cpu()
    noise = torch.linalg.vector_norm(out - ref).item()
    return math.inf if noise == 0 else 20 * math.log10(
        torch.linalg.vector_norm(ref).item() / noise)


def tensors(rows: int, cols: int, gen: torch.Generator) -> dict:
    """name -> (x, mask of the outliers)."""
    base = torch.randn(rows, cols, generator=gen)
    none = torch.zeros(rows, cols, dtype=torch.bool)
    columns = none.clone()
    columns[:, 5:9] = True
    block = none.clone()
    block[:min(rows, 128), 128:256] = True
    return {"gaussian": (base, none),
            "outlier columns x1e3": (torch.where(columns, base * 1e3, base), columns),
            "outlier columns x1e5": (torch.where(columns, base * 1e5, base), columns),
            "outlier 128x128 block x1e5": (torch.where(block, base * 1e5, base), block)}


def quantise_dequantise(x: torch.Tensor, recipe: str) -> torch.Tensor:
    if recipe == "per-tensor":
        scale = ops.compute_scale_from_amax(ops.amax(x).reshape(1), 448.0)
        return ops.cast_to_fp8(x, scale, FP8).double() / scale.double()
    blocks = {"1x128": (1, 128), "128x128": (128, 128), "rowwise": (1, x.shape[1])}[recipe]
    q, s, _, _ = quantize_blockwise(x, *blocks, FP8, True)
    return dequantize_blockwise_reference(q, s)


def measure(x: torch.Tensor, outliers: torch.Tensor, w: torch.Tensor, recipe: str) -> dict:
    x_device = x
    back = quantise_dequantise(x, recipe).cpu()
    x, outliers = x.cpu(), outliers.cpu()
    ordinary = ~outliers & (x != 0)
    # The GEMM's weight is zero on the outliers' channels: its output is the ordinary values'
    # product, which is what per-tensor scaling loses.
    w = torch.where(outliers.any(dim=0), torch.zeros_like(w.cpu()), w.cpu()).to(w.device)
    x_recipe, w_recipe = GEMM_PAIRING[recipe]
    x_gemm = back if x_recipe == recipe else quantise_dequantise(x_device, x_recipe).cpu()
    w_back = quantise_dequantise(w, w_recipe).cpu()
    exact = x.double() @ w.double().cpu().T
    return {"sqnr_all": sqnr(x, back), "sqnr_ordinary": sqnr(x[ordinary], back[ordinary]),
            "flushed": (back[ordinary] == 0).double().mean().item(),
            "gemm_pairing": f"{x_recipe} x {w_recipe}",
            "sqnr_gemm": sqnr(exact, x_gemm @ w_back.T)}


def plot(ax, payload):
    rows = payload["rows"]
    names = list(dict.fromkeys(r["tensor"] for r in rows))
    width = 0.8 / len(RECIPES)
    for i, recipe in enumerate(RECIPES):
        values = [next(r["sqnr_ordinary"] for r in rows
                       if r["tensor"] == n and r["recipe"] == recipe) for n in names]
        ax.bar([j + i * width for j in range(len(names))], values, width, label=recipe)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(names))])
    ax.set_xticklabels(names, fontsize=8)
    ax.set_ylabel("SQNR of the ordinary values (dB)")
    ax.set_title("E4M3 quantisation by scaling granularity", fontsize=10)
    ax.legend(fontsize=7)


def main(argv=None) -> dict:
    args = common.parse_args(TITLE, argv)
    rows_, cols_ = (256, 512) if args.smoke else (4096, 4096)
    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(256 if args.smoke else 1024, cols_, generator=gen) / cols_ ** 0.5)
    rows = []
    for name, (x, outliers) in tensors(rows_, cols_, gen).items():
        for recipe in RECIPES:
            rows.append({"tensor": name, "recipe": recipe,
                         **measure(x.to(args.device), outliers, w.to(args.device), recipe)})
    notes = [f"x: [{rows_}, {cols_}] ~ N(0, 1) with the outliers multiplied as named; "
             "w: an ordinary weight (no outliers)",
             "E4M3 everywhere; block scales rounded down to powers of two"]
    return common.report(args, NAME, TITLE, WHAT, COLUMNS, rows, plot=plot, notes=notes)


if __name__ == "__main__":
    main()
