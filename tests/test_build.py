"""What the build reports, import hygiene (no CUDA initialisation), and the recipe dataclasses."""
from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch

import transformer_fp8
from transformer_fp8 import DelayedScaling, Float8CurrentScaling, Format

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


# ----------------------------------------------------------------------------- build info

@pytest.mark.cuda_branch
def test_build_info_keys_and_types():
    info = transformer_fp8.build_info()
    assert isinstance(info["cuda"], bool)
    assert isinstance(info["cuda_archs"], list)
    assert all(isinstance(a, str) and a for a in info["cuda_archs"])
    assert isinstance(info["torch_version"], str) and info["torch_version"]
    if info["cuda"]:
        assert info["cuda_archs"], "a CUDA build names the architectures it was compiled for"
        assert isinstance(info["cuda_version"], str)
    else:
        assert info["cuda_version"] is None


def test_built_against_the_running_torch():
    """The extension's ABI is tied to torch's major.minor version."""
    built = transformer_fp8.build_info()["torch_version"]
    assert built.split(".")[:2] == torch.__version__.split(".")[:2], (built, torch.__version__)


def test_extension_shares_the_process_libstdcxx():
    """A compiler that links libstdc++ statically into the extension builds one whose own copy
    of the C++ runtime crashes at the first number it formats (an error message, a cache key):
    the extension must load libstdc++.so like torch does (see scripts/gpu_check.sh)."""
    with open(transformer_fp8._C.__file__, "rb") as f:
        needs = b"libstdc++.so" in f.read()
    assert needs, (f"{transformer_fp8._C.__file__} does not link libstdc++.so dynamically; "
                   "rebuild with a compiler that does (e.g. CXX=g++ CC=gcc CUDAHOSTCXX=g++)")


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)


def test_import_does_not_initialise_cuda():
    """In a fresh interpreter (one, as importing torch takes seconds): the import, then
    build_info() and the submodules, leave CUDA uninitialised."""
    result = run_python(
        "import transformer_fp8, torch; assert not torch.cuda.is_initialized(), 'import'; "
        "transformer_fp8.build_info(); "
        "import transformer_fp8.ops, transformer_fp8.reference; "
        "import transformer_fp8.quantization.recipe; "
        "assert not torch.cuda.is_initialized(), 'build_info'")
    assert result.returncode == 0, result.stderr


def test_operators_registered():
    for name in ("amax", "cast_to_fp8", "cast_transpose_to_fp8", "cast_from_fp8",
                 "update_delayed_scaling", "compute_scale_from_amax", "fp8_gemm"):
        assert hasattr(torch.ops.transformer_fp8, name), name


# ----------------------------------------------------------------------------- recipes

def test_delayed_scaling_defaults():
    recipe = DelayedScaling()
    assert recipe.margin == 0
    assert recipe.fp8_format is Format.HYBRID
    assert recipe.amax_history_len == 1024
    assert recipe.amax_compute_algo == "max"
    assert recipe.scaling_factor_compute_algo is None
    assert recipe.reduce_amax is True


@pytest.mark.parametrize("field,value", [("margin", 3), ("amax_history_len", 16),
                                         ("fp8_format", Format.E4M3)])
def test_delayed_scaling_is_frozen(field, value):
    recipe = DelayedScaling()
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(recipe, field, value)


def test_delayed_scaling_accepts_valid_values():
    recipe = DelayedScaling(margin=2, fp8_format=Format.E4M3, amax_history_len=1,
                            amax_compute_algo="most_recent", reduce_amax=False)
    assert (recipe.margin, recipe.amax_history_len) == (2, 1)
    fn = DelayedScaling(amax_compute_algo=lambda h: h[0],
                        scaling_factor_compute_algo=lambda amax, scale, fp8_max, r: scale)
    assert callable(fn.amax_compute_algo) and callable(fn.scaling_factor_compute_algo)


@pytest.mark.parametrize("kwargs,field", [
    ({"margin": -1}, "margin"),
    ({"margin": 1.5}, "margin"),
    ({"margin": 1001}, "margin"),
    ({"margin": True}, "margin"),
    ({"amax_history_len": 0}, "amax_history_len"),
    ({"amax_history_len": -4}, "amax_history_len"),
    ({"amax_compute_algo": "mean"}, "amax_compute_algo"),
    ({"fp8_format": "hybrid"}, "fp8_format"),
    ({"fp8_format": "HYBRID"}, "fp8_format"),
    ({"scaling_factor_compute_algo": 2.0}, "scaling_factor_compute_algo"),
    ({"reduce_amax": 1}, "reduce_amax"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_delayed_scaling_rejects_invalid(kwargs, field):
    with pytest.raises(ValueError, match=field):
        DelayedScaling(**kwargs)


@pytest.mark.parametrize("fmt,fwd,bwd", [(Format.HYBRID, E4M3, E5M2), (Format.E4M3, E4M3, E4M3),
                                         (Format.E5M2, E5M2, E5M2)])
def test_format_dtypes(fmt, fwd, bwd):
    assert fmt.fwd_dtype == fwd and fmt.bwd_dtype == bwd
    assert fmt.max_fwd == torch.finfo(fwd).max and fmt.max_bwd == torch.finfo(bwd).max


def test_format_max_values():
    assert Format.HYBRID.max_fwd == 448.0 and Format.HYBRID.max_bwd == 57344.0


def test_float8_current_scaling():
    recipe = Float8CurrentScaling()
    assert recipe.fp8_format is Format.HYBRID
    assert Float8CurrentScaling(fp8_format=Format.E4M3).fp8_format is Format.E4M3
    with pytest.raises(dataclasses.FrozenInstanceError):
        recipe.fp8_format = Format.E5M2
    with pytest.raises(ValueError, match="fp8_format"):
        Float8CurrentScaling(fp8_format="E4M3")
