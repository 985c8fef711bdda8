"""FP8 recipes, with Transformer Engine's names so that its users can switch with an import."""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch


class Format(enum.Enum):
    """Which FP8 format each role uses.

    E4M3: everything E4M3 (max 448). E5M2: everything E5M2 (max 57344; Linear refuses it, as
    FP8 GEMMs take no E5M2 x E5M2 product). HYBRID: E4M3 for the forward tensors (inputs,
    weights), E5M2 for gradients, which need range more than precision.
    """

    E4M3 = "E4M3"
    E5M2 = "E5M2"
    HYBRID = "HYBRID"

    @property
    def fwd_dtype(self) -> torch.dtype:
        return torch.float8_e5m2 if self is Format.E5M2 else torch.float8_e4m3fn

    @property
    def bwd_dtype(self) -> torch.dtype:
        return torch.float8_e4m3fn if self is Format.E4M3 else torch.float8_e5m2

    @property
    def max_fwd(self) -> float:
        return torch.finfo(self.fwd_dtype).max

    @property
    def max_bwd(self) -> float:
        return torch.finfo(self.bwd_dtype).max


# The largest margin: scale_inv = amax * 2**margin / fp8_max, and a GEMM multiplies two of them;
# with margin <= 32 that product stays finite for amaxes up to ~1e8 (2**64 * 1e8**2 / 448**2).
MAX_MARGIN = 32

AmaxComputeAlgo = Union[str, Callable[[torch.Tensor], torch.Tensor]]


def _check_format(value) -> None:
    if not isinstance(value, Format):
        raise ValueError(f"fp8_format must be one of {[f'Format.{f.name}' for f in Format]}, "
                         f"got {value!r}")


@dataclass(frozen=True)
class DelayedScaling:
    """Delayed scaling: each tensor's scale comes from the amaxes of the last steps.

    margin: scale = fp8_max / amax / 2**margin, an integer in [0, MAX_MARGIN = 32]: 2**margin
        of headroom above the amaxes seen. Beyond that, ordinary tensors get scales near float32's
        limits: they underflow (margin >= 140 gave zero scales and NaN outputs), and the product
        of a GEMM's two scale_invs, which the GEMM applies, overflows to inf.
    amax_history_len: steps of amax kept per tensor (>= 1).
    amax_compute_algo: "max" (largest finite amax of the window), "most_recent", or a callable
        taking the window [L, n] (oldest first, this step's amax last) and returning amax [n].
    scaling_factor_compute_algo: None, or a callable (amax, scale, fp8_max, recipe) -> scale.
    reduce_amax: all-reduce (MAX) the amaxes across fp8_group before each update.
    """

    margin: int = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: AmaxComputeAlgo = "max"
    scaling_factor_compute_algo: Optional[Callable] = None
    reduce_amax: bool = True

    def __post_init__(self):
        if (isinstance(self.margin, bool) or not isinstance(self.margin, int)
                or not 0 <= self.margin <= MAX_MARGIN):
            raise ValueError(f"margin must be an integer in [0, {MAX_MARGIN}] (a larger margin "
                             f"makes scales that underflow float32), got {self.margin!r}")
        _check_format(self.fp8_format)
        if (isinstance(self.amax_history_len, bool) or not isinstance(self.amax_history_len, int)
                or self.amax_history_len < 1):
            raise ValueError(f"amax_history_len must be an integer >= 1, "
                             f"got {self.amax_history_len!r}")
        if not (callable(self.amax_compute_algo)
                or self.amax_compute_algo in ("max", "most_recent")):
            raise ValueError("amax_compute_algo must be 'max', 'most_recent' or a callable, "
                             f"got {self.amax_compute_algo!r}")
        if not (self.scaling_factor_compute_algo is None
                or callable(self.scaling_factor_compute_algo)):
            raise ValueError("scaling_factor_compute_algo must be None or a callable, "
                             f"got {self.scaling_factor_compute_algo!r}")
        if not isinstance(self.reduce_amax, bool):
            raise ValueError(f"reduce_amax must be True or False, got {self.reduce_amax!r}")


@dataclass(frozen=True)
class Float8CurrentScaling:
    """Current scaling: each cast takes its scale from the amax of the tensor being cast
    (reduced across fp8_group so that all ranks agree). No history."""

    fp8_format: Format = Format.HYBRID

    def __post_init__(self):
        _check_format(self.fp8_format)


def _check_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")


