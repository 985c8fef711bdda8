"""The recipes under Transformer Engine's module name: ``transformer_engine.common.recipe``
becomes ``transformer_fp8.recipe`` (``from transformer_fp8.recipe import DelayedScaling,
Format``). They live in quantization/recipe.py."""
from .quantization.recipe import (DelayedScaling, Float8BlockScaling, Float8CurrentScaling,
                                  Float8RowwiseScaling, Format, Recipe)
from .quantization.unsupported_recipes import CustomRecipe, MXFP8BlockScaling, NVFP4BlockScaling
from .quantization.gemm_params import MMParams

__all__ = ["CustomRecipe", "DelayedScaling", "Float8BlockScaling", "Float8CurrentScaling",
           "Float8RowwiseScaling", "Format", "MMParams", "MXFP8BlockScaling",
           "NVFP4BlockScaling", "Recipe"]
