"""Mutation check: plant known bugs in a copy of the package and make sure the tests fail.

Each mutant below is one exact-text replacement in one file of transformer_fp8/ (a wrong
gradient factor under torch.compile only, a factor in one dtype only, SUM for MAX, the wrong
fp8_max for one role, a scale_inv from the wrong step, a skipped amax record, a transposed
block-scale index, ...), with the tests that must catch it. For each mutant the package and the
tests are copied to a temporary directory (the built extension reused, never rebuilt), the
replacement is applied (it must match exactly once, or the check stops: the code it targets has
changed, update the mutant), and pytest runs the mutant's tests there, stopping at the first
failure. A mutant is killed when pytest reports a failing test. First, the same tests run once
on the unmutated copy and must pass. Prints a table; exits 1 if any mutant survives or a run
goes wrong.

    python scripts/mutation_check.py            # every mutant
    python scripts/mutation_check.py NAME ...   # some of them
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUN_TIMEOUT_S = 300
# The unmutated copy runs every mutant's tests in one pytest run: 26 mutants' tests took more
# than 300 s on two CPU cores shared with other work.
UNMUTATED_TIMEOUT_S = 1200


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str  # under transformer_fp8/
    old: str
    new: str
    files: tuple  # test files
    keywords: str = ""  # pytest -k expression selecting the tests in them ("": all)
    # Other (old, new) spellings of the same bug, for other versions of the code: exactly one
    # of all the old texts must occur, exactly once.
    alternatives: tuple = ()

    def pytest_args(self) -> list:
        return [*self.files] + (["-k", self.keywords] if self.keywords else [])


MUTANTS = [
    Mutant("reduction layout left to the collector", "quantization/amax_step.py",
           "    gc.collect()\n", "    pass\n",
           ("tests/test_reduction_layout.py",), "dead_model or dead_layer"),
    Mutant("compiled block wgrad x100", "modules/linear.py",
           "                                    ctx.weight_dtype, fast_accum=plan.fast_accum[2])\n",
           "                                    ctx.weight_dtype, fast_accum=plan.fast_accum[2])\n"
           "            if torch.compiler.is_compiling():\n"
           "                grad_weight = grad_weight * 100\n",
           ("tests/test_blockwise_linear.py",), "test_compile_matches_eager"),
    Mutant("float16 Linear output x1.25", "modules/linear.py",
           "                          weights=(weight,) if needs_weight_grad and hold_weight"
           " else ())\n",
           "                          weights=(weight,) if needs_weight_grad and hold_weight"
           " else ())\n"
           "        if plan.out_dtype == torch.float16:\n"
           "            out = out * 1.25\n",
           ("tests/test_linear.py",), "(low_precision or dtype_casts) and python_path"),
    Mutant("bf16 LayerNormMLP fc1 wgrad x4", "modules/layernorm_mlp.py",
           "                                                fast_accum=fc1_plan.fast_accum[2])\n",
           "                                                fast_accum=fc1_plan.fast_accum[2])\n"
           "                if w1_dtype == torch.bfloat16:\n"
           "                    grad_fc1_weight = grad_fc1_weight * 4\n",
           ("tests/test_te_modules.py",), "low_precision"),
    Mutant("amax all-reduce SUM for MAX", "quantization/update_plan.py",
           "all_reduce(bits, op=torch.distributed.ReduceOp.MAX",
           "all_reduce(bits, op=torch.distributed.ReduceOp.SUM",
           ("tests/test_distributed.py",), "reduced_amax or ddp_training"),
    Mutant("Linear wgrad x8 (training curves)", "modules/linear.py",
           "                                    ctx.weight_dtype, fast_accum=plan.fast_accum[2])\n",
           "                                    ctx.weight_dtype, fast_accum=plan.fast_accum[2])"
           " * 8\n",
           ("tests/test_linear.py",), "mlp_trains_like_bfloat16 and python_path"),
    Mutant("grad_output scale from 448", "quantization/update_plan.py",
           "fp8_max = recipe.fp8_format.max_fwd if role == \"fwd\" else recipe.fp8_format.max_bwd",
           "fp8_max = recipe.fp8_format.max_fwd",
           ("tests/test_autocast.py",)),
    Mutant("backward scale_inv of the next step", "quantization/quantizer.py",
           "        return self.scale, ops.scale_inverse(self.scale), self.amax_slot\n",
           "        return self.scale, self.scale_inv, self.amax_slot\n",
           ("tests/test_linear.py",), "backward_uses_the_scale and python_path"),
    Mutant("compiled: scale_inv of the next step", "quantization/quantizer.py",
           "        return self.scale, ops.scale_inverse(self.scale), self.amax_slot\n",
           "        return self.scale, (self.scale_inv if torch.compiler.is_compiling() else "
           "ops.scale_inverse(self.scale)), self.amax_slot\n",
           ("tests/test_compile.py",), "bit_identical and delayed"),
    Mutant("compiled: amax record skipped", "quantization/quantizer.py",
           "            ops.record_amax(self.history, amax_slot, self.column)\n",
           "            pass\n",
           ("tests/test_compile.py",), "bit_identical and delayed"),
    Mutant("checkpoint replay with the updated scale", "quantization/quantizer.py",
           "TensorQuantizer.replay(self.dtype, used.scale.clone(), used.scale_inv)",
           "TensorQuantizer.replay(self.dtype, used.scale, used.scale_inv)",
           ("tests/test_checkpointing.py",), "bit_identical and delayed"),
    Mutant("transposed block-scale index", "quantization/blockwise.py",
           "    return fp8_gemm_blockwise(a, a_scale_inv, b, b_scale_inv, out_dtype, bias)\n",
           "    if b_scale_inv.shape[0] == b_scale_inv.shape[1]:\n"
           "        b_scale_inv = b_scale_inv.t()\n"
           "    return fp8_gemm_blockwise(a, a_scale_inv, b, b_scale_inv, out_dtype, bias)\n",
           ("tests/test_blockwise_linear.py",), "different_magnitudes"),
    Mutant("tensor-parallel rowwise bias on every rank", "modules/tensor_parallel.py",
           "    add_bias = mesh.get_local_rank() == 0\n", "    add_bias = True\n",
           ("tests/test_tensor_parallel.py",), "two_ranks and delayed"),
    Mutant("tensor-parallel colwise input gradient as replicated", "modules/tensor_parallel.py",
           "        x = inp.to_local(grad_placements=[Partial()])\n",
           "        x = inp.to_local()\n",
           ("tests/test_tensor_parallel.py",), "two_ranks and delayed"),
    Mutant("a reducing step covers another step's layers", "quantization/amax_step.py",
           "                           if state is not None and state.step is not None\n",
           "                           if False\n",
           ("tests/test_distributed.py",), "another_step or routed_on_some"),
    Mutant("current-scaling amaxes reduced across data-parallel ranks", "quantization/roles.py",
           "    fmt, group = recipe.fp8_format, None\n",
           "    fmt, group = recipe.fp8_format, (autocast_state.group\n"
           "                                      or torch.distributed.group.WORLD)\n",
           ("tests/test_distributed.py",), "different_experts or own_amax"),
    Mutant("callable amax algorithm given a reordered window", "ops/update_callable.py",
           "amax_compute_algo(history.clone())", "amax_compute_algo(window)",
           ("tests/test_delayed_scaling.py",), "callable"),
    Mutant("Conv1D keeps its [in, out] storage as the GEMM weight", "integrations/convert.py",
           "        return [self.weight.t()]", "        return [self.weight]",
           ("tests/test_convert.py",), "first_microbatch"),
    Mutant("block recipe's input and grad_output block shapes ignored", "quantization/roles.py",
           "        dims = (recipe.x_block_scaling_dim, recipe.w_block_scaling_dim,\n"
           "                recipe.grad_block_scaling_dim)\n",
           "        dims = (1, recipe.w_block_scaling_dim, 1)\n",
           ("tests/test_blockwise_linear.py",), "bit_for_bit"),
    Mutant("block recipe's power_2_scale=False ignored", "quantization/roles.py",
           "    fmt, pow2 = recipe.fp8_format, recipe.power_2_scale\n",
           "    fmt, pow2 = recipe.fp8_format, True\n",
           ("tests/test_blockwise_linear.py",), "bit_for_bit"),
    Mutant("HYBRID block grad_output cast to E4M3", "quantization/roles.py",
           "    dtypes = (fmt.fwd_dtype, fmt.fwd_dtype, fmt.bwd_dtype)\n",
           "    dtypes = (fmt.fwd_dtype, fmt.fwd_dtype, fmt.fwd_dtype)\n",
           ("tests/test_blockwise_linear.py",), "bit_for_bit"),
    Mutant("scales kept across a switch of fp8_format", "quantization/recipe_switch.py",
           "        return torch.where(made, rescaled, scale)\n",
           "        return scale\n",
           ("tests/test_recipe_switch.py",)),
    Mutant("from_pretrained's assigned state taken without its recipe",
           "quantization/state_materialisation.py",
           "            state.took_loaded_state()\n", "            pass\n",
           ("tests/test_recipe_switch_pretrained.py",)),
    Mutant("C++ step reusing an adoption still owing a rescale", "modules/linear_fused_step.py",
           "            and _adopted(layer, recipe) and all(", "            and all(",
           ("tests/test_recipe_switch.py",), "cpp_step"),
    Mutant("calibration recording no grad_output", "quantization/calibration.py",
           "            if out.requires_grad and bwd_state.step is backward_step.step:\n",
           "            if False:\n", ("tests/test_calibration_backward.py",)),
    Mutant("FSDP2 current amaxes kept across optimizer steps", "modules/fsdp/current_scale.py",
           "\n                or self.optimizer_steps != _OPTIMIZER_STEPS.count):\n", "):\n",
           ("tests/test_fsdp_fp8_all_gather_current.py",), "one_fp8_autocast"),
    Mutant("tensor-parallel query/key norm gradients left per rank", "modules/normalization.py",
           "        if self._grad_sum_over is not None and torch.is_grad_enabled():\n",
           "        if False:\n",
           ("tests/test_te_tensor_parallel_attention.py",), "RMSNorm or LayerNorm"),
    Mutant("packed rotary positions not restarted per sequence", "modules/attention/rotary.py",
           "    angles = freqs[:, 0].float()[position.to(freqs.device)]  # [rows, 1, d2]\n",
           "    angles = freqs[:, 0].float()[row.to(freqs.device)]  # [rows, 1, d2]\n",
           ("tests/test_packed_sequences.py",), "rotary"),
    Mutant("backward_override 'dequantized' reading the operands before their casts",
           "quantization/backward_override.py",
           '    if override == "dequantized":\n',
           '    if override == "dequantised":\n',
           ("tests/test_backward_override.py",), "linear_backward_gemms"),
    Mutant("parity noise floor for every small gradient", "_parity_runs.py",
           "            for name, floor in small.items() if name in zero}\n",
           "            for name, floor in small.items()}\n",
           ("tests/test_testing_helpers.py",), "small_real or random_draws"),
    Mutant("scaling_factor_compute_algo result unguarded", "ops/update_callable.py",
           "        new_scale = torch.where(torch.isfinite(computed) & (computed > 0),\n",
           "        new_scale = torch.where(torch.ones_like(computed, dtype=torch.bool),\n",
           ("tests/test_delayed_scaling.py",), "keeps_the_contracts_guards"),
    Mutant("amax reduction as floats (a NaN dropped by rank)", "quantization/update_plan.py",
           "        if buffer.dtype != torch.float32:\n",
           "        if True:\n",
           ("tests/test_distributed.py",), "nan_amax"),
    Mutant("a stale backward's amax kept after a load", "quantization/amax_step.py",
           '        if scaling_state.LOADED_ROWS and self.role == "bwd":\n',
           "        if False:\n",
           ("tests/test_checkpoint.py",), "between_a_forward"),
]


def make_copy(work: Path) -> None:
    """The package (its built extension linked, not copied, where possible), the tests and the
    pytest configuration, under ``work``."""
    shutil.copytree(ROOT / "transformer_fp8", work / "transformer_fp8",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    for lib in (ROOT / "transformer_fp8").glob("*.so"):
        try:
            os.link(lib, work / "transformer_fp8" / lib.name)
        except OSError:
            shutil.copy2(lib, work / "transformer_fp8" / lib.name)
    shutil.copytree(ROOT / "tests", work / "tests", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy2(ROOT / "pyproject.toml", work / "pyproject.toml")


def anchor_problem(root: Path, mutant: Mutant) -> str | None:
    """Why ``mutant`` cannot be applied to the package under ``root`` (None when it can):
    exactly one of its texts to replace must occur, exactly once."""
    text = (root / "transformer_fp8" / mutant.path).read_text()
    counts = [text.count(old) for old, _ in ((mutant.old, mutant.new),) + mutant.alternatives]
    if sorted(counts) == [0] * (len(counts) - 1) + [1]:
        return None
    return (f"mutant {mutant.name!r}: the texts to replace occur {counts} times in "
            f"transformer_fp8/{mutant.path} (expected one of them, once): the code changed, "
            "update the mutant")


def apply(work: Path, mutant: Mutant) -> str:
    """Applies the mutant; returns the file's original text."""
    path = work / "transformer_fp8" / mutant.path
    text = path.read_text()
    problem = anchor_problem(work, mutant)
    if problem:
        raise SystemExit(problem)
    spellings = ((mutant.old, mutant.new),) + mutant.alternatives
    old, new = spellings[[text.count(o) for o, _ in spellings].index(1)]
    path.write_text(text.replace(old, new))
    return text


