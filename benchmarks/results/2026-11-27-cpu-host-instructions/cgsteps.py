"""Instructions per call of each case, under callgrind: each case's loop runs inside one
functools.reduce call, dumped separately (--dump-after=functools_reduce). Run with cgrun.sh."""
import os, sys, functools, gc
sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))
import torch
import bench_host as bh
import transformer_fp8 as tfp8
bh.load_null_kernels()
torch.set_num_threads(1)
N = int(os.environ.get("CG_N", "40"))
x = torch.randn(16, 16)
delayed, current = tfp8.DelayedScaling(amax_history_len=16), tfp8.Float8CurrentScaling()
nn_model = bh.stack(torch.nn.Linear, 1, 16)
fd = bh.stack(tfp8.Linear, 1, 16, recipe=delayed)
fc = bh.stack(tfp8.Linear, 1, 16, recipe=current)
ctx = tfp8.fp8_autocast(fp8_recipe=delayed)
def enter_exit():
    ctx.__enter__(); ctx.__exit__(None, None, None)
def fwd_in_ctx():
    with ctx:
        fd(x)
outs = []
def fwd_keep():
    with ctx:
        outs.append(fd(x))
def bwd():
    outs.pop().sum().backward()
cases = [("nn", bh.linear_step(nn_model, x)), ("delayed", bh.linear_step(fd, x, delayed)),
         ("current", bh.linear_step(fc, x, current)),
         ("fp8_autocast()", lambda: tfp8.fp8_autocast(fp8_recipe=delayed)),
         ("enter+exit", enter_exit), ("with ctx: fwd", fwd_in_ctx)]
names = []
for name, fn in cases:
    for _ in range(20): fn()
    gc.collect()
    functools.reduce(lambda a, _: fn(), range(N), None)
    names.append(name)
# forward then backward, separately
for _ in range(20): fwd_keep(); bwd()
gc.collect()
functools.reduce(lambda a, _: fwd_keep(), range(N), None); names.append("with ctx: fwd (kept)")
functools.reduce(lambda a, _: bwd(), range(N), None); names.append("backward")
nn_outs = []
def nn_fwd_keep():
    nn_outs.append(nn_model(x))
def nn_bwd():
    nn_outs.pop().sum().backward()
for _ in range(20): nn_fwd_keep(); nn_bwd()
gc.collect()
functools.reduce(lambda a, _: nn_fwd_keep(), range(N), None); names.append("nn fwd (kept)")
functools.reduce(lambda a, _: nn_bwd(), range(N), None); names.append("nn backward")
ctx.__enter__()
for _ in range(20): fd(x)
functools.reduce(lambda a, _: fd(x), range(N), None); names.append("fp8 layer fwd in open ctx (no grad kept)")
ctx.__exit__(None, None, None)
functools.reduce(lambda a, _: nn_model(x), range(N), None); names.append("nn layer fwd (no grad kept)")
with open(os.environ["CG_NAMES"], "w") as f:
    f.write("\n".join(names))
