"""FP8 debugging: per-layer statistics of every FP8 GEMM operand, and per-layer precision
overrides.

    import transformer_fp8 as tfp8
    from transformer_fp8 import debug

    with debug.collect_stats(model, layers="*", frequency=10, path="fp8.jsonl") as stats:
        ...train, calling stats.step() after each step...
    print(debug.worst_report(stats.records))           # the layers and tensors that lose most
    debug.plot_heatmap("fp8.jsonl", "underflow_frac", out="underflow.png")
    debug.override(model, "blocks.3.*", fp8=False)      # or recipe=tfp8.Float8BlockScaling()

Statistics (stats.py): amax, scales, fraction flushed to zero, fraction saturated, dynamic
range, SQNR of the quantised tensor, and per block for block recipes. Eager mode only.
"""
from .analysis import heatmap_matrix, plot_heatmap, worst_report
from .collector import Fp8Stats, collect_stats, select_layers
from .overrides import PrecisionOverride, clear_overrides, override, overrides
from .stats import operand_stats
from .writers import read_records

__all__ = ["Fp8Stats", "PrecisionOverride", "clear_overrides", "collect_stats",
           "heatmap_matrix", "operand_stats", "override", "overrides", "plot_heatmap",
           "read_records", "select_layers", "worst_report"]
