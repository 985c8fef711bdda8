"""LayerNorm and RMSNorm (Transformer Engine's modules), and the norm step of the fused modules.

Both normalise each row over the last dimension in float32. The modules return Transformer
Engine's dtype: the autocast dtype under torch.autocast, else the weight's (the input and the
parameters are cast to it first); the fused modules' norm step returns the input's dtype:
  LayerNorm: y = (x - mean) / sqrt(var + eps) * gamma + beta   (biased variance)
  RMSNorm:   y = x / sqrt(mean(x^2) + eps) * gamma
With zero_centered_gamma the stored weight is gamma - 1 (initialised to zeros), which keeps
weight decay from pulling gamma towards 0.

NormStep is what LayerNormLinear and LayerNormMLP run: the norm fused with the FP8 cast of its
output (fused_ops), its high-precision form, and its backward.
"""
from __future__ import annotations

import math

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from .. import _param_marks as param_marks
from ..quantization.torch_autocast import autocast_dtype
from .torchscript import refuse_torchscript

NORMALIZATIONS = ("LayerNorm", "RMSNorm")


def check_normalization(normalization) -> str:
    if normalization not in NORMALIZATIONS:
        raise ValueError(f"normalization must be one of {NORMALIZATIONS}, got {normalization!r}")
    return normalization


def check_eps(eps) -> float:
    if (isinstance(eps, bool) or not isinstance(eps, (int, float))
            or not (math.isfinite(eps) and eps >= 0)):
        raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")
    return float(eps)


def check_zero_centered_gamma(value) -> bool:
    """True or False; None, 0 / 1, numpy and one-element tensor booleans taken as them (as
    bool() takes them); anything else refused (bool() took the string "no" as True)."""
    if value is None:
        return False
    if isinstance(value, torch.Tensor) and value.numel() == 1 and (
            value.dtype == torch.bool or not value.is_floating_point()):
        value = value.item()
    if type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_"):
        value = bool(value)  # (numpy's bool, without importing numpy)
    if isinstance(value, bool) or (isinstance(value, int) and value in (0, 1)):
        return bool(value)
    raise TypeError(f"zero_centered_gamma must be True or False, got {value!r}")


def norm_hp(x: torch.Tensor, normalization: str, weight: torch.Tensor,
            bias: Optional[torch.Tensor], eps: float, zero_centered_gamma: bool) -> torch.Tensor:
    """The norm in torch ops: float32 math, the result in x's dtype (under torch.autocast in
    the autocast dtype, as Transformer Engine's norms return)."""
    if not x.is_floating_point():
        # (torch.nn.LayerNorm refuses these too; the float32 math would return truncated ints)
        raise TypeError(f"{normalization}: the input must be a floating-point tensor, got "
                        f"{x.dtype}")
    gamma = weight.float() + 1 if zero_centered_gamma else weight.float()
    shape = (x.shape[-1],)
    if normalization == "LayerNorm":
        y = F.layer_norm(x.float(), shape, gamma, None if bias is None else bias.float(), eps)
    else:
        y = F.rms_norm(x.float(), shape, gamma, eps)
    return y.to(autocast_dtype(x.device.type) or x.dtype)


@dataclass(frozen=True)
class NormStep:
    """The norm of a fused module, on 2-D x [M, N]. stats: (mean, rstd) for LayerNorm,
    (rstd,) for RMSNorm, float32 [M]."""

    normalization: str
    eps: float
    zero_centered_gamma: bool

    def fp8(self, x, weight, bias, scale, amax, fp8_dtype, with_transpose, return_hp,
            row_multiple):
        """(y_fp8 [M_pad, N], y_t_fp8, y_hp or None, stats): the norm's output cast to FP8 in
        the same pass (from its float32 value), rows zero-padded to row_multiple."""
        from ..ops import fused as fused_ops
        if self.normalization == "LayerNorm":
            y_fp8, y_t_fp8, y_hp, mean, rstd = fused_ops.layernorm_fwd_fp8(
                x, weight, bias, self.eps, self.zero_centered_gamma, scale, fp8_dtype, amax,
                with_transpose, return_hp, row_multiple)
            stats = (mean, rstd)
        else:
            y_fp8, y_t_fp8, y_hp, rstd = fused_ops.rmsnorm_fwd_fp8(
                x, weight, self.eps, self.zero_centered_gamma, scale, fp8_dtype, amax,
                with_transpose, return_hp, row_multiple)
            stats = (rstd,)
        return y_fp8, y_t_fp8, (y_hp if return_hp else None), stats

    def hp(self, x, weight, bias):
        """(y in x's dtype, stats)."""
        from ..ops import fused as fused_ops
        if self.normalization == "LayerNorm":
            y, mean, rstd = fused_ops.layernorm_fwd(x, weight, bias, self.eps,
                                                    self.zero_centered_gamma)
            return y, (mean, rstd)
        y, rstd = fused_ops.rmsnorm_fwd(x, weight, self.eps, self.zero_centered_gamma)
        return y, (rstd,)

    def backward(self, dy, x, stats, weight):
        """(dx, dweight, dbias or None)."""
        from ..ops import fused as fused_ops
        if self.normalization == "LayerNorm":
            return fused_ops.layernorm_bwd(dy, x, *stats, weight, self.zero_centered_gamma)
        dx, dweight = fused_ops.rmsnorm_bwd(dy, x, *stats, weight, self.zero_centered_gamma)
        return dx, dweight, None


