#!/usr/bin/env bash
# One command for a GPU machine: build the extension against the torch found there, run the
# tests, run the benchmarks, print the results table last.
#
#   scripts/gpu_check.sh                      # from anywhere
#   OUT=/some/dir scripts/gpu_check.sh        # where the logs and results go (default
#                                             #   benchmarks/out in the repository; a relative
#                                             #   OUT is taken from the caller's directory)
#
# Needs no network. Its logs and results are at most 8 files, all directly under $OUT:
#   env.txt build.log tests.log sanitize.log bench.log results.md results.json results.png
# (run_all.py passes each benchmark's JSON through $OUT/parts/ and deletes it once collected).
# It also writes outside $OUT: the build's side effects (pip install -e . writes build/,
# *.egg-info and the extension's .so into the tree and an editable finder into site-packages;
# build_ext --inplace the first and the .so), and torch's, inductor's and pytest's caches
# (under /tmp and ~/.cache).
# Exit status: 0 when the build, every test and every benchmark passed; non-zero otherwise
# (a failed build stops the script; failed tests or benchmarks do not, they fail it at the end).
#
# Time: a default run does not fit one 10-minute command: the build, the whole test suite and
# the benchmarks are unlimited, and the three sanitizers up to 300 s each. The script warns at
# its start when no limits are set. This took 411 s on an H100 (build included;
# benchmarks/results/2026-11-26-h100/README.md, "Rerunning"):
#   TFP8_TEST_CUDA_ONLY=1 GPU_CHECK_PYTEST_ARGS="-n 14 --timeout 100" \
#   GPU_CHECK_TESTS_TIMEOUT=230 GPU_CHECK_SANITIZE_TIMEOUT=40 GPU_CHECK_BENCH_TIMEOUT=70 \
#   GPU_CHECK_BENCH_ARGS="--only bench_fused,bench_te_modules" scripts/gpu_check.sh
# run_all.py rewrites results.md/json/png after every benchmark, so a benchmark timeout keeps
# the benchmarks that finished.
#
# Knobs, to split the work over several calls on a machine that keeps the build:
#   GPU_CHECK_SKIP_BUILD=1   use the extension already built in place
#   GPU_CHECK_SKIP_TESTS=1   no test run
#   GPU_CHECK_PYTEST_ARGS    extra pytest arguments, e.g. "-n 8" (pytest-xdist) or "-k cuda"
#   TFP8_TEST_CUDA_ONLY=1    only the tests a machine without a GPU skips (tests/conftest.py)
#   GPU_CHECK_TESTS_TIMEOUT / GPU_CHECK_BENCH_TIMEOUT   seconds for the whole test run / the
#                            whole benchmark run (default: no limit), to fit a short lease
#   GPU_CHECK_SANITIZE_TIMEOUT  seconds for each of the three sanitizer runs (default 300)
#   GPU_CHECK_SKIP_SANITIZE=1  no compute-sanitizer run (memcheck, racecheck, synccheck)
#   GPU_CHECK_SKIP_BENCH=1   no benchmark run
#   GPU_CHECK_BENCH_ARGS     extra arguments for benchmarks/run_all.py, e.g. "--only bench_gemm"
#   TRANSFORMER_FP8_COMMIT   the commit, recorded in env.txt and the results where the tree
#                            has no .git (a copy sent to a remote machine)
#   PYTHON                   the interpreter (default python3)
set -euo pipefail

