"""One Linear layer's training step (forward + backward) in FP8 and in bf16.

Measures y = layer(x); y.backward(g) with bf16 x [16384, 8192], weight [8192, 8192] and bias
(and the small and medium layers M = 2048, K = N = 1024 and 4096):
torch.nn.Linear in bf16; transformer_fp8.Linear under fp8_autocast with DelayedScaling (the
scale update at the context's exit included), the same under torch.compile(fullgraph=True),
with Float8CurrentScaling and with Float8BlockScaling (1x128 activation and gradient
blocks, 128x128 weight blocks); torchao's float8 training (convert_to_float8_training +
torch.compile) where torchao imports ('n/a' otherwise). On CUDA, bf16 nn.Linear,
DelayedScaling and Float8CurrentScaling also run with the whole step (forward under
fp8_autocast, backward, scale updates) captured in one CUDA graph, a step being one replay
(--graphs auto|on|off), where launch costs no longer count. The compiled rows run on CUDA by default
(--compile on|off|auto); each shape is compiled afresh and statically (torch._dynamo.reset(),
then dynamic=False), so no shape gets a dynamic-shape graph from the shapes compiled before it.
The floor is the three FP8 GEMMs of the step alone (forward, dgrad, wgrad through fp8_gemm on
ready FP8 operands), timed in the same run: '% of GEMM floor' = floor time / step time, the
share of the step spent in the GEMMs rather than in casts, scaling and bookkeeping. Reported:
time per step (CUDA events around 10 back-to-back steps, median; the implementations timed in
turns over 4 rounds), host time per step (the CPU's time to issue the step; when it reaches the
step time, the step is host-bound), TFLOP/s = 6 M K N / time, speedup over bf16 nn.Linear.

    python benchmarks/bench_linear.py [--smoke] [--out DIR] [--compile auto|on|off]
        [--graphs auto|on|off]
"""
from __future__ import annotations

import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import transformer_fp8 as tf8  # noqa: E402
from transformer_fp8 import ops  # noqa: E402

NAME = "bench_linear"
TITLE, WHAT = common.doc_summary(__doc__)
# (M, K, N): a large layer, and small and medium ones where host overhead and launches show.
SHAPES = [(16384, 8192, 8192), (2048, 1024, 1024), (2048, 4096, 4096)]
# Two shapes: the second is where a compiled row would get a dynamic-shape graph.
SMOKE_SHAPES = [(64, 128, 96), (32, 64, 48)]
INNER = 10  # back-to-back steps per timed repetition
TORCHAO = "torchao float8 + torch.compile"
COMPILED = "transformer_fp8.Linear, DelayedScaling + torch.compile"
FLOOR = "3 x fp8_gemm only (floor)"
GRAPHED = ", CUDA graph of the whole step"
# The rows captured whole: recipes whose step replays bit for bit (tests/test_cuda_graphs.py).
GRAPHED_ROWS = ("torch.nn.Linear (bf16)", "transformer_fp8.Linear, DelayedScaling",
                "transformer_fp8.Linear, Float8CurrentScaling")
BF16 = "torch.nn.Linear (bf16)"

COLUMNS = [
    ["impl", "implementation", "{}"],
    ["shape", "M x K x N", "{}"],
    ["time_ms", "fwd+bwd (ms)", "{:.3f}"],
    ["host_ms", "host time (ms)", "{:.3f}"],
    ["tflops", "TFLOP/s", "{:.1f}"],
    ["pct_floor", "% of GEMM floor", "{:.1f}"],
    ["speedup", "speedup vs bf16", "{:.2f}x"],
]


def make_layers(k: int, n: int, device: torch.device) -> dict:
    """name -> (module, fp8 recipe or None); every module holds the same bf16 weights."""
    base = torch.nn.Linear(k, n, device=device, dtype=torch.bfloat16)
    layers = {}
    for name, recipe in common.precision_variants().items():
        if recipe is None:
            layers[BF16] = (base, None)
            continue
        layer = tf8.Linear(k, n, params_dtype=torch.bfloat16, device=device)
        layer.load_state_dict(base.state_dict())  # an nn.Linear state_dict loads as it is
        layers[f"transformer_fp8.Linear, {name.removeprefix('fp8 ')}"] = (layer, recipe)
    return layers


