"""FP8 recipes, with Transformer Engine's names so that its users can switch with an import."""
from __future__ import annotations

import enum
import os
import warnings
from dataclasses import InitVar, dataclass, field
from typing import Callable, Optional, Union

import torch

from .gemm_params import MMParams, check_gemm_params


class _FormatValue(str):
    """A Format's value: its name, which also carries max_fwd and max_bwd, as Transformer
    Engine's _FormatHelper values do (``Format.HYBRID.value.max_fwd``)."""

    def __new__(cls, name: str, max_fwd: float, max_bwd: float):
        value = super().__new__(cls, name)
        value.max_fwd, value.max_bwd = max_fwd, max_bwd
        return value

    def __reduce__(self):
        return _FormatValue, (str(self), self.max_fwd, self.max_bwd)


class Format(enum.Enum):
    """Which FP8 format each role uses.

    E4M3: everything E4M3 (max 448). E5M2: everything E5M2 (max 57344; Linear refuses it, as
    FP8 GEMMs take no E5M2 x E5M2 product). HYBRID: E4M3 for the forward tensors (inputs,
    weights), E5M2 for gradients, which need range more than precision. Each value is the
    format's name (``Format("HYBRID")``), with ``.max_fwd`` / ``.max_bwd`` as Transformer
    Engine's.
    """

    E4M3 = _FormatValue("E4M3", 448.0, 448.0)
    E5M2 = _FormatValue("E5M2", 57344.0, 57344.0)
    HYBRID = _FormatValue("HYBRID", 448.0, 57344.0)

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


class Recipe:
    """The base of every recipe, with Transformer Engine's questions about which one it is
    (class methods, as in Transformer Engine: ``recipe.delayed()``). Recipes are frozen
    dataclasses (``dataclasses.replace`` makes a changed copy); Transformer Engine's can be
    changed in place."""

    @classmethod
    def delayed(cls) -> bool:
        return issubclass(cls, DelayedScaling)

    @classmethod
    def float8_current_scaling(cls) -> bool:
        return issubclass(cls, Float8CurrentScaling)

    @classmethod
    def float8_per_tensor_scaling(cls) -> bool:
        return issubclass(cls, (DelayedScaling, Float8CurrentScaling))

    @classmethod
    def float8_block_scaling(cls) -> bool:
        return issubclass(cls, Float8BlockScaling)

    @classmethod
    def float8_rowwise_scaling(cls) -> bool:
        return issubclass(cls, Float8RowwiseScaling)

    @classmethod
    def mxfp8(cls) -> bool:
        return False

    @classmethod
    def nvfp4(cls) -> bool:
        return False

    @classmethod
    def custom(cls) -> bool:
        return False

    def __setstate__(self, state: dict) -> None:
        # A recipe pickled before a field existed (torch.save(model) holds the recipes) gets
        # the field at the value it behaved as then.
        for name, value in _FIELDS_ADDED.items():
            if name in getattr(type(self), "__dataclass_fields__", {}):
                state.setdefault(name, value)
        self.__dict__.update(state)


# Fields added to the recipes after their first release, and the value an older pickle had in
# effect (the defaults; backward_override and use_power_2_scales, whose defaults come from the
# environment, as not set).
_FIELDS_ADDED = {"fp8_dpa": False, "fp8_mha": False, "backward_override": None,
                 "use_power_2_scales": False}


# Transformer Engine's backward_override values (quantization/backward_override.py).
BACKWARD_OVERRIDES = ("high_precision", "dequantized")


def _env_backward_override() -> Optional[str]:
    return os.environ.get("NVTE_BACKWARD_OVERRIDE") or None


