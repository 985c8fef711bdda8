"""Host cost: CPU time per training step of FP8 layers against the torch layers they replace.

Thread CPU time (time.thread_time) per call, one CPU thread, the cases timed in interleaved
rounds: nn.Linear against tfp8.Linear under DelayedScaling and Float8CurrentScaling (forward +
backward; each with its C++ step and with the Python path it replaces), 24 layers in one step
(fp8_autocast's exit and the backward update included), LayerNormLinear, LayerNormMLP and a
TransformerLayer inside fp8_autocast (with their C++ steps and with the Python path) against
themselves outside it (their torch composition), and the delayed-scaling update of 300 amax
histories (AmaxStep.reduce_and_update, each call after an untimed refill of row 0; and with
nothing recorded, its host work without the kernel's numerics). Every layer is at the minimal
width the FP8 path takes (16 rows or tokens, 16 features; TransformerLayer: one head of 16), on
both sides, so that kernels' own work is as small as it gets on both. The ratio is host work
only where the kernels of both sides cost nothing on the timed thread: with --device cuda
(both sides' kernels asynchronous; nothing in the timed region waits for the GPU), or on the
CPU with --null-kernels, where transformer_fp8's CPU kernels are replaced by ones that only
allocate their outputs (benchmarks/null_kernels.cpp, compiled on first use) and the torch
kernels left on both sides (torch's layers; attention, residual and bias adds) run at 16
features, where their arithmetic is negligible (a 16x16x16 GEMM is 4096 multiply-adds) and
what is left of them is their own host work. On the CPU without --null-kernels the FP8 rows also
emulate their
casts and GEMMs: an upper bound of the host overhead.

    python benchmarks/bench_host.py [--smoke] [--null-kernels] [--device cpu|cuda] [--out DIR]
"""
from __future__ import annotations

import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

import transformer_fp8 as tfp8  # noqa: E402
from transformer_fp8.modules import linear_fused_step  # noqa: E402
from transformer_fp8.quantization.amax_step import AmaxStep  # noqa: E402

NAME = "bench_host"
TITLE, WHAT = common.doc_summary(__doc__)
# Targets of the host-overhead work: FP8 time over torch time (update: microseconds).
TARGETS = {"Linear fwd+bwd": 1.2, "24 Linear layers, one step": 1.0,
           "TransformerLayer fwd+bwd": 1.2}  # (the norm-first modules: no target of their own)
UPDATE_TARGET_US = 20.0

COLUMNS = [
    ["case", "case", "{}"],
    ["recipe", "FP8 recipe", "{}"],
    ["time_torch_us", "torch CPU time / step (µs)", "{:.1f}"],
    ["time_fp8_us", "FP8 CPU time / step (µs)", "{:.1f}"],
    ["ratio", "FP8 / torch", "{:.2f}"],
    ["target", "target", "{}"],
]


