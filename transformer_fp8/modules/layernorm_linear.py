"""LayerNormLinear (Transformer Engine's module): a norm (LayerNorm or RMSNorm) then a Linear.

Inside fp8_autocast the norm writes its output straight to FP8 (and the transpose the weight
gradient needs, and its amax into the input's history slot) in one pass: the high-precision
norm output is never written, unless return_layernorm_output asks for it (DelayedScaling;
a recipe whose scale needs the output's amax first, current or block scaling, quantises the
norm's high-precision output). Backward: grad_output cast (fused with the bias gradient),
dgrad and wgrad in FP8 (under the recipe's backward_override nothing is cast: both in high
precision), then the norm's backward. Outside fp8_autocast it computes exactly norm ->
torch.nn.functional.linear.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

from ..ops import function_output
from .linear_fused_step import fused_norm_linear_step
from ..quantization import backward_override
from ..quantization.backward_override import kept_operand
from ..quantization.quantizer import ALIGN, pad_rows
from .norm_first import NormFirstModule, check_positive
from ..quantization.recipe import Recipe
from .te_args import check_forward_flags, te_only_arguments
from .te_module import split_sizes
from . import te_tensor_parallel, te_tensor_parallel_norm
from .te_tensor_parallel import TensorParallelMixin
from .once_differentiable import once_differentiable, save_for_backward, saved_operands
from .weight_rng import drawing_weights


def cast_norm_output(plan, norm, x, ln_weight, ln_bias, with_transpose, return_hp):
    """The norm of x [M, K] quantised as a GEMM input by plan.input_quantizer: in the norm's
    kernel where the quantizer allows, else from the norm's high-precision output.
    Returns (Quantized, ln_out or None, stats)."""

    def fused(scale, amax_slot, dtype):
        y_fp8, y_t_fp8, y_hp, stats = norm.fp8(x, ln_weight, ln_bias, scale, amax_slot, dtype,
                                               with_transpose, return_hp, ALIGN)
        return y_fp8, y_t_fp8, (y_hp, stats)

    def unfused():
        y, stats = norm.hp(x, ln_weight, ln_bias)
        return pad_rows(y), (y, stats)

    ln_q, (ln_out, stats) = plan.input_quantizer.cast_fused(fused, unfused, with_transpose)
    return ln_q, (ln_out if return_hp else None), stats


def norm_backward(ctx, grad_ln, grad_ln_out, x, stats, ln_weight, features: int) -> tuple:
    """The norm's backward from the gradient its output got from the GEMM (``grad_ln``) plus
    the one a returned norm output got (``grad_ln_out``, or None): (input gradient in the
    input's shape, norm weight gradient, norm bias gradient)."""
    if grad_ln_out is not None:
        grad_ln = grad_ln + grad_ln_out.reshape(grad_ln.shape).to(grad_ln.dtype)
    grad_x, grad_ln_weight, grad_ln_bias = ctx.norm.backward(grad_ln, x, stats, ln_weight)
    return grad_x.reshape(*ctx.lead_shape, features), grad_ln_weight, grad_ln_bias


class _LayerNormLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, inp, ln_weight, ln_bias, weight, bias, plan, norm, return_ln_out,
                hold_weight=True):
        # hold_weight=False: a weight joined from its parts, whose join holds one under
        # torch.compile (once_differentiable.py).
        needs_norm_grad = any(ctx.needs_input_grad[:3])
        needs_weight_grad = ctx.needs_input_grad[3]
        out_features, in_features = weight.shape
        x = inp.reshape(-1, in_features)
        override = plan.backward_override
        keeps_ln_out = override == "high_precision" and needs_weight_grad
        ln_q, ln_out, stats = cast_norm_output(plan, norm, x, ln_weight, ln_bias,
                                               plan.transposes(needs_weight_grad),
                                               return_ln_out or keeps_ln_out)
        w_q = plan.quantize_weight(weight, with_transpose=plan.transposes(needs_norm_grad))
        plan.keep_used(ln_q, w_q)
        out = plan.gemm(ln_q.data, ln_q.scale_inv, w_q.data, w_q.scale_inv, plan.out_dtype,
                        bias=None if bias is None else bias.to(plan.out_dtype),
                        fast_accum=plan.fast_accum[0])
        # Backward keeps the input (for the norm's backward) and the FP8 copies only (under a
        # backward_override the GEMM operands before their casts, or their FP8 data).
        ln_kept = kept_operand(override, ln_q, ln_out, needs_weight_grad)
        w_kept = kept_operand(override, w_q, weight, needs_norm_grad)
        save_for_backward(ctx, x, ln_weight, *ln_kept, *w_kept, *stats,
                          weights=(weight,) if needs_weight_grad and hold_weight else ())
        ctx.plan, ctx.norm = plan, norm
        ctx.rows, ctx.lead_shape = x.shape[0], inp.shape[:-1]
        ctx.in_features, ctx.out_features = in_features, out_features
        ctx.weight_dtype = weight.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        out = function_output(out, ctx.rows, (*ctx.lead_shape, out_features))
        if return_ln_out:
            return out, function_output(ln_out, ctx.rows, inp.shape)
        return out

    @staticmethod
    @once_differentiable("LayerNormLinear")
    def backward(ctx, grad_out, grad_ln_out=None):
        x, ln_weight, ln_t_fp8, ln_t_scale_inv, w_t_fp8, w_t_scale_inv, *stats = \
            saved_operands(ctx)
        needs_norm_grad = any(ctx.needs_input_grad[:3])
        needs_weight_grad, needs_bias_grad = ctx.needs_input_grad[3:5]
        plan = ctx.plan
        g = grad_out.reshape(-1, ctx.out_features)
        override = plan.backward_override
        if override is None:
            plan.on_backward()  # the grad_output update runs when this backward pass ends
            g_q, grad_bias = plan.grad_quantizer.cast_grad_output(
                g, with_transpose=needs_weight_grad, with_dbias=needs_bias_grad)
        else:  # the GEMMs in high precision (quantization/backward_override.py)
            compute = plan.out_dtype
            grad_bias = backward_override.bias_grad(g.to(compute), ctx.bias_dtype) \
                if needs_bias_grad else None
        grad_inp = grad_ln_weight = grad_ln_bias = grad_weight = None
        if needs_norm_grad:
            # dgrad of the GEMM [M, K] = grad_out [M, N] @ weight [N, K], then the norm's.
            if override is None:
                grad_ln = plan.gemm(g_q.data, g_q.scale_inv, w_t_fp8, w_t_scale_inv,
                                    x.dtype, fast_accum=plan.fast_accum[1])[:ctx.rows]
            else:
                weight = backward_override.operand((w_t_fp8, w_t_scale_inv), ctx.out_features,
                                                   compute)
                grad_ln = backward_override.dgrad(g, weight, compute, x.dtype)
            grad_inp, grad_ln_weight, grad_ln_bias = norm_backward(
                ctx, grad_ln, grad_ln_out, x, stats, ln_weight, ctx.in_features)
        if needs_weight_grad and override is None:
            # wgrad [N, K] = grad_out^T [N, M] @ ln_out [M, K]; the b operand is ln_out^T.
            grad_weight = plan.gemm(g_q.data_t, g_q.scale_inv_t, ln_t_fp8, ln_t_scale_inv,
                                    ctx.weight_dtype, fast_accum=plan.fast_accum[2])
        elif needs_weight_grad:
            ln_out = backward_override.operand((ln_t_fp8, ln_t_scale_inv), ctx.rows, compute)
            grad_weight = backward_override.wgrad(g, ln_out, compute, ctx.weight_dtype)
        if needs_bias_grad:
            grad_bias = grad_bias.to(ctx.bias_dtype)
        if not ctx.needs_input_grad[2]:
            grad_ln_bias = None  # (a LayerNorm without bias, or a frozen one)
        return (grad_inp, grad_ln_weight, grad_ln_bias, grad_weight, grad_bias,
                None, None, None, None)


