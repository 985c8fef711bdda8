"""Instructions per training step of one Linear layer (16 rows, 16 features), eager against
torch.compile, under callgrind started with instrumentation off (cgrun.sh). For each case, after
its warm-up, the process has callgrind zero its counters, runs the case's steps, and dumps them
(callgrind_control, called from here: its own calls count a little, the same in every case).
The step is bench_linear.py's training_step: x.grad = None, zero_grad, the forward in
fp8_autocast, y.backward(g). With CG_NULL=1 (the default) transformer_fp8's C++ kernels are the
null kernels of bench_host.py --null-kernels: host work only, as on a GPU."""
import copy, os, subprocess, sys, gc
sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))
import torch
import bench_host as bh
import transformer_fp8 as tfp8
from torch._dynamo.utils import counters
if os.environ.get("CG_NULL", "1") == "1":
    bh.load_null_kernels()
torch.set_num_threads(1)
N = int(os.environ.get("CG_N", "20"))
torch.manual_seed(0)
x = torch.randn(16, 16, requires_grad=True)
g = torch.randn(16, 16)
recipes = {"nn.Linear": None, "delayed": tfp8.DelayedScaling(),
           "current": tfp8.Float8CurrentScaling()}
backends = os.environ.get("CG_BACKENDS", "eager,inductor,aot_eager").split(",")


def callgrind(*args):
    subprocess.run(["callgrind_control", *args, str(os.getpid())], check=True,
                   stdout=subprocess.DEVNULL)


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


cases = []
for rname, recipe in recipes.items():
    base = torch.nn.Linear(16, 16) if recipe is None else tfp8.Linear(16, 16)
    for backend in backends:
        layer = copy.deepcopy(base)
        training_step(layer, recipe)()  # one eager step first, as bench_linear's compiled_step
        mod = layer if backend == "eager" else torch.compile(layer, fullgraph=True,
                                                             dynamic=False, backend=backend)
        cases.append((f"{rname} {backend}", training_step(mod, recipe)))
for _, fn in cases:
    for _ in range(10):
        fn()
compiled = counters["stats"].get("unique_graphs", 0)
callgrind("-i", "on")
for name, fn in cases:
    for _ in range(5):
        fn()
    gc.collect()
    callgrind("-z")
    for _ in range(N):
        fn()
    callgrind("-d", name.replace(" ", "_"))
callgrind("-i", "off")
print("graphs compiled while measured:", counters["stats"].get("unique_graphs", 0) - compiled,
      "graph breaks:", sum(counters["graph_break"].values()), flush=True)