def thread_time_per_call(fns: dict, reps: int, rounds: int = 4, warmup: int = 3) -> dict:
    """{name: median thread CPU seconds per call}, the functions timed in turns."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    samples = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            for _ in range(max(1, reps // rounds)):
                start = time.thread_time()
                fn()
                samples[name].append(time.thread_time() - start)
    return {name: statistics.median(values) for name, values in samples.items()}


def linear_step(model, x, recipe=None):
    def step():
        if recipe is None:
            out = model(x)
        else:
            with tfp8.fp8_autocast(fp8_recipe=recipe):
                out = model(x)
        out.sum().backward()
    return step


# The switches of the C++ steps (modules/linear_fused_step.py): Linear, LayerNormLinear,
# LayerNormMLP.
FUSED_STEP_SWITCHES = ("ENABLED", "NORM_ENABLED", "NORM_MLP_ENABLED")


def python_path(step):
    """The step with the C++ steps turned off (modules/linear_fused_step.py): the Python
    autograd functions they replace, timed in the same run."""
    def run():
        saved = {name: getattr(linear_fused_step, name) for name in FUSED_STEP_SWITCHES}
        for name in FUSED_STEP_SWITCHES:
            setattr(linear_fused_step, name, False)
        try:
            step()
        finally:
            for name, value in saved.items():
                setattr(linear_fused_step, name, value)
    return run


def stack(layer_type, depth, width, **kwargs):
    torch.manual_seed(0)
    return torch.nn.Sequential(*[layer_type(width, width, **kwargs) for _ in range(depth)])


# The layers' sizes: the minimal ones the FP8 path takes (features a multiple of 16), on both
# sides of every ratio.
WIDTH = 16  # features of every layer; rows of the Linear input
TOKENS = (8, 2)  # (sequence, batch) of the norm-first modules and TransformerLayer
FFN = 16  # LayerNormMLP's and TransformerLayer's hidden size of the MLP
HEADS = 1  # TransformerLayer: one head of 16


def update_step(count: int, device=None):
    """AmaxStep.reduce_and_update over ``count`` recorded states of Linear layers, and the refill
    of row 0 of their histories (something recorded, as after a step) that precedes each."""
    recipe = tfp8.DelayedScaling(amax_history_len=16)
    layers = [tfp8.Linear(16, 16, recipe=recipe, device=device) for _ in range(count)]
    step = AmaxStep(recipe, None, include_unrecorded=False)
    for layer in layers:
        step.add(layer._scaling_states[0])
    rows = [layer.fp8_fwd_amax_history[0] for layer in layers]

    def refill():
        for row in rows:
            row.fill_(1.0)

    def update():
        step.reduce_and_update()
        return layers  # (the step holds its states weakly: the layers must stay alive)
    return update, refill, rows


def check_updated(rows) -> None:
    """Raise unless the last update consumed every recorded row (the timed calls did the
    update, not nothing)."""
    if any(bool(row.any()) for row in rows):
        raise RuntimeError("bench_host: the update of the histories did not run")


def check_fp8_ran(case: str, layer) -> None:
    """Raise unless every amax history of ``layer`` recorded something: its FP8 rows ran the
    FP8 path at these sizes, not a high-precision fallback. (Not with null kernels: they record
    nothing.)"""
    histories = {name: buffer for name, buffer in layer.named_buffers()
                 if "amax_history" in name}
    empty = [name for name, buffer in histories.items() if not bool(buffer.any())]
    if not histories or empty:
        raise RuntimeError(f"bench_host: {case} did not run its FP8 path "
                           f"(amax histories {empty or 'none'} empty)")


def thread_time_after(prepare, fn, reps: int, warmup: int = 3) -> float:
    """Median thread CPU seconds of fn(), each call after an untimed prepare()."""
    for _ in range(warmup):
        prepare()
        fn()
    samples = []
    for _ in range(reps):
        prepare()
        start = time.thread_time()
        fn()
        samples.append(time.thread_time() - start)
    return statistics.median(samples)


# The operators benchmarks/null_kernels.cpp replaces (every one a step of these layers calls but
# update_delayed_scaling, whose rows keep their real kernel).
NULL_KERNEL_OPS = ("amax", "cast_to_fp8", "cast_transpose_to_fp8", "cast_from_fp8",
                   "compute_scale_from_amax", "fp8_gemm", "cast_transpose_dbias",
                   "layernorm_fwd", "layernorm_fwd_fp8", "layernorm_bwd", "rmsnorm_fwd",
                   "rmsnorm_fwd_fp8", "rmsnorm_bwd", "activation_fwd", "activation_fwd_fp8",
                   "activation_bwd", "activation_bwd_fp8")


def load_null_kernels() -> None:
    """Replace the CPU kernels of transformer_fp8's operators, for this process, by kernels that
    only allocate their outputs (benchmarks/null_kernels.cpp); raise if any is not replaced."""
    from torch.utils.cpp_extension import load
    source = os.path.join(os.path.dirname(os.path.abspath(__file__)), "null_kernels.cpp")
    load(name="transformer_fp8_null_kernels", is_python_module=False, extra_cflags=["-O2"],
         sources=[source])
    for op in NULL_KERNEL_OPS:
        active = [line for line in torch._C._dispatch_dump(f"transformer_fp8::{op}").splitlines()
                  if line.startswith("CPU:")]
        if not (active and "null_kernels.cpp" in active[0]):
            raise RuntimeError(f"bench_host --null-kernels: the CPU kernel of {op} was not "
                               f"replaced ({active})")


def add_arguments(parser) -> None:
    parser.add_argument("--null-kernels", action="store_true",
                        help="time host work only: transformer_fp8's CPU kernels replaced by "
                             "kernels that only allocate (benchmarks/null_kernels.cpp); CPU "
                             "only")


def main(argv=None) -> dict:
    args = common.parse_args(TITLE, argv, add_arguments)
    device = args.device
    if device.type not in ("cpu", "cuda"):
        raise SystemExit(f"bench_host: --device cpu or cuda, got {device}")
    if args.null_kernels:
        if device.type != "cpu":
            raise SystemExit("bench_host: --null-kernels replaces CPU kernels: use it with "
                             "--device cpu (on CUDA the kernels are asynchronous already)")
        load_null_kernels()
    reps = 8 if args.smoke else 200
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rows = []
        x = torch.randn(WIDTH, WIDTH, device=device)
        delayed, current = tfp8.DelayedScaling(amax_history_len=16), tfp8.Float8CurrentScaling()
        # one Linear, forward + backward
        nn_layer = stack(torch.nn.Linear, 1, WIDTH, device=device)
        fp8_delayed = stack(tfp8.Linear, 1, WIDTH, recipe=delayed, device=device)
        fp8_current = stack(tfp8.Linear, 1, WIDTH, recipe=current, device=device)
        t = thread_time_per_call({"nn": linear_step(nn_layer, x),
                                  "delayed": linear_step(fp8_delayed, x, delayed),
                                  "delayed, Python path": python_path(
                                      linear_step(fp8_delayed, x, delayed)),
                                  "current": linear_step(fp8_current, x, current),
                                  "current, Python path": python_path(
                                      linear_step(fp8_current, x, current))}, reps)
        for recipe in ("delayed", "delayed, Python path", "current", "current, Python path"):
            rows.append({"case": "Linear fwd+bwd", "recipe": recipe,
                         "time_torch_us": t["nn"] * 1e6, "time_fp8_us": t[recipe] * 1e6})
        # 24 layers in one step
        depth = 4 if args.smoke else 24
        t = thread_time_per_call({"nn": linear_step(stack(torch.nn.Linear, depth, WIDTH,
                                                          device=device), x),
                                  "delayed": linear_step(stack(tfp8.Linear, depth, WIDTH,
                                                               recipe=delayed, device=device),
                                                         x, delayed)},
                                 max(4, reps // 4))
        rows.append({"case": "24 Linear layers, one step" if not args.smoke else
                     f"{depth} Linear layers, one step", "recipe": "delayed",
                     "time_torch_us": t["nn"] * 1e6, "time_fp8_us": t["delayed"] * 1e6})
        # The norm-first modules and TransformerLayer: each module's high-precision form
        # (outside fp8_autocast: its torch composition) against FP8
        torch.manual_seed(0)
        h = torch.randn(*TOKENS, WIDTH, device=device)
        modules = {
            "LayerNormLinear fwd+bwd": lambda r: tfp8.LayerNormLinear(WIDTH, WIDTH, recipe=r,
                                                                      device=device),
            "LayerNormMLP fwd+bwd": lambda r: tfp8.LayerNormMLP(WIDTH, FFN, recipe=r,
                                                                device=device),
            "TransformerLayer fwd+bwd": lambda r: tfp8.TransformerLayer(
                WIDTH, FFN, HEADS, hidden_dropout=0.0, attention_dropout=0.0, recipe=r,
                device=device)}
        for case, make in modules.items():
            layer, layer_current = make(delayed), make(current)
            t = thread_time_per_call({"torch": linear_step(layer, h),
                                      "delayed": linear_step(layer, h, delayed),
                                      "delayed, Python path": python_path(
                                          linear_step(layer, h, delayed)),
                                      "current": linear_step(layer_current, h, current)},
                                     max(4, reps // 4))
            if not args.null_kernels:
                check_fp8_ran(case, layer)
            for recipe in ("delayed", "delayed, Python path", "current"):
                rows.append({"case": case, "recipe": recipe, "time_torch_us": t["torch"] * 1e6,
                             "time_fp8_us": t[recipe] * 1e6})
        # the update of 300 histories (each after an untimed refill of their row 0)
        count = 16 if args.smoke else 300
        update, refill, recorded_rows = update_step(count, device)
        rows.append({"case": f"update of {count} histories", "recipe": "delayed",
                     "time_fp8_us": thread_time_after(refill, update, reps) * 1e6})
        check_updated(recorded_rows)
        # the same with nothing recorded: the host work of the call without the kernel's
        # numerics (each column is skipped at its first read)
        rows.append({"case": f"update of {count} histories, none recorded", "recipe": "delayed",
                     "time_fp8_us": thread_time_after(lambda: None, update, reps) * 1e6})
    finally:
        torch.set_num_threads(threads)
    for row in rows:
        row["ratio"] = common.ratio(row["time_fp8_us"], row.get("time_torch_us"))
        row["target"] = (f"<= {TARGETS[row['case']]}x" if row["case"] in TARGETS
                         else f"<= {UPDATE_TARGET_US:.0f} µs"
                         if row["case"] == f"update of {count} histories"
                         else None)
    if device.type == "cuda":
        method = ("tensors and layers on the GPU: both sides' kernels asynchronous, so the "
                  "times are host work (launches included) on both sides")
    elif args.null_kernels:
        method = ("transformer_fp8's CPU kernels replaced by null kernels that only allocate "
                  "(--null-kernels): the FP8 rows are host work plus the few torch kernels "
                  "they keep (attention, adds); the torch rows keep their real CPU kernels, whose "
                  f"arithmetic at {WIDTH} features is negligible: host work on both sides")
    else:
        method = ("real CPU kernels on both sides: the FP8 rows include the CPU emulation of "
                  "casts and GEMMs (an upper bound of the host overhead)")
    notes = [f"thread CPU time (time.thread_time), one CPU thread ({common.cpu_model()}), "
             "median over interleaved rounds; " + method,
             f"sizes, both sides: Linear {WIDTH}x{WIDTH} on {WIDTH} rows; the norm-first "
             f"modules and TransformerLayer hidden {WIDTH}, FFN {FFN}, {HEADS} head, "
             f"{TOKENS[0]}x{TOKENS[1]} tokens (LayerNorm, gelu)"]
    name = NAME + ("_null_kernels" if args.null_kernels else "")
    return common.report(args, name, TITLE, WHAT, COLUMNS, rows, plot=plot, notes=notes,
                         extra={"width": WIDTH, "ffn": FFN, "heads": HEADS,
                                "tokens": list(TOKENS), "null_kernels": args.null_kernels})


def plot(ax, payload):
    rows = [r for r in payload["rows"] if r.get("ratio") is not None]
    common.bar_plot(ax, [f"{r['case']}\n{r['recipe']}" for r in rows],
                    [r["ratio"] for r in rows], "FP8 / torch CPU time",
                    "host cost per step", reference=1.0, reference_label="torch")


if __name__ == "__main__":
    main()