def torchao_layer(base: torch.nn.Linear, backend: str = "inductor"):
    """torchao's float8 training of a copy of ``base``, compiled; None with the reason printed
    when torchao is missing or refuses."""
    try:
        import copy

        from torchao.float8 import convert_to_float8_training
        model = convert_to_float8_training(torch.nn.Sequential(copy.deepcopy(base)))
        return torch.compile(model, dynamic=False, backend=backend)
    except Exception as exc:
        print(f"({TORCHAO}: n/a, {type(exc).__name__}: {str(exc).splitlines()[0][:160]})")
        return None


def compiled_step(layers: dict, x, g, backend: str = "inductor"):
    """A training step of a copy of the DelayedScaling layer under torch.compile(fullgraph=True),
    tried once here; None with the reason printed when it fails."""
    import copy

    name = next(n for n, (_, recipe) in layers.items()
                if isinstance(recipe, tf8.DelayedScaling))
    layer, recipe = layers[name]
    layer = copy.deepcopy(layer)
    training_step(layer, recipe, x, g)()  # one eager step: the state takes the recipe's shapes
    step = training_step(torch.compile(layer, fullgraph=True, dynamic=False, backend=backend),
                         recipe, x, g)
    try:
        step()
    except Exception as exc:
        print(f"({COMPILED}: n/a, {type(exc).__name__}: {str(exc).splitlines()[0][:160]})")
        return None
    return step


def graphed_step(layer, recipe, x, g):
    """The training step of a copy of ``layer`` (on a copy of ``x``) captured whole in one CUDA
    graph, after three warm-up steps on a side stream (plans, workspaces, the recipe's state):
    a step is one replay. Gradients are set to None before the capture, so the backward
    allocates them from the graph's pool, as torch's whole-network capture does. Returns
    (replay, the layer's copy, x's copy), or None, the reason printed, where the warm-up or the
    capture fails; one replay has run (four steps in all). replay holds the graph, the copies
    and g: a graph keeps none of the tensors it was captured on alive."""
    import copy

    layer = copy.deepcopy(layer)
    x = x.detach().clone().requires_grad_(True)
    step = training_step(layer, recipe, x, g)
    graph = torch.cuda.CUDAGraph()
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                step()
        torch.cuda.current_stream().wait_stream(side)
        x.grad = None
        layer.zero_grad(set_to_none=True)
        with torch.cuda.graph(graph):
            with common.fp8_context(recipe):
                y = layer(x)
            y.backward(g)
    except Exception as exc:
        print(f"(graphed step: n/a, {common.exception_chain(exc)})")
        return None

    def replay(kept=(graph, layer, x, g)):
        kept[0].replay()

    replay()
    return replay, layer, x


def training_step(layer, recipe, x, g):
    def step():
        x.grad = None
        layer.zero_grad(set_to_none=True)
        with common.fp8_context(recipe):
            y = layer(x)
        y.backward(g)
    return step


def gemm_floor(m: int, k: int, n: int, device: torch.device):
    """The step's three FP8 GEMMs on ready operands (E4M3 x, w; E5M2 grad), as the layer runs
    them: fwd x[M,K]·w[N,K]ᵀ, dgrad g[M,N]·wᵀ[K,N]ᵀ, wgrad gᵀ[N,M]·xᵀ[K,M]ᵀ."""
    one = torch.ones(1, device=device)

    def fp8(rows, cols, dtype):
        return torch.randn(rows, cols, device=device).to(dtype)

    x, x_t = fp8(m, k, torch.float8_e4m3fn), fp8(k, m, torch.float8_e4m3fn)
    w, w_t = fp8(n, k, torch.float8_e4m3fn), fp8(k, n, torch.float8_e4m3fn)
    g, g_t = fp8(m, n, torch.float8_e5m2), fp8(n, m, torch.float8_e5m2)
    bias = torch.zeros(n, device=device, dtype=torch.bfloat16)

    def step():
        ops.fp8_gemm(x, one, w, one, torch.bfloat16, bias=bias, use_fast_accum=True)
        ops.fp8_gemm(g, one, w_t, one, torch.bfloat16)
        ops.fp8_gemm(g_t, one, x_t, one, torch.bfloat16)
    return step


def plot(ax, payload):
    rows = [r for r in payload["rows"] if r["shape"] == payload["rows"][0]["shape"]]
    common.bar_plot(ax, [r["impl"] for r in rows], [r["tflops"] for r in rows], "TFLOP/s",
                    f"Linear fwd+bwd, {rows[0]['shape']}")


