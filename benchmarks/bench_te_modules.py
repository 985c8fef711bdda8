"""LayerNormMLP and TransformerLayer training steps (forward + backward) in FP8 and in bf16.

Measures y = module(x); y.backward(g) with bf16 parameters and input x [tokens, hidden]
(8192 tokens: sequence 2048 x batch 4; hidden 4096, FFN 16384, 32 heads of 128, 8 key/value
groups, RMSNorm + SwiGLU as in Llama-style models) for transformer_fp8.LayerNormMLP and
transformer_fp8.TransformerLayer inside fp8_autocast with DelayedScaling (the scale update at
the context's exit included), Float8CurrentScaling and Float8BlockScaling, against bf16
baselines. FP8 changes more than the GEMMs: inside fp8_autocast the norm and the activation run as
fused kernels that emit
FP8 (transformer_fp8.fused_ops), while the same module outside fp8_autocast runs them as
unfused float32 torch ops (the whole fc1 output upcast to float32 for SwiGLU, autograd through
each op). So the speedup is reported against bf16 baselines that fuse the norm and activation
too: the same module outside fp8_autocast under torch.compile (inductor, fullgraph, static
shapes) and, for LayerNormMLP, the same step on transformer_fp8's non-FP8 fused norm and
activation kernels with bf16 GEMMs; 'speedup vs fused bf16' is over the faster of the two.
The unfused eager module is kept as its own row and column ('vs unfused eager bf16'); it is
the baseline of the figures published before 2026-11-27. Attention (scaled_dot_product_attention,
causal, GQA) runs in bf16 in every row. Reported: time per step (CUDA events around 5
back-to-back steps, median; the variants timed in turns over 4 rounds), TFLOP/s of the GEMMs
(6 x weights x tokens; attention's own FLOPs not counted), and the speedups, all measured in the
same run.

    python benchmarks/bench_te_modules.py [--smoke] [--out DIR] [--no-compile]
"""
from __future__ import annotations

import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from transformer_fp8.modules.layernorm_mlp import LayerNormMLP  # noqa: E402
from transformer_fp8.modules.transformer_layer import TransformerLayer  # noqa: E402
from transformer_fp8.ops import fused as fused_ops  # noqa: E402

NAME = "bench_te_modules"
TITLE, WHAT = common.doc_summary(__doc__)
# (seq, batch, hidden, ffn, heads, kv groups)
SHAPE = (2048, 4, 4096, 16384, 32, 8)
SMOKE_SHAPE = (16, 2, 64, 128, 4, 2)
INNER = 5  # back-to-back steps per timed repetition

UNFUSED = "bf16 unfused eager (module outside fp8_autocast)"
COMPILED = "bf16 torch.compile (same module, fused by inductor)"
FUSED_KERNELS = "bf16 fused kernels (transformer_fp8 non-FP8 norm + activation)"
FAIR_BASELINES = (COMPILED, FUSED_KERNELS)

COLUMNS = [
    ["module", "module", "{}"],
    ["precision", "precision", "{}"],
    ["shape", "tokens x hidden x ffn", "{}"],
    ["time_ms", "fwd+bwd (ms)", "{:.3f}"],
    ["tflops", "GEMM TFLOP/s", "{:.1f}"],
    ["speedup", "speedup vs fused bf16", "{:.2f}x"],
    ["speedup_unfused", "vs unfused eager bf16", "{:.2f}x"],
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


class _FusedKernelsMLP(torch.autograd.Function):
    """LayerNormMLP's step (RMSNorm, fc1, gated activation, fc2) in high precision on
    transformer_fp8's non-FP8 fused kernels: rmsnorm_fwd / rmsnorm_bwd and activation_fwd /
    activation_bwd, the kernels the FP8 path runs with an FP8 cast fused in, and bf16 GEMMs.
    Saves what the FP8 path saves (in high precision): x, rstd, the norm's output, the fc1
    output and the activation's output."""

    @staticmethod
    def forward(ctx, x, ln_weight, fc1_weight, fc1_bias, fc2_weight, fc2_bias, eps, activation):
        x2 = x.reshape(-1, x.shape[-1])
        y, rstd = fused_ops.rmsnorm_fwd(x2, ln_weight, eps)
        h = torch.addmm(fc1_bias, y, fc1_weight.t())
        a = fused_ops.activation_fwd(h, activation)
        out = torch.addmm(fc2_bias, a, fc2_weight.t())
        ctx.save_for_backward(x2, rstd, y, h, a, ln_weight, fc1_weight, fc2_weight)
        ctx.activation, ctx.shape = activation, x.shape
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, dout):
        x2, rstd, y, h, a, ln_weight, fc1_weight, fc2_weight = ctx.saved_tensors
        d2 = dout.reshape(-1, dout.shape[-1])
        da = d2 @ fc2_weight
        dfc2_weight, dfc2_bias = d2.t() @ a, d2.sum(0)
        dh = fused_ops.activation_bwd(da, h, ctx.activation)
        dy = dh @ fc1_weight
        dfc1_weight, dfc1_bias = dh.t() @ y, dh.sum(0)
        dx, dln_weight = fused_ops.rmsnorm_bwd(dy, x2, rstd, ln_weight)
        return (dx.view(ctx.shape), dln_weight, dfc1_weight, dfc1_bias, dfc2_weight, dfc2_bias,
                None, None)


