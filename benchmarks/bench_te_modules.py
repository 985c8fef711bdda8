"""LayerNormMLP and TransformerLayer training steps (forward + backward) in FP8 and in bf16.

Measures y = module(x); y.backward(g) with bf16 parameters and input x [tokens, hidden]
(8192 tokens: sequence 2048 x batch 4; hidden 4096, FFN 16384, 32 heads of 128, 8 key/value
groups, RMSNorm + SwiGLU as in Llama-style models): transformer_fp8.LayerNormMLP and
transformer_fp8.TransformerLayer outside fp8_autocast (their bf16 torch composition) and
inside it with DelayedScaling (the scale update at the context's exit included) and
Float8CurrentScaling. Attention itself runs in bf16 in every case (scaled_dot_product_attention,
causal); only the GEMMs change. Reported: time per step (CUDA events, median; the variants timed
in turns over 4 rounds), TFLOP/s of the GEMMs (6 x weights x tokens; attention's own FLOPs not
counted), speedup over bf16 (the same module, outside fp8_autocast, in the same run).

    python benchmarks/bench_te_modules.py [--smoke] [--out DIR]
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from transformer_fp8.modules.layernorm_mlp import LayerNormMLP  # noqa: E402
from transformer_fp8.modules.transformer_layer import TransformerLayer  # noqa: E402

NAME = "bench_te_modules"
TITLE, WHAT = common.doc_summary(__doc__)
# (seq, batch, hidden, ffn, heads, kv groups)
SHAPE = (2048, 4, 4096, 16384, 32, 8)
SMOKE_SHAPE = (16, 2, 64, 128, 4, 2)

COLUMNS = [
    ["module", "module", "{}"],
    ["precision", "precision", "{}"],
    ["shape", "tokens x hidden x ffn", "{}"],
    ["time_ms", "fwd+bwd (ms)", "{:.3f}"],
    ["tflops", "GEMM TFLOP/s", "{:.1f}"],
    ["speedup", "speedup vs bf16", "{:.2f}x"],
]


def make_module(kind: str, shape, device, recipe):
    """The module under test in bf16, built for ``recipe`` (None: bf16 only), from a fixed
    seed: every precision holds the same weights."""
    _, _, hidden, ffn, heads, groups = shape
    torch.manual_seed(0)
    options = dict(params_dtype=torch.bfloat16, device=device, normalization="RMSNorm",
                   recipe=recipe)
    if kind == "LayerNormMLP":
        return LayerNormMLP(hidden, ffn, activation="swiglu", **options)
    return TransformerLayer(hidden, ffn, heads, num_gqa_groups=groups, hidden_dropout=0.0,
                            attention_dropout=0.0, activation="swiglu", **options)


def gemm_flops(kind: str, shape) -> float:
    """6 * weight elements * tokens: the forward, dgrad and wgrad GEMMs of each weight."""
    seq, batch, hidden, ffn, heads, groups = shape
    weights = hidden * 2 * ffn + ffn * hidden  # SwiGLU fc1 has 2 * ffn outputs
    if kind == "TransformerLayer":
        d = hidden // heads
        weights += hidden * (heads + 2 * groups) * d + heads * d * hidden
    return 6.0 * weights * seq * batch


def training_step(module, recipe, x, g):
    def step():
        x.grad = None
        module.zero_grad(set_to_none=True)
        with common.fp8_context(recipe):
            y = module(x)
        y.backward(g)
    return step


def measure(kind: str, shape, args, warmup: int, reps: int) -> list[dict]:
    seq, batch, hidden = shape[:3]
    x = torch.randn(seq, batch, hidden, device=args.device, dtype=torch.bfloat16,
                    requires_grad=True)
    g = torch.randn_like(x)
    steps = {}
    for name, recipe in common.precision_variants().items():
        module = make_module(kind, shape, args.device, recipe)
        steps[name] = tried(f"{kind}, {name}", training_step(module, recipe, x, g))
    timings = common.time_interleaved(steps, args.device, warmup=warmup, reps=reps,
                                      rounds=1 if args.smoke else 4)
    seconds = {name: t.median_s if t else None for name, t in timings.items()}
    flops = gemm_flops(kind, shape)
    return [{"module": kind, "precision": name, "shape": f"{seq * batch}x{hidden}x{shape[3]}",
             "time_ms": s * 1e3 if s else None, "tflops": common.ratio(flops / 1e12, s),
             "speedup": common.ratio(seconds["bf16"], s)} for name, s in seconds.items()]


def tried(label: str, step):
    """``step`` after one successful call; None with the reason printed when it fails (the
    row then reads n/a)."""
    try:
        step()
    except Exception as exc:
        print(f"({label}: n/a, {type(exc).__name__}: {str(exc).splitlines()[0][:160]})")
        return None
    return step


def plot(ax, payload):
    rows = payload["rows"]
    common.bar_plot(ax, [f"{r['module']}\n{r['precision']}" for r in rows],
                    [r["speedup"] for r in rows], "speedup vs bf16 (x)",
                    f"fwd+bwd, {rows[0]['shape']}", reference=1.0, reference_label="bf16")


def main(argv=None) -> dict:
    args = common.parse_args(TITLE, argv)
    warmup, reps = (1, 2) if args.smoke else (3, 12)
    shape = SMOKE_SHAPE if args.smoke else SHAPE
    rows = []
    for kind in ("LayerNormMLP", "TransformerLayer"):
        rows += measure(kind, shape, args, warmup, reps)
    notes = ["bf16 = the same module outside fp8_autocast (its torch composition, bf16 GEMMs); "
             "FP8 recipes use Format.HYBRID (E4M3 input and weight, E5M2 gradients)",
             "TransformerLayer: attention (SDPA, causal, GQA) runs in bf16 in every row",
             "the FP8 path of LayerNormMLP/LayerNormLinear needs transformer_fp8.ops.fused"]
    extra = {"seq": shape[0], "batch": shape[1], "hidden": shape[2], "ffn": shape[3],
             "heads": shape[4], "kv_groups": shape[5]}
    return common.report(args, NAME, TITLE, WHAT, COLUMNS, rows, plot=plot, notes=notes,
                         extra=extra)


if __name__ == "__main__":
    main()
