"""Transformer Engine's per-GEMM options (``MMParams``) and the accumulation each FP8 GEMM of a
layer runs with.

On Hopper an FP8 GEMM may accumulate in the tensor cores' reduced precision ("fast
accumulation", cuBLASLt's CUBLASLT_MATMUL_DESC_FAST_ACCUM) or promote its partial sums to
float32 at intervals ("split accumulator"). As in Transformer Engine, the forward GEMM uses
fast accumulation and the backward GEMMs (dgrad, wgrad) the split accumulator, unless a recipe
that has the fields (Float8CurrentScaling; Float8BlockScaling, which takes the split
accumulator only) says otherwise. The CPU kernels always accumulate in float32.
"""
from __future__ import annotations

from dataclasses import dataclass

# fast_accum of (fprop, dgrad, wgrad) where a recipe says nothing (Transformer Engine's).
DEFAULT_FAST_ACCUM = (True, False, False)


@dataclass(frozen=True)
class MMParams:
    """Transformer Engine's matrix multiplication options: ``use_split_accumulator`` (True:
    float32 promotion of the partial sums; False: fast accumulation)."""

    use_split_accumulator: bool = True

    def __post_init__(self):
        if not isinstance(self.use_split_accumulator, bool):
            raise ValueError("MMParams: use_split_accumulator must be True or False, got "
                             f"{self.use_split_accumulator!r}")


GEMM_FIELDS = ("fp8_gemm_fprop", "fp8_gemm_dgrad", "fp8_gemm_wgrad")


def check_gemm_params(recipe, split_only: bool = False) -> None:
    """Each of the recipe's GEMM fields is an MMParams (with the split accumulator where
    ``split_only``: Transformer Engine's Float8BlockScaling requires it). Called by the recipe's
    __post_init__, which also keeps the flags fast_accum_of reads (a frozen recipe: computed
    once, not at every forward)."""
    name = type(recipe).__name__
    for field_name in GEMM_FIELDS:
        value = getattr(recipe, field_name)
        if not isinstance(value, MMParams):
            raise TypeError(f"{name}: {field_name} must be an MMParams, got "
                            f"{type(value).__name__}")
        if split_only and not value.use_split_accumulator:
            raise ValueError(f"{name}: {field_name}=MMParams(use_split_accumulator=False) is not "
                             "supported: block-scaled GEMMs accumulate with the split "
                             "accumulator (as in Transformer Engine)")
    fast = tuple(not getattr(recipe, f).use_split_accumulator for f in GEMM_FIELDS)
    object.__setattr__(recipe, "_fast_accum", DEFAULT_FAST_ACCUM if fast == DEFAULT_FAST_ACCUM
                       else fast)


def fast_accum_of(recipe) -> tuple:
    """(fprop, dgrad, wgrad): whether each GEMM uses fast accumulation under ``recipe`` (the
    default, Transformer Engine's, for recipes without MMParams; ``is DEFAULT_FAST_ACCUM``
    where a recipe asks for the default)."""
    return getattr(recipe, "_fast_accum", DEFAULT_FAST_ACCUM)