def host_seconds(step, device: torch.device, reps: int) -> float:
    """Host time per step: the CPU's time to issue ``reps`` steps, not waiting for the device
    (close to the step time when the step is host-bound)."""
    common.synchronize(device)
    start = time.perf_counter()
    for _ in range(reps):
        step()
    seconds = (time.perf_counter() - start) / reps
    common.synchronize(device)
    return seconds


def measure_shape(m: int, k: int, n: int, args, warmup: int, reps: int,
                  inner: int = 1) -> list[dict]:
    x = torch.randn(m, k, device=args.device, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(m, n, device=args.device, dtype=torch.bfloat16)
    layers = make_layers(k, n, args.device)
    steps = {name: training_step(layer, recipe, x, g) for name, (layer, recipe) in layers.items()}
    compile_rows = args.compile == "on" or (args.compile == "auto"
                                            and args.device.type == "cuda")
    if compile_rows:
        # This shape's graphs compiled afresh and static (with dynamic=False below): without
        # both, a second shape recompiles the same code objects with symbolic sizes (dynamo's
        # automatic dynamic shapes), and a row would depend on the shapes measured before it.
        torch._dynamo.reset()
    compiled = torchao_layer(layers[BF16][0], args.compile_backend) if compile_rows else None
    steps[TORCHAO] = training_step(compiled, None, x, g) if compiled is not None else None
    steps[COMPILED] = compiled_step(layers, x, g, args.compile_backend) if compile_rows else None
    steps[FLOOR] = gemm_floor(m, k, n, args.device)
    graph_rows = args.graphs == "on" or (args.graphs == "auto" and args.device.type == "cuda")
    if graph_rows:  # last: a failed capture must not disturb the rows above
        for name in GRAPHED_ROWS:
            layer, recipe = layers[name]
            graphed = graphed_step(layer, recipe, x, g)
            steps[name + GRAPHED] = graphed[0] if graphed is not None else None

    timings = common.time_interleaved(steps, args.device, warmup=warmup, reps=reps,
                                      rounds=1 if args.smoke else 4, inner=inner)
    seconds = {name: t.median_s if t else None for name, t in timings.items()}
    host = {name: host_seconds(step, args.device, reps) if step else None
            for name, step in steps.items()}
    return [{"impl": name, "shape": f"{m}x{k}x{n}",
             "time_ms": s * 1e3 if s else None,
             "host_ms": host[name] * 1e3 if host[name] else None,
             "tflops": common.ratio(6 * m * k * n / 1e12, s),
             "pct_floor": common.ratio(100 * seconds[FLOOR], s),
             "speedup": common.ratio(seconds[BF16 + GRAPHED if name.endswith(GRAPHED)
                                             else BF16], s)}
            for name, s in seconds.items()]


def add_arguments(parser) -> None:
    parser.add_argument("--compile", choices=("auto", "on", "off"), default="auto",
                        help="the torch.compile rows: auto = on CUDA only (default)")
    parser.add_argument("--compile-backend", default="inductor",
                        help="torch.compile backend of the compiled rows (default inductor)")
    parser.add_argument("--graphs", choices=("auto", "on", "off"), default="auto",
                        help="the rows captured in a CUDA graph: auto = on CUDA (default)")


def main(argv=None) -> dict:
    args = common.parse_args(TITLE, argv, add_arguments)
    warmup, reps, inner = (1, 2, 2) if args.smoke else (5, 20, INNER)
    rows = []
    for m, k, n in SMOKE_SHAPES if args.smoke else SHAPES:
        rows += measure_shape(m, k, n, args, warmup, reps, inner)
    notes = ["bf16 = torch.nn.Linear with bf16 parameters; FP8 recipes use Format.HYBRID "
             "(E4M3 input and weight, E5M2 gradients); weights and bias are the same in every "
             "layer", f"{TORCHAO}: where torchao imports; compiled rows (--compile "
             f"{args.compile}, backend {args.compile_backend}): compiled per shape after "
             "torch._dynamo.reset(), dynamic=False",
             f"time per step: CUDA events around {inner} back-to-back steps, median over "
             f"{reps} repetitions", f"'{GRAPHED.lstrip(', ')}' rows (--graphs {args.graphs}): "
             "forward, backward and scale updates captured once, each step one replay; their "
             "speedup is over the bf16 row captured the same way, and their '% of GEMM floor' "
             "compares a replay with GEMMs launched one by one (it can pass 100% at small "
             "shapes)"]
    return common.report(args, NAME, TITLE, WHAT, COLUMNS, rows, plot=plot, notes=notes)


if __name__ == "__main__":
    main()
