"""The GPU kernels of one Linear training step, by time (torch.profiler), for one recipe.

bench_linear gives a step's total; this says where it goes: each kernel's total CUDA time over
the profiled steps and its share of the step, so the casts and scaling around the three GEMMs
can be told apart from them. Gradients are set to None before each step, as bench_linear
does (no accumulation kernels). --host adds the host side: the time to issue one step without
the profiler, and the operators and CUDA runtime calls by self CPU time under it (for small,
host-bound layers: where a step's host time goes beyond nn.Linear's; run --recipe bf16 for the
comparison).

    python scripts/profile_linear_step.py [--recipe delayed|current|block|rowwise|bf16]
                                          [--shape 16384,8192,8192] [--steps 5] [--top 15]
                                          [--host] [--device cuda|cpu]
                                          [--blockwise-transpose-kernel registers|staged|both]

--blockwise-transpose-kernel sets TRANSFORMER_FP8_BLOCKWISE_TRANSPOSE_KERNEL (the kernel of the
1x128 quantisation with its transpose, blockwise_transpose.cu; recipe block) and has the
operator read it again; `both` profiles the step under each, one table per kernel, in one
process. Without it the variable is left as it is (unset: registers). --device cpu runs the
host side only (a smoke test).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import time

import torch

import transformer_fp8 as tfp8
from transformer_fp8 import _C

RECIPES = {"delayed": tfp8.DelayedScaling, "current": tfp8.Float8CurrentScaling,
           "block": tfp8.Float8BlockScaling, "rowwise": tfp8.Float8RowwiseScaling, "bf16": None}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", choices=sorted(RECIPES), default="block")
    parser.add_argument("--shape", default="16384,8192,8192", help="M,K,N")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--device", default="cuda",
                        help="cuda (default); cpu runs the host side only (a smoke test)")
    parser.add_argument("--host", action="store_true",
                        help="also the host time per step and its operators / runtime calls")
    parser.add_argument("--blockwise-transpose-kernel", choices=["registers", "staged", "both"])
    args = parser.parse_args()
    m, k, n = (int(v) for v in args.shape.split(","))
    recipe = RECIPES[args.recipe]() if RECIPES[args.recipe] else None
    layer = (tfp8.Linear(k, n, params_dtype=torch.bfloat16, device=args.device) if recipe
             else torch.nn.Linear(k, n, device=args.device, dtype=torch.bfloat16))
    x = torch.randn(m, k, device=args.device, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(m, n, device=args.device, dtype=torch.bfloat16)

    def step():
        x.grad = None
        layer.zero_grad(set_to_none=True)
        with tfp8.fp8_autocast(fp8_recipe=recipe) if recipe else contextlib.nullcontext():
            y = layer(x)
        y.backward(g)

    choice = args.blockwise_transpose_kernel
    kernels = ([None] if choice is None else ["registers", "staged"] if choice == "both"
               else [choice])
    for kernel in kernels:
        label = ""
        if kernel is not None:
            os.environ["TRANSFORMER_FP8_BLOCKWISE_TRANSPOSE_KERNEL"] = kernel
            label = f", blockwise transpose kernel {_C._reread_blockwise_transpose_kernel()}"
        profile(step, f"{args.recipe} Linear step {m}x{k}x{n}{label}", args)


def profile(step, title, args):
    """Warms up, profiles args.steps steps and prints each kernel's time per step (and, with
    args.host, the host side)."""
    on_cuda = torch.device(args.device).type == "cuda"

    def sync():
        if on_cuda:
            torch.cuda.synchronize()

    for _ in range(3):
        step()
    sync()
    if args.host:
        start = time.perf_counter()
        for _ in range(args.steps):
            step()
        issued = (time.perf_counter() - start) / args.steps
        sync()
        print(f"host time to issue one step (no profiler): {issued * 1e6:.1f} us")
    activities = [torch.profiler.ProfilerActivity.CUDA] if on_cuda else []
    if args.host or not on_cuda:
        activities.append(torch.profiler.ProfilerActivity.CPU)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(args.steps):
            step()
        sync()
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    total = sum(e.self_device_time_total for e in events)
    name = torch.cuda.get_device_name() if on_cuda else "cpu"
    print(f"{title} on {name}: {total / args.steps / 1e3:.3f} ms of kernels per step")
    print("| kernel | calls/step | ms/step | share |\n|---|---|---|---|")
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:args.top]:
        print(f"| {e.key[:90]} | {e.count / args.steps:g} | "
              f"{e.self_device_time_total / args.steps / 1e3:.3f} | "
              f"{100 * e.self_device_time_total / total:.1f}% |")
    if args.host:
        print_host_table(prof, args.steps, args.top)


def print_host_table(prof, steps: int, top: int) -> None:
    """Operators and CUDA runtime calls by self CPU time per step (the profiler adds its own
    cost to each event: read the shares and counts, not the absolute times)."""
    events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    total = sum(e.self_cpu_time_total for e in events)
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel",
                                                        "cudaLaunchKernelExC", "cuLaunchKernelEx"))
    print(f"host, under the profiler: {total / steps:.1f} us of self CPU time per step, "
          f"{launches / steps:g} kernel launches per step")
    print("| operator or runtime call | calls/step | self us/step | share |\n|---|---|---|---|")
    for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:top]:
        print(f"| {e.key[:90]} | {e.count / steps:g} | {e.self_cpu_time_total / steps:.1f} | "
              f"{100 * e.self_cpu_time_total / total:.1f}% |")


if __name__ == "__main__":
    main()
