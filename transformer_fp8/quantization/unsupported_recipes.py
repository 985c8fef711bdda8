"""Transformer Engine's recipes for Blackwell's FP8 and FP4 formats, and its CustomRecipe:
importable under their names (a script that names them among others runs), refused when made.
"""
from __future__ import annotations

from .recipe import Recipe


class _UnsupportedRecipe(Recipe):
    """Transformer Engine's recipes for Blackwell's FP8 and FP4 formats: importable (a script
    that names them among others runs), refused when made."""

    def __init__(self, *args, **kwargs):
        raise NotImplementedError(
            f"{type(self).__name__} is not supported by transformer_fp8 (its recipes are "
            "DelayedScaling, Float8CurrentScaling, Float8BlockScaling and "
            "Float8RowwiseScaling)")


class MXFP8BlockScaling(_UnsupportedRecipe):
    @classmethod
    def mxfp8(cls) -> bool:
        return True


class NVFP4BlockScaling(_UnsupportedRecipe):
    @classmethod
    def nvfp4(cls) -> bool:
        return True


class CustomRecipe(_UnsupportedRecipe):
    @classmethod
    def custom(cls) -> bool:
        return True