def _norm_parameters(module, hidden_size, bias, zero_centered_gamma, device, dtype,
                     prefix=""):
    """Register gamma (ones, or zeros when zero-centred) and beta (zeros) as Parameters."""
    factory = dict(device=device, dtype=dtype)
    fill = torch.zeros if zero_centered_gamma else torch.ones
    module.register_parameter(prefix + "weight",
                              torch.nn.Parameter(fill(hidden_size, **factory)))
    module.register_parameter(prefix + "bias", torch.nn.Parameter(
        torch.zeros(hidden_size, **factory)) if bias else None)


def reset_norm_parameters(weight, bias, zero_centered_gamma) -> None:
    with torch.no_grad():
        weight.fill_(0.0 if zero_centered_gamma else 1.0)
        if bias is not None:
            bias.zero_()


def _normalized_size(owner: str, normalized_shape, hidden_size) -> int:
    """The feature size from Transformer Engine's normalized_shape (an int or a 1-element
    sequence) or its older hidden_size; they must agree when both are given."""
    if normalized_shape is not None and not isinstance(normalized_shape, int):
        shape = tuple(normalized_shape) if isinstance(normalized_shape, (list, tuple,
                                                                         torch.Size)) else None
        if shape is None or len(shape) != 1:
            raise ValueError(f"{owner}: normalized_shape must be an int or a 1-element "
                             f"sequence (normalisation over the last dimension only), got "
                             f"{normalized_shape!r}")
        normalized_shape = shape[0]
    if normalized_shape is not None and hidden_size is not None and \
            normalized_shape != hidden_size:
        raise ValueError(f"{owner}: normalized_shape ({normalized_shape}) and hidden_size "
                         f"({hidden_size}) name the same thing and must agree; pass one")
    size = normalized_shape if normalized_shape is not None else hidden_size
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"{owner}: normalized_shape / hidden_size must be a positive integer, "
                         f"got {size!r}")
    return size