def run_pytest(work: Path, args: list,
               timeout_s: float = RUN_TIMEOUT_S) -> tuple[int, str, float]:
    """(exit code or None on timeout, output tail, seconds) of pytest on the copy."""
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", PYTHONPATH=str(work))
    cmd = [sys.executable, "-m", "pytest", *args, "-x", "-q", "-p", "no:cacheprovider"]
    start = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return None, f"no result after {timeout_s} s", time.monotonic() - start
    tail = " | ".join((proc.stdout + proc.stderr).strip().splitlines()[-5:])
    return proc.returncode, tail, time.monotonic() - start


def run_tests(work: Path, mutant: Mutant) -> tuple[str, float]:
    """('killed' | 'SURVIVED' | 'error: ...', seconds)."""
    code, tail, seconds = run_pytest(work, mutant.pytest_args())
    if code == 1:
        return "killed", seconds
    if code == 0:
        return "SURVIVED", seconds
    return f"error: pytest exit code {code}: {tail}", seconds


def check_unmutated(work: Path, mutants: list) -> None:
    """Every selected test passes on the unmutated copy (one pytest run over all of them):
    otherwise a failure would say nothing about a mutant."""
    files = sorted({f for m in mutants for f in m.files})
    keywords = " or ".join(f"({m.keywords or ' or '.join(Path(f).name for f in m.files)})"
                           for m in mutants)
    code, tail, seconds = run_pytest(work, [*files, "-k", keywords], UNMUTATED_TIMEOUT_S)
    if code != 0:
        raise SystemExit(f"the selected tests do not pass without a mutant (pytest exit code "
                         f"{code}): {tail}")
    print(f"unmutated copy: the selected tests pass ({seconds:.0f} s)", flush=True)


