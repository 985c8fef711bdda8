"""transformer_fp8: FP8 training for PyTorch.

Importing this package loads the compiled operators (torch.ops.transformer_fp8) but never
initialises CUDA.
"""
from . import ops
from .availability import (build_info, get_default_recipe, get_device_compute_capability,
                           is_bf16_available, is_fp8_available, is_fp8_block_scaling_available,
                           is_mxfp8_available, is_nvfp4_available)
from .cpu_offload import get_cpu_offload_context
from .cross_entropy import parallel_cross_entropy
from .integrations.convert import Conv1D, ConversionSummary, convert_to_fp8
from .integrations.cuda_graphs import make_graphed_callables
from .integrations.pretrained import load_fp8_state
from .modules.attention import (DotProductAttention, InferenceParams, MultiheadAttention,
                                RotaryPositionEmbedding)
from .modules.fp8_padding import Fp8Padding, Fp8Unpadding
from .modules.fsdp import enable_fp8_all_gather
from .modules.grouped_linear import GroupedLinear
from .modules.layernorm_linear import LayerNormLinear
from .modules.layernorm_mlp import LayerNormMLP
from .modules.linear import Linear, strip_fp8_state
from .modules.moe import (moe_permute, moe_permute_with_probs, moe_sort_chunks_by_index,
                          moe_sort_chunks_by_index_with_probs, moe_unpermute)
from .modules.normalization import LayerNorm, RMSNorm
from .modules.transformer_layer import TransformerLayer
from .ops import blockwise as blockwise_ops
from .ops import fused as fused_ops
from . import distributed, optimizers, recipe
from .distributed import CudaRNGStatesTracker
from .quantization.autocast import autocast, fp8_autocast
from .quantization.model_init import fp8_model_init, quantized_model_init
from .quantization.recipe import (DelayedScaling, Float8BlockScaling, Float8CurrentScaling,
                                  Float8RowwiseScaling, Format)
from .quantization.replay import checkpoint
from . import debug  # noqa: E402 (after the modules it inspects)

__version__ = "0.1.0"


__all__ = ["Conv1D", "ConversionSummary", "CudaRNGStatesTracker", "DelayedScaling",
           "DotProductAttention", "Float8BlockScaling", "Float8CurrentScaling",
           "Float8RowwiseScaling", "Format", "Fp8Padding", "Fp8Unpadding", "GroupedLinear",
           "InferenceParams", "LayerNorm", "LayerNormLinear", "LayerNormMLP", "Linear",
           "MultiheadAttention", "RMSNorm", "RotaryPositionEmbedding", "TransformerLayer",
           "autocast", "blockwise_ops", "build_info", "checkpoint", "convert_to_fp8", "debug",
           "distributed", "enable_fp8_all_gather", "fp8_autocast", "fp8_model_init", "fused_ops",
           "get_cpu_offload_context", "get_default_recipe", "get_device_compute_capability",
           "is_bf16_available", "is_fp8_available", "is_fp8_block_scaling_available",
           "is_mxfp8_available", "is_nvfp4_available", "load_fp8_state", "make_graphed_callables",
           "moe_permute", "moe_permute_with_probs", "moe_sort_chunks_by_index",
           "moe_sort_chunks_by_index_with_probs", "moe_unpermute", "ops", "optimizers",
           "parallel_cross_entropy", "quantized_model_init", "recipe", "strip_fp8_state"]