def _check_block_dim(name: str, value) -> None:
    if isinstance(value, bool) or value not in (1, 2):
        raise ValueError(f"{name} must be 1 (1x128 tiles) or 2 (128x128 blocks), got {value!r}")


@dataclass(frozen=True)
class Float8BlockScaling:
    """Per-block scaling (DeepSeek-V3 style; Transformer Engine's recipe of this name).

    Every tensor is scaled per block from its own values at the time of the cast: no amax
    history, no update, no collective (each rank's blocks are its own). Dimensions:
    1 = 1x128 tiles along the rows, 2 = 128x128 blocks. Scales are float32; with power_2_scale
    (the default, as in Transformer Engine) each is rounded down to a power of two.

    x_block_scaling_dim: the input's blocks (1 or 2).
    w_block_scaling_dim: the weight's blocks (1 or 2).
    grad_block_scaling_dim: grad_output's blocks (1 or 2).
    At most one of the three may be 2: each GEMM (fprop x.w, dgrad grad.w, wgrad grad.x) takes
    two of them, and cuBLASLt has no 128x128 by 128x128 block-scaled GEMM.
    fp8_format: E4M3 everywhere by default (per-block scales need less range); HYBRID gives
    gradients E5M2. E5M2 everywhere is refused.
    """

    fp8_format: Format = Format.E4M3
    x_block_scaling_dim: int = 1
    w_block_scaling_dim: int = 2
    grad_block_scaling_dim: int = 1
    power_2_scale: bool = True

    def __post_init__(self):
        _check_format(self.fp8_format)
        if self.fp8_format is Format.E5M2:
            raise ValueError("Float8BlockScaling: fp8_format=Format.E5M2 is not supported (FP8 "
                             "GEMMs take no E5M2 x E5M2 product); use Format.E4M3 or "
                             "Format.HYBRID")
        dims = {"x_block_scaling_dim": self.x_block_scaling_dim,
                "w_block_scaling_dim": self.w_block_scaling_dim,
                "grad_block_scaling_dim": self.grad_block_scaling_dim}
        for name, value in dims.items():
            _check_block_dim(name, value)
        two_d = [name for name, value in dims.items() if value == 2]
        if len(two_d) > 1:
            raise ValueError(f"Float8BlockScaling: {' and '.join(two_d)} are both 2, but a "
                             "128x128 by 128x128 block-scaled GEMM is not supported (fprop "
                             "multiplies x by w, dgrad grad by w, wgrad grad by x); make at "
                             "most one of them 2")
        _check_bool("power_2_scale", self.power_2_scale)


@dataclass(frozen=True)
class Float8RowwiseScaling:
    """Row-wise scaling (torchao's "rowwise" recipe): one scale per row of each GEMM operand,
    along the contraction dimension: per row of the input and of the weight in the forward,
    per row of grad_output and per column of the weight for dgrad, per column of grad_output
    and of the input for wgrad. Scales come from the tensor itself (no history, no collective).

    fp8_format: E4M3 everywhere by default (as torchao); HYBRID gives gradients E5M2.
    power_2_scale: round each scale down to a power of two (torchao's default too).
    """

    fp8_format: Format = Format.E4M3
    power_2_scale: bool = True

    def __post_init__(self):
        _check_format(self.fp8_format)
        if self.fp8_format is Format.E5M2:
            raise ValueError("Float8RowwiseScaling: fp8_format=Format.E5M2 is not supported (FP8 "
                             "GEMMs take no E5M2 x E5M2 product); use Format.E4M3 or "
                             "Format.HYBRID")
        _check_bool("power_2_scale", self.power_2_scale)


BLOCK_RECIPES = (Float8BlockScaling, Float8RowwiseScaling)
RECIPE_TYPES = (DelayedScaling, Float8CurrentScaling) + BLOCK_RECIPES
# The recipes whose steps a captured CUDA graph can hold (integrations/cuda_graphs.py).
GRAPHABLE_RECIPES = (DelayedScaling, Float8CurrentScaling)
# The recipes under which FSDP2 all-gathers weight shards cast to FP8 (the delayed scale, the
# current scale of the full weight's amax agreed by the ranks, or 128x128 blocks quantised
# where they lie: modules/fsdp_all_gather.py).
FP8_ALL_GATHER_RECIPES = (DelayedScaling, Float8CurrentScaling, Float8BlockScaling)
# The recipes with no amax history or scale in the module state.
STATELESS_RECIPES = (Float8CurrentScaling,) + BLOCK_RECIPES

Recipe = Union[DelayedScaling, Float8CurrentScaling, Float8BlockScaling, Float8RowwiseScaling]