class FusedKernelsLayerNormMLP(torch.nn.Module):
    """A bf16 LayerNormMLP (RMSNorm, biases, gated activation) on the fused kernels, sharing
    ``module``'s parameters."""

    def __init__(self, module: LayerNormMLP):
        super().__init__()
        if module.normalization != "RMSNorm" or module.zero_centered_gamma or \
                module.fc1_bias is None or module.fc2_bias is None:
            raise ValueError("FusedKernelsLayerNormMLP: RMSNorm with biases only")
        self.module = module

    def forward(self, x):
        m = self.module
        return _FusedKernelsMLP.apply(x, m.layer_norm_weight, m.fc1_weight, m.fc1_bias,
                                      m.fc2_weight, m.fc2_bias, m.eps, m.activation)


def compiled(module):
    """The module compiled afresh (torch._dynamo.reset()), fullgraph, static shapes."""
    torch._dynamo.reset()
    return torch.compile(module, fullgraph=True, dynamic=False)


def measure(kind: str, shape, args, warmup: int, reps: int, inner: int) -> list[dict]:
    seq, batch, hidden = shape[:3]
    x = torch.randn(seq, batch, hidden, device=args.device, dtype=torch.bfloat16,
                    requires_grad=True)
    g = torch.randn_like(x)
    bf16 = make_module(kind, shape, args.device, None)
    steps = {UNFUSED: tried(f"{kind}, {UNFUSED}", training_step(bf16, None, x, g))}
    if args.no_compile:
        steps[COMPILED] = None
    else:
        start = time.perf_counter()
        steps[COMPILED] = tried(f"{kind}, {COMPILED}",
                                training_step(compiled(bf16), None, x, g))
        print(f"({kind}: torch.compile and the first step took "
              f"{time.perf_counter() - start:.1f} s)")
    steps[FUSED_KERNELS] = (tried(f"{kind}, {FUSED_KERNELS}", training_step(
        FusedKernelsLayerNormMLP(bf16), None, x, g)) if kind == "LayerNormMLP" else None)
    for name, recipe in common.precision_variants().items():
        if recipe is not None:
            module = make_module(kind, shape, args.device, recipe)
            steps[name] = tried(f"{kind}, {name}", training_step(module, recipe, x, g))
    timings = common.time_interleaved(steps, args.device, warmup=warmup, reps=reps,
                                      rounds=1 if args.smoke else 4, inner=inner)
    seconds = {name: t.median_s if t else None for name, t in timings.items()}
    fair = [seconds[name] for name in FAIR_BASELINES if seconds[name]]
    fastest_fair = min(fair) if fair else None
    flops = gemm_flops(kind, shape)
    return [{"module": kind, "precision": name, "shape": f"{seq * batch}x{hidden}x{shape[3]}",
             "time_ms": s * 1e3 if s else None, "tflops": common.ratio(flops / 1e12, s),
             "speedup": common.ratio(fastest_fair, s),
             "speedup_unfused": common.ratio(seconds[UNFUSED], s)}
            for name, s in seconds.items()]


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
                    [r["speedup"] for r in rows], "speedup vs fused bf16 (x)",
                    f"fwd+bwd, {rows[0]['shape']}", reference=1.0,
                    reference_label="faster fused bf16 baseline")


def add_arguments(parser) -> None:
    parser.add_argument("--no-compile", action="store_true",
                        help="no torch.compile baseline (then LayerNormMLP's fused-kernel "
                             "baseline alone; TransformerLayer's fair speedup reads n/a)")


def main(argv=None) -> dict:
    args = common.parse_args(TITLE, argv, add_arguments)
    warmup, reps, inner = (1, 2, 2) if args.smoke else (3, 12, INNER)
    shape = SMOKE_SHAPE if args.smoke else SHAPE
    rows = []
    for kind in ("LayerNormMLP", "TransformerLayer"):
        rows += measure(kind, shape, args, warmup, reps, inner)
    notes = ["speedup vs fused bf16: over the faster of the bf16 baselines that fuse the norm "
             "and the activation (torch.compile of the same module; for LayerNormMLP also "
             "transformer_fp8's non-FP8 fused kernels); torch.compile may fuse more than the "
             "FP8 path does (residual adds, bias), which favours bf16",
             "vs unfused eager bf16: over the same module outside fp8_autocast, whose norm and "
             "activation are unfused float32 torch ops; it credits FP8 with kernel fusion a "
             "bf16 path can have too",
             "FP8 recipes use Format.HYBRID (E4M3 input and weight, E5M2 gradients)",
             "TransformerLayer: attention (SDPA, causal, GQA) runs in bf16 in every row",
             f"time per step: CUDA events around {inner} back-to-back steps, median over "
             f"{reps} repetitions",
             "the FP8 path of LayerNormMLP/LayerNormLinear needs transformer_fp8.ops.fused"]
    extra = {"seq": shape[0], "batch": shape[1], "hidden": shape[2], "ffn": shape[3],
             "heads": shape[4], "kv_groups": shape[5]}
    return common.report(args, NAME, TITLE, WHAT, COLUMNS, rows, plot=plot, notes=notes,
                         extra=extra)


if __name__ == "__main__":
    main()
