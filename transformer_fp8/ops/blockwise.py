"""Block-scaled FP8 operators: typed wrappers over ``torch.ops.transformer_fp8`` and their fakes.

Numerics (every kernel, CPU or CUDA, bit for bit; executable in reference.py):
  * x [rows, cols] is cut into blocks: 1x128 tiles along the rows, 128x128 blocks, or one block
    per row (row-wise, block 1 x cols). Edge blocks (dims not multiples of 128) are partial: they
    hold the elements that exist; nothing is padded in x_fp8, which has x's shape.
  * per block: amax = max |x| (NaN propagating); scale = fp8_max / amax computed in fp64 and
    rounded to fp32 once (overflow clamped to FLT_MAX); with power_2_scale the fp64 quotient is
    rounded DOWN to a power of two, so scale * amax <= fp8_max; scale = 1.0 when amax is 0 or not
    finite; x_fp8 = saturating cast of x * scale (clamp to +-fp8_max, round to nearest even, NaN
    stays NaN); the stored factor is scale_inv = 1 / scale (exact for powers of two), the
    dequantisation multiplier: x ~= x_fp8 * scale_inv.
  * scale_inv layout (what cuBLASLt's block-scaled GEMM reads), float32:
      1x128, row-wise: logical [rows, nb] (nb = ceil(cols / 128), or 1 for row-wise) with
                       strides (1, round_up(rows, 4)): rows contiguous per column block.
      128x128:         logical [ceil(rows / 128), nb] with strides (round_up(nb, 4), 1).
    The storage padding (to multiples of 4 elements, 16 bytes) is zero and never read.
  * with_transpose: x^T [cols, rows] is quantised from the high-precision values with its own
    blocks (a 1x128 tile of x^T is a 128x1 column block of x; 128x128 blocks give the transposed
    bytes and the transposed scales; row-wise x^T has one scale per column of x): the operands of
    the dgrad and wgrad GEMMs.

Nothing here reads a tensor value on the host.
"""
from __future__ import annotations

from typing import Optional

import torch

from .. import _C  # noqa: F401  (loads the library and registers the operators)
from .checks import check_wrapper_arguments, register_fake

_ops = torch.ops.transformer_fp8

BLOCK = 128
MODES = ("1x128", "128x128", "rowwise")


def quantize_blockwise(x: torch.Tensor, block_rows: int = 1, block_cols: int = BLOCK,
                       fp8_dtype: torch.dtype = torch.float8_e4m3fn, power_2_scale: bool = True,
                       with_transpose: bool = False):
    """(x_fp8, scale_inv, x_t_fp8, scale_inv_t) of a 2-D x (float32, bfloat16 or float16).

    block_rows x block_cols: 1 x 128, 128 x 128, or row-wise: 1 x -1 (or 1 x x.shape[1]; for a
    128-column x, 1 x 128 means 1x128 tiles, whose transposes differ from row-wise ones).
    Without with_transpose the last two are empty tensors. See the module docstring for the
    numerics.
    """
    if not (isinstance(x, torch.Tensor) and isinstance(fp8_dtype, torch.dtype)
            and type(block_rows) is int and type(block_cols) is int
            and -2**63 <= block_rows < 2**63 and -2**63 <= block_cols < 2**63):
        check_wrapper_arguments("quantize_blockwise", tensors={"x": x},
                                dtypes={"fp8_dtype": fp8_dtype},
                                ints={"block_rows": block_rows, "block_cols": block_cols})
    for name, flag in (("power_2_scale", power_2_scale), ("with_transpose", with_transpose)):
        if not isinstance(flag, bool):
            raise TypeError(f"quantize_blockwise: {name} must be True or False, got "
                            f"{type(flag).__name__}")
    return _ops.quantize_blockwise(x, block_rows, block_cols, fp8_dtype, power_2_scale,
                                   with_transpose)


