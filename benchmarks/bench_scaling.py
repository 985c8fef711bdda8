"""The delayed-scaling update of a whole model in one call.

Measures update_delayed_scaling over 300 tensors, each with an amax history [1024, 2], a scale
[2] and a scale_inv [2] (the state of 300 FP8 tensors). Before every call row 0 of each history
is refilled with a fresh amax (one copy over a buffer that holds every history), so that every
call does the full roll and rescale; the refill's own time, measured alone in the same run, is
subtracted. Reported per call: device time (CUDA events around 50 back-to-back calls, so host
launch overhead shows where it starves the GPU; target <= 20 µs), host time (perf_counter, no
synchronize), and from torch.profiler the kernels and host-to-device copies launched per call
(the update should be ONE kernel launch) and that kernel's own duration. The baseline is the
pure-torch per-tensor reference loop (transformer_fp8.reference), measured in the same run.

    python benchmarks/bench_scaling.py [--smoke] [--out DIR] [--tensors 300] [--history 1024]
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from transformer_fp8 import ops, reference  # noqa: E402

NAME = "bench_scaling"
TITLE, WHAT = common.doc_summary(__doc__)
TARGET_US = 20.0
FP8_MAX = 448.0

COLUMNS = [
    ["impl", "implementation", "{}"],
    ["state", "tensors x [L, n]", "{}"],
    ["time_us", "time / call (µs)", "{:.1f}"],
    ["host_us", "host time / call (µs)", "{:.1f}"],
    ["kernels", "kernels / call", "{:.0f}"],
    ["memcpys", "H2D copies / call", "{:.0f}"],
    ["kernel_us", "update kernel (µs)", "{:.1f}"],
    ["speedup", "speedup vs reference", "{:.1f}x"],
    ["within_target", f"<= {TARGET_US:.0f} µs", "{}"],
]


def add_arguments(parser):
    parser.add_argument("--tensors", type=int, default=300)
    parser.add_argument("--history", type=int, default=1024, help="amax_history_len L")
    parser.add_argument("--columns", type=int, default=2, help="amaxes per tensor n")


class ScalingState:
    """The FP8 state of ``count`` tensors, as views into three buffers so that one copy can
    refill every history's row 0 with this step's amax."""

    def __init__(self, count: int, length: int, n: int, device: torch.device):
        self.history_buf = torch.rand(count, length, n, device=device) * 10 + 0.1
        self.scale_buf = torch.ones(count, n, device=device)
        self.scale_inv_buf = torch.ones(count, n, device=device)
        self.fresh_amax = torch.rand(count, n, device=device) * 10 + 0.1
        self.histories = list(self.history_buf.unbind(0))
        self.scales = list(self.scale_buf.unbind(0))
        self.scale_invs = list(self.scale_inv_buf.unbind(0))
        self.maxes = [FP8_MAX] * count

    def refill(self):
        self.history_buf[:, 0].copy_(self.fresh_amax)

    def fused(self):
        ops.update_delayed_scaling(self.histories, self.scales, self.scale_invs, self.maxes)

    def reference(self):
        for h, s, si, m in zip(self.histories, self.scales, self.scale_invs, self.maxes):
            reference.update_delayed_scaling_reference(h, s, si, m)


def profile_launches(fn, device: torch.device, calls: int, minus: dict | None = None) -> dict:
    """Kernels and host-to-device copies per call of ``fn`` from torch.profiler (CUDA only),
    less those of ``minus`` (a profile of the refill that ``fn`` includes), and the mean
    duration of the kernels whose name contains 'update_delayed_scaling'."""
    if device.type != "cuda":
        return {}
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize(device)
    device_events = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    kernels = [e for e in device_events if not e.name.lower().startswith(("memcpy", "memset"))]
    host_to_device = [e for e in device_events if e.name.lower().startswith("memcpy htod")]
    update = [e for e in kernels if "update_delayed_scaling" in e.name]
    minus = minus or {}
    return {
        "kernels": len(kernels) / calls - minus.get("kernels", 0),
        "memcpys": len(host_to_device) / calls - minus.get("memcpys", 0),
        "update_kernels": len(update) / calls,
        "kernel_us": (sum(e.time_range.elapsed_us() for e in update) / len(update)
                      if update else None),
        "kernel_names": sorted({e.name[:120] for e in kernels}),
    }


def plot(ax, payload):
    rows = payload["rows"]
    ax.set_yscale("log")
    common.bar_plot(ax, [r["impl"] for r in rows], [r["time_us"] for r in rows],
                    "µs per call (log)", f"update_delayed_scaling, {rows[0]['state']}",
                    reference=TARGET_US, reference_label=f"target {TARGET_US:.0f} µs")


def main(argv=None) -> dict:
    args = common.parse_args(TITLE, argv, add_arguments)
    if args.smoke:
        args.tensors, args.history = min(args.tensors, 8), min(args.history, 16)
    inner, reps = (2, 2) if args.smoke else (50, 20)
    state = ScalingState(args.tensors, args.history, args.columns, args.device)
    shape = f"{args.tensors} x [{args.history}, {args.columns}]"

    def with_refill(update):
        def step():
            state.refill()
            update()
        return step

    t_refill = common.time_fn(state.refill, args.device, reps=reps, inner=inner)
    t_fused = common.time_fn(with_refill(state.fused), args.device, reps=reps, inner=inner)
    t_ref = common.time_fn(with_refill(state.reference), args.device, warmup=1,
                           reps=max(2, reps // 5), inner=1)
    host = torch.device("cpu")  # perf_counter around the calls: the host's share
    host_fused = common.time_fn(state.fused, host, reps=reps, inner=inner)
    host_ref = common.time_fn(state.reference, host, warmup=1, reps=2)

    # None ('n/a') where the difference is below what the timer resolves.
    fused_us, ref_us = (t.us - t_refill.us if t.us > t_refill.us else None
                        for t in (t_fused, t_ref))
    # Profiled with the refill, so that the update kernel does its full work; the refill's
    # own launches are subtracted.
    prof_refill = profile_launches(state.refill, args.device, calls=10)
    prof_fused = profile_launches(with_refill(state.fused), args.device, calls=10,
                                  minus=prof_refill)
    prof_ref = profile_launches(with_refill(state.reference), args.device, calls=1,
                                minus=prof_refill)
    on_cuda = args.device.type == "cuda"
    rows = [
        {"impl": "update_delayed_scaling (fused)", "state": shape, "time_us": fused_us,
         "host_us": host_fused.us, **{k: prof_fused.get(k) for k in
                                       ("kernels", "memcpys", "kernel_us")},
         "speedup": common.ratio(ref_us, fused_us),
         "within_target": (("yes" if fused_us <= TARGET_US else "no")
                           if on_cuda and fused_us is not None else None)},
        {"impl": "pure-torch reference loop", "state": shape, "time_us": ref_us,
         "host_us": host_ref.us, "kernels": prof_ref.get("kernels"),
         "memcpys": prof_ref.get("memcpys"), "speedup": 1.0},
        {"impl": "refill row 0 (subtracted above)", "state": shape, "time_us": t_refill.us},
    ]
    clock = "CUDA events" if on_cuda else "perf_counter"
    notes = [f"time / call: {clock} around {inner} back-to-back calls (refill included, "
             "then the refill's own time subtracted)",
             "update_delayed_scaling kernels / call seen by the profiler: "
             f"{prof_fused.get('update_kernels', 'n/a')}; kernel names seen (with the refill's "
             f"copy): {prof_fused.get('kernel_names', 'n/a')}"]
    return common.report(args, NAME, TITLE, WHAT, COLUMNS, rows, plot=plot, notes=notes,
                         extra={"profile_fused": prof_fused,
                                "profile_reference": {k: v for k, v in prof_ref.items()
                                                      if k != "kernel_names"}})


if __name__ == "__main__":
    main()
