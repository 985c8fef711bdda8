"""transformer_fp8.debug writers: the TensorBoard scalars read back from the event file equal
the JSON lines records of the same steps (as float32, TensorBoard's scalar type), and asking
for TensorBoard without the package is an ImportError naming it."""
from __future__ import annotations

import math
import sys

import numpy as np
import pytest
import torch
from conftest import randn

import transformer_fp8 as tfp8
from transformer_fp8 import debug
from transformer_fp8.debug.writers import SCALARS


def _train(model, gen, steps, stats):
    for _ in range(steps):
        x = randn(gen, 8, 32).requires_grad_(True)
        with tfp8.fp8_autocast(fp8_recipe=tfp8.DelayedScaling(amax_history_len=4)):
            out = model(x)
        out.backward(randn(gen, 8, 32))
        stats.step()


def test_tensorboard_scalars_equal_the_json_lines_records(gen, tmp_path):
    pytest.importorskip("tensorboard")
    model = torch.nn.Sequential(tfp8.Linear(32, 32), torch.nn.ReLU(), tfp8.LayerNormMLP(32, 64))
    path, logdir = str(tmp_path / "fp8.jsonl"), str(tmp_path / "tb")
    with debug.collect_stats(model, frequency=2, path=path, tensorboard_dir=logdir) as stats:
        _train(model, gen, 5, stats)
    records = debug.read_records(path)
    assert sorted({r["step"] for r in records}) == [0, 2, 4] and len(records) == 3 * 9
    _assert_events_hold(logdir, records)


