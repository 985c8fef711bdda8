"""A user installs a wheel, not this checkout: the wheel must hold every file of the package.

The wheel is built as a user builds it (``pip wheel --no-build-isolation --no-deps``) from a
copy of the source tree (so that the build writes nothing into the checkout and no extension
already built here can slip in), with the CPU kernels only (TRANSFORMER_FP8_CPU_ONLY=1) and
MAX_JOBS=2 (or the MAX_JOBS set) to keep the compilation to a few minutes. It is then checked
file by file against the source tree, installed into a fresh virtual environment (which sees
the installed torch) and run from a folder outside the checkout by tests/wheel_smoke.py, whose
results must equal, bit for bit, the same script's run on the checkout.
"""
from __future__ import annotations

import configparser
import importlib.util
import os
import shutil
import subprocess
import sys
import zipfile
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path

import pytest
import torch

from conftest import assert_bitwise_equal, randn

CHECKOUT = Path(__file__).resolve().parent.parent
PACKAGE = "transformer_fp8"
PLUGIN_MODULE = "pytest_transformer_fp8.py"
BUILD_TIMEOUT_S = 1200


def _pip_and_venv_missing() -> str:
    if importlib.util.find_spec("venv") is None:
        return "the venv module is not available"
    result = subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True)
    return "" if result.returncode == 0 else "pip is not available to this Python"


_MISSING = _pip_and_venv_missing()
pytestmark = pytest.mark.skipif(bool(_MISSING), reason=_MISSING)


def _ignored(folder: str, names: list) -> set:
    """What .gitignore leaves out of the source tree (build outputs, caches, extensions built
    in place, results), and the git metadata."""
    out_folders = {"out"} if Path(folder).name in ("benchmarks", "examples") else set()
    return {name for name in names
            if name in {".git", "build", "dist", "__pycache__", ".pytest_cache", ".build-stamp"}
            or name in out_folders or name.endswith((".egg-info", ".so"))}


def _clean_env(**extra) -> dict:
    """The environment of the build and of the installed package: no path into the checkout,
    no CUDA requirement (CI sets TRANSFORMER_FP8_FORCE_CUDA=1 for its own build)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "TRANSFORMER_FP8_FORCE_CUDA")}
    env.update(PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1", **extra)
    return env


def _run(command: list, timeout: float, **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run([str(c) for c in command], capture_output=True, text=True,
                            timeout=timeout, **kwargs)
    assert result.returncode == 0, (f"{' '.join(map(str, command))} failed "
                                    f"({result.returncode}):\n{result.stdout[-6000:]}\n"
                                    f"{result.stderr[-6000:]}")
    return result


@pytest.fixture(scope="module")
def source_tree(tmp_path_factory) -> Path:
    source = tmp_path_factory.mktemp("wheel") / "source"
    shutil.copytree(CHECKOUT, source, ignore=_ignored)
    return source


@pytest.fixture(scope="module")
def wheel(source_tree) -> Path:
    dist = source_tree.parent / "dist"
    env = _clean_env(TRANSFORMER_FP8_CPU_ONLY="1", MAX_JOBS=os.environ.get("MAX_JOBS", "2"))
    _run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps",
          "--no-index", "--wheel-dir", dist, source_tree], BUILD_TIMEOUT_S, env=env)
    wheels = list(dist.glob(f"{PACKAGE}-*.whl"))
    assert len(wheels) == 1, f"pip wheel made {wheels}"
    return wheels[0]


def _package_files(source_tree: Path) -> set:
    """Every file of the package's source tree and the plugin module, as wheel paths."""
    files = {p.relative_to(source_tree).as_posix()
             for p in (source_tree / PACKAGE).rglob("*") if p.is_file()}
    return files | {PLUGIN_MODULE}


def test_wheel_holds_every_file_of_the_package(source_tree, wheel):
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        dist_info = {n.split("/")[0] for n in names if n.split("/")[0].endswith(".dist-info")}
        assert len(dist_info) == 1, dist_info
        entry_points = configparser.ConfigParser()
        entry_points.read_string(archive.read(f"{dist_info.pop()}/entry_points.txt").decode())

    missing = sorted(_package_files(source_tree) - names)
    assert not missing, (f"files of the source tree missing from {wheel.name}: {missing} (a "
                         "folder without __init__.py is no package; a data file needs "
                         "package-data in pyproject.toml)")
    extensions = [f"{PACKAGE}/_C{suffix}" for suffix in EXTENSION_SUFFIXES
                  if f"{PACKAGE}/_C{suffix}" in names]
    assert len(extensions) == 1, f"one compiled {PACKAGE}/_C extension, got {extensions}"
    # Nothing else: no tests/, benchmarks/ or stale build output in the user's site-packages.
    extra = sorted(n for n in names - _package_files(source_tree) - set(extensions)
                   if not n.split("/")[0].endswith(".dist-info"))
    assert not extra, f"{wheel.name} holds files that are not the package's: {extra}"
    assert dict(entry_points["pytest11"]) == {PACKAGE: PLUGIN_MODULE.removesuffix(".py")}


def _smoke(python, inputs: Path, results: Path, package_root: Path, cwd: Path, env: dict,
           installed: bool) -> str:
    command = [python, CHECKOUT / "tests" / "wheel_smoke.py", inputs, results,
               "--package-root", package_root] + (["--installed"] if installed else [])
    return _run(command, 300, cwd=cwd, env=env).stdout


def test_installed_wheel_runs_outside_the_checkout(wheel, gen, tmp_path):
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", venv], 300)
    python = venv / "bin" / "python"
    # The pip of the Python that made the venv, run by the venv's Python, installs into it;
    # --ignore-installed: the checkout may be installed (editable) in the outer environment.
    _run([python, "-m", "pip", "install", "--no-deps", "--no-index", "--ignore-installed",
          wheel], 300, env=_clean_env())

    inputs = tmp_path / "inputs.pt"
    torch.save({"x": randn(gen, 96, 128), "weight": randn(gen, 64, 128) / 128**0.5,
                "bias": randn(gen, 64), "grad": randn(gen, 96, 64)}, inputs)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    report = _smoke(python, inputs, tmp_path / "installed.pt", venv, elsewhere, _clean_env(),
                    installed=True)
    print(report)
    _smoke(sys.executable, inputs, tmp_path / "checkout.pt", CHECKOUT, elsewhere,
           _clean_env(PYTHONPATH=str(CHECKOUT)), installed=False)

    # The CPU kernels of the wheel's build compute what the checkout's compute, bit for bit.
    installed = torch.load(tmp_path / "installed.pt")
    checkout = torch.load(tmp_path / "checkout.pt")
    assert installed.keys() == checkout.keys()
    for name in checkout:
        assert_bitwise_equal(installed[name], checkout[name], name)
