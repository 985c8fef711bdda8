"""Every planted bug of scripts/mutation_check.py still matches the code it targets.

The mutation check runs last in CI, after the whole suite; a mutant whose text no longer occurs
(the code was edited since) would fail CI there. This test catches it in seconds, with the
suite."""
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "mutation_check.py"

pytestmark = pytest.mark.skipif(not SCRIPT.exists(), reason="scripts/ not beside the tests "
                                "(a copy made by the mutation check itself)")


def _load():
    spec = importlib.util.spec_from_file_location("mutation_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("mutation_check", module)  # (its dataclasses look themselves up)
    spec.loader.exec_module(module)
    return module


def test_every_mutant_matches_its_code_exactly_once():
    check = _load()
    assert len(check.MUTANTS) >= 20
    problems = [p for p in (check.anchor_problem(ROOT, m) for m in check.MUTANTS) if p]
    assert problems == []


def test_a_stale_mutant_is_reported(tmp_path):
    check = _load()
    mutant = check.MUTANTS[0]
    target = tmp_path / "transformer_fp8" / mutant.path
    target.parent.mkdir(parents=True)
    target.write_text("nothing to replace here\n")
    assert "occur [0] times" in check.anchor_problem(tmp_path, mutant)
    target.write_text(mutant.old + mutant.old)
    assert "occur [2] times" in check.anchor_problem(tmp_path, mutant)
    target.write_text(mutant.old)
    assert check.anchor_problem(tmp_path, mutant) is None
