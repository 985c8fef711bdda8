"""transformer_fp8: FP8 training for PyTorch.

Importing this package loads the compiled operators (torch.ops.transformer_fp8) but never
initialises CUDA.
"""
from . import ops, recipe
from .autocast import fp8_autocast
from .convert import Conv1D, ConversionSummary, convert_to_fp8
from .linear import Linear, strip_fp8_state
from .recipe import DelayedScaling, Float8CurrentScaling, Format

__version__ = "0.1.0"


def build_info() -> dict:
    """What this build contains: {"cuda": bool, "cuda_archs": [...], "cuda_version": str|None,
    "torch_version": str (built against), "torch_runtime_version": str}."""
    import torch

    from . import _C

    info = dict(_C.build_info())
    info["cuda_archs"] = [a for a in info["cuda_archs"].split(";") if a]
    info["torch_runtime_version"] = torch.__version__
    return info


__all__ = ["Conv1D", "ConversionSummary", "DelayedScaling", "Float8CurrentScaling", "Format",
           "Linear", "build_info", "convert_to_fp8", "fp8_autocast", "ops", "recipe",
           "strip_fp8_state"]