def _check_te_switches(recipe) -> None:
    """Transformer Engine's switches: FP8 attention, accepted at its defaults only (attention
    runs in high precision here), and backward_override (quantization/backward_override.py;
    its default Transformer Engine reads from NVTE_BACKWARD_OVERRIDE)."""
    name = type(recipe).__name__
    for switch in ("fp8_dpa", "fp8_mha"):
        value = getattr(recipe, switch)
        _check_bool(switch, value)
        if value:
            raise ValueError(f"{name}: {switch}=True (FP8 attention) is not supported: "
                             "attention runs in high precision; leave it False")
    value = recipe.backward_override
    from_env = ("" if value is None or value != _env_backward_override() else
                " (the default, from the environment variable NVTE_BACKWARD_OVERRIDE)")
    if value is not None and (not isinstance(value, str) or value not in BACKWARD_OVERRIDES):
        raise ValueError(f"{name}: backward_override must be None, 'high_precision' or "
                         f"'dequantized', got {value!r}{from_env}")
    if value is not None and isinstance(recipe, DelayedScaling):
        raise ValueError(f"{name}: backward_override={value!r}{from_env} is not supported with "
                         "delayed scaling (as in Transformer Engine: its grad_output scales "
                         "come from the backward's FP8 casts); use Float8CurrentScaling or "
                         "Float8BlockScaling, or leave it None (unset NVTE_BACKWARD_OVERRIDE)")


@dataclass(frozen=True)
class DelayedScaling(Recipe):
    """Delayed scaling: each tensor's scale comes from the amaxes of the last steps.

    margin: scale = fp8_max / amax / 2**margin, an integer in [0, MAX_MARGIN = 32]: 2**margin
        of headroom above the amaxes seen. Beyond that, ordinary tensors get scales near float32's
        limits: they underflow (margin >= 140 gave zero scales and NaN outputs), and the product
        of a GEMM's two scale_invs, which the GEMM applies, overflows to inf.
    amax_history_len: steps of amax kept per tensor (>= 1).
    amax_compute_algo: "max" (largest finite amax of the window), "most_recent", or a callable
        taking the history before its roll, [L, n] (as Transformer Engine: row 0 this step's
        amax, rows 1..L-1 the earlier ones, oldest first), and returning amax [n].
    scaling_factor_compute_algo: None, or a callable (amax, scale, fp8_max, recipe) -> scale
        [n]. Its result is taken where it is a finite positive scale; where it is not (inf, as
        fp8_max / amax gives for an empty window's amax of 0; NaN, 0, negative) the old scale
        is kept, so no update writes a scale whose casts give zeros or NaN.
    reduce_amax: all-reduce (MAX) the amaxes across fp8_group before each update.
    fp8_dpa, fp8_mha: Transformer Engine's, accepted at their defaults (False) only.
    backward_override: Transformer Engine's (default from NVTE_BACKWARD_OVERRIDE); delayed
        scaling takes None only, as there.
    """

    margin: int = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: AmaxComputeAlgo = "max"
    scaling_factor_compute_algo: Optional[Callable] = None
    reduce_amax: bool = True
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: Optional[str] = field(default_factory=_env_backward_override)
    # Transformer Engine 1.x's: interval (deprecated there, unused; keyword only here: 1.x
    # put it second), override_linear_precision (only its default, all GEMMs in FP8).
    interval: InitVar[int] = -1
    override_linear_precision: InitVar[tuple] = (False, False, False)

    def __post_init__(self, interval, override_linear_precision):
        if isinstance(interval, bool) or not isinstance(interval, int):
            raise ValueError(f"interval must be an int, got {interval!r}")
        if interval >= 0:
            warnings.warn("DelayedScaling: interval is deprecated and unused (as in Transformer "
                          "Engine 1.x): scales are updated at every step", DeprecationWarning,
                          stacklevel=3)
        if (not isinstance(override_linear_precision, (tuple, list))
                or tuple(override_linear_precision) != (False, False, False)):
            raise ValueError(f"DelayedScaling: override_linear_precision="
                             f"{override_linear_precision!r} (some GEMMs in high precision) is "
                             "not supported; leave it at (False, False, False)")
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
        _check_te_switches(self)


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "0") == "1"


