"""Pure-torch references of every operator: the numeric contract, executable.

Tests compare the C++/CUDA kernels with these bit for bit (casts, scaling) or by SQNR (GEMM).
They are written for clarity, not speed. update_delayed_scaling_reference (with
check_delayed_scaling_lists) also serves recipes with callable algorithms, which run in Python.
"""
from __future__ import annotations

from typing import Callable, Optional, Union

import torch

FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
# The delayed-scaling update's pure-torch form is also the operator's path for callable
# recipes: one copy, in the package (ops/update_callable.py).
from .ops.update_callable import (FLT_MAX, FLT_MIN, _checked_result,  # noqa: F401
                                  check_delayed_scaling_lists, delayed_scaling_result)
from .ops.update_callable import scale_from_amax as scale_from_amax_reference


def amax_reference(x: torch.Tensor) -> torch.Tensor:
    """max |x| in float32, NaN propagating, 0 for an empty x."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    return x.float().abs().amax()


def cast_to_fp8_reference(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype,
                          amax: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Clamp first: torch's float->fp8 conversion does not saturate (overflow becomes NaN for
    E4M3, inf for E5M2)."""
    fp8_max = FP8_MAX[fp8_dtype]
    out = (x.float() * scale.reshape(())).clamp(-fp8_max, fp8_max).to(fp8_dtype)
    if amax is not None and x.numel() > 0:
        amax.copy_(torch.maximum(amax, amax_reference(x).reshape(amax.shape)))
    return out


def cast_from_fp8_reference(x_fp8: torch.Tensor, scale_inv: torch.Tensor,
                            dtype: torch.dtype) -> torch.Tensor:
    return (x_fp8.float() * scale_inv.reshape(())).to(dtype)


def compute_scale_from_amax_reference(amax: torch.Tensor, fp8_max: float,
                                      margin: int = 0) -> torch.Tensor:
    usable = torch.isfinite(amax) & (amax > 0)
    return torch.where(usable, scale_from_amax_reference(amax, fp8_max, margin),
                       torch.ones_like(amax))


def update_delayed_scaling_reference(
        history: torch.Tensor, scale: torch.Tensor, scale_inv: torch.Tensor, fp8_max: float,
        margin: int = 0,
        amax_compute_algo: Union[str, Callable[[torch.Tensor], torch.Tensor]] = "max",
        scaling_factor_compute_algo: Optional[Callable] = None, recipe=None) -> None:
    """One history [L, n] with its scale [n] and scale_inv [n], in place (see ops/__init__.py)."""
    new_state = delayed_scaling_result(history, scale, scale_inv, fp8_max, margin,
                                       amax_compute_algo, scaling_factor_compute_algo, recipe)
    for old, new in zip((history, scale, scale_inv), new_state):
        old.copy_(new)


