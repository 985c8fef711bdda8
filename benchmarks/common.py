"""Shared pieces of the benchmark scripts: arguments, timing, the copy-bandwidth ceiling, the
device description, and the table / JSON / plot writers.

Conventions every benchmark follows:
  * ``main(argv) -> dict`` parses ``--smoke``, ``--out DIR``, ``--device`` and ``--no-plot``,
    prints a markdown table, writes ``<out>/<name>.json`` (and ``<name>.png`` unless
    ``--no-plot``) and returns the JSON payload.
  * ``--smoke`` runs tiny shapes on the CPU in seconds: it shows that the script runs, its
    numbers mean nothing.
  * Every ratio in a table compares two things measured in the same run on the same device.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import dataclasses
import os
import platform
import statistics
import subprocess
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")


# ----------------------------------------------------------------------------- arguments

def parse_args(description: str, argv: Optional[Sequence[str]] = None,
               add_arguments: Optional[Callable[[argparse.ArgumentParser], None]] = None):
    """The common flags, plus whatever ``add_arguments(parser)`` adds; sets ``args.device``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes on the CPU, a few seconds: checks that it runs")
    parser.add_argument("--out", default=DEFAULT_OUT, help="folder for <name>.json and .png")
    parser.add_argument("--device", default=None,
                        help="default: cuda when available (cpu with --smoke)")
    parser.add_argument("--no-plot", action="store_true", help="write no .png")
    if add_arguments is not None:
        add_arguments(parser)
    args = parser.parse_args(None if argv is None else list(argv))
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    args.device = torch.device(args.device)
    return args


# ----------------------------------------------------------------------------- timing

@dataclass(frozen=True)
class Timing:
    """Seconds per call: the median and the minimum over ``reps`` repetitions."""

    median_s: float
    min_s: float
    reps: int
    samples: list = dataclasses.field(default_factory=list, repr=False)  # seconds per call

    @property
    def us(self) -> float:
        return self.median_s * 1e6

    @property
    def ms(self) -> float:
        return self.median_s * 1e3


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_fn(fn: Callable[[], object], device: torch.device, *, warmup: int = 3, reps: int = 10,
            inner: int = 1) -> Timing:
    """Time ``fn()``: ``warmup`` untimed calls, then ``reps`` repetitions of ``inner`` calls.

    On CUDA each repetition is bracketed by CUDA events recorded on the current stream. The
    stream is idle when the start event is recorded, so the host's time to issue the first call
    counts as device time; after that, host launch time counts only where it starves the
    device. Hence ``inner`` > 1 for short calls: the first call's launch is spread over
    ``inner`` calls. On the CPU, time.perf_counter.
    Returns the median (and min) over repetitions of the time per call.
    """
    for _ in range(warmup):
        fn()
    synchronize(device)
    per_call = []
    if device.type == "cuda":
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(inner):
                fn()
            end.record()
            end.synchronize()
            per_call.append(start.elapsed_time(end) / 1e3 / inner)
    else:
        for _ in range(reps):
            start = time.perf_counter()
            for _ in range(inner):
                fn()
            per_call.append((time.perf_counter() - start) / inner)
    return Timing(statistics.median(per_call), min(per_call), reps, per_call)


