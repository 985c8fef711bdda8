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
    assert "\n" not in payload["title"], f"{name}: a title on several lines: {payload['title']!r}"
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


def _check_block_sqnr(payload):
    """Each row's GEMM pairs x and w as a recipe does: on the 128x128 row, Float8BlockScaling's
    forward (activation x in 1x128 tiles, weight w in 128x128 blocks)."""
    pairing = {row["recipe"]: row["gemm_pairing"] for row in payload["rows"]}
    assert pairing == {"per-tensor": "per-tensor x per-tensor", "1x128": "1x128 x 1x128",
                       "128x128": "1x128 x 128x128", "rowwise": "rowwise x rowwise"}


def _check_te_modules(payload):
    """Speedups are over the fused bf16 baselines, and the unfused eager module is its own row
    and column; every row of LayerNormMLP has both."""
    mlp = [row for row in payload["rows"] if row["module"] == "LayerNormMLP"]
    names = [row["precision"] for row in mlp]
    te = importlib.import_module("bench_te_modules")
    assert {te.UNFUSED, te.COMPILED, te.FUSED_KERNELS} <= set(names)
    assert all(row["speedup"] and row["speedup_unfused"] for row in mlp), mlp


def _check_gpt(payload):
    header = {key: title for key, title, _ in payload["columns"]}
    assert "not a convergence check" in header["final_loss"]
    for row in payload["rows"]:
        curve = payload["extra"]["losses"][row["precision"]]
        assert row["loss_change"] == pytest.approx(row["final_loss"] - curve[0])


EXTRA_CHECKS = {"bench_block_sqnr": _check_block_sqnr, "bench_te_modules": _check_te_modules,
                "bench_gpt": _check_gpt}


@pytest.mark.parametrize("name", BENCHMARKS)
def test_benchmark_smoke(name, tmp_path):
    payload = importlib.import_module(name).main(["--smoke", "--out", str(tmp_path)])
    with open(tmp_path / f"{name}.json") as f:
        written = json.load(f)
    check_payload(written, name)
    assert written["rows"] == json.loads(json.dumps(payload["rows"], default=str))
    if HAS_MATPLOTLIB:
        assert (tmp_path / f"{name}.png").stat().st_size > 0
    if name in EXTRA_CHECKS:
        EXTRA_CHECKS[name](written)


def test_fsdp_comm_smoke_counts_fp8_all_gathers(tmp_path):
    """The FP8 all-gathers of bias-free Linear layers move exactly a quarter of float32's bytes
    and half of bfloat16's (counted at the collective, not computed from shapes). The ranks
    run on the CPU whatever --device says, and the results name the CPU."""
    payload = importlib.import_module("bench_fsdp_comm").main(
        ["--smoke", "--out", str(tmp_path), "--no-plot", "--device", "cuda"])
    fp8 = [row for row in payload["rows"] if row["gather"] == "fp8"]
    assert fp8 and all(row["ratio_fp32"] == 0.25 and row["ratio_bf16"] == 0.5 for row in fp8)
    assert payload["info"]["device"] == "cpu"
    assert payload["info"]["device_name"].startswith("CPU (")


def test_te_modules_fused_kernel_baseline_computes_the_module():
    """bench_te_modules' bf16 baseline on transformer_fp8's non-FP8 fused kernels computes what
    the module computes outside fp8_autocast: output, input gradient and every parameter
    gradient (float32, so that the comparison is tight)."""
    pytest.importorskip("transformer_fp8.ops.fused")
    te = importlib.import_module("bench_te_modules")
    module = te.make_module("LayerNormMLP", te.SMOKE_SHAPE, torch.device("cpu"), None).float()
    with torch.no_grad():  # gamma and biases away from their 1 / 0 initialisation
        module.layer_norm_weight.uniform_(0.5, 1.5)
        module.fc1_bias.normal_()
        module.fc2_bias.normal_()
    x = torch.randn(*te.SMOKE_SHAPE[:3], requires_grad=True)
    g = torch.randn_like(x)
    results = []
    for run in (module, te.FusedKernelsLayerNormMLP(module)):
        x.grad = None
        module.zero_grad(set_to_none=True)
        y = run(x)
        y.backward(g)
        results.append([y.detach(), x.grad] + [p.grad for p in module.parameters()])
    assert len(results[0]) == 7
    for expected, got in zip(*results):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_linear_compiles_each_shape_statically(tmp_path):
    """bench_linear's compiled rows: every shape gets a fresh, static graph. Without
    torch._dynamo.reset() and dynamic=False, the second shape recompiles the same code with a
    symbolic size (dynamo's automatic dynamic shapes). A recording backend sees every graph."""
    graphs = []

    def recording(gm, example_inputs):
        symbolic = []
        for node in gm.graph.nodes:
            value = node.meta.get("example_value")
            if node.op == "placeholder" and (
                    isinstance(value, torch.SymInt) or (isinstance(value, torch.Tensor) and any(
                        isinstance(size, torch.SymInt) for size in value.shape))):
                symbolic.append(node.name)
        graphs.append(symbolic)
        return gm.forward

    import torch._dynamo
    torch._dynamo.register_backend(name="bench_smoke_recording", compiler_fn=recording)
    bench_linear = importlib.import_module("bench_linear")
    assert len(bench_linear.SMOKE_SHAPES) >= 2
    payload = bench_linear.main(["--smoke", "--out", str(tmp_path), "--no-plot", "--compile",
                                 "on", "--compile-backend", "bench_smoke_recording"])
    compiled = [row for row in payload["rows"] if row["impl"] == bench_linear.COMPILED]
    assert len(compiled) == len(bench_linear.SMOKE_SHAPES)
    assert all(row["time_ms"] for row in compiled), compiled
    assert len(graphs) >= len(bench_linear.SMOKE_SHAPES)
    assert graphs == [[]] * len(graphs), f"graphs with symbolic inputs: {graphs}"


