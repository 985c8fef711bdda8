"""Run every benchmark and collect the results into one file.

Calls each benchmark's main(argv) in turn and writes, under --out, three files only:
results.md (a header naming device, torch, CUDA and date, then every benchmark's table),
results.json (every benchmark's payload) and results.png (every plot, one panel each). The
per-benchmark JSON files go to a temporary folder, or to <out>/parts with --keep-parts. A
benchmark that fails is reported in results.md and the others still run; the exit status is 1
when any failed.

    python benchmarks/run_all.py [--smoke] [--out DIR] [--only bench_cast,bench_gemm]
"""
from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import sys
import tempfile
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

BENCHMARKS = ("bench_cast", "bench_scaling", "bench_fused", "bench_gemm", "bench_linear",
              "bench_gpt", "bench_te_modules", "bench_block_sqnr", "bench_parity", "bench_host",
              "bench_fsdp_comm")

READING_GUIDE = """\
How to read: every ratio compares two measurements of this run on this device. '% of copy BW'
is a kernel's bytes read + written per second over dst.copy_(src) on a 1 GiB buffer (the
practical ceiling of a memory-bound kernel, so 100% is as fast as it gets); '% of GEMM floor'
is the time of a layer's three bare FP8 GEMMs over the time of its whole training step;
'speedup' is the baseline's time over this row's time (above 1 is faster). 'n/a': not
measured here (unsupported, or not available on this device)."""


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    parser.add_argument("--out", default=common.DEFAULT_OUT)
    parser.add_argument("--device", default=None, help="passed to every benchmark")
    parser.add_argument("--only", default=",".join(BENCHMARKS),
                        help="comma-separated benchmark names")
    parser.add_argument("--keep-parts", action="store_true",
                        help="keep each benchmark's JSON in <out>/parts")
    args = parser.parse_args(argv)
    args.only = [name.strip() for name in args.only.split(",") if name.strip()]
    unknown = sorted(set(args.only) - set(BENCHMARKS))
    if unknown:
        parser.error(f"unknown benchmarks {unknown}; choose from {list(BENCHMARKS)}")
    return args


def run_one(name: str, argv: list[str], parts: str) -> tuple[dict | None, str | None]:
    """(the payload read back from <parts>/<name>.json, None) or (None, error text); frees the
    device's cached memory afterwards."""
    argv = argv + ["--out", parts]
    print(f"\n===== {name} {' '.join(argv)}", flush=True)
    try:
        importlib.import_module(name).main(argv)
        with open(os.path.join(parts, f"{name}.json")) as f:
            return json.load(f), None
    except Exception as exc:
        traceback.print_exc()
        return None, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    finally:
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def results_markdown(info: dict, payloads: dict, failures: dict, smoke: bool) -> str:
    build = info.get("transformer_fp8")
    lines = ["# transformer_fp8 benchmark results", "",
             f"- device: {info['device_name']}" + (f" ({info['capability']})"
                                                   if "capability" in info else ""),
             f"- torch: {info['torch']}", f"- CUDA: {info['cuda'] or 'none'}"
             + (f" (driver supports {info['driver_cuda']})" if info.get("driver_cuda") else ""),
             f"- transformer_fp8 build: {build}", f"- date: {info['date']}", ""]
    if smoke:
        lines += ["**Smoke run: tiny shapes on the CPU; the numbers mean nothing.**", ""]
    lines += [READING_GUIDE, ""]
    for name, payload in payloads.items():
        lines += [common.payload_markdown(payload), ""]
    for name, error in failures.items():
        lines += [f"## {name}: FAILED", "", f"    {error}", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    shared = (["--smoke"] if args.smoke else []) + ["--no-plot"]
    if args.device:
        shared += ["--device", args.device]
    with tempfile.TemporaryDirectory() as tmp:
        parts = os.path.join(args.out, "parts") if args.keep_parts else tmp
        payloads, failures = {}, {}
        for name in args.only:
            payload, error = run_one(name, shared, parts)
            if error is None:
                payloads[name] = payload
            else:
                failures[name] = error

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() and not args.smoke
                                          else "cpu"))
    info = common.device_info(device)
    markdown = results_markdown(info, payloads, failures, args.smoke)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(markdown + "\n")
    common.write_json(os.path.join(args.out, "results.json"),
                      {"info": info, "smoke": args.smoke, "benchmarks": payloads,
                       "failures": failures})
    if payloads:
        panels = [(importlib.import_module(name).plot, p) for name, p in payloads.items()]
        common.save_plot(os.path.join(args.out, "results.png"), panels,
                         title=common.describe(info))
    print(f"\nwrote {os.path.join(args.out, 'results.md')} (+ results.json, results.png)"
          + (f"; FAILED: {', '.join(failures)}" if failures else ""))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
