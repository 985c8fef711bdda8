"""benchmarks/gpt_loss_curves.py on the CPU (--smoke: a tiny GPT on the standard library's
text): precisions trained in separate runs merge into one summary; the same seed gives the
same bf16 losses bit for bit; a run stopped by its time limit or by SIGTERM keeps the steps
it did, and a run resumed from its checkpoint is the uninterrupted one bit for bit. Also the
batches and the held-out split of benchmarks/stdlib_text.py."""
from __future__ import annotations

import importlib
import json
import math
import os
import signal
import statistics
import sys

import pytest
import torch

BENCH_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                         "benchmarks")
sys.path.insert(0, BENCH_DIR)
glc = importlib.import_module("gpt_loss_curves")
stdlib_text = importlib.import_module("stdlib_text")

try:
    import matplotlib  # noqa: F401
    HAS_MATPLOTLIB = True
except ImportError:
    HAS_MATPLOTLIB = False


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def train(out, *argv):
    return glc.main(["--smoke", "--no-plot", "--out", str(out), *argv])


def record(out, key):
    with open(os.path.join(out, f"gpt_loss_curves.{key}.json")) as f:
        return json.load(f)


def trained(out, key, *argv):
    """The record of ``key`` trained alone into ``out``."""
    train(out, "--precisions", key, *argv)
    return record(out, key)


def test_runs_in_pieces_merge_into_one_summary(tmp_path):
    """Two precisions trained by two runs into two folders, then summarised together: one
    table, the final loss the mean of the last --tail steps, each FP8 ratio to bf16's."""
    train(tmp_path / "a", "--precisions", "bf16")
    train(tmp_path / "b", "--precisions", "delayed")
    argv = ["--summarize", str(tmp_path / "a"), str(tmp_path / "b"),
            "--out", str(tmp_path / "sum"), "--tail", "10"]
    payload = glc.main(argv if HAS_MATPLOTLIB else argv + ["--no-plot"])
    rows = {row["precision"]: row for row in payload["rows"]}
    assert list(rows) == ["bf16", "fp8 DelayedScaling"]
    bf16, fp8 = record(tmp_path / "a", "bf16"), record(tmp_path / "b", "delayed")
    for rec in (bf16, fp8):
        assert rec["complete"] and len(rec["losses"]) == 40 and rec["stopped"] is None
        assert all(math.isfinite(x) for x in rec["losses"]) and math.isfinite(rec["val_loss"])
        # a byte-level model learns: well below ln 256 = 5.55 after 40 steps
        assert statistics.fmean(rec["losses"][-10:]) < rec["losses"][0] - 1.0
    assert fp8["fp8_layers"] == 8 and bf16["fp8_layers"] == 0
    assert rows["bf16"]["final_loss"] == statistics.fmean(bf16["losses"][-10:])
    assert rows["fp8 DelayedScaling"]["final_loss"] == statistics.fmean(fp8["losses"][-10:])
    ratio = rows["fp8 DelayedScaling"]["ratio"]
    assert ratio == rows["fp8 DelayedScaling"]["final_loss"] / rows["bf16"]["final_loss"]
    assert rows["fp8 DelayedScaling"]["within"] == ("yes" if abs(ratio - 1) <= 0.005 else "NO")
    assert rows["fp8 DelayedScaling"]["val_ratio"] == fp8["val_loss"] / bf16["val_loss"]
    assert rows["bf16"]["run"] == "a" and rows["fp8 DelayedScaling"]["run"] == "b"
    written = json.loads((tmp_path / "sum" / "gpt_loss_curves.json").read_text())
    assert written["rows"] == payload["rows"]
    assert "| fp8 DelayedScaling | 40/40 |" in (tmp_path / "sum" / "gpt_loss_curves.md").read_text()
    if HAS_MATPLOTLIB:
        assert (tmp_path / "sum" / "gpt_loss_curves.png").stat().st_size > 0


def test_same_seed_same_bf16_losses(tmp_path):
    """Same seed: the same initial weights and bit-identical losses; another seed: other
    weights and other losses."""
    runs = [trained(tmp_path / name, "bf16", "--steps", "12", *seed)
            for name, seed in (("a", ()), ("b", ()), ("c", ("--seed", "1")))]
    assert runs[0]["losses"] == runs[1]["losses"] and runs[0]["val_loss"] == runs[1]["val_loss"]
    assert runs[0]["init_checksum"] == runs[1]["init_checksum"]
    assert runs[2]["init_checksum"] != runs[0]["init_checksum"]
    assert runs[2]["losses"] != runs[0]["losses"]


