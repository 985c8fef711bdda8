"""Typed wrappers and fake kernels of the fused norm / activation / dbias operators.

The operators (csrc/cpu/norm.cpp, activation.cpp; csrc/cuda/kernels/norm.cu, activation.cu)
take a 2-D x [M, N] (float32, bfloat16 or float16, any strides) and do all their math in float32:

* High-precision results (y, y_hp, dx, activation outputs) have x's dtype; mean and rstd are
  float32 [M]; the norms' dweight / dbias have weight's dtype.
* FP8 results are the saturating cast (the contract of ``cast_to_fp8``) of the **float32**
  result times ``scale``; the result is never rounded to x's dtype first. ``amax`` (1-element
  float32, optional) becomes max(amax, max |result|) over the M real rows, NaN propagating,
  in the same pass. A NaN result is a NaN in every output; its sign bit is not specified (the
  float16 -> float32 conversion of a negative NaN keeps its sign on some paths of torch's CPU
  kernels and not on others, and on the GPU likewise).
* FP8 results have M_pad = M rounded up to a multiple of ``row_multiple`` rows; the extra rows
  are zero bytes and do not enter amax. With ``with_transpose`` the contiguous transpose
  [N, M_pad] comes too, otherwise an empty tensor of shape [0] of the FP8 dtype; outputs that
  were not asked for (``return_hp``, ``with_dbias``) are empty [0] tensors of x's dtype.
* Activations: "gelu" (the tanh approximation of ``F.gelu(approximate="tanh")``, computed as
  ``x * sigmoid(2u)``, which is 0.5 x (1 + tanh(u)) without its cancellation for x below about
  -4, so that CPU and GPU give the same FP8 codes there), "relu", "silu", "qgelu"
  (``x * sigmoid(1.702 x)``), "srelu" (``relu(x) ** 2``), and the gated "swiglu", "geglu",
  "reglu", "qgeglu", "sreglu", "glu" (sigmoid gate), which take x [M, 2N] and return
  ``act(x[:, :N]) * x[:, N:]``: the first half is activated, the second half is the linear gate
  (Transformer Engine's convention; ``torch.nn.functional.glu`` gates the other way round).

Pure-torch references of each operator are in transformer_fp8/reference.py.
"""
from __future__ import annotations

from typing import Optional

import torch

from .. import _C  # noqa: F401  (loads the library and registers the operators)
from .checks import check_wrapper_arguments, register_fake

_ops = torch.ops.transformer_fp8

ACTIVATIONS = ("gelu", "relu", "silu", "qgelu", "srelu", "swiglu", "geglu", "reglu", "qgeglu",
               "sreglu", "glu")
GATED_ACTIVATIONS = ("swiglu", "geglu", "reglu", "qgeglu", "sreglu", "glu")

Tensor = torch.Tensor