CALLER_DIR=$PWD
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3}
# A relative OUT is the caller's (the default, benchmarks/out, is the repository's).
if [[ -n "${OUT:-}" && "$OUT" != /* ]]; then
  OUT_DIR="$CALLER_DIR/$OUT"
else
  OUT_DIR=${OUT:-benchmarks/out}
fi
mkdir -p "$OUT_DIR"
# The repository itself on the path: an in-place build (the fallback below) is then importable
# by the benchmarks too.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PIP_BREAK_SYSTEM_PACKAGES=1 PIP_NO_INPUT=1 PIP_DISABLE_PIP_VERSION_CHECK=1

section() { printf '\n===== %s\n' "$*"; }

# Unlimited steps cannot fit a 10-minute remote command: say so before spending the time.
unlimited=()
[[ "${GPU_CHECK_SKIP_TESTS:-0}" == 1 || -n "${GPU_CHECK_TESTS_TIMEOUT:-}" ]] \
  || unlimited+=("tests (GPU_CHECK_TESTS_TIMEOUT unset)")
[[ "${GPU_CHECK_SKIP_BENCH:-0}" == 1 || -n "${GPU_CHECK_BENCH_TIMEOUT:-}" ]] \
  || unlimited+=("benchmarks (GPU_CHECK_BENCH_TIMEOUT unset)")
[[ "${GPU_CHECK_SKIP_SANITIZE:-0}" == 1 || -n "${GPU_CHECK_SANITIZE_TIMEOUT:-}" ]] \
  || unlimited+=("sanitizers (3 x 300 s by default; GPU_CHECK_SANITIZE_TIMEOUT unset)")
if (( ${#unlimited[@]} )); then
  printf '\n%s\n' "!!!!! WARNING: no time limit on: ${unlimited[*]}"
  echo "!!!!! This run can outlast a 600 s remote command, and a command killed at its limit"
  echo "!!!!! loses the step in flight. Set the *_TIMEOUT knobs (see the script's header)."
fi

section "environment"
{
  nvidia-smi || echo "nvidia-smi failed"
  "$PYTHON" - <<'EOF'
import platform, torch
print(f"python {platform.python_version()}, torch {torch.__version__}, "
      f"torch.version.cuda {torch.version.cuda}, cuda available {torch.cuda.is_available()}")
if torch.cuda.is_available():
    print(f"device {torch.cuda.get_device_name()}, capability {torch.cuda.get_device_capability()}")
from torch.utils.cpp_extension import CUDA_HOME
print(f"CUDA_HOME {CUDA_HOME}")
EOF
  command -v nvcc >/dev/null && nvcc --version | tail -n 2 || echo "nvcc not on PATH"
  if commit=$(git rev-parse HEAD 2>/dev/null); then
    if [[ -n "$(git status --porcelain --untracked-files=no 2>/dev/null)" ]]; then
      echo "commit $commit + uncommitted changes to tracked files"
    else
      echo "commit $commit (clean)"
    fi
  elif [[ -n "${TRANSFORMER_FP8_COMMIT:-}" ]]; then
    echo "commit $TRANSFORMER_FP8_COMMIT (from \$TRANSFORMER_FP8_COMMIT; no git repository" \
      "here, so whether the tree differs from it is unknown)"
  else
    echo "commit unknown: no git repository here and \$TRANSFORMER_FP8_COMMIT unset"
  fi
} 2>&1 | tee "$OUT_DIR/env.txt"

section "build (log: $OUT_DIR/build.log)"
build_failed() {
  tail -n 60 "$OUT_DIR/build.log"
  echo "BUILD FAILED: see $OUT_DIR/build.log"
  exit 1
}
links_libstdcxx_dynamically() {  # compiler: does a shared object it links need libstdc++.so?
  local dir; dir=$(mktemp -d)
  printf '#include <sstream>\nstd::string f(long x){std::ostringstream s; s << x; return s.str();}\n' \
    >"$dir/t.cpp"
  "$1" -shared -fPIC "$dir/t.cpp" -o "$dir/t.so" 2>/dev/null && grep -q "libstdc++.so" "$dir/t.so"
  local rc=$?; rm -rf "$dir"; return $rc
}
build_in_place() {
  "$PYTHON" setup.py build_ext --inplace >>"$OUT_DIR/build.log" 2>&1 || build_failed
}
if [[ "${GPU_CHECK_SKIP_BUILD:-0}" == 1 ]]; then
  echo "GPU_CHECK_SKIP_BUILD=1: using the extension as built" | tee "$OUT_DIR/build.log"
else
  export MAX_JOBS=16 TRANSFORMER_FP8_FORCE_CUDA=1 TRANSFORMER_FP8_CUDA_ARCHS=9.0
  # The extension must share the process's libstdc++: a compiler that links it statically
  # (some images set CXX to such a toolchain) builds an extension that crashes at its first
  # formatted number (seen: CXX=/opt/gcc/bin/g++). Then use the system's g++ instead.
  if ! links_libstdcxx_dynamically "${CXX:-c++}"; then
    echo "${CXX:-c++} links libstdc++ statically; building with $(command -v g++) instead"
    export CXX=g++ CC=gcc CUDAHOSTCXX=g++
  fi
  # pip's editable install needs setuptools and wheel already here (no network, no build
  # isolation); without them, or when pip fails for want of them, build in place instead.
  # (setuptools is imported first: importing pip before it trips setuptools' distutils check)
  if "$PYTHON" -c "import setuptools, wheel" 2>/dev/null \
      && "$PYTHON" -m pip --version >/dev/null 2>&1; then
    if ! "$PYTHON" -m pip install --no-build-isolation --no-deps --no-index -e . \
        >"$OUT_DIR/build.log" 2>&1; then
      grep -qE "No module named '?(setuptools|wheel)|invalid command 'bdist_wheel'" \
        "$OUT_DIR/build.log" || build_failed
      echo "pip editable install failed for want of a build tool; building in place" \
        | tee -a "$OUT_DIR/build.log"
      build_in_place
    fi
  else
    echo "pip, setuptools or wheel missing: $PYTHON setup.py build_ext --inplace" \
      | tee "$OUT_DIR/build.log"
    build_in_place
  fi
  grep -m1 "transformer_fp8 build:" "$OUT_DIR/build.log" || true
fi
"$PYTHON" -c "import transformer_fp8 as t; print('transformer_fp8', t.build_info())" \
  | tee -a "$OUT_DIR/build.log"

tests_rc=0 tests_status=passed
section "tests (log: $OUT_DIR/tests.log)"
if [[ "${GPU_CHECK_SKIP_TESTS:-0}" == 1 ]]; then
  tests_status=skipped
  echo "GPU_CHECK_SKIP_TESTS=1: no test run" | tee "$OUT_DIR/tests.log"
# shellcheck disable=SC2086  # GPU_CHECK_PYTEST_ARGS is a list of words
elif ! timeout "${GPU_CHECK_TESTS_TIMEOUT:-0}" \
    "$PYTHON" -m pytest tests -q -rfEs ${GPU_CHECK_PYTEST_ARGS:-} 2>&1 \
    | tee "$OUT_DIR/tests.log"; then
  rc=${PIPESTATUS[0]}
  tests_rc=1 tests_status=FAILED
  if [[ $rc == 124 ]]; then
    tests_status="TIMED OUT after ${GPU_CHECK_TESTS_TIMEOUT}s"
  fi
  echo "TESTS $tests_status (continuing with the benchmarks)"
fi

sanitize_rc=0 sanitize_status=clean
section "compute-sanitizer (log: $OUT_DIR/sanitize.log)"
if [[ "${GPU_CHECK_SKIP_SANITIZE:-0}" == 1 ]]; then
  sanitize_status=skipped
  echo "GPU_CHECK_SKIP_SANITIZE=1: no sanitizer run" | tee "$OUT_DIR/sanitize.log"
elif ! command -v compute-sanitizer >/dev/null; then
  sanitize_rc=1 sanitize_status="NOT FOUND (compute-sanitizer not on PATH; nothing checked)"
  echo "compute-sanitizer not found on PATH: no sanitizer ran (GPU_CHECK_SKIP_SANITIZE=1" \
    "skips this step)" | tee "$OUT_DIR/sanitize.log"
else
  : >"$OUT_DIR/sanitize.log"
  sanitize_errors=() sanitize_timeouts=()
  for tool in memcheck racecheck synccheck; do
    echo "--- $tool" | tee -a "$OUT_DIR/sanitize.log"
    rc=0
    timeout "${GPU_CHECK_SANITIZE_TIMEOUT:-300}" \
      compute-sanitizer --tool "$tool" --error-exitcode 1 \
      "$PYTHON" scripts/sanitize_ops.py >>"$OUT_DIR/sanitize.log" 2>&1 || rc=$?
    if [[ $rc == 124 ]]; then
      sanitize_timeouts+=("$tool")
      echo "$tool: TIMED OUT after ${GPU_CHECK_SANITIZE_TIMEOUT:-300}s" \
        | tee -a "$OUT_DIR/sanitize.log"
    elif [[ $rc != 0 ]]; then
      sanitize_errors+=("$tool")
      echo "$tool: ERRORS (exit $rc)" | tee -a "$OUT_DIR/sanitize.log"
    fi
    tail -n 3 "$OUT_DIR/sanitize.log"
  done
  if (( ${#sanitize_errors[@]} + ${#sanitize_timeouts[@]} )); then
    sanitize_rc=1 sanitize_status=""
    (( ${#sanitize_errors[@]} )) && sanitize_status="ERRORS in ${sanitize_errors[*]}"
    (( ${#sanitize_timeouts[@]} )) && sanitize_status="${sanitize_status:+$sanitize_status; }TIMED OUT: ${sanitize_timeouts[*]}"
  fi
fi

bench_rc=0 bench_status=completed
section "benchmarks (log: $OUT_DIR/bench.log)"
if [[ "${GPU_CHECK_SKIP_BENCH:-0}" == 1 ]]; then
  bench_status=skipped
  echo "GPU_CHECK_SKIP_BENCH=1: no benchmark run" | tee "$OUT_DIR/bench.log"
# shellcheck disable=SC2086  # GPU_CHECK_BENCH_ARGS is a list of words
elif ! timeout "${GPU_CHECK_BENCH_TIMEOUT:-0}" \
    "$PYTHON" benchmarks/run_all.py --out "$OUT_DIR" ${GPU_CHECK_BENCH_ARGS:-} 2>&1 \
    | tee "$OUT_DIR/bench.log"; then
  rc=${PIPESTATUS[0]}
  bench_rc=1 bench_status=FAILED
  if [[ $rc == 124 ]]; then
    bench_status="TIMED OUT after ${GPU_CHECK_BENCH_TIMEOUT}s (results.md keeps the benchmarks that finished)"
  fi
fi

section "results ($OUT_DIR/results.md)"
cat "$OUT_DIR/results.md" 2>/dev/null || echo "no results.md was written"
section "summary"
echo "tests: $tests_status, sanitizers: $sanitize_status, benchmarks: $bench_status"
exit $(( tests_rc || sanitize_rc || bench_rc ))