def test_summary_refuses_runs_that_differ(tmp_path):
    train(tmp_path / "a", "--precisions", "bf16", "--steps", "2")
    train(tmp_path / "b", "--precisions", "delayed", "--steps", "2", "--seed", "1")
    with pytest.raises(ValueError, match="differ in config"):
        glc.main(["--summarize", str(tmp_path / "a"), str(tmp_path / "b"),
                  "--out", str(tmp_path / "sum"), "--no-plot"])


@pytest.mark.parametrize("key", list(glc.PRECISIONS))
def test_resume_is_the_uninterrupted_run(tmp_path, key):
    """12 steps straight, and 6 steps checkpointed then resumed to 12 (another output folder,
    as on a fresh call): the same losses and validation loss, bit for bit (the FP8 state
    travels in the model's state_dict)."""
    straight = trained(tmp_path / "straight", key, "--steps", "12")
    ckpt = ["--checkpoint-dir", str(tmp_path / "ckpt")]
    train(tmp_path / "first", "--precisions", key, "--steps", "6", "--checkpoint-every", "3",
          *ckpt)
    resumed = trained(tmp_path / "second", key, "--steps", "12", "--resume", *ckpt)
    assert resumed["resumed_at"] == [6]
    assert resumed["losses"] == straight["losses"]
    assert resumed["val_loss"] == straight["val_loss"]


def test_time_limit_stops_checkpoints_and_resumes(tmp_path, monkeypatch):
    """When the time left cannot hold another step, the run stops before it, writes the steps
    done and a checkpoint, computes the validation loss and starts no further precision;
    resumed, it finishes as the uninterrupted run."""
    straight = trained(tmp_path / "straight", "bf16", "--steps", "10")
    calls = []

    def time_left():  # the precision's start, then one check per step: time for 4 steps
        calls.append(1)
        return 1e9 if len(calls) <= 5 else 0.0
    monkeypatch.setattr(glc, "_time_left", time_left)
    ckpt = ["--checkpoint-dir", str(tmp_path / "ckpt")]
    payload = train(tmp_path / "cut", "--precisions", "bf16,delayed", "--steps", "10", *ckpt)
    cut = record(tmp_path / "cut", "bf16")
    assert cut["losses"] == straight["losses"][:4] and not cut["complete"]
    assert cut["stopped"] == "time limit, before step 5" and math.isfinite(cut["val_loss"])
    assert not (tmp_path / "cut" / "gpt_loss_curves.delayed.json").exists()
    assert [row["precision"] for row in payload["rows"]] == ["bf16"]
    monkeypatch.undo()
    rest = trained(tmp_path / "rest", "bf16", "--steps", "10", "--resume", *ckpt)
    assert rest["resumed_at"] == [4] and rest["losses"] == straight["losses"]


def test_sigterm_keeps_the_steps_done(tmp_path, monkeypatch):
    """SIGTERM (what timeout sends) in the middle of a run: the record holds the steps done,
    says so, the run still summarises, and the previous SIGTERM handler is back."""
    straight = trained(tmp_path / "straight", "bf16", "--steps", "8")
    bench_gpt = importlib.import_module("bench_gpt")
    step, steps = bench_gpt.train_step, []

    def step_then_sigterm(*args, **kwargs):
        loss = step(*args, **kwargs)
        steps.append(1)
        if len(steps) == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return loss
    monkeypatch.setattr(bench_gpt, "train_step", step_then_sigterm)
    before = signal.getsignal(signal.SIGTERM)
    payload = train(tmp_path / "cut", "--precisions", "bf16,delayed", "--steps", "8")
    cut = record(tmp_path / "cut", "bf16")
    assert cut["stopped"].startswith("SIGTERM after step") and not cut["complete"]
    assert 2 <= len(cut["losses"]) <= 3 and cut["losses"] == straight["losses"][:len(cut["losses"])]
    assert not (tmp_path / "cut" / "gpt_loss_curves.delayed.json").exists()
    assert [row["precision"] for row in payload["rows"]] == ["bf16"]
    assert signal.getsignal(signal.SIGTERM) is before


