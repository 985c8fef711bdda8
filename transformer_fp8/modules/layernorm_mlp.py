"""LayerNormMLP (Transformer Engine's module): norm -> fc1 -> activation -> fc2.

Inside fp8_autocast both GEMMs run in FP8, each with its own input, weight and grad_output
scales (columns 0-1 / 2-3 of the forward history: fc1 input and weight, fc2 input and weight;
columns 0 / 1 of the backward one: fc1's and fc2's grad_output). Fusions, each one pass (the
casts only where the quantizer fuses them, DelayedScaling's: current and block scaling need
the tensor's amax first and quantise the high-precision output):
  forward:  norm + cast of its output (fc1's input, with its transpose and amax);
            activation + cast of its output (fc2's input, with its transpose and amax);
  backward: fc2's grad_output cast + fc2's bias gradient;
            activation backward + cast of the result (fc1's grad_output) + fc1's bias gradient;
            then the norm's backward. (Under the recipe's backward_override the backward GEMMs
            run in high precision, nothing cast: quantization/backward_override.py.)
clamped_swiglu has no fused kernel: it runs as torch ops (activations.py) and its float32
result is cast after it (its derivative likewise, in the input's dtype, then cast).
Saved for backward: the input, fc1's high-precision output (the activation's backward needs
it) and FP8 copies. Outside fp8_autocast it computes exactly the torch composition.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

from ..ops import fused as fused_ops
from .activations import (activation_backward, activation_forward, activation_hp, activation_of,
                          check_activation, check_activation_params, has_kernel, is_gated)
from ..ops import function_output
from .linear_fused_step import fused_norm_mlp_step
from ..quantization import backward_override
from ..quantization.backward_override import kept_operand
from ..quantization.quantizer import ALIGN, pad_rows
from .layernorm_linear import cast_norm_output, norm_backward
from .norm_first import NormFirstModule, check_positive, te_default_init
from ..quantization.recipe import Recipe
from .te_args import te_only_arguments
from . import te_tensor_parallel, te_tensor_parallel_norm
from .te_tensor_parallel import TensorParallelMixin
from .once_differentiable import once_differentiable, save_for_backward, saved_operands
from .weight_rng import drawing_weights


def _cast_activation(plan, activation, fc1_out, with_transpose, return_hp=False):
    """act(fc1_out) quantised as fc2's input (in the activation's kernel where the quantizer
    allows): (Quantized, the high-precision act(fc1_out) if return_hp else None)."""

    def fused(scale, amax_slot, dtype):
        y_fp8, y_t_fp8 = fused_ops.activation_fwd_fp8(fc1_out, activation, scale, dtype,
                                                      amax_slot, with_transpose, ALIGN)
        return y_fp8, y_t_fp8, None

    def unfused():
        y = activation_forward(fc1_out, activation)
        return pad_rows(y), y

    if not has_kernel(activation) and plan.input_quantizer.fuses_cast:
        # No kernel to fuse the cast with: the float32 result cast (and its amax recorded)
        # as a fused kernel does, not the result rounded to fc1_out's dtype first.
        y32 = activation.forward(fc1_out, torch.float32)
        act_q = plan.input_quantizer.cast(pad_rows(y32), with_transpose)
        return act_q, (y32.to(fc1_out.dtype) if return_hp else None)
    if return_hp and plan.input_quantizer.fuses_cast:
        y = activation_forward(fc1_out, activation)  # (made in high precision first)
        return plan.input_quantizer.cast(pad_rows(y), with_transpose), y
    act_q, y = plan.input_quantizer.cast_fused(fused, unfused, with_transpose)
    return act_q, (y if return_hp else None)


def _cast_activation_grad(plan, activation, grad_act, fc1_out, with_transpose, with_dbias):
    """d(loss)/d(fc1_out) from the activation's backward, quantised as fc1's grad_output:
    (Quantized, fc1's bias gradient or None)."""

    def fused(scale, amax_slot, dtype):
        return fused_ops.activation_bwd_fp8(grad_act, fc1_out, activation, scale, dtype,
                                            amax_slot, with_transpose, with_dbias, ALIGN)

    def unfused():
        dx = activation_backward(grad_act, fc1_out, activation)
        dbias = dx.sum(dim=0, dtype=torch.float32).to(dx.dtype) if with_dbias else None
        return pad_rows(dx), dbias

    if not has_kernel(activation) and plan.grad_quantizer.fuses_cast:
        dx, dbias = unfused()  # (no kernel to fuse the cast with: cast after)
        return plan.grad_quantizer.cast(dx, with_transpose), dbias
    dx_q, dbias = plan.grad_quantizer.cast_fused(fused, unfused, with_transpose)
    return dx_q, (dbias if with_dbias else None)


class _LayerNormMLPFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, inp, ln_weight, ln_bias, fc1_weight, fc1_bias, fc2_weight, fc2_bias,
                plans, norm, activation, return_ln_out):
        grads = ctx.needs_input_grad
        needs_norm_grad = any(grads[:3])
        needs_fc1_dgrad = needs_norm_grad  # fc1's dgrad feeds only the norm's backward
        needs_fc2_dgrad = any(grads[:5])
        fc1_plan, fc2_plan = plans
        hidden = fc1_weight.shape[1]  # (= inp.shape[-1], static under torch.compile)
        x = inp.reshape(-1, hidden)
        rows = x.shape[0]
        override = fc1_plan.backward_override  # (one recipe: the same in both plans)
        high_precision = override == "high_precision"
        ln_q, ln_out, stats = cast_norm_output(fc1_plan, norm, x, ln_weight, ln_bias,
                                               fc1_plan.transposes(grads[3]),
                                               return_ln_out or (high_precision and grads[3]))
        w1_q = fc1_plan.quantize_weight(fc1_weight,
                                        with_transpose=fc1_plan.transposes(needs_fc1_dgrad))
        fc1_plan.keep_used(ln_q, w1_q)
        fc1_out = fc1_plan.gemm(
            ln_q.data, ln_q.scale_inv, w1_q.data, w1_q.scale_inv, fc1_plan.out_dtype,
            bias=None if fc1_bias is None else fc1_bias.to(fc1_plan.out_dtype),
            fast_accum=fc1_plan.fast_accum[0])[:rows]
        act_q, act_out = _cast_activation(fc2_plan, activation, fc1_out,
                                          fc2_plan.transposes(grads[5]),
                                          high_precision and grads[5])
        w2_q = fc2_plan.quantize_weight(fc2_weight,
                                        with_transpose=fc2_plan.transposes(needs_fc2_dgrad))
        fc2_plan.keep_used(act_q, w2_q)
        out = fc2_plan.gemm(
            act_q.data, act_q.scale_inv, w2_q.data, w2_q.scale_inv, fc2_plan.out_dtype,
            bias=None if fc2_bias is None else fc2_bias.to(fc2_plan.out_dtype),
            fast_accum=fc2_plan.fast_accum[0])[:rows]
        # The FP8 transposes the backward GEMMs read (under a backward_override the operands
        # before their casts, or their FP8 data: quantization/backward_override.py).
        kept = [kept_operand(override, q, hp, needed)
                for q, hp, needed in ((ln_q, ln_out, grads[3]), (w1_q, fc1_weight, needs_norm_grad),
                                      (act_q, act_out, grads[5]),
                                      (w2_q, fc2_weight, needs_fc2_dgrad))]
        save_for_backward(ctx, x, ln_weight, fc1_out, *(t for pair in kept for t in pair),
                          *stats,
                          weights=[w for w, g in ((fc1_weight, grads[3]), (fc2_weight, grads[5]))
                                   if g])
        ctx.plans, ctx.norm, ctx.activation = plans, norm, activation
        ctx.lead_shape, ctx.hidden = inp.shape[:-1], hidden
        ctx.dtypes = (fc1_weight.dtype, None if fc1_bias is None else fc1_bias.dtype,
                      fc2_weight.dtype, None if fc2_bias is None else fc2_bias.dtype)
        out = function_output(out, rows, (*ctx.lead_shape, fc2_weight.shape[0]))
        if return_ln_out:
            return out, function_output(ln_out, rows, (*ctx.lead_shape, hidden))
        return out

    @staticmethod
    @once_differentiable("LayerNormMLP")
    def backward(ctx, grad_out, grad_ln_out=None):
        (x, ln_weight, fc1_out, ln_t_fp8, ln_t_scale_inv, w1_t_fp8, w1_t_scale_inv, act_t_fp8,
         act_t_scale_inv, w2_t_fp8, w2_t_scale_inv, *stats) = saved_operands(ctx)
        fc1_plan, fc2_plan = ctx.plans
        g = grad_out.reshape(-1, grad_out.shape[-1])
        if fc1_plan.backward_override is not None:
            return _high_precision_backward(
                ctx, g, grad_ln_out, x, ln_weight, fc1_out, stats,
                ((ln_t_fp8, ln_t_scale_inv), (w1_t_fp8, w1_t_scale_inv),
                 (act_t_fp8, act_t_scale_inv), (w2_t_fp8, w2_t_scale_inv)))
        grads = ctx.needs_input_grad
        needs_norm_grad = any(grads[:3])
        needs_fc2_dgrad = any(grads[:5])
        fc1_plan.on_backward()  # one queue for the module: the plans share the backward step
        w1_dtype, b1_dtype, w2_dtype, b2_dtype = ctx.dtypes
        g_q, grad_fc2_bias = fc2_plan.grad_quantizer.cast_grad_output(
            g, with_transpose=grads[5], with_dbias=grads[6])
        grad_inp = grad_ln_weight = grad_ln_bias = None
        grad_fc1_weight = grad_fc1_bias = grad_fc2_weight = None
        if grads[5]:
            # fc2 wgrad [H, F] = grad_out^T [H, M] @ act [M, F]; the b operand is act^T.
            grad_fc2_weight = fc2_plan.gemm(g_q.data_t, g_q.scale_inv_t, act_t_fp8,
                                            act_t_scale_inv, w2_dtype,
                                            fast_accum=fc2_plan.fast_accum[2])
        if needs_fc2_dgrad:
            # fc2 dgrad [M, F] = grad_out [M, H] @ fc2_weight [H, F]
            grad_act = fc2_plan.gemm(g_q.data, g_q.scale_inv, w2_t_fp8, w2_t_scale_inv,
                                     fc1_out.dtype, fast_accum=fc2_plan.fast_accum[1])[:x.shape[0]]
            d1_q, grad_fc1_bias = _cast_activation_grad(
                fc1_plan, ctx.activation, grad_act, fc1_out, with_transpose=grads[3],
                with_dbias=grads[4])
            if grads[3]:
                # fc1 wgrad [F', H] = d1^T [F', M] @ ln_out [M, H]; the b operand is ln_out^T.
                grad_fc1_weight = fc1_plan.gemm(d1_q.data_t, d1_q.scale_inv_t, ln_t_fp8,
                                                ln_t_scale_inv, w1_dtype,
                                                fast_accum=fc1_plan.fast_accum[2])
            if needs_norm_grad:
                grad_ln = fc1_plan.gemm(d1_q.data, d1_q.scale_inv, w1_t_fp8, w1_t_scale_inv,
                                        x.dtype, fast_accum=fc1_plan.fast_accum[1])[:x.shape[0]]
                grad_inp, grad_ln_weight, grad_ln_bias = norm_backward(
                    ctx, grad_ln, grad_ln_out, x, stats, ln_weight, ctx.hidden)
        if grad_fc1_bias is not None:
            grad_fc1_bias = grad_fc1_bias.to(b1_dtype)
        if grad_fc2_bias is not None:
            grad_fc2_bias = grad_fc2_bias.to(b2_dtype)
        if not ctx.needs_input_grad[2]:
            grad_ln_bias = None  # (a LayerNorm without bias, or a frozen one)
        return (grad_inp, grad_ln_weight, grad_ln_bias, grad_fc1_weight, grad_fc1_bias,
                grad_fc2_weight, grad_fc2_bias, None, None, None, None)