def _graphed_row_layers(bench_linear):
    """(name, layer, recipe, x, g) for each of bench_linear's graphed rows, on CUDA, at its
    first smoke shape."""
    m, k, n = bench_linear.SMOKE_SHAPES[0]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    for name, (layer, recipe) in bench_linear.make_layers(k, n, torch.device("cuda")).items():
        if name in bench_linear.GRAPHED_ROWS:
            yield name, layer, recipe, x, g


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_linear_graphed_rows_replay_the_eager_step(tmp_path):
    """bench_linear's CUDA-graph rows: replays of the captured step give the gradients of as
    many eager steps (the rows time what they claim to), and every such row is timed."""
    import copy

    bench_linear = importlib.import_module("bench_linear")
    for name, layer, recipe, x, g in _graphed_row_layers(bench_linear):
        eager = copy.deepcopy(layer)
        captured = bench_linear.graphed_step(layer, recipe, x, g)
        assert captured is not None, name
        replay, graphed, graphed_x = captured
        for _ in range(2):
            replay()
        for _ in range(6):  # graphed_step's 3 warm-up steps and 1 replay, then 2 replays
            bench_linear.training_step(eager, recipe, x, g)()
        torch.cuda.synchronize()
        pairs = [(graphed_x.grad, x.grad)] + [
            (p.grad, q.grad) for p, q in zip(graphed.parameters(), eager.parameters())]
        for got, expected in pairs:
            torch.testing.assert_close(got, expected, msg=name)
        for (key, got), expected in zip(graphed.state_dict().items(),
                                        eager.state_dict().values()):
            if isinstance(got, torch.Tensor) and got.is_floating_point():
                torch.testing.assert_close(got, expected, msg=f"{name}: {key}")
    payload = bench_linear.main(["--smoke", "--out", str(tmp_path), "--no-plot", "--compile",
                                 "off", "--graphs", "on", "--device", "cuda"])
    graphed = [row for row in payload["rows"] if row["impl"].endswith(bench_linear.GRAPHED)]
    assert len(graphed) == len(bench_linear.GRAPHED_ROWS) * len(bench_linear.SMOKE_SHAPES)
    assert all(row["time_ms"] for row in graphed), graphed


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_linear_graphed_step_keeps_what_its_graph_replays_on():
    """A CUDA graph keeps none of the tensors it was captured on alive: bench_linear's replay
    must hold the layer's and x's copies, or replays write into memory handed out again (here
    to sentinel-filled tensors of the same sizes)."""
    import gc

    bench_linear = importlib.import_module("bench_linear")
    for name, layer, recipe, x, g in _graphed_row_layers(bench_linear):
        replay = bench_linear.graphed_step(layer, recipe, x, g)[0]
        gc.collect()
        torch.cuda.synchronize()
        fillers = [torch.full_like(t, -7.0) for t in [x, *layer.parameters()] for _ in range(4)]
        for _ in range(2):
            replay()
        torch.cuda.synchronize()
        for t in fillers:
            assert bool((t == -7.0).all()), f"{name}: a replay wrote into freed memory"