class LayerNormLinear(TensorParallelMixin, NormFirstModule):
    """Transformer Engine's LayerNormLinear: y = Linear(Norm(x)), the norm LayerNorm or RMSNorm.

    Parameters: layer_norm_weight, layer_norm_bias (LayerNorm only), weight [out, in], bias.
    Returns out; with return_bias, (out, bias) and the bias is not added; with
    return_layernorm_output, the norm's output comes last.
    Weights are initialised as Transformer Engine does (init_method, default normal with std
    0.023; bias zero). Arguments in Transformer Engine's order; parameters_split keeps the
    weight and bias as several Parameters (``<name>_weight``, ``<name>_bias``);
    fuse_wgrad_accumulation and delay_wgrad_compute as in wgrad.py; tp_group, tp_size,
    parallel_mode="column", sequence_parallel and return_layernorm_output_gathered: Transformer
    Engine's tensor parallelism, the module holding its shard (te_tensor_parallel_norm.py).
    recipe: the recipe it will train with (sizes the amax histories now, as for Linear).
    """

    def __init__(self, in_features: int, out_features: int, eps: float = 1e-5,
                 sequence_parallel: bool = False, fuse_wgrad_accumulation: bool = False,
                 tp_group=None, tp_size: int = 1, get_rng_state_tracker=None,
                 init_method: Optional[Callable] = None, bias: bool = True,
                 normalization: str = "LayerNorm", return_bias: bool = False,
                 params_dtype: Optional[torch.dtype] = None, parallel_mode=None,
                 return_layernorm_output: bool = False,
                 return_layernorm_output_gathered: bool = False, parameters_split=None,
                 zero_centered_gamma: bool = False, device=None, ub_overlap_ag: bool = False,
                 ub_overlap_rs: bool = False, ub_overlap_rs_dgrad: bool = False,
                 ub_bulk_wgrad: bool = False, ub_bulk_dgrad: bool = False, ub_name=None,
                 delay_wgrad_compute: bool = False, symmetric_ar_type=None, name=None, *,
                 dtype: Optional[torch.dtype] = None, recipe: Optional[Recipe] = None):
        te_options = te_only_arguments(locals())
        super().__init__()
        whole_out = check_positive("LayerNormLinear", "out_features", out_features)
        out_features, parallel, self._ln_out_gathered = \
            te_tensor_parallel_norm.configure_norm_linear(in_features, out_features, te_options)
        dtype = self._init_options(te_options, dtype, params_dtype, return_bias,
                                   return_layernorm_output, init_method,
                                   fuse_wgrad_accumulation, delay_wgrad_compute)
        self.in_features = check_positive("LayerNormLinear", "in_features", in_features)
        self.out_features = out_features  # (the rank's shard's, with parallel_mode="column")
        parts = split_sizes("LayerNormLinear", parameters_split, whole_out,
                            te_tensor_parallel.split_shards(parallel))
        factory = dict(device=device, dtype=dtype)
        self._init_norm(in_features, eps, normalization, zero_centered_gamma, device, dtype)
        self._register_gemm_parameter("weight", torch.empty(out_features, in_features,
                                                            **factory), parts)
        self._register_gemm_parameter(
            "bias", torch.zeros(out_features, **factory) if bias else None, parts)
        te_tensor_parallel_norm.attach(self, parallel, {"weight": 0, "bias": 0})
        self._init_state(recipe, num_gemms=1)
        self._initialise()

    def _init_parameters(self) -> None:
        self.reset_norm_parameters()
        with drawing_weights(self):
            for weight in self._parameters_of("weight"):
                self.init_method(weight)
        with torch.no_grad():
            for bias in self._parameters_of("bias"):
                if bias is not None:
                    bias.zero_()

    def _gemm_dims(self):
        return [(self.out_features, self.in_features)]

    def fp8_weights(self) -> list[torch.Tensor]:
        return [self._param("weight", routed=False)]

    def forward(self, inp: torch.Tensor, is_first_microbatch: Optional[bool] = None,
                fp8_output: bool = False, fp8_grad: bool = False):
        check_forward_flags("LayerNormLinear", fp8_output, fp8_grad)
        if self._te_tp is not None:  # Transformer Engine's tensor parallelism: collectives
            te_tensor_parallel.checked_group(self, inp)
        return self._forward(inp, is_first_microbatch, self.in_features, "bias")

    def _gemm_bias(self):
        return None if self.return_bias else self._param("bias")

    def _high_precision(self, inp, linear=F.linear):
        if self._te_tp is not None:
            return te_tensor_parallel_norm.norm_linear_hp(self, inp, linear)
        ln_out = self._norm_hp(inp)
        out = linear(ln_out, self._param("weight"), self._gemm_bias())
        return (out, ln_out) if self.return_layernorm_output else out

    # The common cases (DelayedScaling, Float8CurrentScaling) as one C++ operator, tried first by
    # base.py's _dispatch.
    _fused_step = staticmethod(fused_norm_linear_step)

    def _fp8_apply(self, inp, plans):
        if self._te_tp is not None:
            return te_tensor_parallel_norm.norm_linear_fp8(self, inp, plans[0])
        return _LayerNormLinearFunction.apply(
            inp, self.layer_norm_weight, self.layer_norm_bias, self._param("weight"),
            self._gemm_bias(), plans[0], self._norm_step, self.return_layernorm_output,
            self._weight_held("weight"))

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"normalization={self.normalization}, bias={self._has('bias')}, "
                "fp8=True")
