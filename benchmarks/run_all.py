"""Run every benchmark and collect the results into one file.

Calls each benchmark's main(argv) in turn and writes, under --out, three files:
results.md (a header naming device, torch, CUDA, commit and date, then every benchmark's
table), results.json (every benchmark's payload) and results.png (every plot, one panel each).
The three are rewritten after every benchmark, so a run stopped part-way (a timeout, SIGTERM,
Ctrl-C) leaves the results of the benchmarks that finished. Each benchmark writes its JSON to
<out>/parts/; once read into results.json the part is deleted (kept with --keep-parts), and the
empty folder removed at the end, so a finished run leaves the three files alone. A benchmark
that fails is reported in results.md and the others still run; the exit status is 1 when any
failed or the run was stopped.

    python benchmarks/run_all.py [--smoke] [--out DIR] [--only bench_cast,bench_gemm]
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import json
import os
import signal
import sys
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
                        help="keep each benchmark's JSON in <out>/parts (deleted once collected "
                             "otherwise)")
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


def results_markdown(info: dict, payloads: dict, failures: dict, smoke: bool,
                     pending: list | None = None, stopped: str | None = None) -> str:
    build = info.get("transformer_fp8")
    lines = ["# transformer_fp8 benchmark results", "",
             f"- device: {info['device_name']}" + (f" ({info['capability']})"
                                                   if "capability" in info else ""),
             f"- CPU: {info.get('cpu', 'unknown')}",
             f"- torch: {info['torch']}", f"- CUDA: {info['cuda'] or 'none'}"
             + (f" (driver supports {info['driver_cuda']})" if info.get("driver_cuda") else ""),
             f"- transformer_fp8 build: {build}",
             f"- {common.describe_commit(info)} ({info.get('commit_source', 'unknown')})",
             f"- date: {info['date']}", ""]
    if smoke:
        lines += ["**Smoke run: tiny shapes on the CPU; the numbers mean nothing.**", ""]
    if stopped:
        lines += [f"**Run stopped ({stopped}) before it finished: the benchmarks below are the "
                  "ones that completed.**", ""]
    if pending:
        lines += [f"Not finished: {', '.join(pending)}", ""]
    lines += [READING_GUIDE, ""]
    for name, payload in payloads.items():
        lines += [common.payload_markdown(payload)]
        measured_on = payload.get("info", {}).get("device_name")
        if measured_on and measured_on != info["device_name"]:
            lines += ["", f"(measured on {measured_on}, not on the device named above)"]
        lines += [""]
    for name, error in failures.items():
        lines += [f"## {name}: FAILED", "", f"    {error}", ""]
    return "\n".join(lines)


def write_results(out: str, info: dict, payloads: dict, failures: dict, smoke: bool,
                  pending: list, stopped: str | None = None, plot: bool = True) -> None:
    """(Re)write results.md, results.json and, with ``plot``, results.png from what has
    finished so far; each file is written to a temporary name and renamed, so a kill mid-write
    leaves the previous version."""
    markdown = results_markdown(info, payloads, failures, smoke, pending, stopped)
    _replace(os.path.join(out, "results.md"), lambda path: _write_text(path, markdown + "\n"))
    _replace(os.path.join(out, "results.json"), lambda path: common.write_json(
        path, {"info": info, "smoke": smoke, "benchmarks": payloads, "failures": failures,
               "not_finished": pending, "stopped": stopped}))
    if plot and payloads:
        panels = [(importlib.import_module(name).plot, p) for name, p in payloads.items()]
        _replace(os.path.join(out, "results.png"), lambda path: common.save_plot(
            path, panels, title=common.describe(info)))


def _write_text(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _replace(path: str, write) -> None:
    base, ext = os.path.splitext(path)
    tmp = f"{base}.partial{ext}"  # (the extension kept: savefig picks the format by it)
    try:
        write(tmp)
        if os.path.exists(tmp):
            os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


class Stopped(BaseException):
    """SIGTERM (as sent by timeout(1)) turned into an exception, so the results are written
    (a BaseException: run_one's ``except Exception`` must not take it for a failed
    benchmark)."""


def _raise_stopped(signum, frame):
    raise Stopped(signal.Signals(signum).name)


def main(argv=None) -> int:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    shared = (["--smoke"] if args.smoke else []) + ["--no-plot"]
    if args.device:
        shared += ["--device", args.device]
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() and not args.smoke
                                          else "cpu"))
    info = common.device_info(device)
    parts = os.path.join(args.out, "parts")
    os.makedirs(parts, exist_ok=True)
    payloads, failures, stopped = {}, {}, None
    pending = list(args.only)
    previous = signal.signal(signal.SIGTERM, _raise_stopped) if _in_main_thread() else None
    try:
        write_results(args.out, info, payloads, failures, args.smoke, pending, plot=False)
        for name in args.only:
            payload, error = run_one(name, shared, parts)
            pending.remove(name)
            if error is None:
                payloads[name] = payload
                if not args.keep_parts:
                    os.remove(os.path.join(parts, f"{name}.json"))
            else:
                failures[name] = error
            write_results(args.out, info, payloads, failures, args.smoke, pending)
    except (Stopped, KeyboardInterrupt) as exc:
        stopped = str(exc) or type(exc).__name__
        print(f"\nstopped ({stopped}): writing the results of the benchmarks that finished",
              flush=True)
        write_results(args.out, info, payloads, failures, args.smoke, pending, stopped)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        if not args.keep_parts:
            for name in args.only:  # a part of a benchmark stopped as it was being collected
                with contextlib.suppress(FileNotFoundError):
                    os.remove(os.path.join(parts, f"{name}.json"))
            with contextlib.suppress(OSError):  # (left where it holds anything else)
                os.rmdir(parts)
    print(f"\nwrote {os.path.join(args.out, 'results.md')} (+ results.json, results.png)"
          + (f"; FAILED: {', '.join(failures)}" if failures else "")
          + (f"; STOPPED ({stopped}), not run: {', '.join(pending)}" if stopped else ""))
    return 1 if failures or stopped else 0


def _in_main_thread() -> bool:
    """signal.signal works in the main thread only (run_all.main may be called elsewhere)."""
    import threading
    return threading.current_thread() is threading.main_thread()


if __name__ == "__main__":
    sys.exit(main())