def _high_precision_backward(ctx, g, grad_ln_out, x, ln_weight, fc1_out, stats, kept):
    """LayerNormMLP's backward under a backward_override: the four GEMMs as torch's matmuls in
    the forward's output dtype on the kept operands (quantization/backward_override.py); the
    activation's and the norm's backward as without it."""
    grads = ctx.needs_input_grad
    needs_norm_grad = any(grads[:3])
    ln_kept, w1_kept, act_kept, w2_kept = kept
    w1_dtype, b1_dtype, w2_dtype, b2_dtype = ctx.dtypes
    rows = x.shape[0]
    compute = ctx.plans[0].out_dtype
    g = g.to(compute)
    grad_inp = grad_ln_weight = grad_ln_bias = None
    grad_fc1_weight = grad_fc1_bias = grad_fc2_weight = None
    grad_fc2_bias = backward_override.bias_grad(g, b2_dtype) if grads[6] else None
    if grads[5]:
        act = backward_override.operand(act_kept, rows, compute)
        grad_fc2_weight = backward_override.wgrad(g, act, compute, w2_dtype)
    if any(grads[:5]):
        w2 = backward_override.operand(w2_kept, w2_kept[0].shape[0], compute)
        grad_act = backward_override.dgrad(g, w2, compute, fc1_out.dtype)
        d1 = activation_backward(grad_act, fc1_out, ctx.activation)
        if grads[4]:
            grad_fc1_bias = backward_override.bias_grad(d1, b1_dtype)
        if grads[3]:
            ln_out = backward_override.operand(ln_kept, rows, compute)
            grad_fc1_weight = backward_override.wgrad(d1, ln_out, compute, w1_dtype)
        if needs_norm_grad:
            w1 = backward_override.operand(w1_kept, w1_kept[0].shape[0], compute)
            grad_ln = backward_override.dgrad(d1, w1, compute, x.dtype)
            grad_inp, grad_ln_weight, grad_ln_bias = norm_backward(
                ctx, grad_ln, grad_ln_out, x, stats, ln_weight, ctx.hidden)
    if not grads[2]:
        grad_ln_bias = None  # (a LayerNorm without bias, or a frozen one)
    return (grad_inp, grad_ln_weight, grad_ln_bias, grad_fc1_weight, grad_fc1_bias,
            grad_fc2_weight, grad_fc2_bias, None, None, None, None)


