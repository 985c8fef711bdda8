"""Build of the transformer_fp8 extension.

Always builds the C++ CPU kernels; adds the CUDA kernels when the installed torch is a CUDA
build and nvcc is found. Environment flags:
  TRANSFORMER_FP8_CUDA_ARCHS  compute capabilities, ";"-separated (default "8.9;9.0": FP8 tensor
                              cores start at sm_89)
  TRANSFORMER_FP8_FORCE_CUDA  "1": a missing CUDA toolkit is a build error, not a CPU-only build
  TRANSFORMER_FP8_CPU_ONLY    "1": the CPU kernels only, even where CUDA kernels could be built
                              (a build in a fraction of the time; tests/test_wheel.py uses it)
  MAX_JOBS                    parallel compile jobs (read by torch's ninja build)
"""
import glob
import os
import re
import subprocess

import torch
from setuptools import setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

HERE = os.path.dirname(os.path.abspath(__file__))
ARCHS = os.environ.get("TRANSFORMER_FP8_CUDA_ARCHS", "8.9;9.0").replace(",", ";")
FORCE_CUDA = os.environ.get("TRANSFORMER_FP8_FORCE_CUDA", "0") == "1"
CPU_ONLY = os.environ.get("TRANSFORMER_FP8_CPU_ONLY", "0") == "1"
if FORCE_CUDA and CPU_ONLY:
    raise RuntimeError("TRANSFORMER_FP8_FORCE_CUDA=1 and TRANSFORMER_FP8_CPU_ONLY=1 contradict "
                       "each other: set at most one of them")


def nvcc_version():
    """'13.0' from `nvcc --version`, or None when there is no usable nvcc."""
    if CUDA_HOME is None:
        return None
    try:
        text = subprocess.run([os.path.join(CUDA_HOME, "bin", "nvcc"), "--version"],
                              capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    match = re.search(r"release (\d+\.\d+)", text)
    return match.group(1) if match else None


def write_build_config(with_cuda, cuda_version):
    """A header with what this build chose, read by build_info() at run time."""
    folder = os.path.join(HERE, "build", "generated")
    os.makedirs(folder, exist_ok=True)
    lines = [
        "#pragma once",
        f'#define TRANSFORMER_FP8_TORCH_VERSION "{torch.__version__}"',
        f'#define TRANSFORMER_FP8_CUDA_ARCHS "{ARCHS if with_cuda else ""}"',
        f'#define TRANSFORMER_FP8_CUDA_VERSION "{cuda_version or ""}"',
    ]
    with open(os.path.join(folder, "build_config.h"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return folder


def sources_below(folder, *endings):
    """Every file with one of these endings in folder and its subfolders, sorted."""
    return sorted(path for ending in endings
                  for path in glob.glob(os.path.join(folder, "**", "*" + ending), recursive=True))


cuda_version = None if CPU_ONLY else nvcc_version()
with_cuda = torch.version.cuda is not None and cuda_version is not None
if FORCE_CUDA and not with_cuda:
    raise RuntimeError(
        "TRANSFORMER_FP8_FORCE_CUDA=1 but no CUDA build is possible: "
        f"torch.version.cuda={torch.version.cuda!r}, CUDA_HOME={CUDA_HOME!r}, "
        f"nvcc version={cuda_version!r}")

CUDA_FOLDER = os.path.join("csrc", "cuda")
# csrc/registration.cpp, the shared checks and the CPU kernels; csrc/cuda/ only in a CUDA build.
sources = [path for path in sources_below("csrc", ".cpp")
           if not path.startswith(CUDA_FOLDER + os.sep)]
include_dirs = [write_build_config(with_cuda, cuda_version)]
cxx_flags = ["-O3"]
if with_cuda:
    os.environ["TORCH_CUDA_ARCH_LIST"] = ARCHS
    sources += sources_below(CUDA_FOLDER, ".cpp", ".cu")
    extension = CUDAExtension(
        "transformer_fp8._C", sources, include_dirs=include_dirs, libraries=["cublasLt"],
        define_macros=[("TRANSFORMER_FP8_WITH_CUDA", None)],
        extra_compile_args={"cxx": cxx_flags, "nvcc": ["-O3", "-lineinfo"]})
else:
    extension = CppExtension("transformer_fp8._C", sources, include_dirs=include_dirs,
                             extra_compile_args={"cxx": cxx_flags})

print(f"transformer_fp8 build: torch {torch.__version__}, "
      f"CUDA kernels {'ON' if with_cuda else 'OFF'}"
      + (f" (nvcc {cuda_version}, archs {ARCHS})" if with_cuda else
         " (TRANSFORMER_FP8_CPU_ONLY=1)" if CPU_ONLY else
         f" (torch.version.cuda={torch.version.cuda}, nvcc={cuda_version})")
      + f", MAX_JOBS={os.environ.get('MAX_JOBS', 'default')}", flush=True)

setup(ext_modules=[extension], cmdclass={"build_ext": BuildExtension})