def main(names: list[str]) -> int:
    mutants = [m for m in MUTANTS if not names or m.name in names]
    if names and len(mutants) != len(names):
        known = ", ".join(repr(m.name) for m in MUTANTS)
        raise SystemExit(f"unknown mutant name in {names}; known: {known}")
    # Every mutant must still match the code before any test runs (minutes saved on a stale one).
    problems = [p for p in (anchor_problem(ROOT, m) for m in mutants) if p]
    if problems:
        raise SystemExit("\n".join(problems))
    rows = []
    with tempfile.TemporaryDirectory(prefix="tfp8-mutants-") as tmp:
        work = Path(tmp)
        make_copy(work)
        check_unmutated(work, mutants)
        for mutant in mutants:
            original = apply(work, mutant)
            try:
                outcome, seconds = run_tests(work, mutant)
            finally:
                (work / "transformer_fp8" / mutant.path).write_text(original)
            rows.append((mutant.name, " ".join(mutant.pytest_args()), outcome, seconds))
            print(f"{mutant.name}: {outcome} ({seconds:.0f} s)", flush=True)
    width = [max(len(r[i]) for r in rows + [("mutant", "tests run", "killed")])
             for i in range(3)]
    print()
    print(f"{'mutant':<{width[0]}}  {'tests run':<{width[1]}}  {'killed':<8}  seconds")
    for name, tests, outcome, seconds in rows:
        killed = "yes" if outcome == "killed" else "NO"
        print(f"{name:<{width[0]}}  {tests:<{width[1]}}  {killed:<8}  {seconds:7.1f}")
        if outcome not in ("killed", "SURVIVED"):
            print(f"    {outcome}")
    survivors = [r[0] for r in rows if r[2] != "killed"]
    if survivors:
        print(f"\n{len(survivors)} of {len(rows)} mutants not killed: {survivors}")
        return 1
    print(f"\nall {len(rows)} mutants killed")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