def _assert_events_hold(logdir, records):
    """The event file's scalars are the records' figures, non-finite ones included."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(logdir, size_guidance={"scalars": 0})
    events.Reload()
    expected = {}
    for r in records:
        label = r["layer"] + (f".{r['gemm']}" if r["gemm"] else "")
        for figure in SCALARS:
            expected.setdefault(f"fp8/{label}/{r['tensor']}/{figure}", []).append(
                (r["step"], repr(float(np.float32(r[figure])))))  # (repr: nan == nan)
    assert sorted(events.Tags()["scalars"]) == sorted(expected)
    for tag, points in expected.items():
        assert [(e.step, repr(e.value)) for e in events.Scalars(tag)] == points, tag


def test_tensorboard_writes_non_finite_figures(gen, tmp_path):
    """A NaN in the input: its NaN figures reach TensorBoard (they were dropped, and with them
    the step one debugs), as do infinite ones."""
    pytest.importorskip("tensorboard")
    layer = tfp8.Linear(32, 32)
    path, logdir = str(tmp_path / "fp8.jsonl"), str(tmp_path / "tb")
    x = randn(gen, 8, 32)
    x[1, 2] = float("nan")
    with debug.collect_stats(torch.nn.Sequential(layer), path=path,
                             tensorboard_dir=logdir) as stats:
        with tfp8.fp8_autocast(fp8_recipe=tfp8.Float8CurrentScaling()):
            layer(x)
        stats.step()
    records = debug.read_records(path)
    figures = [r[f] for r in records for f in SCALARS]
    assert any(math.isnan(v) for v in figures)
    _assert_events_hold(logdir, records)


def test_tensorboard_without_the_package_is_an_import_error(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails
    model = torch.nn.Sequential(tfp8.Linear(16, 16))
    with pytest.raises(ImportError, match=r"tensorboard_dir=.* needs the tensorboard package"):
        debug.collect_stats(model, path=str(tmp_path / "s.jsonl"),
                            tensorboard_dir=str(tmp_path / "tb"))
    assert not (tmp_path / "s.jsonl").exists()  # refused before any file was opened


def test_a_writer_that_fails_warns_once_and_training_goes_on(tmp_path):
    """A JSON lines file that cannot be written (a full disk: /dev/full): each step warns once
    per writer at most, counts, and keeps its records; disable() ends cleanly (step() raised
    OSError, the step was not counted, and every later step was logged as step 0)."""
    import os
    if not os.path.exists("/dev/full"):
        pytest.skip("needs /dev/full")
    torch.manual_seed(0)
    layer = tfp8.Linear(32, 32)
    stats = debug.collect_stats(torch.nn.Sequential(layer), path="/dev/full").enable()
    with pytest.warns(UserWarning, match="JsonLinesWriter failed") as caught:
        for _ in range(3):
            with tfp8.fp8_autocast(fp8_recipe=tfp8.Float8CurrentScaling()):
                layer(torch.randn(16, 32)).sum().backward()
            stats.step()
        stats.disable()
    assert sum("failed" in str(w.message) for w in caught) == 1
    assert stats.step_index == 3
    assert sorted({r["step"] for r in stats.records}) == [0, 1, 2]


def test_an_empty_expert_under_row_wise_scaling_is_observed(gen):
    """GroupedLinear with an expert that got no rows, Float8RowwiseScaling, statistics on: it
    trains as with them off (the transposed operand's blocks of 0 rows raised)."""
    torch.manual_seed(0)
    layer = tfp8.GroupedLinear(3, 256, 64)
    x = randn(gen, 40, 256)
    stats = debug.collect_stats(torch.nn.Sequential(layer)).enable()
    try:
        with tfp8.fp8_autocast(fp8_recipe=tfp8.Float8RowwiseScaling()):
            out = layer(x, [17, 0, 23])
        out.sum().backward()
        records = stats.step()
    finally:
        stats.disable()
    assert records and all(r["layer"] for r in records)


def test_each_collector_rewrites_its_json_lines_file(tmp_path):
    """Two runs logging to one path: the file holds the second run only (the runs were
    appended, and heatmap_matrix showed one run's amaxes at some steps, silently); the same
    collector enabled again appends."""
    path = str(tmp_path / "fp8.jsonl")
    for scale in (1.0, 1000.0):
        torch.manual_seed(0)
        layer = tfp8.Linear(32, 32)
        with debug.collect_stats(torch.nn.Sequential(layer), path=path) as stats:
            for _ in range(2):
                with tfp8.fp8_autocast(fp8_recipe=tfp8.DelayedScaling()):
                    layer(torch.randn(16, 32) * scale).sum().backward()
                stats.step()
    assert debug.read_records(path) == stats.records and len(stats.records) == 6
    assert min(r["amax"] for r in stats.records if r["tensor"] == "input") > 100
    with stats:
        with tfp8.fp8_autocast(fp8_recipe=tfp8.DelayedScaling()):
            layer(torch.randn(16, 32)).sum().backward()
        stats.step()
    assert [r["step"] for r in debug.read_records(path)] == [0] * 3 + [1] * 3 + [2] * 3


def test_layer_names_that_read_as_numbers_come_back_as_names(tmp_path):
    """Layers named "inf" and "nan" (a ModuleDict's keys): read_records gives back the names,
    as written (it turned them into floats), and the non-finite figures as floats."""
    path = str(tmp_path / "fp8.jsonl")
    model = torch.nn.ModuleDict({"inf": tfp8.Linear(32, 32), "nan": tfp8.Linear(32, 32)})
    with debug.collect_stats(model, path=path) as stats:
        with tfp8.fp8_autocast(fp8_recipe=tfp8.DelayedScaling()):
            out = model["nan"](model["inf"](torch.randn(16, 32)))
        out.sum().backward()
        stats.step()
    records = debug.read_records(path)
    assert {r["layer"] for r in records} == {"inf", "nan"}
    assert records == stats.records
    assert any(isinstance(r[k], float) and math.isinf(r[k]) for r in records for k in r
               if k not in ("layer", "gemm", "tensor")), "an infinite figure read back as one"


def test_mixed_runs_are_refused_by_the_analysis():
    """Two records of one operand at one step (runs or collectors mixed): heatmap_matrix and
    worst_report refuse them (they kept the last, or the worst of either run)."""
    record = dict(layer="0", gemm="", tensor="input", step=0, sqnr_db=30.0, underflow_frac=0.0,
                  saturation_frac=0.0, dynamic_range_log2=1.0, amax=1.0, scale_min=1.0)
    runs = [record, dict(record, step=1), dict(record, amax=1000.0)]
    for call in (lambda: debug.heatmap_matrix(runs, "amax"), lambda: debug.worst_report(runs)):
        with pytest.raises(ValueError, match=r"two records of 0:input at step 0: records of "
                                             r"several runs or collectors mixed"):
            call()
    assert debug.heatmap_matrix(runs[:2], "amax") == (["0:input"], [0, 1], [[1.0, 1.0]])