def layernorm_fwd(x: Tensor, weight: Tensor, bias: Optional[Tensor], eps: float,
                  zero_centered_gamma: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """LayerNorm over the last dimension: (y, mean, rstd).

    mean and the biased variance per row in float32, rstd = 1 / sqrt(var + eps),
    y = (x - mean) * rstd * gamma + bias with gamma = weight (+ 1 if zero_centered_gamma).
    """
    return _ops.layernorm_fwd(x, weight, bias, float(eps), zero_centered_gamma)


def _check_scalars(op: str, fp8_dtype=torch.float8_e4m3fn, activation: str = "gelu",
                   row_multiple: int = 1) -> None:
    """The dispatcher would read an int fp8_dtype as some dtype (24: e4m3) and answer a wrong
    activation or row_multiple type with a pybind error naming no argument: checked here (one
    cheap test on the common path)."""
    if type(fp8_dtype) is torch.dtype and type(activation) is str and \
            type(row_multiple) is int and -2**63 <= row_multiple < 2**63:
        return
    if not isinstance(activation, str):
        raise TypeError(f"{op}: argument 'activation' must be a string, got {activation!r}")
    check_wrapper_arguments(op, dtypes={"fp8_dtype": fp8_dtype},
                            ints={"row_multiple": row_multiple})


def _amax_slot(op: str, amax: Optional[Tensor]) -> Optional[Tensor]:
    """amax as the kernels take it, checked by check_wrapper_arguments where a cheap test fails
    (as the cast wrappers do): a lazily negated view must be refused here, since the
    dispatcher's fallback for such views fails on a mutated argument before the kernel's own
    check runs. (Eager only: torch.compile cannot trace is_neg.)"""
    if amax is not None and (not isinstance(amax, Tensor) or (
            not torch.compiler.is_compiling() and (amax.is_neg() or amax.is_conj()))):
        check_wrapper_arguments(op, tensors={"amax": amax})
    return amax


def layernorm_fwd_fp8(x: Tensor, weight: Tensor, bias: Optional[Tensor], eps: float,
                      zero_centered_gamma: bool, scale: Tensor, fp8_dtype: torch.dtype,
                      amax: Optional[Tensor] = None, with_transpose: bool = False,
                      return_hp: bool = False, row_multiple: int = 1
                      ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """LayerNorm emitting FP8: (y_fp8 [M_pad, N], y_t_fp8 [N, M_pad] or [0], y_hp [M, N] or [0],
    mean [M], rstd [M]). y_fp8 is the cast of the float32 y (see the module docstring)."""
    _check_scalars("layernorm_fwd_fp8", fp8_dtype, row_multiple=row_multiple)
    return _ops.layernorm_fwd_fp8(x, weight, bias, float(eps), zero_centered_gamma, scale,
                                  fp8_dtype, _amax_slot("layernorm_fwd_fp8", amax),
                                  with_transpose, return_hp, row_multiple)


def layernorm_bwd(dy: Tensor, x: Tensor, mean: Tensor, rstd: Tensor, weight: Tensor,
                  zero_centered_gamma: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """LayerNorm backward from the forward's mean and rstd: (dx in x's dtype, dweight and dbias
    in weight's dtype). dy has x's shape and dtype."""
    return _ops.layernorm_bwd(dy, x, mean, rstd, weight, zero_centered_gamma)


def rmsnorm_fwd(x: Tensor, weight: Tensor, eps: float,
                zero_centered_gamma: bool = False) -> tuple[Tensor, Tensor]:
    """RMSNorm over the last dimension: (y, rstd), rstd = 1 / sqrt(mean(x^2) + eps) in float32,
    y = x * rstd * gamma."""
    return _ops.rmsnorm_fwd(x, weight, float(eps), zero_centered_gamma)


def rmsnorm_fwd_fp8(x: Tensor, weight: Tensor, eps: float, zero_centered_gamma: bool,
                    scale: Tensor, fp8_dtype: torch.dtype, amax: Optional[Tensor] = None,
                    with_transpose: bool = False, return_hp: bool = False,
                    row_multiple: int = 1) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """RMSNorm emitting FP8: (y_fp8, y_t_fp8, y_hp, rstd), as layernorm_fwd_fp8."""
    _check_scalars("rmsnorm_fwd_fp8", fp8_dtype, row_multiple=row_multiple)
    return _ops.rmsnorm_fwd_fp8(x, weight, float(eps), zero_centered_gamma, scale, fp8_dtype,
                                _amax_slot("rmsnorm_fwd_fp8", amax), with_transpose, return_hp,
                                row_multiple)


def rmsnorm_bwd(dy: Tensor, x: Tensor, rstd: Tensor, weight: Tensor,
                zero_centered_gamma: bool = False) -> tuple[Tensor, Tensor]:
    """RMSNorm backward from the forward's rstd: (dx, dweight)."""
    return _ops.rmsnorm_bwd(dy, x, rstd, weight, zero_centered_gamma)


def activation_fwd(x: Tensor, activation: str) -> Tensor:
    """The activation in float32, returned in x's dtype ([M, N] for a gated x [M, 2N])."""
    _check_scalars("activation_fwd", activation=activation)
    return _ops.activation_fwd(x, activation)


def activation_fwd_fp8(x: Tensor, activation: str, scale: Tensor, fp8_dtype: torch.dtype,
                       amax: Optional[Tensor] = None, with_transpose: bool = False,
                       row_multiple: int = 1) -> tuple[Tensor, Tensor]:
    """The activation emitting FP8: (y_fp8 [M_pad, N], y_t_fp8 [N, M_pad] or [0])."""
    _check_scalars("activation_fwd_fp8", fp8_dtype, activation, row_multiple)
    return _ops.activation_fwd_fp8(x, activation, scale, fp8_dtype,
                                   _amax_slot("activation_fwd_fp8", amax), with_transpose,
                                   row_multiple)


def activation_bwd(dy: Tensor, x: Tensor, activation: str) -> Tensor:
    """d(loss)/dx of the activation (x's shape and dtype); dy has the output's shape and x's
    dtype."""
    _check_scalars("activation_bwd", activation=activation)
    return _ops.activation_bwd(dy, x, activation)


def activation_bwd_fp8(dy: Tensor, x: Tensor, activation: str, scale: Tensor,
                       fp8_dtype: torch.dtype, amax: Optional[Tensor] = None,
                       with_transpose: bool = False, with_dbias: bool = False,
                       row_multiple: int = 1) -> tuple[Tensor, Tensor, Tensor]:
    """The activation backward emitting FP8: (dx_fp8 [M_pad, N_in], dx_t_fp8 [N_in, M_pad] or
    [0], dbias [N_in] or [0]). dbias = column sums of the float32 dx over the M real rows,
    accumulated in float32, returned in x's dtype (the bias gradient of the Linear before the
    activation)."""
    _check_scalars("activation_bwd_fp8", fp8_dtype, activation, row_multiple)
    return _ops.activation_bwd_fp8(dy, x, activation, scale, fp8_dtype,
                                   _amax_slot("activation_bwd_fp8", amax), with_transpose,
                                   with_dbias, row_multiple)


def cast_transpose_dbias(x: Tensor, scale: Tensor, fp8_dtype: torch.dtype,
                         amax: Optional[Tensor] = None,
                         row_multiple: int = 1) -> tuple[Tensor, Tensor, Tensor]:
    """cast_transpose_to_fp8 with row padding plus dbias = x.sum(0) (float32 accumulation, in
    x's dtype), from one read of x: for the grad_output of a Linear with a bias."""
    _check_scalars("cast_transpose_dbias", fp8_dtype, row_multiple=row_multiple)
    return _ops.cast_transpose_dbias(x, scale, fp8_dtype, _amax_slot("cast_transpose_dbias", amax),
                                     row_multiple)


# Fake kernels: shapes and dtypes only, for torch.compile and meta tensors.

def _padded(rows, row_multiple: int):
    torch._check(row_multiple >= 1, lambda: f"row_multiple must be >= 1, got {row_multiple}")
    # (The form pad_rows and the output's slice use: with a dynamic row count, torch.export
    # and torch.compile(dynamic=True) prove rows <= rows_pad from it, not from a ceiling.)
    return rows + (-rows) % row_multiple


def _fp8_outputs(x: Tensor, rows, cols, fp8_dtype, with_transpose: bool, row_multiple: int):
    rows_pad = _padded(rows, row_multiple)
    out = x.new_empty((rows_pad, cols), dtype=fp8_dtype)
    out_t = (x.new_empty((cols, rows_pad), dtype=fp8_dtype) if with_transpose
             else x.new_empty((0,), dtype=fp8_dtype))
    return out, out_t


def _check_2d(x: Tensor, op: str):
    torch._check(x.dim() == 2, lambda: f"{op} needs a 2-D x [M, N], got {x.dim()}-D")


def _activation_out_cols(x: Tensor, activation: str, op: str):
    _check_2d(x, op)
    torch._check(activation in ACTIVATIONS,
                 lambda: f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    return x.shape[1] // 2 if activation in GATED_ACTIVATIONS else x.shape[1]


def _stats(x: Tensor):
    return x.new_empty((x.shape[0],), dtype=torch.float32)


@register_fake("transformer_fp8::layernorm_fwd")
def _layernorm_fwd_fake(x, weight, bias, eps, zero_centered_gamma):
    _check_2d(x, "layernorm_fwd")
    return x.new_empty(x.shape), _stats(x), _stats(x)


@register_fake("transformer_fp8::layernorm_fwd_fp8")
def _layernorm_fwd_fp8_fake(x, weight, bias, eps, zero_centered_gamma, scale, fp8_dtype, amax,
                            with_transpose, return_hp, row_multiple):
    _check_2d(x, "layernorm_fwd_fp8")
    y_fp8, y_t_fp8 = _fp8_outputs(x, x.shape[0], x.shape[1], fp8_dtype, with_transpose,
                                  row_multiple)
    y_hp = x.new_empty(x.shape) if return_hp else x.new_empty((0,))
    return y_fp8, y_t_fp8, y_hp, _stats(x), _stats(x)


@register_fake("transformer_fp8::layernorm_bwd")
def _layernorm_bwd_fake(dy, x, mean, rstd, weight, zero_centered_gamma):
    _check_2d(x, "layernorm_bwd")
    return x.new_empty(x.shape), weight.new_empty(weight.shape), weight.new_empty(weight.shape)


@register_fake("transformer_fp8::rmsnorm_fwd")
def _rmsnorm_fwd_fake(x, weight, eps, zero_centered_gamma):
    _check_2d(x, "rmsnorm_fwd")
    return x.new_empty(x.shape), _stats(x)


@register_fake("transformer_fp8::rmsnorm_fwd_fp8")
def _rmsnorm_fwd_fp8_fake(x, weight, eps, zero_centered_gamma, scale, fp8_dtype, amax,
                          with_transpose, return_hp, row_multiple):
    _check_2d(x, "rmsnorm_fwd_fp8")
    y_fp8, y_t_fp8 = _fp8_outputs(x, x.shape[0], x.shape[1], fp8_dtype, with_transpose,
                                  row_multiple)
    y_hp = x.new_empty(x.shape) if return_hp else x.new_empty((0,))
    return y_fp8, y_t_fp8, y_hp, _stats(x)


@register_fake("transformer_fp8::rmsnorm_bwd")
def _rmsnorm_bwd_fake(dy, x, rstd, weight, zero_centered_gamma):
    _check_2d(x, "rmsnorm_bwd")
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


@register_fake("transformer_fp8::activation_fwd")
def _activation_fwd_fake(x, activation):
    return x.new_empty((x.shape[0], _activation_out_cols(x, activation, "activation_fwd")))


@register_fake("transformer_fp8::activation_fwd_fp8")
def _activation_fwd_fp8_fake(x, activation, scale, fp8_dtype, amax, with_transpose,
                             row_multiple):
    cols = _activation_out_cols(x, activation, "activation_fwd_fp8")
    return _fp8_outputs(x, x.shape[0], cols, fp8_dtype, with_transpose, row_multiple)


@register_fake("transformer_fp8::activation_bwd")
def _activation_bwd_fake(dy, x, activation):
    _activation_out_cols(x, activation, "activation_bwd")
    return x.new_empty(x.shape)


@register_fake("transformer_fp8::activation_bwd_fp8")
def _activation_bwd_fp8_fake(dy, x, activation, scale, fp8_dtype, amax, with_transpose,
                             with_dbias, row_multiple):
    _activation_out_cols(x, activation, "activation_bwd_fp8")
    dx_fp8, dx_t_fp8 = _fp8_outputs(x, x.shape[0], x.shape[1], fp8_dtype, with_transpose,
                                    row_multiple)
    dbias = x.new_empty((x.shape[1],)) if with_dbias else x.new_empty((0,))
    return dx_fp8, dx_t_fp8, dbias


@register_fake("transformer_fp8::cast_transpose_dbias")
def _cast_transpose_dbias_fake(x, scale, fp8_dtype, amax, row_multiple):
    _check_2d(x, "cast_transpose_dbias")
    x_fp8, x_t_fp8 = _fp8_outputs(x, x.shape[0], x.shape[1], fp8_dtype, True, row_multiple)
    return x_fp8, x_t_fp8, x.new_empty((x.shape[1],))