def test_unknown_precision_is_refused(tmp_path):
    with pytest.raises(ValueError, match="--precisions: unknown"):
        train(tmp_path, "--precisions", "bf16,fp4")


def test_batches_depend_on_the_step_only():
    """Every step's batch is the same whichever steps came before (or none); within an epoch
    the windows do not overlap; later epochs start at another offset."""
    stream = torch.arange(1000) % 251
    seq, batch = 15, 3
    first = stdlib_text.Batches(stream.to(torch.uint8), seq, batch, seed=0)
    per_epoch = 1000 // (seq + 1)
    in_order = [first.batch_at(s) for s in range(2 * per_epoch // batch + 2)]
    fresh = stdlib_text.Batches(stream.to(torch.uint8), seq, batch, seed=0)
    for s in (40, 3, 0, 21):  # crosses epoch boundaries (62 windows per epoch)
        assert torch.equal(fresh.batch_at(s), in_order[s])
    starts = first._epoch(0).tolist()
    assert sorted(starts) == list(range(0, per_epoch * (seq + 1), seq + 1))
    assert first._epoch(1)[0] % (seq + 1) != 0 or first._epoch(2)[0] % (seq + 1) != 0
    other = stdlib_text.Batches(stream.to(torch.uint8), seq, batch, seed=1)
    assert not torch.equal(other.batch_at(0), in_order[0])
    assert in_order[0].shape == (batch, seq + 1) and in_order[0].dtype == torch.int64


def test_corpus_split_and_fingerprint():
    """Every 20th page held out, the rest trained on, nothing lost; the text is prose plus
    the standard library's source, named by its SHA-256."""
    corpus = stdlib_text.load("stdlib")
    text, _ = stdlib_text.corpus_text("stdlib")
    data, page = text.encode(), stdlib_text.PAGE
    pages = [data[i:i + page] for i in range(0, len(data), page)]
    assert bytes(corpus.val.tolist()) == b"".join(pages[19::20])
    assert bytes(corpus.train.tolist()) == b"".join(p for i, p in enumerate(pages) if i % 20 != 19)
    assert "def " in text and 'The "import" statement' in text  # code, the reference's prose
    assert corpus.describe()["tokens"] > 1_000_000
    windows = stdlib_text.val_windows(corpus.val, 15, 8)
    assert windows.shape == (8, 16)


def test_master_adamw_steps_float32_masters():
    """The default optimizer: AdamW on float32 copies of the bf16 parameters, fed the bf16
    gradients in float32, the parameters the masters rounded to bf16; a float32 AdamW given
    the same gradients computes the same masters bit for bit. A LayerNorm gain of 1.0 moves
    in its master, where AdamW on the bf16 parameter loses every update of lr 3e-4."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.LayerNorm(16)).bfloat16()
    optimizer = glc.MasterAdamW(model.parameters(), lr=3e-4)
    copy_of = [p.detach().float().clone().requires_grad_(True)
                       for p in model.parameters()]
    reference = torch.optim.AdamW(copy_of, lr=3e-4, betas=(0.9, 0.95), weight_decay=0.0)
    bf16_model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.LayerNorm(16)).bfloat16()
    bf16_model.load_state_dict(model.state_dict())
    bf16_opt = importlib.import_module("bench_gpt").make_optimizer(bf16_model.parameters())
    x = torch.randn(8, 16).bfloat16()
    for _ in range(3):
        for net in (model, bf16_model):
            net(x).float().square().mean().backward()
        for p, ref in zip(model.parameters(), copy_of):
            ref.grad = p.grad.float()
        optimizer.step()
        optimizer.zero_grad()
        reference.step()
        bf16_opt.step()
        bf16_opt.zero_grad()
    for p, master, ref in zip(model.parameters(), optimizer.masters, copy_of):
        assert torch.equal(master, ref) and p.grad is None and master.grad is None
        assert torch.equal(p, master.to(torch.bfloat16))
    gain = optimizer.masters[2]
    assert (gain != 1).all() and (bf16_model[1].weight == 1).all()
    restored = glc.MasterAdamW(model.parameters(), lr=3e-4)
    restored.load_state_dict(optimizer.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(restored.masters, optimizer.masters))