def fp8_gemm_reference(a: torch.Tensor, a_scale_inv: torch.Tensor, b: torch.Tensor,
                       b_scale_inv: torch.Tensor, out_dtype: torch.dtype,
                       bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Dequantise to float64, multiply, add the bias: the exact product, rounded to out_dtype."""
    out = (a.double() * a_scale_inv.double().reshape(())) @ \
          (b.double() * b_scale_inv.double().reshape(())).T
    if bias is not None:
        out = out + bias.double()
    return out.to(out_dtype)


# ----------------------------------------------------------------------------- fused operators
# References of transformer_fp8/ops/fused.py. All math in float32, in the order the CPU kernels
# (csrc/cpu/norm.cpp, activation.cpp) use, so that the CPU results are bit-identical. The norms
# accept the kernel's own mean / rstd, which makes the elementwise part exactly determined.

def fp8_rows_reference(value: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype,
                       amax: Optional[torch.Tensor] = None, with_transpose: bool = False,
                       row_multiple: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """The FP8 outputs of a fused operator from its float32 result [M, N]: the cast padded with
    zero rows to a multiple of row_multiple, and its transpose (or an empty [0])."""
    rows, cols = value.shape
    rows_pad = -(-rows // row_multiple) * row_multiple
    out = torch.zeros((rows_pad, cols), dtype=fp8_dtype, device=value.device)
    out[:rows] = cast_to_fp8_reference(value, scale, fp8_dtype, amax)
    out_t = out.t().contiguous() if with_transpose else out.new_empty((0,))
    return out, out_t


def _gamma(weight: torch.Tensor, zero_centered_gamma: bool) -> torch.Tensor:
    gamma = weight.float()
    return gamma + 1.0 if zero_centered_gamma else gamma


def layernorm_reference(x, weight, bias, eps, zero_centered_gamma=False, mean=None, rstd=None):
    """(y in float32, mean, rstd). mean / rstd are computed unless given."""
    xf = x.float().contiguous()
    if mean is None or rstd is None:
        var, mean = torch.var_mean(xf, dim=1, correction=0)
        rstd = torch.rsqrt(var + eps)
    y = (xf - mean[:, None]) * rstd[:, None] * _gamma(weight, zero_centered_gamma)
    if bias is not None:
        y = y + bias.float()
    return y, mean, rstd


def rmsnorm_reference(x, weight, eps, zero_centered_gamma=False, rstd=None):
    """(y in float32, rstd). rstd is computed unless given."""
    xf = x.float().contiguous()
    if rstd is None:
        rstd = torch.rsqrt((xf * xf).mean(dim=1) + eps)
    return xf * rstd[:, None] * _gamma(weight, zero_centered_gamma), rstd


def layernorm_fwd_fp8_reference(x, weight, bias, eps, zero_centered_gamma, scale, fp8_dtype,
                                amax=None, with_transpose=False, return_hp=False,
                                row_multiple=1, mean=None, rstd=None):
    y, mean, rstd = layernorm_reference(x, weight, bias, eps, zero_centered_gamma, mean, rstd)
    y_fp8, y_t_fp8 = fp8_rows_reference(y, scale, fp8_dtype, amax, with_transpose, row_multiple)
    y_hp = y.to(x.dtype) if return_hp else x.new_empty((0,))
    return y_fp8, y_t_fp8, y_hp, mean, rstd


def rmsnorm_fwd_fp8_reference(x, weight, eps, zero_centered_gamma, scale, fp8_dtype, amax=None,
                              with_transpose=False, return_hp=False, row_multiple=1, rstd=None):
    y, rstd = rmsnorm_reference(x, weight, eps, zero_centered_gamma, rstd)
    y_fp8, y_t_fp8 = fp8_rows_reference(y, scale, fp8_dtype, amax, with_transpose, row_multiple)
    y_hp = y.to(x.dtype) if return_hp else x.new_empty((0,))
    return y_fp8, y_t_fp8, y_hp, rstd


def layernorm_bwd_reference(dy, x, mean, rstd, weight, zero_centered_gamma=False):
    """(dx, dweight, dbias): g = dy * gamma, xhat = (x - mean) * rstd,
    dx = (g - (xhat * mean(g * xhat) + mean(g))) * rstd per row."""
    xhat = (x.float().contiguous() - mean[:, None]) * rstd[:, None]
    dyf = dy.float().contiguous()
    g = dyf * _gamma(weight, zero_centered_gamma)
    c1 = (g * xhat).mean(dim=1, keepdim=True)
    c2 = g.mean(dim=1, keepdim=True)
    dx = (g - (xhat * c1 + c2)) * rstd[:, None]
    return (dx.to(x.dtype), (dyf * xhat).sum(0).to(weight.dtype),
            dyf.sum(0).to(weight.dtype))


def rmsnorm_bwd_reference(dy, x, rstd, weight, zero_centered_gamma=False):
    """(dx, dweight): xhat = x * rstd, dx = (g - xhat * mean(g * xhat)) * rstd."""
    xhat = x.float().contiguous() * rstd[:, None]
    dyf = dy.float().contiguous()
    g = dyf * _gamma(weight, zero_centered_gamma)
    c1 = (g * xhat).mean(dim=1, keepdim=True)
    dx = (g - xhat * c1) * rstd[:, None]
    return dx.to(x.dtype), (dyf * xhat).sum(0).to(weight.dtype)


_GATED_BASE = {"swiglu": "silu", "geglu": "gelu", "reglu": "relu", "qgeglu": "qgelu",
               "sreglu": "srelu", "glu": "sigmoid"}
_QGELU_ALPHA = 1.702  # qgelu(a) = a sigmoid(1.702 a), Transformer Engine's "quick gelu"


# gelu, tanh approximation, as a * sigmoid(2u), u = sqrt(2/pi) (a + 0.044715 a^3): the function of
# F.gelu(approximate="tanh") without its cancellation in 1 + tanh(u) for a below about -4 (where
# one ulp of tanh changed E5M2 codes by up to 23 between devices). float32 constants and the
# operation order of the kernels (csrc/cpu/activation.cpp, csrc/cuda/kernels/fused_math.cuh).
_GELU_TWO_BETA, _GELU_KAPPA, _GELU_THREE_KAPPA = 1.5957691216057308, 0.044715, 0.134145


def _gelu_two_u(a: torch.Tensor) -> torch.Tensor:
    return (a + (a * a) * a * _GELU_KAPPA) * _GELU_TWO_BETA


def _pointwise(a: torch.Tensor, name: str) -> torch.Tensor:
    if name == "gelu":
        return a * torch.sigmoid(_gelu_two_u(a))
    if name == "relu":
        return torch.relu(a)
    if name == "silu":
        return torch.nn.functional.silu(a)
    if name == "qgelu":
        return a * torch.sigmoid(a * _QGELU_ALPHA)
    if name == "srelu":
        r = torch.relu(a)
        return r * r
    if name == "sigmoid":
        return torch.sigmoid(a)
    raise ValueError(f"unknown activation {name!r}")


def _pointwise_grad(d: torch.Tensor, a: torch.Tensor, name: str) -> torch.Tensor:
    """d * act'(a), as torch's autograd computes it (gelu: of the formula above, s + a s (1 - s)
    2u' with s = sigmoid(2u) and 1 - s as sigmoid(-2u); qgelu likewise with 1.702 a for 2u;
    srelu: 2a where a > 0 or a is NaN, else 0, as relu's)."""
    if name == "gelu":
        two_u = _gelu_two_u(a)
        s, one_minus_s = torch.sigmoid(two_u), torch.sigmoid(-two_u)
        two_u_prime = ((a * a) * _GELU_THREE_KAPPA + 1.0) * _GELU_TWO_BETA
        return d * (s + a * s * one_minus_s * two_u_prime)
    if name == "relu":
        return torch.ops.aten.threshold_backward(d, a, 0)
    if name == "silu":
        return torch.ops.aten.silu_backward(d, a)
    if name == "qgelu":
        s, one_minus_s = torch.sigmoid(a * _QGELU_ALPHA), torch.sigmoid(a * -_QGELU_ALPHA)
        return d * (s + a * s * one_minus_s * _QGELU_ALPHA)
    if name == "srelu":
        return torch.ops.aten.threshold_backward(d * (a + a), a, 0)
    if name == "sigmoid":
        return d * (torch.sigmoid(a) * torch.sigmoid(-a))
    raise ValueError(f"unknown activation {name!r}")


def activation_reference(x: torch.Tensor, activation: str) -> torch.Tensor:
    """The activation in float32; gated ones: act(x[:, :N]) * x[:, N:] (first half activated)."""
    xf = x.float().contiguous()
    if activation not in _GATED_BASE:
        return _pointwise(xf, activation)
    a, b = xf.chunk(2, dim=1)
    return _pointwise(a, _GATED_BASE[activation]) * b


def activation_grad_reference(dy: torch.Tensor, x: torch.Tensor, activation: str) -> torch.Tensor:
    """d(loss)/dx in float32; gated: [(dy * b) * act'(a), dy * act(a)]."""
    xf, dyf = x.float().contiguous(), dy.float().contiguous()
    if activation not in _GATED_BASE:
        return _pointwise_grad(dyf, xf, activation)
    a, b = xf.chunk(2, dim=1)
    base = _GATED_BASE[activation]
    return torch.cat([_pointwise_grad(dyf * b, a, base), dyf * _pointwise(a, base)], dim=1)


def activation_fwd_fp8_reference(x, activation, scale, fp8_dtype, amax=None,
                                 with_transpose=False, row_multiple=1):
    return fp8_rows_reference(activation_reference(x, activation), scale, fp8_dtype, amax,
                              with_transpose, row_multiple)


def activation_bwd_fp8_reference(dy, x, activation, scale, fp8_dtype, amax=None,
                                 with_transpose=False, with_dbias=False, row_multiple=1):
    dx = activation_grad_reference(dy, x, activation)
    dx_fp8, dx_t_fp8 = fp8_rows_reference(dx, scale, fp8_dtype, amax, with_transpose,
                                          row_multiple)
    dbias = dx.sum(0).to(x.dtype) if with_dbias else x.new_empty((0,))
    return dx_fp8, dx_t_fp8, dbias


def cast_transpose_dbias_reference(x, scale, fp8_dtype, amax=None, row_multiple=1):
    x_fp8, x_t_fp8 = fp8_rows_reference(x, scale, fp8_dtype, amax, True, row_multiple)
    return x_fp8, x_t_fp8, x.float().contiguous().sum(0).to(x.dtype)

# ---------------------------------------------------------------------------- block scaling

def block_scale_reference(amax: torch.Tensor, fp8_max: float, power_2_scale: bool) -> torch.Tensor:
    """Per-block scale (see ops/blockwise.py): fp8_max / amax in fp64, rounded once to fp32
    (overflow to FLT_MAX); with power_2_scale the fp64 quotient rounded down to a power of two
    (2**127 at most); 1.0 where amax is 0 or not finite."""
    usable = torch.isfinite(amax) & (amax > 0)
    q = fp8_max / torch.where(usable, amax, torch.ones_like(amax)).double()
    if power_2_scale:
        _, exponent = torch.frexp(q)  # q = m * 2**exponent, m in [0.5, 1)
        scale = torch.ldexp(torch.ones_like(q), (exponent - 1).clamp(max=127)).float()
    else:
        scale = q.float()
        scale = torch.where(torch.isinf(scale), torch.full_like(scale, FLT_MAX), scale)
    return torch.where(usable, scale, torch.ones_like(scale))


def _quantize_blocks_reference(xf: torch.Tensor, block_rows: int, block_cols: int,
                               fp8_dtype: torch.dtype, power_2_scale: bool, mode: str):
    from .ops.blockwise import scale_shape_and_strides

    rows, cols = xf.shape
    fp8_max = FP8_MAX[fp8_dtype]
    nbr, nbc = -(-rows // block_rows), -(-cols // block_cols)
    if mode == "rowwise":
        nbc = 1  # one scale per row, also for a row of no elements (amax 0, scale 1)
    # Zero padding to whole blocks changes no amax (|x| >= 0; a NaN still wins).
    padded = torch.nn.functional.pad(xf, (0, nbc * block_cols - cols, 0, nbr * block_rows - rows))
    blocks = padded.reshape(nbr, block_rows, nbc, block_cols)
    amax = blocks.abs().amax(dim=(1, 3))
    scale = block_scale_reference(amax, fp8_max, power_2_scale)
    scaled = blocks * scale[:, None, :, None]
    x_fp8 = scaled.clamp(-fp8_max, fp8_max).to(fp8_dtype).reshape(padded.shape)[:rows, :cols]
    shape, strides = scale_shape_and_strides(mode, rows, cols)
    # Storage of the padded layout: whole columns (1-D blocks) or whole rows (128x128) of it.
    storage = torch.zeros(shape[1] * strides[1] if strides[0] == 1 else shape[0] * strides[0],
                          dtype=torch.float32)
    scale_inv = storage.as_strided(shape, strides)
    scale_inv.copy_(1.0 / scale)
    return x_fp8.clone(memory_format=torch.contiguous_format), scale_inv


def quantize_blockwise_reference(x: torch.Tensor, block_rows: int, block_cols: int,
                                 fp8_dtype: torch.dtype, power_2_scale: bool = True,
                                 with_transpose: bool = False):
    """(x_fp8, scale_inv, x_t_fp8, scale_inv_t) as quantize_blockwise computes them (CPU)."""
    from .ops.blockwise import block_mode

    xf = x.detach().cpu().float()
    rows, cols = xf.shape
    mode = block_mode(block_rows, block_cols, cols)
    if mode == "rowwise":
        block_cols = max(cols, 1)
    x_fp8, scale_inv = _quantize_blocks_reference(xf, block_rows, block_cols, fp8_dtype,
                                                  power_2_scale, mode)
    if not with_transpose:
        return (x_fp8, scale_inv, torch.empty(0, dtype=fp8_dtype),
                torch.empty(0, dtype=torch.float32))
    t_cols = max(rows, 1) if mode == "rowwise" else block_cols
    x_t_fp8, scale_inv_t = _quantize_blocks_reference(xf.t(), block_rows, t_cols, fp8_dtype,
                                                      power_2_scale, mode)
    return x_fp8, scale_inv, x_t_fp8, scale_inv_t


def dequantize_blockwise_reference(x_fp8: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """x_fp8 [rows, K] times its blocks' scale_inv, in float64 (mode read from the scale shape,
    as fp8_gemm_blockwise reads it)."""
    rows, K = x_fp8.shape
    s = scale_inv.double().cpu()
    if s.shape == (rows, -(-K // 128)):
        full = s.repeat_interleave(128, dim=1)[:, :K]
    elif s.shape == (-(-rows // 128), -(-K // 128)):
        full = s.repeat_interleave(128, dim=0).repeat_interleave(128, dim=1)[:rows, :K]
    elif s.shape == (rows, 1):
        full = s
    else:
        raise ValueError(f"scale_inv of shape {tuple(s.shape)} fits no block mode of an operand "
                         f"of shape {(rows, K)}")
    return x_fp8.cpu().double() * full


def fp8_gemm_blockwise_reference(a: torch.Tensor, a_scale_inv: torch.Tensor, b: torch.Tensor,
                                 b_scale_inv: torch.Tensor, out_dtype: torch.dtype,
                                 bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Dequantise to float64, multiply, add the bias: the exact product, rounded to out_dtype."""
    out = dequantize_blockwise_reference(a, a_scale_inv) @ \
        dequantize_blockwise_reference(b, b_scale_inv).T
    if bias is not None:
        out = out + bias.cpu().double()
    return out.to(out_dtype)