def fp8_gemm_blockwise(a: torch.Tensor, a_scale_inv: torch.Tensor, b: torch.Tensor,
                       b_scale_inv: torch.Tensor, out_dtype: torch.dtype,
                       bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``out[M, N] = dequant(a [M, K]) @ dequant(b [N, K]).T (+ bias[N])``, rounded to out_dtype.

    The scale_inv shapes state the block modes ([M, ceil(K/128)]: 1x128; [ceil(M/128),
    ceil(K/128)]: 128x128; [M, 1] with K > 128: row-wise); any strides are accepted. Pairs:
    1x128 x 1x128, 1x128 x 128x128, 128x128 x 1x128, row-wise x row-wise (128x128 x 128x128 is
    not a GEMM cuBLASLt runs). CUDA: cuBLASLt with split accumulation (never fast accumulation),
    M, N and K multiples of 16. CPU: dequantise to float32 and multiply.
    """
    if not (type(out_dtype) is torch.dtype and (bias is None or isinstance(bias, torch.Tensor))):
        check_wrapper_arguments("fp8_gemm_blockwise", tensors={} if bias is None else
                                {"bias": bias}, dtypes={"out_dtype": out_dtype})
    return _ops.fp8_gemm_blockwise(a, a_scale_inv, b, b_scale_inv, out_dtype, bias)


def block_mode(block_rows: int, block_cols: int, cols) -> str:
    """The mode name of a (block_rows, block_cols) pair for an x with ``cols`` columns."""
    if block_rows == 1 and block_cols == -1:
        return "rowwise"
    if block_rows == 1 and block_cols == BLOCK:
        return "1x128"
    if block_rows == BLOCK and block_cols == BLOCK:
        return "128x128"
    if block_rows == 1 and block_cols == cols and cols > 0:
        return "rowwise"
    raise ValueError(f"block_rows x block_cols must be 1 x 128, 128 x 128 or row-wise: 1 x -1 "
                     f"(or 1 x cols, here 1 x {cols}), got {block_rows} x {block_cols}")


def scale_shape_and_strides(mode: str, rows, cols) -> tuple[tuple, tuple]:
    """Logical shape and strides of the scale_inv tensor of an operand [rows, cols]."""
    nb = (cols + BLOCK - 1) // BLOCK
    if mode == "128x128":
        return ((rows + BLOCK - 1) // BLOCK, nb), ((nb + 3) // 4 * 4, 1)
    return (rows, 1 if mode == "rowwise" else nb), (1, (rows + 3) // 4 * 4)


def _scale_fake(x, mode, rows, cols):
    shape, strides = scale_shape_and_strides(mode, rows, cols)
    return torch.empty_strided(shape, strides, dtype=torch.float32, device=x.device)


@register_fake("transformer_fp8::quantize_blockwise")
def _quantize_blockwise_fake(x, block_rows, block_cols, fp8_dtype, power_2_scale, with_transpose):
    torch._check(x.dim() == 2, lambda: f"quantize_blockwise needs a 2-D x, got {x.dim()}-D")
    rows, cols = x.shape
    mode = block_mode(block_rows, block_cols, cols)
    x_fp8 = x.new_empty((rows, cols), dtype=fp8_dtype)
    scale_inv = _scale_fake(x, mode, rows, cols)
    if not with_transpose:
        return (x_fp8, scale_inv, x.new_empty((0,), dtype=fp8_dtype),
                x.new_empty((0,), dtype=torch.float32))
    return (x_fp8, scale_inv, x.new_empty((cols, rows), dtype=fp8_dtype),
            _scale_fake(x, mode, cols, rows))


@register_fake("transformer_fp8::fp8_gemm_blockwise")
def _fp8_gemm_blockwise_fake(a, a_scale_inv, b, b_scale_inv, out_dtype, bias=None):
    torch._check(a.dim() == 2 and b.dim() == 2, lambda: "fp8_gemm_blockwise needs 2-D a and b")
    torch._check(a.shape[1] == b.shape[1],
                 lambda: "fp8_gemm_blockwise: a [M, K] and b [N, K] must share K")
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)
