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
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    model = torch.nn.Sequential(tfp8.Linear(32, 32), torch.nn.ReLU(), tfp8.LayerNormMLP(32, 64))
    path, logdir = str(tmp_path / "fp8.jsonl"), str(tmp_path / "tb")
    with debug.collect_stats(model, frequency=2, path=path, tensorboard_dir=logdir) as stats:
        _train(model, gen, 5, stats)
    records = debug.read_records(path)
    assert sorted({r["step"] for r in records}) == [0, 2, 4] and len(records) == 3 * 9
    events = EventAccumulator(logdir, size_guidance={"scalars": 0})
    events.Reload()
    expected = {}
    for r in records:
        label = r["layer"] + (f".{r['gemm']}" if r["gemm"] else "")
        for figure in SCALARS:
            if math.isfinite(r[figure]):
                expected.setdefault(f"fp8/{label}/{r['tensor']}/{figure}", []).append(
                    (r["step"], float(np.float32(r[figure]))))
    assert "fp8/2.fc1/input/sqnr_db" in expected and "fp8/0/grad_output/amax" in expected
    assert sorted(events.Tags()["scalars"]) == sorted(expected)
    for tag, points in expected.items():
        assert [(e.step, e.value) for e in events.Scalars(tag)] == points, tag


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