class LayerNormMLP(TensorParallelMixin, NormFirstModule):
    """Transformer Engine's LayerNormMLP: fc2(act(fc1(Norm(x)))), the norm LayerNorm or RMSNorm.

    Parameters: layer_norm_weight, layer_norm_bias (LayerNorm only), fc1_weight [F', hidden]
    (F' = 2 * ffn_hidden_size for the gated activations swiglu, geglu, reglu, qgeglu, sreglu,
    glu, clamped_swiglu, else ffn_hidden_size), fc1_bias, fc2_weight [hidden, ffn_hidden_size],
    fc2_bias.
    activation: gelu (tanh approximation), relu, silu, qgelu (x sigmoid(1.702 x)), srelu
    (relu(x)^2), swiglu, geglu, reglu, qgeglu, sreglu, glu (sigmoid(a) * b), clamped_swiglu
    (gated too; activation_params: its limit, alpha and glu_linear_offset, activations.py's
    ClampedSwiGLU).
    Returns out; with return_bias, (out, fc2_bias) and fc2's bias is not added; with
    return_layernorm_output, the norm's output comes last.
    Weights as Transformer Engine initialises them (init_method for fc1, output_layer_init_method
    for fc2, default normal with std 0.023; biases zero). Arguments in Transformer Engine's
    order; fuse_wgrad_accumulation and delay_wgrad_compute as in wgrad.py; tp_group, tp_size,
    set_parallel_mode, sequence_parallel and return_layernorm_output_gathered: Transformer
    Engine's tensor parallelism, fc1 column- and fc2 row-parallel, the module holding its shards
    (te_tensor_parallel_norm.py); the others it takes are accepted at their defaults
    (te_args.py).
    """

    _NO_BIAS_RETURNS_NONE = True  # return_bias without a bias: None, as Transformer Engine 2.x
    _TE_STATE_LAYOUT = "layernorm_mlp"  # its grad_output columns moved between versions

    def __init__(self, hidden_size: int, ffn_hidden_size: int, eps: float = 1e-5,
                 sequence_parallel: bool = False, return_bias: bool = False,
                 get_rng_state_tracker=None, tp_group=None, tp_size: int = 1,
                 init_method: Optional[Callable] = None, bias: bool = True,
                 normalization: str = "LayerNorm", activation: str = "gelu",
                 activation_params: Optional[dict] = None,
                 output_layer_init_method: Optional[Callable] = None,
                 fuse_wgrad_accumulation: bool = False,
                 params_dtype: Optional[torch.dtype] = None,
                 return_layernorm_output: bool = False,
                 return_layernorm_output_gathered: bool = False, seq_length=None,
                 micro_batch_size=None, set_parallel_mode: bool = False,
                 zero_centered_gamma: bool = False, device=None, ub_overlap_ag: bool = False,
                 name=None, ub_overlap_rs: bool = False, ub_overlap_rs_dgrad: bool = False,
                 ub_bulk_dgrad: bool = False, ub_bulk_wgrad: bool = False,
                 delay_wgrad_compute: bool = False, symmetric_ar_type=None,
                 checkpoint: bool = False, *, dtype: Optional[torch.dtype] = None,
                 recipe: Optional[Recipe] = None):
        te_options = te_only_arguments(locals())
        super().__init__()
        check_positive("LayerNormMLP", "ffn_hidden_size", ffn_hidden_size)
        ffn_local, parallel, self._ln_out_gathered = \
            te_tensor_parallel_norm.configure_norm_mlp(hidden_size, ffn_hidden_size, te_options)
        dtype = self._init_options(te_options, dtype, params_dtype, return_bias,
                                   return_layernorm_output, init_method,
                                   fuse_wgrad_accumulation, delay_wgrad_compute)
        self.hidden_size = check_positive("LayerNormMLP", "hidden_size", hidden_size)
        self.ffn_hidden_size = check_positive("LayerNormMLP", "ffn_hidden_size",
                                              ffn_hidden_size)
        self.activation = check_activation(activation)
        self.activation_params = check_activation_params(activation, activation_params)
        self.output_layer_init_method = output_layer_init_method or te_default_init
        self.size_per_partition = ffn_local  # (Transformer Engine's name: ffn_hidden_size / tp)
        fc1_out = 2 * ffn_local if is_gated(activation) else ffn_local
        factory = dict(device=device, dtype=dtype)
        self._init_norm(hidden_size, eps, normalization, zero_centered_gamma, device, dtype)
        self._register_gemm_parameter("fc1_weight", torch.empty(fc1_out, hidden_size,
                                                                **factory))
        self._register_gemm_parameter("fc1_bias",
                                      torch.zeros(fc1_out, **factory) if bias else None)
        self._register_gemm_parameter("fc2_weight", torch.empty(hidden_size, ffn_local,
                                                                **factory))
        self._register_gemm_parameter("fc2_bias",
                                      torch.zeros(hidden_size, **factory) if bias else None)
        te_tensor_parallel_norm.attach(self, parallel, {"fc1_weight": 0, "fc1_bias": 0,
                                                        "fc2_weight": 1}, row_bias="fc2_bias")
        self._init_state(recipe, num_gemms=2)
        self._initialise()

    def _init_parameters(self) -> None:
        self.reset_norm_parameters()
        with drawing_weights(self):
            self.init_method(self.fc1_weight)
            self.output_layer_init_method(self.fc2_weight)
        with torch.no_grad():
            for bias in (self.fc1_bias, self.fc2_bias):
                if bias is not None:
                    bias.zero_()

    activation_params = None  # (a module pickled whole before clamped_swiglu)

    @property
    def _activation(self):
        """What the activation computes with: the fused kernel's name, or a ClampedSwiGLU."""
        return activation_of(self.activation, self.activation_params)

    def _gemm_dims(self):
        return [tuple(self.fc1_weight.shape), tuple(self.fc2_weight.shape)]

    def fp8_weights(self) -> list[torch.Tensor]:
        return [self.fc1_weight, self.fc2_weight]

    @property
    def set_parallel_mode(self) -> bool:
        return self._te_parallel is not None and self._te_parallel.mode is not None

    def forward(self, inp: torch.Tensor, is_first_microbatch: Optional[bool] = None):
        if self._te_tp is not None:  # Transformer Engine's tensor parallelism: collectives
            te_tensor_parallel.checked_group(self, inp)
        return self._forward(inp, is_first_microbatch, self.hidden_size, "fc2_bias")

    def _fc2_gemm_bias(self):
        return None if self.return_bias else self._param("fc2_bias")

    def _high_precision(self, inp, linear=F.linear):
        if self._te_tp is not None:
            return te_tensor_parallel_norm.norm_mlp_hp(self, inp, linear)
        ln_out = self._norm_hp(inp)
        hidden = activation_hp(linear(ln_out, self._param("fc1_weight"), self._param("fc1_bias")),
                               self._activation)
        out = linear(hidden, self._param("fc2_weight"), self._fc2_gemm_bias())
        return (out, ln_out) if self.return_layernorm_output else out

    # The common cases (DelayedScaling, Float8CurrentScaling) as one C++ operator, tried first by
    # base.py's _dispatch.
    _fused_step = staticmethod(fused_norm_mlp_step)

    def _fp8_apply(self, inp, plans):
        if self._te_tp is not None:
            return te_tensor_parallel_norm.norm_mlp_fp8(self, inp, plans)
        return _LayerNormMLPFunction.apply(
            inp, self.layer_norm_weight, self.layer_norm_bias, self._param("fc1_weight"),
            self._param("fc1_bias"), self._param("fc2_weight"), self._fc2_gemm_bias(), plans,
            self._norm_step, self._activation, self.return_layernorm_output)

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, ffn_hidden_size={self.ffn_hidden_size}, "
                f"normalization={self.normalization}, activation={self.activation}, "
                + (f"activation_params={self.activation_params}, " if self.activation_params
                   else "") +
                f"bias={self.fc1_bias is not None}, fp8=True")