def time_interleaved(fns: dict, device: torch.device, *, warmup: int = 3, reps: int = 20,
                     rounds: int = 4, inner: int = 1) -> dict:
    """{name: Timing} for several functions timed in turns: ``rounds`` rounds, each timing every
    function for reps / rounds repetitions, so that clock and temperature drift during the run
    (a GPU slows down as it heats up under a long GEMM) weighs on every function alike instead
    of on whichever runs last. A function that is None stays None.

    Each repetition times ``inner`` back-to-back calls between one pair of CUDA events (time per
    call = elapsed / inner): the stream is idle when a repetition starts, so the host's time to
    issue the first call (Python, dispatcher, library setup) lands between the events; with
    several calls the later ones are issued while the earlier run, and that launch time is
    counted once per ``inner`` calls instead of once per call."""
    per_call = {name: [] for name in fns}
    for name, fn in fns.items():
        if fn is not None:
            for _ in range(warmup):
                fn()
    synchronize(device)
    per_round = max(1, reps // rounds)
    for _ in range(rounds):
        for name, fn in fns.items():
            if fn is not None:
                timing = time_fn(fn, device, warmup=0, reps=per_round, inner=inner)
                per_call[name] += timing.samples
    return {name: Timing(statistics.median(t), min(t), len(t), t) if t else None
            for name, t in per_call.items()}


def copy_bandwidth(device: torch.device, nbytes: Optional[int] = None, reps: int = 10) -> float:
    """The ceiling of memory-bound kernels: GB/s of ``dst.copy_(src)`` on a large buffer,
    counting bytes read plus bytes written (2 * nbytes per copy). Default size: 1 GiB on CUDA
    (far beyond L2), 16 MiB on the CPU."""
    if nbytes is None:
        nbytes = (1 << 30) if device.type == "cuda" else (16 << 20)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    timing = time_fn(lambda: dst.copy_(src), device, warmup=2, reps=reps)
    return 2 * nbytes / timing.median_s / 1e9


# ----------------------------------------------------------------------------- precisions

def precision_variants() -> dict:
    """The training precisions compared by bench_linear and bench_gpt: name -> FP8 recipe
    (None: plain bf16, no fp8_autocast)."""
    import transformer_fp8 as tf8

    return {"bf16": None,
            "fp8 DelayedScaling": tf8.DelayedScaling(fp8_format=tf8.Format.HYBRID),
            "fp8 Float8CurrentScaling": tf8.Float8CurrentScaling(fp8_format=tf8.Format.HYBRID),
            "fp8 Float8BlockScaling": tf8.Float8BlockScaling()}


def exception_chain(exc: BaseException) -> str:
    """The exception and those it was raised while handling (a CUDA graph capture that fails
    raises again on leaving torch.cuda.graph, hiding the first error), on one line."""
    chain = []
    while exc is not None and len(chain) < 4:
        chain.append(" ".join(f"{type(exc).__name__}: {exc}".split())[:300])
        exc = exc.__cause__ or exc.__context__
    return " <- ".join(chain)


def fp8_context(recipe, calibrating: bool = False):
    """fp8_autocast(fp8_recipe=recipe), or a no-op context for recipe None; ``calibrating``:
    fp8_autocast(enabled=False, calibrating=True, fp8_recipe=recipe), a high-precision step
    that sets the recipe's delayed scales."""
    if recipe is None:
        return contextlib.nullcontext()
    import transformer_fp8 as tf8

    if calibrating:
        return tf8.fp8_autocast(enabled=False, calibrating=True, fp8_recipe=recipe)
    return tf8.fp8_autocast(enabled=True, fp8_recipe=recipe)


# ----------------------------------------------------------------------------- description

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Where the tree has no .git (a copy sent to a GPU machine), the caller names the commit.
COMMIT_ENV = "TRANSFORMER_FP8_COMMIT"


def git_commit(root: str = REPO_ROOT) -> dict:
    """{"commit": full hash or None, "dirty": True/False/None, "commit_source": how it was
    found}: ``git rev-parse HEAD`` and ``git status --porcelain --untracked-files=no`` (dirty:
    tracked files differ from the commit) in the repository holding the benchmarks; where git
    or .git is missing, $TRANSFORMER_FP8_COMMIT (dirty then unknown: None)."""
    def git(*args):
        return subprocess.run(["git", "-C", root, *args], capture_output=True, text=True,
                              timeout=30, check=True).stdout.strip()
    try:
        commit = git("rev-parse", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
        return {"commit": commit, "dirty": dirty, "commit_source": "git"}
    except Exception:
        pass
    named = os.environ.get(COMMIT_ENV, "").strip()
    if named:
        return {"commit": named, "dirty": None, "commit_source": f"${COMMIT_ENV}"}
    return {"commit": None, "dirty": None,
            "commit_source": f"unknown (no git repository, ${COMMIT_ENV} unset)"}


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux), its cores and torch's thread count."""
    name = None
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    name = name or platform.processor() or platform.machine()
    return f"{name}, {os.cpu_count()} cores, {torch.get_num_threads()} threads"


def device_info(device: torch.device) -> dict:
    """What the numbers were measured on: device name (the CPU's model for a CPU run), the
    CPU's model in every case, torch / CUDA versions, extension build, git commit of the
    benchmarks' tree and whether it had uncommitted changes, host, date (UTC)."""
    info = {
        "device": str(device),
        "device_name": (torch.cuda.get_device_name(device) if device.type == "cuda"
                        else f"CPU ({cpu_model()})"),
        "cpu": cpu_model(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "host": platform.node(),
        **git_commit(),
    }
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        info["capability"] = f"sm_{major}{minor}"
        info["driver_cuda"] = _driver_cuda_version()
    try:
        import transformer_fp8
        info["transformer_fp8"] = transformer_fp8.build_info()
    except Exception as exc:  # the description must never stop a benchmark
        info["transformer_fp8"] = f"unavailable: {exc}"
    return info


def describe_commit(info: dict) -> str:
    """'commit abc1234' (+ ', uncommitted changes' / ', dirty flag unknown'), or 'commit
    unknown'."""
    commit = info.get("commit")
    if not commit:
        return "commit unknown"
    dirty = info.get("dirty")
    return f"commit {commit[:12]}" + (" + uncommitted changes" if dirty
                                      else "" if dirty is False else " (dirty flag unknown)")


def _driver_cuda_version() -> Optional[str]:
    try:
        import ctypes
        version = ctypes.c_int()
        ctypes.CDLL("libcuda.so.1").cuDriverGetVersion(ctypes.byref(version))
        return f"{version.value // 1000}.{version.value % 1000 // 10}"
    except Exception:
        return None


def describe(info: dict) -> str:
    """One line naming device, torch, CUDA and date."""
    return (f"{info['device_name']} | torch {info['torch']} | CUDA {info['cuda'] or 'none'}"
            f" | {describe_commit(info)} | {info['date']}")


# ----------------------------------------------------------------------------- tables

# A column is [key, header, format]; format is a str.format spec applied to numbers. Missing
# values and None print as "n/a". Columns are plain lists so that they survive JSON.

def format_value(value, fmt: str) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return fmt.format(value)
    return str(value)


def markdown_table(columns: Sequence[Sequence[str]], rows: Sequence[dict]) -> str:
    header = "| " + " | ".join(c[1] for c in columns) + " |"
    rule = "|" + "|".join("---" for _ in columns) + "|"
    body = ["| " + " | ".join(format_value(row.get(c[0]), c[2]) for c in columns) + " |"
            for row in rows]
    return "\n".join([header, rule, *body])


def ratio(numerator: Optional[float], denominator: Optional[float]) -> Optional[float]:
    """numerator / denominator, None when either is missing or the denominator is 0."""
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator


def doc_summary(doc: str) -> tuple[str, str]:
    """(first paragraph, second paragraph), each joined into one line, of a benchmark's
    docstring: the first is the title (a markdown heading: one line)."""
    paragraphs = doc.strip().split("\n\n")
    return " ".join(paragraphs[0].split()).rstrip("."), " ".join(paragraphs[1].split())


def payload_markdown(payload: dict, heading: str = "##") -> str:
    """A benchmark's section: title, what it measures, table, notes."""
    parts = [f"{heading} {payload['title']}", "", payload["what"], "",
             markdown_table(payload["columns"], payload["rows"])]
    if payload.get("notes"):
        parts += [""] + [f"- {note}" for note in payload["notes"]]
    return "\n".join(parts)


# ----------------------------------------------------------------------------- output

def write_json(path: str, payload: dict) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=2, default=str)
        f.write("\n")
    return path


def save_plot(path: str, panels: Sequence[tuple[Callable, dict]], title: str = "") -> Optional[str]:
    """One figure with one panel per ``(plot_fn, payload)``; ``plot_fn(ax, payload)`` draws.
    Returns the path, or None (with a note) when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"(matplotlib not installed: no plot written to {path})")
        return None
    columns = min(2, len(panels))
    rows_n = (len(panels) + columns - 1) // columns
    fig, axes = plt.subplots(rows_n, columns, figsize=(7 * columns, 4.2 * rows_n), squeeze=False)
    for ax, (plot_fn, payload) in zip(axes.flat, panels):
        plot_fn(ax, payload)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def bar_plot(ax, labels: Sequence[str], values: Sequence[Optional[float]], ylabel: str,
             title: str, reference: Optional[float] = None, reference_label: str = "") -> None:
    """Bars (None is drawn as an empty slot), an optional horizontal reference line."""
    heights = [v if v is not None else 0.0 for v in values]
    bars = ax.bar(range(len(labels)), heights, color="tab:blue")
    ax.bar_label(bars, labels=["n/a" if v is None else f"{v:.3g}" for v in values], fontsize=7)
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=7)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    if reference is not None:
        ax.axhline(reference, color="tab:red", linestyle="--", label=reference_label)
        ax.legend(fontsize=7)


def report(args, name: str, title: str, what: str, columns: Sequence[Sequence[str]],
           rows: Sequence[dict], plot: Optional[Callable] = None,
           notes: Sequence[str] = (), extra: Optional[dict] = None) -> dict:
    """Print the table and write ``<out>/<name>.json`` (+ ``.png``); return the payload."""
    payload = {
        "name": name, "title": title, "what": what, "smoke": bool(args.smoke),
        "info": device_info(args.device), "columns": [list(c) for c in columns],
        "rows": list(rows), "notes": list(notes), "extra": extra or {},
    }
    print(describe(payload["info"]))
    print(payload_markdown(payload))
    if args.smoke:
        print("(smoke run on tiny shapes: the numbers above mean nothing)")
    write_json(os.path.join(args.out, f"{name}.json"), payload)
    if plot is not None and not args.no_plot:
        save_plot(os.path.join(args.out, f"{name}.png"), [(plot, payload)],
                  title=describe(payload["info"]))
    return payload