def test_device_info_names_the_commit(tmp_path, monkeypatch):
    """device_info records the git commit of the benchmarks' tree and whether tracked files
    differ from it; where there is no git repository, the commit named by
    $TRANSFORMER_FP8_COMMIT (dirty unknown), else that it is unknown."""
    import subprocess

    common = importlib.import_module("common")
    info = common.device_info(torch.device("cpu"))
    assert {"commit", "dirty", "commit_source", "cpu"} <= set(info)
    try:
        head = subprocess.run(["git", "-C", common.REPO_ROOT, "rev-parse", "HEAD"],
                              capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        head = None
    if head:
        assert info["commit"] == head and info["dirty"] in (True, False)
        assert info["commit"][:12] in common.describe(info)
    monkeypatch.setenv(common.COMMIT_ENV, "0123456789abcdef")
    named = common.git_commit(str(tmp_path))  # not a repository
    assert named["commit"] == "0123456789abcdef" and named["dirty"] is None
    monkeypatch.delenv(common.COMMIT_ENV)
    assert common.git_commit(str(tmp_path))["commit"] is None


def test_gpt_smoke_trains_every_precision(tmp_path):
    """bf16 and the three FP8 recipes each produce a finite loss per step."""
    payload = importlib.import_module("bench_gpt").main(
        ["--smoke", "--out", str(tmp_path), "--no-plot"])
    losses = payload["extra"]["losses"]
    assert set(losses) == {"bf16", "fp8 DelayedScaling", "fp8 Float8CurrentScaling",
                           "fp8 Float8BlockScaling"}
    for name, curve in losses.items():
        assert curve and all(torch.isfinite(torch.tensor(curve))), f"{name}: {curve}"
    assert not (tmp_path / "bench_gpt.png").exists()


def test_gpt_smoke_with_transformer_layer_blocks(tmp_path, capsys):
    """--blocks te: the torch bf16 row, the TransformerLayer GPT outside fp8_autocast and the
    three FP8 recipes on TransformerLayer blocks, each with a finite loss per step and the torch
    GPT's parameter count; the TransformerLayer GPT starts from the torch GPT's weights (same
    first loss). --graphed on the CPU: skipped, no graphed rows."""
    bench_gpt = importlib.import_module("bench_gpt")
    payload = bench_gpt.main(["--smoke", "--out", str(tmp_path), "--no-plot", "--blocks", "te",
                              "--graphed"])
    names = [row["precision"] for row in payload["rows"]]
    assert names == ["bf16", bench_gpt.TE_BF16, "fp8 DelayedScaling",
                     "fp8 Float8CurrentScaling", "fp8 Float8BlockScaling"]
    assert [row["blocks"] for row in payload["rows"]] == ["nn.Linear"] + ["TransformerLayer"] * 4
    losses = payload["extra"]["losses"]
    for row in payload["rows"]:
        curve = losses[row["precision"]]
        assert curve and all(math.isfinite(v) for v in curve), f"{row['precision']}: {curve}"
        assert math.isfinite(row["final_loss"]) and row["time_ms"] > 0
    assert payload["extra"]["params_te"] == payload["extra"]["params"] > 0
    # (the same weights: equal here; a wrong QKV layout moves it by ~1e-4 relative)
    assert losses[bench_gpt.TE_BF16][0] == pytest.approx(losses["bf16"][0], rel=2e-5)
    assert "--graphed: skipped" in capsys.readouterr().out
    assert any("--graphed skipped" in note for note in payload["notes"])


def test_gpt_graphed_rows_come_last_and_a_failed_capture_gives_an_n_a_row(tmp_path,
                                                                         monkeypatch):
    """--graphed's bookkeeping, on the CPU with graph_blocks replaced (CUDA graphs themselves
    run on a GPU only): every row again after the eager ones, the speedup over the graphed bf16
    row, and a capture that raises gives an n/a row and its reason, not a failed benchmark."""
    bench_gpt = importlib.import_module("bench_gpt")
    graphed = []

    def fake_graph_blocks(model, recipe, batch, cfg):
        if type(recipe).__name__ == "Float8BlockScaling":
            try:
                raise ValueError("first error")
            except ValueError:
                raise RuntimeError("capture failed")  # (raised while handling the first)
        graphed.append(recipe)

    monkeypatch.setattr(bench_gpt, "graphs_available", lambda device: True)
    monkeypatch.setattr(bench_gpt, "graph_blocks", fake_graph_blocks)
    payload = bench_gpt.main(["--smoke", "--out", str(tmp_path), "--no-plot", "--graphed"])
    check_payload(payload, "bench_gpt")
    eager = ["bf16", "fp8 DelayedScaling", "fp8 Float8CurrentScaling", "fp8 Float8BlockScaling"]
    rows = {row["precision"]: row for row in payload["rows"]}
    assert list(rows) == eager + [name + bench_gpt.GRAPHED for name in eager]
    assert len(graphed) == 3 and graphed[0] is None
    failed = rows["fp8 Float8BlockScaling" + bench_gpt.GRAPHED]
    assert failed["time_ms"] is None and failed["speedup"] is None
    assert any("capture failed <- ValueError: first error" in note for note in payload["notes"])
    bf16_graphed = rows["bf16" + bench_gpt.GRAPHED]
    for name in ("fp8 DelayedScaling", "fp8 Float8CurrentScaling"):
        row = rows[name + bench_gpt.GRAPHED]
        assert row["speedup"] == pytest.approx(bf16_graphed["time_ms"] / row["time_ms"])


def test_gpt_transformer_layer_model_holds_the_torch_weights():
    """te_model's TransformerLayer blocks compute what the torch blocks compute, from the same
    weights: in float32 (outside fp8_autocast) the logits are equal."""
    models = importlib.import_module("gpt_models")
    cfg = models.SMOKE_CONFIG
    torch_gpt = models.initial_model(cfg, "cpu")
    te_gpt = models.te_model(torch_gpt, cfg)
    assert all(isinstance(b, models.tf8.TransformerLayer) for b in te_gpt.blocks)
    assert sum(p.numel() for p in te_gpt.parameters()) == \
        sum(p.numel() for p in torch_gpt.parameters())
    tokens = torch.randint(cfg.vocab, (2, cfg.seq), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = torch_gpt.float()(tokens)
        got = te_gpt.float()(tokens)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_gpt_graph_blocks_needs_cuda():
    models = importlib.import_module("gpt_models")
    model = models.initial_model(models.SMOKE_CONFIG, "cpu")
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA model"):
        models.graph_blocks(model, None, 2, models.SMOKE_CONFIG)


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
    info = results["info"]
    if info["commit"] is None:  # (a copy without .git and $TRANSFORMER_FP8_COMMIT unset: the
        assert info["commit_source"].startswith("unknown") and "commit unknown" in text  # device
    else:
        assert "- commit " in text and info["commit"][:12] in text
    # Only the three collected files: each part, once collected, was deleted with its folder.
    expected = {"results.md", "results.json"} | ({"results.png"} if HAS_MATPLOTLIB else set())
    assert set(os.listdir(tmp_path)) == expected


def test_run_all_keeps_finished_results_when_stopped(tmp_path, monkeypatch):
    """results.md/json are rewritten after every benchmark, so they hold the first benchmark's
    results while the second runs (what a SIGKILL would leave), and a SIGTERM (what timeout(1)
    sends) during the second writes them with the run marked as stopped: status 1, the parts
    folder under --out gone, the benchmark cut short and the ones after it named."""
    import signal

    run_all = importlib.import_module("run_all")
    bench_gemm = importlib.import_module("bench_gemm")
    seen = {}

    def killed(argv):
        seen["md"] = (tmp_path / "results.md").read_text()
        seen["json"] = json.loads((tmp_path / "results.json").read_text())
        seen["parts"] = os.listdir(tmp_path / "parts")
        os.kill(os.getpid(), signal.SIGTERM)
        raise AssertionError("SIGTERM did not stop the run")

    monkeypatch.setattr(bench_gemm, "main", killed)
    status = run_all.main(["--smoke", "--out", str(tmp_path), "--only",
                           "bench_cast,bench_gemm,bench_scaling"])
    assert status == 1
    # while the second benchmark ran: the first one's results were on disk already
    assert "Memory-bound FP8 kernels" in seen["md"]
    assert sorted(seen["json"]["benchmarks"]) == ["bench_cast"] and seen["parts"] == []
    results = json.loads((tmp_path / "results.json").read_text())
    assert sorted(results["benchmarks"]) == ["bench_cast"]
    assert results["stopped"] == "SIGTERM"
    assert results["not_finished"] == ["bench_gemm", "bench_scaling"]
    check_payload(results["benchmarks"]["bench_cast"], "bench_cast")
    text = (tmp_path / "results.md").read_text()
    assert "Run stopped (SIGTERM)" in text and "Memory-bound FP8 kernels" in text
    assert "Not finished: bench_gemm, bench_scaling" in text
    assert not (tmp_path / "parts").exists()
    assert signal.getsignal(signal.SIGTERM) is not run_all._raise_stopped


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
