"""Reading the statistics: the worst operands as a table, and a per-layer heat map over steps.

    python -m transformer_fp8.debug.analysis fp8.jsonl --figure underflow_frac --out heat.png
"""
from __future__ import annotations

import argparse
import math
from typing import Optional, Union

from .writers import read_records

# For each figure, which end is bad: worst_report sorts by it.
_WORSE_IS_LOWER = {"sqnr_db": True, "block_min_sqnr_db": True, "underflow_frac": False,
                   "saturation_frac": False, "dynamic_range_log2": False, "amax": False}


def _records(source: Union[str, list]) -> list:
    """The records of a file or list, each (operand, step) at most once: a repeat means runs
    or collectors mixed, which a heat map or a worst step would silently pick one of."""
    records = read_records(source) if isinstance(source, str) else list(source)
    seen = set()
    for r in records:
        key = (row_label(r), r["step"])
        if key in seen:
            raise ValueError(f"two records of {key[0]} at step {key[1]}: records of several "
                             "runs or collectors mixed; pass one run's records")
        seen.add(key)
    return records


def row_label(record: dict) -> str:
    """"<layer>[.<gemm>]:<tensor>", e.g. "blocks.2.mlp.fc2:input"."""
    gemm = f".{record['gemm']}" if record["gemm"] else ""
    return f"{record['layer']}{gemm}:{record['tensor']}"


def worst_report(source: Union[str, list], figure: str = "sqnr_db", top: int = 5) -> str:
    """A table of the ``top`` operands with the worst ``figure`` (by default the lowest SQNR),
    each at its worst logged step."""
    if figure not in _WORSE_IS_LOWER:
        raise ValueError(f"figure must be one of {sorted(_WORSE_IS_LOWER)}, got {figure!r}")
    if isinstance(top, bool) or not isinstance(top, int) or top < 1:
        raise ValueError(f"top must be a positive integer (how many operands to list), got "
                         f"{top!r}")
    worst: dict = {}
    lower = _WORSE_IS_LOWER[figure]

    def badness(record) -> tuple:  # smaller is worse; NaN is the worst of all
        value = record[figure]
        return (0, 0.0) if math.isnan(value) else (1, value if lower else -value)

    for r in _records(source):
        key = row_label(r)
        if key not in worst or badness(r) < badness(worst[key]):
            worst[key] = r
    ranked = sorted(worst.values(), key=badness)[:top]
    width = max([len("operand")] + [len(row_label(r)) for r in ranked])
    lines = [f"{'operand':<{width}}  {'step':>5} {'SQNR dB':>8} {'underflow':>9} "
             f"{'saturated':>9} {'range log2':>10} {'amax':>10} {'scale':>10}"]
    for r in ranked:
        lines.append(f"{row_label(r):<{width}}  {r['step']:>5} {r['sqnr_db']:>8.2f} "
                     f"{r['underflow_frac']:>9.2%} {r['saturation_frac']:>9.2%} "
                     f"{r['dynamic_range_log2']:>10.1f} {r['amax']:>10.3g} "
                     f"{r['scale_min']:>10.3g}")
    return "\n".join(lines)


def heatmap_matrix(source: Union[str, list], figure: str) -> tuple:
    """(row labels, steps, matrix [rows][steps] of ``figure``, NaN where not logged)."""
    records = _records(source)
    labels = sorted({row_label(r) for r in records})
    steps = sorted({r["step"] for r in records})
    index = {label: i for i, label in enumerate(labels)}
    column = {s: j for j, s in enumerate(steps)}
    matrix = [[math.nan] * len(steps) for _ in labels]
    for r in records:
        matrix[index[row_label(r)]][column[r["step"]]] = r[figure]
    return labels, steps, matrix


def plot_heatmap(source: Union[str, list], figure: str = "sqnr_db",
                 out: Optional[str] = None):
    """A heat map of ``figure`` per operand (rows) and logged step (columns); saved to ``out``
    when given. Returns the matplotlib Figure (needs matplotlib)."""
    import matplotlib

    if out is not None:
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, steps, matrix = heatmap_matrix(source, figure)
    fig, ax = plt.subplots(figsize=(min(16, 3 + 0.25 * len(steps)),
                                    min(24, 1.5 + 0.25 * len(labels))))
    finite = [[v if math.isfinite(v) else math.nan for v in row] for row in matrix]
    image = ax.imshow(finite, aspect="auto", interpolation="nearest",
                      cmap="viridis_r" if _WORSE_IS_LOWER.get(figure, False) else "viridis")
    ax.set_yticks(range(len(labels)))
    ax.set_yticklabels(labels, fontsize=7)
    ticks = range(0, len(steps), max(1, len(steps) // 10))
    ax.set_xticks(list(ticks))
    ax.set_xticklabels([str(steps[i]) for i in ticks], fontsize=7)
    ax.set_xlabel("step")
    ax.set_title(f"FP8 {figure} per operand")
    fig.colorbar(image, ax=ax)
    fig.tight_layout()
    if out is not None:
        fig.savefig(out, dpi=120)
    return fig


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="Heat map and worst operands of FP8 statistics")
    parser.add_argument("path", help="JSON lines file written by transformer_fp8.debug")
    parser.add_argument("--figure", default="sqnr_db")
    parser.add_argument("--out", default=None, help="PNG file of the heat map")
    parser.add_argument("--top", type=int, default=10)
    args = parser.parse_args(argv)
    print(worst_report(args.path, args.figure, args.top))
    if args.out:
        plot_heatmap(args.path, args.figure, args.out)
        print(f"heat map written to {args.out}")


if __name__ == "__main__":
    main()
