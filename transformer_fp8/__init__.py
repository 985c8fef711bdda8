"""transformer_fp8: FP8 training for PyTorch.

Importing this package loads the compiled operators (torch.ops.transformer_fp8) but never
initialises CUDA.
"""
from . import ops
from .integrations.convert import Conv1D, ConversionSummary, convert_to_fp8
from .integrations.cuda_graphs import make_graphed_callables
from .integrations.pretrained import load_fp8_state
from .modules.attention import DotProductAttention, RotaryPositionEmbedding
from .modules.fsdp_all_gather import enable_fp8_all_gather
from .modules.grouped_linear import GroupedLinear
from .modules.layernorm_linear import LayerNormLinear
from .modules.layernorm_mlp import LayerNormMLP
from .modules.linear import Linear, strip_fp8_state
from .modules.multi_head_attention import MultiheadAttention
from .modules.normalization import LayerNorm, RMSNorm
from .modules.transformer_layer import TransformerLayer
from .ops import blockwise as blockwise_ops
from .ops import fused as fused_ops
from .quantization import recipe
from .quantization.autocast import autocast, fp8_autocast, fp8_model_init, quantized_model_init
from .quantization.recipe import (DelayedScaling, Float8BlockScaling, Float8CurrentScaling,
                                  Float8RowwiseScaling, Format)
from .quantization.replay import checkpoint
from . import debug  # noqa: E402 (after the modules it inspects)

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


def is_fp8_available() -> tuple[bool, str]:
    """(True, "") when FP8 training can run on the current CUDA device with this build, else
    (False, the reason). The CPU kernels (an exact emulation) always run, whatever this says."""
    import torch

    if not build_info()["cuda"]:
        return False, "transformer_fp8 was built without its CUDA kernels (CPU only)"
    if not torch.cuda.is_available():
        return False, "no CUDA device is available"
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < (8, 9):
        return False, (f"{torch.cuda.get_device_name()} has compute capability {major}.{minor}; "
                       "FP8 tensor cores need 8.9 (Ada) or 9.0 (Hopper) or newer")
    return True, ""


__all__ = ["Conv1D", "ConversionSummary", "DelayedScaling", "DotProductAttention",
           "Float8BlockScaling", "Float8CurrentScaling", "Float8RowwiseScaling", "Format",
           "GroupedLinear",
           "LayerNorm", "LayerNormLinear", "LayerNormMLP", "Linear", "MultiheadAttention",
           "RMSNorm", "RotaryPositionEmbedding", "TransformerLayer", "autocast", "blockwise_ops",
           "build_info", "checkpoint", "convert_to_fp8", "debug", "enable_fp8_all_gather",
           "fp8_autocast",
           "fp8_model_init", "fused_ops", "is_fp8_available", "load_fp8_state",
           "make_graphed_callables", "ops",
           "quantized_model_init", "recipe", "strip_fp8_state"]
