"""transformer_fp8.debug across ranks (2 gloo processes): each rank's statistics are reduced so
that every rank holds the statistics of the whole batch, as one process running it would (the
first rank writes them), and a layer that ran on one rank only is reported too."""
from __future__ import annotations

import json
import math

import torch
from multiprocess import WORLD, run_ranks

import transformer_fp8 as tfp8
from transformer_fp8 import debug

RECIPE = tfp8.DelayedScaling(amax_history_len=4)
ROWS = 16
FIGURES = ("amax", "scale_min", "underflow_frac", "saturation_frac", "nonzero",
           "dynamic_range_log2", "sqnr_db")


class TwoExperts(torch.nn.Module):
    """A shared layer, then an expert that only rank 1's batches (and the whole batch) reach."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.shared = tfp8.Linear(32, 32, recipe=RECIPE)
        self.expert = tfp8.Linear(32, 32, recipe=RECIPE)

    def forward(self, x, use_expert: bool):
        h = self.shared(x)
        return self.expert(h) if use_expert else h


def _batch(rank: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 + rank)
    return torch.randn(ROWS, 32, generator=gen) * (1 + 3 * rank)


def _records(model, x, use_expert, path=None):
    with debug.collect_stats(model, path=path) as stats:
        with tfp8.fp8_autocast(fp8_recipe=RECIPE):
            out = model(x, use_expert)
        out.square().sum().backward()
        return stats.step()


def _worker(rank: int, out_dir: str) -> None:
    model = TwoExperts()
    records = _records(model, _batch(rank), use_expert=rank == 1, path=f"{out_dir}/shared.jsonl")
    with open(f"{out_dir}/records{rank}.json", "w") as f:
        json.dump(records, f)


def _by_key(records):
    return {(r["layer"], r["tensor"]): r for r in records}


def test_statistics_are_reduced_across_ranks(tmp_path):
    run_ranks(_worker, (str(tmp_path),), tmp_path)
    per_rank = [_by_key(json.loads((tmp_path / f"records{r}.json").read_text()))
                for r in range(WORLD)]
    assert per_rank[0] == per_rank[1], "every rank keeps the same reduced records"
    got = per_rank[0]
    # One path given on every rank: the first rank writes the records, once each (each rank
    # wrote them: every record twice, which the analysis refuses as two runs mixed).
    written = debug.read_records(str(tmp_path / "shared.jsonl"))
    assert _by_key(written) == got and len(written) == len(got)
    assert debug.worst_report(written)
    assert ("expert", "input") in got, "a layer that ran on rank 1 only is reported"
    # One process over the concatenated batch of the shared layer: the same casts of its input
    # (the same scales, elementwise) and of its weight (cast on each rank: counts doubled,
    # fractions and SQNR unchanged), so the same figures. (Its grad_output differs: rank 1's
    # comes back through the expert.)
    whole = _by_key(_records(TwoExperts(), torch.cat([_batch(r) for r in range(WORLD)]),
                             use_expert=False))
    for tensor in ("input", "weight"):
        expected, reduced = whole[("shared", tensor)], got[("shared", tensor)]
        for key in FIGURES:
            want = expected[key] * (WORLD if tensor == "weight" and key == "nonzero" else 1)
            if isinstance(want, float) and math.isfinite(want):
                assert math.isclose(reduced[key], want, rel_tol=1e-9), (tensor, key)
            else:
                assert reduced[key] == want, (tensor, key)
    # The expert's input is rank 1's shared-layer output only: its figures are rank 1's.
    only_rank1 = _by_key(_records(TwoExperts(), _batch(1), use_expert=True))
    for key in FIGURES:
        assert math.isclose(got[("expert", "input")][key], only_rank1[("expert", "input")][key],
                            rel_tol=1e-9), key


def _nan_worker(rank: int, out_dir: str) -> None:
    model = TwoExperts()
    x = _batch(rank)
    if rank == 1:
        x[3, 5] = float("nan")  # (on the second rank: gloo's MAX dropped it)
    records = _records(model, x, use_expert=False)
    with open(f"{out_dir}/records{rank}.json", "w") as f:
        json.dump(records, f)


def test_a_nan_on_one_rank_reaches_every_rank(tmp_path):
    """An operand holding a NaN on one rank: every rank's reduced amax is NaN, as one process's
    over the whole batch (it was the other rank's finite amax)."""
    run_ranks(_nan_worker, (str(tmp_path),), tmp_path)
    for rank in range(WORLD):
        text = (tmp_path / f"records{rank}.json").read_text()
        got = _by_key(json.loads(text))[("shared", "input")]
        assert math.isnan(got["amax"]), (rank, got["amax"])
        assert math.isnan(got["dynamic_range_log2"]), rank
