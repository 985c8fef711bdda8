"""Host time per training step of one Linear layer, eager against torch.compile(fullgraph=True,
dynamic=False), per recipe and backend, on the CPU: thread CPU time (time.thread_time) of
rounds of 10 steps, the cases in turns, min and median over the rounds (the machine is shared:
the min is the steadier figure). The step is bench_linear.py's training_step. Also counts the
graphs compiled and graph breaks while timed (0 and 0: no recompilation after the warm-up).

    PYTHONPATH=<checkout> python3 host_times.py [--n 16] [--rows 16] [--dtype float32]
        [--null-kernels] [--backends eager,aot_eager,inductor]
"""
import argparse, copy, os, statistics, sys, time
import torch
import transformer_fp8 as tfp8
from torch._dynamo.utils import counters

parser = argparse.ArgumentParser()
parser.add_argument("--n", type=int, default=16, help="in and out features")
parser.add_argument("--rows", type=int, default=16)
parser.add_argument("--dtype", default="float32")
parser.add_argument("--rounds", type=int, default=100)
parser.add_argument("--per-round", type=int, default=10)
parser.add_argument("--null-kernels", action="store_true",
                    help="transformer_fp8's CPU kernels replaced by bench_host's null kernels")
parser.add_argument("--backends", default="eager,aot_eager,inductor")
args = parser.parse_args()
if args.null_kernels:
    sys.path.insert(0, os.path.join(os.environ.get("PYTHONPATH", "."), "benchmarks"))
    import bench_host
    bench_host.load_null_kernels()
torch.set_num_threads(1)
dtype = getattr(torch, args.dtype)
torch.manual_seed(0)
x = torch.randn(args.rows, args.n, dtype=dtype, requires_grad=True)
g = torch.randn(args.rows, args.n, dtype=dtype)
recipes = {"nn.Linear": None, "delayed": tfp8.DelayedScaling(),
           "current": tfp8.Float8CurrentScaling()}


def training_step(layer, recipe):
    def step():
        x.grad = None
        layer.zero_grad(set_to_none=True)
        if recipe is None:
            y = layer(x)
        else:
            with tfp8.fp8_autocast(enabled=True, fp8_recipe=recipe):
                y = layer(x)
        y.backward(g)
    return step


steps = {}
for name, recipe in recipes.items():
    base = (torch.nn.Linear(args.n, args.n, dtype=dtype) if recipe is None
            else tfp8.Linear(args.n, args.n, params_dtype=dtype))
    for backend in args.backends.split(","):
        layer = copy.deepcopy(base)
        training_step(layer, recipe)()  # one eager step first, as bench_linear's compiled_step
        module = layer if backend == "eager" else torch.compile(
            layer, fullgraph=True, dynamic=False, backend=backend)
        steps[(name, backend)] = training_step(module, recipe)
for step in steps.values():
    for _ in range(10):
        step()
graphs = counters["stats"].get("unique_graphs", 0)
samples = {key: [] for key in steps}
for _ in range(args.rounds):
    for key, step in steps.items():
        start = time.thread_time()
        for _ in range(args.per_round):
            step()
        samples[key].append((time.thread_time() - start) / args.per_round)
print(f"Linear({args.n}, {args.n}), {args.rows} rows, {args.dtype}"
      f"{', null kernels' if args.null_kernels else ''}; graphs compiled while timed: "
      f"{counters['stats'].get('unique_graphs', 0) - graphs}, graph breaks: "
      f"{sum(counters['graph_break'].values())}")
for (name, backend), values in samples.items():
    print(f"{name:10s} {backend:10s} min {min(values) * 1e3:6.3f} ms   median "
          f"{statistics.median(values) * 1e3:6.3f} ms")
