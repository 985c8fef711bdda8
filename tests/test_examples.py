"""The examples run end to end (in-process, reduced sizes): examples/quickstart.py,
examples/train_gpt.py --tiny and (where transformers is installed) examples/train_llama.py
--tiny. On the GPU when there is one, else on the CPU (~30 s)."""
from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"_example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _finite(values) -> bool:
    return all(math.isfinite(v) for v in values)


def test_quickstart(capsys):
    quickstart = _load("quickstart")
    steps = 60
    results = quickstart.main(["--steps", str(steps)])
    out = capsys.readouterr().out
    assert "relative difference FP8 vs BF16" in out

    bf16, fp8 = results["bf16"], results["fp8"]
    for r in (bf16, fp8):
        assert len(r["losses"]) == steps
        assert _finite(r["losses"]) and _finite([r["final_train_loss"], r["val_loss"]])
        assert r["final_train_loss"] < 0.5 * r["initial_loss"], "the MLP did not learn"
    # Same init, same batches: FP8 training tracks BF16 closely.
    assert fp8["final_train_loss"] == pytest.approx(bf16["final_train_loss"], rel=0.2)
    assert fp8["val_loss"] == pytest.approx(bf16["val_loss"], rel=0.2)
    assert results["rel_diff_val"] < 0.2


def test_train_gpt_tiny_both(tmp_path):
    train_gpt = _load("train_gpt")
    out = tmp_path / "out"
    summary = train_gpt.main(["--tiny", "--precision", "both", "--out", str(out),
                              "--no-progress"])
    results = summary["results"]
    steps = summary["config"]["steps"]
    assert set(results) == {"bf16", "fp8"}
    for name, r in results.items():
        assert len(r["train_losses"]) == steps
        assert _finite(r["train_losses"]) and _finite([r["final_train_loss"], r["val_loss"]])
        # From ~ln(vocab) at init to clearly below it: the model learnt character statistics.
        assert r["final_train_loss"] < 0.8 * r["train_losses"][0], name
    assert len(results["fp8"]["fp8_layers"]) == 4 * summary["config"]["layers"]
    assert "lm_head" not in results["fp8"]["fp8_layers"]
    b, f = results["bf16"]["final_train_loss"], results["fp8"]["final_train_loss"]
    assert f == pytest.approx(b, rel=0.1)
    assert results["fp8"]["val_loss"] == pytest.approx(results["bf16"]["val_loss"], rel=0.1)

    png, js = out / "loss_curves.png", out / "losses.json"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000
    record = json.loads(js.read_text())
    assert record["config"]["precision"] == "both"
    for name in ("bf16", "fp8"):
        assert record[name]["train_losses"] == results[name]["train_losses"]


def test_train_llama_tiny_resume_is_exact(tmp_path):
    """examples/train_llama.py (a transformers Llama from a config): it learns in both
    precisions, FP8 tracks bf16, and a run checkpointed and resumed halfway has the losses of
    an uninterrupted one, bit for bit."""
    pytest.importorskip("transformers", reason="examples/train_llama.py needs transformers")
    train_llama = _load("train_llama")
    resumed = train_llama.main(["--tiny", "--out", str(tmp_path / "a"), "--no-progress"])
    straight = train_llama.main(["--tiny", "--out", str(tmp_path / "b"), "--no-progress",
                                 "--resume-at", "0"])
    assert resumed["config"]["resume_at"] == resumed["config"]["steps"] // 2 > 0
    for name in ("bf16", "fp8"):
        losses = resumed["results"][name]["train_losses"]
        assert losses == straight["results"][name]["train_losses"], name
        assert _finite(losses) and losses[-1] < 0.9 * losses[0], name
    assert (tmp_path / "a" / "llama_fp8_checkpoint.pt").exists()
    b, f = (resumed["results"][n]["final_train_loss"] for n in ("bf16", "fp8"))
    assert f == pytest.approx(b, rel=0.1)
    png = tmp_path / "a" / "llama_loss_curves.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # standard JSON (no bare NaN), and no validation loss claimed where none was measured

    def no_constant(name):
        raise AssertionError(f"llama_losses.json holds {name}, which is not standard JSON")

    written = json.loads((tmp_path / "a" / "llama_losses.json").read_text(),
                         parse_constant=no_constant)
    assert all("val_loss" not in written[name] for name in ("bf16", "fp8"))


def test_train_gpt_tiny_te_layers(tmp_path):
    """examples/train_gpt.py --tiny --te-layers: the blocks are transformer_fp8.TransformerLayer
    (three FP8 modules each, nothing converted), both precisions learn and FP8 tracks bf16."""
    pytest.importorskip("transformer_fp8.ops.fused",
                        reason="the FP8 path of TransformerLayer needs transformer_fp8.ops.fused")
    train_gpt = _load("train_gpt")
    summary = train_gpt.main(["--tiny", "--te-layers", "--precision", "both", "--out",
                              str(tmp_path / "out"), "--no-progress"])
    results, layers = summary["results"], summary["config"]["layers"]
    assert summary["config"]["te_layers"] is True
    for name, r in results.items():
        assert _finite(r["train_losses"]) and _finite([r["final_train_loss"], r["val_loss"]])
        assert r["final_train_loss"] < 0.8 * r["train_losses"][0], name
    assert len(results["fp8"]["fp8_layers"]) == 3 * layers
    assert all(".self_attention." in n or n.endswith("layernorm_mlp")
               for n in results["fp8"]["fp8_layers"])
    b, f = results["bf16"]["final_train_loss"], results["fp8"]["final_train_loss"]
    assert f == pytest.approx(b, rel=0.1)
    assert (tmp_path / "out" / "loss_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_inspect_fp8_points_at_the_outlier_layer(tmp_path, capsys):
    inspect_fp8 = _load("inspect_fp8")
    results = inspect_fp8.main(["--steps", "30", "--out", str(tmp_path)])
    worst = results["worst"]
    assert (worst["layer"], worst["gemm"], worst["tensor"]) == ("blocks.2.fc1", "", "input")
    assert worst["underflow_frac"] > 0.3
    assert _finite(results["losses"].values())
    assert "blocks.2.fc1 in high precision" in capsys.readouterr().out
    assert (tmp_path / "fp8_stats.jsonl").stat().st_size > 0


@pytest.mark.parametrize("example, argv", [("inspect_fp8", ["--steps", "5"]),
                                           ("quickstart", ["--steps", "0"])])
def test_examples_refuse_step_counts_they_cannot_report_on(example, argv, capsys):
    """inspect_fp8 takes statistics every 10 steps (under 11 steps: nothing to report, it
    crashed in max()); a zero step count divided by zero."""
    with pytest.raises(SystemExit):
        _load(example).main(argv)
    assert "--steps must be" in capsys.readouterr().err
