"""The benchmark scripts run: each main(["--smoke", ...]) on the CPU with tiny shapes.

Smoke runs check that every script runs end to end and writes its JSON (rows with positive
times) and plot; their numbers mean nothing. The real measurements run on a GPU through
scripts/gpu_check.sh.
"""
from __future__ import annotations

import importlib
import json
import math
import os
import sys

import pytest
import torch

BENCH_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                         "benchmarks")
sys.path.insert(0, BENCH_DIR)

BENCHMARKS = ["bench_cast", "bench_scaling", "bench_fused", "bench_gemm", "bench_linear",
              "bench_gpt", "bench_te_modules", "bench_block_sqnr", "bench_parity",
              "bench_host", "bench_fsdp_comm"]

try:
    import matplotlib  # noqa: F401
    HAS_MATPLOTLIB = True
except ImportError:
    HAS_MATPLOTLIB = False


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny shapes run faster, and far steadier on a loaded machine, with one CPU thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# Benchmarks that measure numerics rather than time: every row has every column, finite.
NUMERIC_BENCHMARKS = {"bench_block_sqnr", "bench_parity", "bench_fsdp_comm"}


def check_payload(payload: dict, name: str) -> None:
    assert payload["name"] == name and payload["smoke"] is True
    assert payload["rows"], f"{name}: no rows"
    keys = [column[0] for column in payload["columns"]]
    for row in payload["rows"]:
        assert set(row) >= {keys[0]}, f"{name}: row without its first column: {row}"
        if name in NUMERIC_BENCHMARKS:
            assert set(row) >= set(keys), f"{name}: row without every column: {row}"
            assert all(math.isfinite(row[k]) for k in keys if isinstance(row[k], float)), row
            continue
        times = {k: v for k, v in row.items() if k.startswith("time_")}
        assert times, f"{name}: row without a time: {row}"
        for key, value in times.items():
            assert value is None or value > 0, f"{name}: {key} = {value} in {row}"
    if name not in NUMERIC_BENCHMARKS:
        assert any(v for row in payload["rows"] for k, v in row.items()
                   if k.startswith("time_"))


@pytest.mark.parametrize("name", BENCHMARKS)
def test_benchmark_smoke(name, tmp_path):
    payload = importlib.import_module(name).main(["--smoke", "--out", str(tmp_path)])
    with open(tmp_path / f"{name}.json") as f:
        written = json.load(f)
    check_payload(written, name)
    assert written["rows"] == json.loads(json.dumps(payload["rows"], default=str))
    if HAS_MATPLOTLIB:
        assert (tmp_path / f"{name}.png").stat().st_size > 0


def test_fsdp_comm_smoke_counts_fp8_all_gathers(tmp_path):
    """The FP8 all-gathers of bias-free Linear layers move exactly a quarter of float32's bytes
    and half of bfloat16's (counted at the collective, not computed from shapes)."""
    payload = importlib.import_module("bench_fsdp_comm").main(
        ["--smoke", "--out", str(tmp_path), "--no-plot"])
    fp8 = [row for row in payload["rows"] if row["gather"] == "fp8"]
    assert fp8 and all(row["ratio_fp32"] == 0.25 and row["ratio_bf16"] == 0.5 for row in fp8)


def test_gpt_smoke_trains_every_precision(tmp_path):
    """bf16 and both FP8 recipes each produce a finite loss per step."""
    payload = importlib.import_module("bench_gpt").main(
        ["--smoke", "--out", str(tmp_path), "--no-plot"])
    losses = payload["extra"]["losses"]
    assert set(losses) == {"bf16", "fp8 DelayedScaling", "fp8 Float8CurrentScaling"}
    for name, curve in losses.items():
        assert curve and all(torch.isfinite(torch.tensor(curve))), f"{name}: {curve}"
    assert not (tmp_path / "bench_gpt.png").exists()


def test_run_all_collects_one_results_file(tmp_path):
    run_all = importlib.import_module("run_all")
    status = run_all.main(["--smoke", "--out", str(tmp_path), "--only", "bench_cast,bench_gemm"])
    assert status == 0
    text = (tmp_path / "results.md").read_text()
    assert text.startswith("# transformer_fp8 benchmark results")
    for needle in ("- device:", "- torch:", "- CUDA:", "- date:", "Smoke run"):
        assert needle in text
    results = json.loads((tmp_path / "results.json").read_text())
    assert sorted(results["benchmarks"]) == ["bench_cast", "bench_gemm"]
    assert results["failures"] == {}
    for name, payload in results["benchmarks"].items():
        check_payload(payload, name)
    # Only the three collected files: the per-benchmark parts went to a temporary folder.
    expected = {"results.md", "results.json"} | ({"results.png"} if HAS_MATPLOTLIB else set())
    assert set(os.listdir(tmp_path)) == expected


def test_run_all_reports_a_failing_benchmark(tmp_path, monkeypatch):
    """A benchmark that raises is named in results.md, the others still run, status 1."""
    run_all = importlib.import_module("run_all")
    bench_cast = importlib.import_module("bench_cast")

    def broken(argv):
        raise RuntimeError("deliberate failure")

    monkeypatch.setattr(bench_cast, "main", broken)
    status = run_all.main(["--smoke", "--out", str(tmp_path), "--only", "bench_cast,bench_gemm"])
    assert status == 1
    text = (tmp_path / "results.md").read_text()
    assert "bench_cast: FAILED" in text and "deliberate failure" in text
    assert "FP8 GEMM throughput" in text


def test_bench_host_null_kernels_smoke(tmp_path):
    """bench_host --null-kernels compiles benchmarks/null_kernels.cpp and replaces the CPU
    kernels of the operators for its own process (a subprocess here: they would stay replaced
    for the tests that follow); it checks that each was replaced."""
    import subprocess
    result = subprocess.run(
        [sys.executable, os.path.join(BENCH_DIR, "bench_host.py"), "--smoke", "--null-kernels",
         "--no-plot", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    with open(tmp_path / "bench_host_null_kernels.json") as f:
        written = json.load(f)
    check_payload(dict(written, name="bench_host"), "bench_host")
    assert "null kernels" in " ".join(written["notes"])