@dataclass(frozen=True)
class Float8CurrentScaling(Recipe):
    """Current scaling: each cast takes its scale from the amax of the tensor being cast, each
    rank from what it holds (as Transformer Engine; a tensor-parallel DTensor weight's amax is
    reduced across its mesh). No history.

    use_power_2_scales: Transformer Engine's (default from NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES):
        every scale fp8_max / amax rounded down to a power of two (its mantissa bits cleared,
        as Transformer Engine does), so that casts and GEMMs scale exactly. Such layers take the
        Python path (not the C++ steps); FSDP2's FP8 all-gather casts the shards with the full
        weight's power-of-two scale.
        fp8_dpa, fp8_mha: see DelayedScaling.
    backward_override: None (the backward GEMMs in FP8), "high_precision" or "dequantized"
        (in high precision, from the forward's operands before their casts or dequantised:
        quantization/backward_override.py); default from NVTE_BACKWARD_OVERRIDE.
    fp8_gemm_fprop, fp8_gemm_dgrad, fp8_gemm_wgrad: Transformer Engine's MMParams, the
        accumulation of each GEMM on Hopper (defaults: fast accumulation in the forward, the
        split accumulator in the backward; quantization/gemm_params.py). Other values run the
        Python path (not the C++ steps).
    """

    fp8_format: Format = Format.HYBRID
    use_power_2_scales: bool = field(
        default_factory=lambda: _env_flag("NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES"))
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: Optional[str] = field(default_factory=_env_backward_override)
    fp8_gemm_fprop: MMParams = MMParams(use_split_accumulator=False)
    fp8_gemm_dgrad: MMParams = MMParams(use_split_accumulator=True)
    fp8_gemm_wgrad: MMParams = MMParams(use_split_accumulator=True)

    def __post_init__(self):
        _check_format(self.fp8_format)
        _check_bool("use_power_2_scales", self.use_power_2_scales)
        _check_te_switches(self)
        check_gemm_params(self)


def _check_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")


def _check_block_dim(name: str, value) -> None:
    if isinstance(value, bool) or value not in (1, 2):
        raise ValueError(f"{name} must be 1 (1x128 tiles) or 2 (128x128 blocks), got {value!r}")


@dataclass(frozen=True)
class Float8BlockScaling(Recipe):
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
    power_2_scale: powers of two, or float32 scales; by default powers of two unless
        NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1 (Transformer Engine's switch). use_f32_scales:
        Transformer Engine's spelling, an argument only: given, it sets power_2_scale to its
        opposite.
    fp8_dpa, fp8_mha: see DelayedScaling. backward_override: see Float8CurrentScaling.
    fp8_gemm_fprop, fp8_gemm_dgrad, fp8_gemm_wgrad: MMParams with the split accumulator only,
        as Transformer Engine requires.
    """

    fp8_format: Format = Format.E4M3
    x_block_scaling_dim: int = 1
    w_block_scaling_dim: int = 2
    grad_block_scaling_dim: int = 1
    power_2_scale: Optional[bool] = None
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: Optional[str] = field(default_factory=_env_backward_override)
    fp8_gemm_fprop: MMParams = MMParams(use_split_accumulator=True)
    fp8_gemm_dgrad: MMParams = MMParams(use_split_accumulator=True)
    fp8_gemm_wgrad: MMParams = MMParams(use_split_accumulator=True)
    use_f32_scales: InitVar[Optional[bool]] = None

    def __post_init__(self, use_f32_scales):
        _check_format(self.fp8_format)
        if use_f32_scales is not None:  # (Transformer Engine's spelling)
            _check_bool("use_f32_scales", use_f32_scales)
            object.__setattr__(self, "power_2_scale", not use_f32_scales)
        elif self.power_2_scale is None:
            object.__setattr__(self, "power_2_scale",
                               not _env_flag("NVTE_FP8_BLOCK_SCALING_FP32_SCALES"))
        _check_bool("power_2_scale", self.power_2_scale)
        _check_te_switches(self)
        check_gemm_params(self, split_only=True)
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


@dataclass(frozen=True)
class Float8RowwiseScaling(Recipe):
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
# where they lie: modules/fsdp/all_gather.py).
FP8_ALL_GATHER_RECIPES = (DelayedScaling, Float8CurrentScaling, Float8BlockScaling)
# The recipes with no amax history or scale in the module state.
STATELESS_RECIPES = (Float8CurrentScaling,) + BLOCK_RECIPES
