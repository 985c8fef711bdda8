"""What this build contains and what the current CUDA device can run with it, in Transformer
Engine 2.x's spellings: ``is_fp8_available(return_reason=False)`` and its siblings return a
bool, or ``(bool, reason)`` when asked for the reason (the reason is "" when available).

The CPU kernels (an exact emulation of the CUDA ones) always run, whatever these say: they
answer for the current CUDA device only, as Transformer Engine's do. Nothing here initialises
CUDA at import.
"""
from __future__ import annotations

from typing import Union

import torch

Answer = Union[bool, tuple[bool, str]]


def build_info() -> dict:
    """What this build contains: {"cuda": bool, "cuda_archs": [...], "cuda_version": str|None,
    "torch_version": str (built against), "torch_runtime_version": str}."""
    from . import _C

    info = dict(_C.build_info())
    info["cuda_archs"] = [a for a in info["cuda_archs"].split(";") if a]
    info["torch_runtime_version"] = torch.__version__
    return info


def get_device_compute_capability() -> tuple[int, int]:
    """The compute capability (major, minor) of the current CUDA device (a RuntimeError that
    says so where there is none, as in Transformer Engine)."""
    if not torch.cuda.is_available():
        raise RuntimeError("get_device_compute_capability: no CUDA device is available (the "
                           "CPU kernels need none; is_fp8_available() answers without one)")
    return torch.cuda.get_device_capability(torch.cuda.current_device())


def _answer(available: bool, reason: str, return_reason: bool) -> Answer:
    if not isinstance(return_reason, bool):
        raise TypeError(f"return_reason must be a bool, got {type(return_reason).__name__}")
    return (available, "" if available else reason) if return_reason else available


# torch's names for architectures in TORCH_CUDA_ARCH_LIST (the build passes the list on).
_NAMED_ARCHES = {"Ampere": "8.0;8.6+PTX", "Ada": "8.9+PTX", "Hopper": "9.0+PTX",
                 "Blackwell": "10.0+PTX"}


def _parsed_archs(archs: list[str]) -> list:
    """(major, minor, kind) per entry of a TORCH_CUDA_ARCH_LIST-style list ("8.9", "9.0+PTX",
    "9.0a", "10.0f", "Hopper", space- or ";"-separated); kind: "sass", "ptx", "exact" (an
    arch-specific "a" build runs on that capability only) or "family" ("f": its major);
    None for an entry that is none of these."""
    parsed = []
    for entry in " ".join(archs).replace(";", " ").split():
        for arch in _NAMED_ARCHES.get(entry, entry).split(";"):
            ptx = arch.endswith("+PTX")
            arch = arch.removesuffix("+PTX")
            kind = "ptx" if ptx else "sass"
            if arch[-1:] in ("a", "f"):
                kind = {"a": "exact", "f": "family"}[arch[-1]]
                arch = arch[:-1]
            try:
                major, minor = (int(part) for part in arch.split("."))
            except ValueError:
                parsed.append(None)
                continue
            parsed.append((major, minor, kind))
    return parsed


def _runs_on(capability: tuple[int, int], archs: list[str]) -> bool:
    """Whether code built for ``archs`` runs on a device of ``capability``: machine code on its
    own major version at the same or a higher minor ("a": that capability only), PTX (compiled
    by the driver) on that version and any newer one."""
    for arch in _parsed_archs(archs):
        if arch is None:
            continue
        major, minor, kind = arch
        if kind == "exact":
            if capability == (major, minor):
                return True
        elif capability[0] == major and capability[1] >= minor:
            return True
        elif kind == "ptx" and capability >= (major, minor):
            return True
    return False


def _fp8_support() -> tuple[bool, str]:
    info = build_info()
    if not info["cuda"]:
        return False, "transformer_fp8 was built without its CUDA kernels (CPU only)"
    if not torch.cuda.is_available():
        return False, "no CUDA device is available"
    capability = get_device_compute_capability()
    name = torch.cuda.get_device_name()
    if capability < (8, 9):
        return False, (f"{name} has compute capability {capability[0]}.{capability[1]}; FP8 "
                       "tensor cores need 8.9 (Ada) or 9.0 (Hopper) or newer")
    if not _runs_on(capability, info["cuda_archs"]):
        return False, (f"this build's CUDA kernels are for compute capabilities "
                       f"{';'.join(info['cuda_archs'])}, none of which runs on {name} "
                       f"({capability[0]}.{capability[1]}); rebuild with "
                       f"TRANSFORMER_FP8_CUDA_ARCHS=\"{capability[0]}.{capability[1]}\"")
    return True, ""


def is_fp8_available(return_reason: bool = False) -> Answer:
    """Whether per-tensor FP8 training (DelayedScaling, Float8CurrentScaling) runs on the
    current CUDA device with this build: a bool, or (bool, reason) with ``return_reason``."""
    return _answer(*_fp8_support(), return_reason)


def is_fp8_block_scaling_available(return_reason: bool = False) -> Answer:
    """Whether Float8BlockScaling runs on the current CUDA device: its GEMMs are cuBLASLt's
    block-scaled ones, which need compute capability 9.0 and a build against CUDA 12.9 or
    newer."""
    available, reason = _fp8_support()
    if available:
        capability = get_device_compute_capability()
        version = build_info()["cuda_version"] or "0.0"
        if capability < (9, 0):
            available, reason = False, (
                f"block-scaled FP8 GEMMs need compute capability 9.0 or newer, the current "
                f"device has {capability[0]}.{capability[1]}")
        elif tuple(int(part) for part in version.split(".")[:2]) < (12, 9):
            available, reason = False, (
                f"block-scaled FP8 GEMMs need cuBLASLt 12.9 or newer; this build is for CUDA "
                f"{version}")
    return _answer(available, reason, return_reason)


def is_mxfp8_available(return_reason: bool = False) -> Answer:
    """Always False: transformer_fp8 has no MXFP8 recipe (Transformer Engine's
    MXFP8BlockScaling, for compute capability 10.0)."""
    return _answer(False, "transformer_fp8 has no MXFP8 recipe (MXFP8BlockScaling)",
                   return_reason)


def is_nvfp4_available(return_reason: bool = False) -> Answer:
    """Always False: transformer_fp8 has no NVFP4 recipe (Transformer Engine's
    NVFP4BlockScaling, for compute capability 10.0)."""
    return _answer(False, "transformer_fp8 has no NVFP4 recipe (NVFP4BlockScaling)",
                   return_reason)


def is_bf16_available(return_reason: bool = False) -> Answer:
    """Whether the current CUDA device computes in bfloat16 (compute capability 8.0 or newer)."""
    if not torch.cuda.is_available():
        return _answer(False, "no CUDA device is available", return_reason)
    capability = get_device_compute_capability()
    return _answer(capability >= (8, 0), "bfloat16 needs a GPU of compute capability 8.0 or "
                   f"newer, the current device has {capability[0]}.{capability[1]}",
                   return_reason)


def get_default_recipe():
    """The recipe Transformer Engine defaults to on Hopper and Ada: DelayedScaling() (the one
    fp8_autocast takes when given none)."""
    from .quantization.recipe import DelayedScaling

    return DelayedScaling()