class _Norm(torch.nn.Module):
    normalization = "LayerNorm"
    __prepare_scriptable__ = refuse_torchscript  # (torch.jit.script: a clear error)
    # Set by MultiheadAttention on its query/key norms under tensor parallelism (the
    # te_tensor_parallel.TensorParallelOptions of its ranks): each rank normalises its own
    # heads, so the weights' gradients are summed over the ranks in backward (every rank then
    # holds the whole gradient, as a norm over all the heads computes it).
    _grad_sum_over = None

    def __init__(self, normalized_shape=None, eps: float = 1e-5, sequence_parallel=None,
                 params_dtype: Optional[torch.dtype] = None, zero_centered_gamma: bool = False,
                 hidden_size: Optional[int] = None, *, device=None,
                 dtype: Optional[torch.dtype] = None, sm_margin=0):
        super().__init__()
        owner = type(self).__name__
        # sm_margin: SMs Transformer Engine's CUDA kernels leave free for communication; a
        # tuning knob with no effect on the result, accepted and unused.
        if not (isinstance(sm_margin, (int, dict)) and not isinstance(sm_margin, bool)):
            raise TypeError(f"{owner}: sm_margin must be an int or a dict of ints, got "
                            f"{type(sm_margin).__name__}")
        hidden_size = _normalized_size(owner, normalized_shape, hidden_size)
        if dtype is not None and params_dtype is not None and dtype != params_dtype:
            raise ValueError(f"{owner}: 'dtype' ({dtype}) and 'params_dtype' "
                             f"({params_dtype}) name the same thing and must agree; pass one")
        if sequence_parallel not in (None, False, True):
            raise TypeError(f"{owner}: sequence_parallel must be True or False, got "
                            f"{sequence_parallel!r}")
        # As Transformer Engine: no communication; the weights are marked so that
        # Megatron-LM sums their gradients over the tensor-parallel ranks (each rank's covers
        # its part of the sequence).
        self.sequence_parallel = bool(sequence_parallel)
        self.hidden_size = hidden_size
        self.eps = check_eps(eps)
        self.zero_centered_gamma = check_zero_centered_gamma(zero_centered_gamma)
        _norm_parameters(self, hidden_size, self.normalization == "LayerNorm",
                         zero_centered_gamma, device, dtype or params_dtype)
        for name in ("weight", "bias"):
            param_marks.mark(self, name, sequence_parallel=self.sequence_parallel)

    def __setattr__(self, name, value):
        # Set after construction (norm.eps = ...): checked as the constructor checks them (a
        # negative or NaN eps gave NaN outputs).
        if name == "eps":
            value = check_eps(value)
        elif name == "zero_centered_gamma":
            value = check_zero_centered_gamma(value)
        super().__setattr__(name, value)

    def reset_parameters(self, defer_init: Optional[bool] = False) -> None:
        if defer_init:  # (Transformer Engine's: the caller initialises later)
            return
        reset_norm_parameters(self.weight, self.bias, self.zero_centered_gamma)
        param_marks.mark_again(self)  # (Parameters made again by to_empty())

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        param_marks.mark_again(self)  # (a move that made new Parameters)
        return self

    def _load_from_state_dict(self, state_dict, prefix, *args):
        from . import te_checkpoint
        super()._load_from_state_dict(state_dict, prefix, *args)
        te_checkpoint.drop_extra_state(state_dict, prefix, args[3], type(self).__name__)

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        if inp.shape[-1:] != (self.hidden_size,):
            raise ValueError(f"{type(self).__name__}: input must have shape "
                             f"[..., {self.hidden_size}], got {tuple(inp.shape)}")
        weight, bias = self.weight, self.bias
        if self._grad_sum_over is not None and torch.is_grad_enabled():
            from .te_tensor_parallel import sum_gradient_over
            group = self._grad_sum_over.group
            if group is None:  # (never the whole world by default)
                raise RuntimeError(f"{type(self).__name__}: a query/key norm of a "
                                   "MultiheadAttention built with tp_size and no tp_group: call "
                                   "set_tensor_parallel_group(tp_group) on the "
                                   "MultiheadAttention (or its TransformerLayer)")
            weight = sum_gradient_over(weight, group)
            bias = None if bias is None else sum_gradient_over(bias, group)
        if inp.is_floating_point():
            # Transformer Engine's dtype: the autocast dtype under torch.autocast, else the
            # weight's; the input and the parameters are cast to it first (float32 math after).
            dtype = autocast_dtype(inp.device.type) or weight.dtype
            # (contiguous, as Transformer Engine's: torch's RMSNorm reduces a strided input
            # in another order, and its result differed in the last bit)
            inp, weight = inp.to(dtype).contiguous(), weight.to(dtype)
            bias = None if bias is None else bias.to(dtype)
        return norm_hp(inp, self.normalization, weight, bias, self.eps, self.zero_centered_gamma)

    def extra_repr(self) -> str:
        return (f"{self.hidden_size}, eps={self.eps}, "
                f"zero_centered_gamma={self.zero_centered_gamma}")


class LayerNorm(_Norm):
    """Transformer Engine's LayerNorm: parameters weight (gamma, or gamma - 1 when
    zero_centered_gamma) and bias; float32 math, output in the weight's dtype (the autocast
    dtype under torch.autocast)."""

    normalization = "LayerNorm"


class RMSNorm(_Norm):
    """Transformer Engine's RMSNorm: parameter weight (gamma, or gamma - 1 when
    zero_centered_gamma); float32 math, output in the weight's dtype (the autocast dtype under
    torch.autocast)."""

    normalization = "RMSNorm"
