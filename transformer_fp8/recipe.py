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


AmaxComputeAlgo = Union[str, Callable[[torch.Tensor], torch.Tensor]]


def _check_format(value) -> None:
    if not isinstance(value, Format):
        raise ValueError(f"fp8_format must be one of {[f'Format.{f.name}' for f in Format]}, "
                         f"got {value!r}")


@dataclass(frozen=True)
class DelayedScaling:
    """Delayed scaling: each tensor's scale comes from the amaxes of the last steps.

    margin: scale = fp8_max / amax / 2**margin (an integer in [0, 1000]).
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
                or not 0 <= self.margin <= 1000):
            raise ValueError(f"margin must be an integer in [0, 1000], got {self.margin!r}")
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


Recipe = Union[DelayedScaling, Float8CurrentScaling]
