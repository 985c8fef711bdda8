"""The FP8 forward and backward of transformer_fp8.Linear under Float8BlockScaling and
Float8RowwiseScaling.

Every tensor takes its scales from its own blocks at the time of the cast (ops/blockwise.py):
there is no amax history, no scale update and no collective. In a multi-rank run nothing needs
reducing: each rank quantises the blocks of the tensors it holds, and no two ranks share a
block's scale (a tensor sharded across ranks would need its blocks aligned to the shards, which
row sharding of activations gives for 1x128 tiles).

GEMMs (a [M, K] @ b [N, K]^T, both operands quantised along their contraction dimension):
  fprop  out [M, N]  = x [M, K]      . w [N, K]
  dgrad  dx  [M, K]  = g [M, N]      . w^T [K, N]   (w^T quantised with its own blocks)
  wgrad  dw  [N, K]  = g^T [N, M]    . x^T [K, M]   (g^T and x^T likewise)
The transposes come from the high-precision tensors in the same quantize_blockwise call, so no
value is quantised twice. Rows are padded with zeros to a multiple of 16 (the CUDA GEMM's
alignment); zero rows change no block's amax and their product rows are dropped.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..ops.blockwise import BLOCK, fp8_gemm_blockwise, quantize_blockwise
from ..ops import pad_rows
from .recipe import Float8BlockScaling, Float8RowwiseScaling
from .torch_autocast import autocast_dtype

@dataclass(frozen=True)
class _BlockPlan:
    """How the three roles are quantised: block dims (1, 2 or "rowwise") and FP8 dtypes."""

    x_dim: object
    w_dim: object
    grad_dim: object
    fwd_dtype: torch.dtype
    bwd_dtype: torch.dtype
    power_2_scale: bool
    out_dtype: torch.dtype


def _plan_for(recipe, out_dtype: torch.dtype) -> _BlockPlan:
    fmt = recipe.fp8_format
    if isinstance(recipe, Float8RowwiseScaling):
        dims = ("rowwise",) * 3
    else:
        dims = (recipe.x_block_scaling_dim, recipe.w_block_scaling_dim,
                recipe.grad_block_scaling_dim)
    return _BlockPlan(*dims, fmt.fwd_dtype, fmt.bwd_dtype, recipe.power_2_scale, out_dtype)


def _quantize(t: torch.Tensor, dim, fp8_dtype, power_2_scale: bool, with_transpose: bool):
    # Row-wise as (1, -1): for a 128-column t, (1, 128) would mean 1x128 tiles (other
    # transposes).
    """quantize_blockwise of a 2-D t with the blocks of one recipe dimension."""
    if dim == "rowwise":
        block_rows, block_cols = 1, -1  # one block per row, whatever the width
    else:
        block_rows, block_cols = (1, BLOCK) if dim == 1 else (BLOCK, BLOCK)
    return quantize_blockwise(t, block_rows, block_cols, fp8_dtype, power_2_scale,
                              with_transpose)


class _BlockwiseLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, inp, weight, bias, plan: _BlockPlan, weight_q: Optional[tuple]):
        needs_input_grad, needs_weight_grad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        out_features, in_features = weight.shape
        inp_2d = inp.reshape(-1, in_features)
        # Transposed copies only where a backward GEMM needs them.
        x_fp8, x_si, x_t_fp8, x_t_si = _quantize(pad_rows(inp_2d), plan.x_dim, plan.fwd_dtype,
                                                 plan.power_2_scale, needs_weight_grad)
        w_fp8, w_si, w_t_fp8, w_t_si = weight_q if weight_q is not None else _quantize(
            weight, plan.w_dim, plan.fwd_dtype, plan.power_2_scale, needs_input_grad)
        out = fp8_gemm_blockwise(x_fp8, x_si, w_fp8, w_si, plan.out_dtype,
                                 None if bias is None else bias.to(plan.out_dtype))
        # Backward needs only the FP8 transposes and their scales.
        ctx.save_for_backward(x_t_fp8, x_t_si, w_t_fp8, w_t_si)
        ctx.plan = plan
        ctx.rows, ctx.lead_shape = inp_2d.shape[0], inp.shape[:-1]
        ctx.in_features, ctx.out_features = in_features, out_features
        ctx.inp_dtype, ctx.weight_dtype = inp.dtype, weight.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        return out[:ctx.rows].reshape(*ctx.lead_shape, out_features)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        x_t_fp8, x_t_si, w_t_fp8, w_t_si = ctx.saved_tensors
        needs_input_grad, needs_weight_grad, needs_bias_grad = ctx.needs_input_grad[:3]
        plan = ctx.plan
        g_2d = grad_out.reshape(-1, ctx.out_features)
        g_fp8, g_si, g_t_fp8, g_t_si = _quantize(pad_rows(g_2d), plan.grad_dim, plan.bwd_dtype,
                                                 plan.power_2_scale, needs_weight_grad)
        grad_inp = grad_weight = grad_bias = None
        if needs_input_grad:
            # dgrad [M, K] = grad_out [M, N] @ weight [N, K]; the b operand is weight^T [K, N]
            grad_inp = fp8_gemm_blockwise(g_fp8, g_si, w_t_fp8, w_t_si, ctx.inp_dtype)
            grad_inp = grad_inp[:ctx.rows].reshape(*ctx.lead_shape, ctx.in_features)
        if needs_weight_grad:
            # wgrad [N, K] = grad_out^T [N, M] @ input [M, K]; the b operand is input^T [K, M]
            grad_weight = fp8_gemm_blockwise(g_t_fp8, g_t_si, x_t_fp8, x_t_si, ctx.weight_dtype)
        if needs_bias_grad:
            grad_bias = g_2d.sum(dim=0).to(ctx.bias_dtype)
        return grad_inp, grad_weight, grad_bias, None, None


def blockwise_linear(inp: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                     recipe: "Float8BlockScaling | Float8RowwiseScaling",
                     weight_q: Optional[tuple] = None) -> torch.Tensor:
    """``F.linear(inp, weight, bias)`` with its three GEMMs block-scaled FP8 under ``recipe``
    (weight [out_features, in_features]). weight_q: the weight already quantised by
    quantize_weight (is_first_microbatch=False reuses it); else it is quantised here."""
    out_dtype = autocast_dtype(inp.device.type) or inp.dtype
    return _BlockwiseLinearFunction.apply(inp, weight, bias, _plan_for(recipe, out_dtype),
                                          weight_q)


def quantize_weight(weight: torch.Tensor, recipe) -> tuple:
    """(w_fp8, scale_inv, w_t_fp8, scale_inv_t): the weight as ``recipe`` quantises it, with the
    transpose dgrad needs, to keep across the microbatches of a step."""
    plan = _plan_for(recipe, weight.dtype)
    with torch.no_grad():
        return _quantize(weight, plan.w_dim, plan.fwd_dtype, plan.power_2_scale, True)


def is_block_recipe(recipe: Optional[object]) -> bool:
    return isinstance(recipe, (Float8BlockScaling, Float8RowwiseScaling))
