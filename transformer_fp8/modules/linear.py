"""transformer_fp8.Linear: a drop-in torch.nn.Linear whose GEMMs run in FP8 inside fp8_autocast.

Its FP8 state (one GEMM: input, weight and grad_output amax histories and scales) and the
machinery that keeps it valid are Fp8StateMixin's (base.py, over quantization/state.py); this
file holds the layer and its autograd function: the forward GEMM and the dgrad and wgrad GEMMs,
all in FP8.
"""
from __future__ import annotations

import math
import operator
from collections.abc import Mapping
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from .._dtensor import is_dtensor
from ..quantization import model_init
from ..ops import function_output
from ..quantization import backward_override
from ..quantization.backward_override import kept_operand
from ..quantization.quantizer import pad_rows
from ..quantization.recipe import Recipe
from ..quantization.history import history_len_for
from ..quantization.state_layout import FP8_STATE_KEYS
from .base import Fp8StateMixin
from .fp8_primary_weights import SCALE_INV_SUFFIX, make_fp8_primary_weights
from .fsdp.enable import check_fp8_all_gather, enable_fp8_all_gather
from .linear_fused_step import fused_linear_step, ticketed_linear_step
from .te_args import check_forward_flags, check_te_options
from .te_module import TeModuleMixin, split_sizes
from .tensor_parallel import sharded_linear
from . import te_tensor_parallel
from .te_tensor_parallel import TensorParallelMixin
from .once_differentiable import once_differentiable, save_for_backward, saved_operands
from .weight_rng import drawing_weights, weight_rng


class _Fp8LinearFunction(torch.autograd.Function):
    """F.linear with its three GEMMs in FP8, each operand quantised by the plan's quantizer for
    its role (any recipe); the backward GEMMs in high precision under a backward_override."""

    @staticmethod
    def forward(ctx, inp, weight, bias, plan, add_bias=True, hold_weight=True):
        # add_bias=False: bias only takes its gradient (tensor_parallel.py's rowwise ranks but
        # the first, whose partial sums must not each hold it). hold_weight=False: a weight
        # joined from its parts, whose join holds one under torch.compile.
        needs_input_grad, needs_weight_grad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        out_features, in_features = weight.shape
        inp_2d = inp.reshape(-1, in_features)
        # The transposed copies feed wgrad (input^T) and dgrad (weight^T): made only if needed.
        x_q = plan.input_quantizer.cast(pad_rows(inp_2d),
                                        with_transpose=plan.transposes(needs_weight_grad))
        w_q = plan.quantize_weight(weight, with_transpose=plan.transposes(needs_input_grad))
        plan.keep_used(x_q, w_q)
        ctx.bias_dtype = None if bias is None else bias.dtype
        if not add_bias:
            bias = None
        if bias is not None and bias.dtype != plan.out_dtype:
            bias = bias.to(plan.out_dtype)
        out = plan.gemm(x_q.data, x_q.scale_inv, w_q.data, w_q.scale_inv, plan.out_dtype,
                        bias=bias, fast_accum=plan.fast_accum[0])
        # Backward needs only the FP8 transposes: the high-precision input is not kept (under
        # torch.compile a reference to the weight too: once_differentiable.py). Under a
        # backward_override, the operands before their casts or their FP8 data instead.
        override = plan.backward_override
        x_kept = kept_operand(override, x_q, inp_2d, needs_weight_grad)
        w_kept = kept_operand(override, w_q, weight, needs_input_grad)
        save_for_backward(ctx, *x_kept, *w_kept,
                          weights=(weight,) if needs_weight_grad and hold_weight else ())
        ctx.plan = plan
        ctx.rows, ctx.lead_shape = inp_2d.shape[0], inp.shape[:-1]
        ctx.in_features, ctx.out_features = in_features, out_features
        ctx.inp_dtype, ctx.weight_dtype = inp.dtype, weight.dtype
        return _unpad(out, ctx.rows, ctx.lead_shape, out_features)

    @staticmethod
    @once_differentiable("Linear")
    def backward(ctx, grad_out):
        x_t_fp8, x_t_scale_inv, w_t_fp8, w_t_scale_inv = saved_operands(ctx)
        needs_input_grad, needs_weight_grad, needs_bias_grad = ctx.needs_input_grad[:3]
        plan = ctx.plan
        g_2d = grad_out if grad_out.dim() == 2 else grad_out.reshape(-1, ctx.out_features)
        if plan.backward_override is not None:
            return (*_high_precision_backward(ctx, g_2d, (x_t_fp8, x_t_scale_inv),
                                              (w_t_fp8, w_t_scale_inv)), None, None, None)
        plan.on_backward()  # the grad_output update runs when this backward pass ends
        # The bias gradient comes from the same read of grad_output as its cast.
        g_q, grad_bias = plan.grad_quantizer.cast_grad_output(
            g_2d, with_transpose=needs_weight_grad, with_dbias=needs_bias_grad)
        grad_inp = grad_weight = None
        if needs_input_grad:
            # dgrad [M, K] = grad_out [M, N] @ weight [N, K]; the b operand is weight^T [K, N]
            grad_inp = plan.gemm(g_q.data, g_q.scale_inv, w_t_fp8, w_t_scale_inv, ctx.inp_dtype,
                                 fast_accum=plan.fast_accum[1])
            grad_inp = _unpad(grad_inp, ctx.rows, ctx.lead_shape, ctx.in_features)
        if needs_weight_grad:
            # wgrad [N, K] = grad_out^T [N, M] @ input [M, K]; the b operand is input^T [K, M]
            grad_weight = plan.gemm(g_q.data_t, g_q.scale_inv_t, x_t_fp8, x_t_scale_inv,
                                    ctx.weight_dtype, fast_accum=plan.fast_accum[2])
        if needs_bias_grad and grad_bias.dtype != ctx.bias_dtype:
            grad_bias = grad_bias.to(ctx.bias_dtype)
        return grad_inp, grad_weight, grad_bias, None, None, None


def _high_precision_backward(ctx, g_2d, x_kept, w_kept) -> tuple:
    """(grad input, grad weight, grad bias) under a backward_override: torch's matmuls in the
    forward's output dtype on the kept operands (quantization/backward_override.py)."""
    needs_input_grad, needs_weight_grad, needs_bias_grad = ctx.needs_input_grad[:3]
    compute = ctx.plan.out_dtype
    grad_inp = grad_weight = grad_bias = None
    if needs_input_grad:
        weight = backward_override.operand(w_kept, ctx.out_features, compute)
        grad_inp = backward_override.dgrad(g_2d, weight, compute, ctx.inp_dtype)
        grad_inp = grad_inp.reshape(*ctx.lead_shape, ctx.in_features)
    if needs_weight_grad:
        inp = backward_override.operand(x_kept, ctx.rows, compute)
        grad_weight = backward_override.wgrad(g_2d, inp, compute, ctx.weight_dtype)
    if needs_bias_grad:
        grad_bias = backward_override.bias_grad(g_2d.to(compute), ctx.bias_dtype)
    return grad_inp, grad_weight, grad_bias


def _unpad(out: torch.Tensor, rows: int, lead_shape, features: int) -> torch.Tensor:
    """The GEMM output [padded rows, features] as [*lead_shape, features] (not a view)."""
    return function_output(out, rows, (*lead_shape, features))


class LinearLayer(TensorParallelMixin, TeModuleMixin, Fp8StateMixin, torch.nn.Module):
    """What an FP8 linear layer is, Linear and Conv1D alike: everything of Linear but its
    torch.nn.Linear base, which Conv1D (its weight stored transposed, [in, out]) must not
    have: code written for nn.Linear (peft's LoRA merge, DoRA) reads an nn.Linear's weight
    as [out, in]."""

    _NO_BIAS_RETURNS_NONE = True  # return_bias without a bias: None, as Transformer Engine 2.x

    _supports_tensor_parallel = True

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None,
                 dtype: Optional[torch.dtype] = None, *,
                 params_dtype: Optional[torch.dtype] = None, recipe: Optional[Recipe] = None,
                 init_method: Optional[Callable] = None, return_bias: bool = False,
                 parameters_split=None, fuse_wgrad_accumulation: bool = False,
                 delay_wgrad_compute: bool = False, fp8_all_gather: bool = False,
                 **te_options):
        if isinstance(device, torch.dtype):
            raise TypeError(f"Linear: argument 'device' must be a device, got the dtype {device} "
                            "(the fourth argument is device, as in torch.nn.Linear; pass the "
                            "dtype as dtype= or params_dtype=)")
        if isinstance(device, bool) or isinstance(dtype, bool):
            # Transformer Engine's Linear takes (in, out, sequence_parallel,
            # fuse_wgrad_accumulation, ...) positionally; this one torch.nn.Linear's order.
            raise TypeError("Linear: positional arguments follow torch.nn.Linear (in_features, "
                            "out_features, bias, device, dtype), not Transformer Engine's "
                            "(in_features, out_features, sequence_parallel, "
                            f"fuse_wgrad_accumulation, ...); got device={device!r}, "
                            f"dtype={dtype!r}: pass Transformer Engine's options by keyword")
        in_features = _feature_count("in_features", in_features)
        out_features = _feature_count("out_features", out_features)
        rng = weight_rng("Linear", te_options.pop("get_rng_state_tracker", None),
                         te_options.pop("rng_tracker_name", None))
        whole_out = out_features
        in_features, out_features, parallel = te_tensor_parallel.configure(
            "Linear", in_features, out_features, te_options)  # (the local shard's sizes)
        check_te_options("Linear", te_options)
        te_tensor_parallel.check_combination("Linear", parallel, fp8_all_gather)
        if dtype is not None and params_dtype is not None and dtype != params_dtype:
            raise ValueError(f"Linear: 'dtype' ({dtype}) and 'params_dtype' ({params_dtype}) are "
                             "two names for the parameters' dtype and must agree; pass one")
        parts = split_sizes("Linear", parameters_split, whole_out,
                            te_tensor_parallel.split_shards(parallel))
        check_fp8_all_gather("Linear", fp8_all_gather, parameters_split=parts,
                             fuse_wgrad_accumulation=fuse_wgrad_accumulation,
                             delay_wgrad_compute=delay_wgrad_compute)
        super().__init__(in_features, out_features, bias=bias, device=device,
                         dtype=dtype if dtype is not None else params_dtype)
        self._init_te_module(fuse_wgrad_accumulation, delay_wgrad_compute)
        self._weight_rng = rng
        self.return_bias = bool(return_bias)
        self.init_method = init_method
        weight, bias_param = self._parameters.pop("weight"), self._parameters.pop("bias")
        self._register_gemm_parameter("weight", weight.data if parts else weight, parts)
        self._register_gemm_parameter(
            "bias", None if bias_param is None else (bias_param.data if parts else bias_param),
            parts)
        if init_method is not None and not weight.is_meta:
            self._init_te_parameters()
        elif rng is not None and not weight.is_meta:
            # (torch.nn.Linear's initialisation drew them from the default generator)
            self._draw_default_weights()
        if recipe is None:
            recipe = model_init.init_recipe()  # from quantized_model_init, if any
        te_tensor_parallel.attach(self, parallel)
        self._register_fp8_state(self.weight_nk().device, history_len_for(recipe))
        self.prepare_fp8_recipe(recipe)
        if fp8_all_gather:
            enable_fp8_all_gather(self)
        make_fp8_primary_weights(self)  # inside quantized_model_init

    def _init_converted(self) -> None:
        """The Transformer Engine attributes of an nn.Linear that convert_to_fp8 turned into
        this class: the defaults."""
        self._init_te_module()
        self._parts = {"weight": ["weight"], "bias": ["bias"]}  # (None until one is set)
        self.return_bias = False
        self.init_method = None
        self._weight_rng = None

    def _init_te_parameters(self) -> None:
        """init_method on each weight Parameter (each part of a split weight, as Transformer
        Engine does: a fan-based init sees the part's shape), zero biases."""
        with drawing_weights(self):
            for weight in self._parameters_of("weight"):
                self.init_method(weight)
        with torch.no_grad():
            for bias in self._parameters_of("bias"):
                if bias is not None:
                    bias.zero_()

    def _draw_default_weights(self) -> None:
        """torch.nn.Linear's weight initialisation, part by part (the same fan-in), inside the
        tracker's fork where the layer has one."""
        with drawing_weights(self):
            for param in self._parameters_of("weight"):
                torch.nn.init.kaiming_uniform_(param, a=math.sqrt(5))

    def weight_nk(self, routed: bool = False) -> torch.Tensor:
        """The weight as [out_features, in_features] (the Parameter itself, or its parts joined
        with parameters_split; a view in Conv1D, which stores it transposed)."""
        return self._param("weight", routed)

    def _gemm_bias(self):
        """The bias the GEMM adds (None with return_bias: it is returned instead; a
        row-parallel layer replaces this method by one that gives None: it adds the bias after
        the ranks' sum, te_tensor_parallel.py)."""
        return None if self.return_bias else self._param("bias")

    def _high_precision(self, inp: torch.Tensor, linear=F.linear) -> torch.Tensor:
        """What the layer computes outside fp8_autocast: torch.nn.Linear's forward."""
        return linear(inp, self.weight_nk(routed=True), self._gemm_bias())

    def _gemm_dims(self):
        return [(self.out_features, self.in_features)]

    def fp8_weights(self) -> list[torch.Tensor]:
        return [self._param("weight", routed=False)]  # (weight_nk(), one call less per step)

    def reset_parameters(self, defer_init: Optional[bool] = False) -> None:
        if defer_init:  # (Transformer Engine's: the caller initialises later)
            return
        if not hasattr(self, "_parts"):  # nn.Linear.__init__ calls this first
            super().reset_parameters()
            return
        if self.init_method is not None:
            self._init_te_parameters()
        else:
            self._draw_default_weights()
            for param in self._parameters_of("bias"):
                if param is not None:
                    bound = 1 / math.sqrt(self.in_features) if self.in_features > 0 else 0
                    torch.nn.init.uniform_(param, -bound, bound)
        self.reset_fp8_state()

    # ---- forward ---------------------------------------------------------------------------

    def forward(self, inp: torch.Tensor, is_first_microbatch: Optional[bool] = None,
                fp8_output: bool = False, fp8_grad: bool = False):
        if self._te_tp is not None:  # Transformer Engine's tensor parallelism: collectives
            return te_tensor_parallel.forward(self, inp, is_first_microbatch, fp8_output,
                                              fp8_grad)
        if self._fused_ticket is not None:  # the C++ step of the last forward, if it holds
            if is_first_microbatch is None and not fp8_output and not fp8_grad:
                out = ticketed_linear_step(self, inp)
                if out is not None:
                    return out
            else:  # (is_first_microbatch: the full path keeps or reuses a quantised weight)
                self.__dict__["_fused_ticket"] = None
        if fp8_output or fp8_grad:
            check_forward_flags("Linear", fp8_output, fp8_grad)
        if self._wgrad is not None:  # (no attribute write otherwise: torch.compile)
            self._wgrad_first = is_first_microbatch
        out = self._dispatch(inp, is_first_microbatch, self.in_features)
        if getattr(self, "return_bias", False):
            return out, self._returned_bias("bias", out)
        return out

    # The common cases (DelayedScaling, a plain weight) as one C++ operator, tried first by
    # base.py's _dispatch.
    _fused_step = staticmethod(fused_linear_step)

    def _fp8_apply(self, inp, plans):
        weight, bias = self.weight_nk(routed=True), self._gemm_bias()
        if is_dtensor(weight):  # tensor parallelism: the GEMMs on the local shards
            return sharded_linear(_Fp8LinearFunction.apply, self, inp, weight, bias, plans[0])
        return _Fp8LinearFunction.apply(inp, weight, bias, plans[0], True,
                                        self._weight_held("weight"))

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self._has('bias')}, fp8=True")


def _feature_count(name: str, value) -> int:
    """An int >= 0 (0: torch.nn.Linear's empty layer; numpy integers too, as there)."""
    try:
        count = operator.index(value) if not isinstance(value, bool) else None
    except TypeError:
        count = None
    if count is None:
        raise TypeError(f"Linear: {name} must be an int, got {type(value).__name__} {value!r}")
    if count < 0:
        raise ValueError(f"Linear: {name} must be >= 0, got {count}")
    return count


class Linear(LinearLayer, torch.nn.Linear):
    """Drop-in for torch.nn.Linear (same parameters, initialisation and state_dict keys, plus the
    FP8 state). Outside fp8_autocast, or with enabled=False, it computes what nn.Linear does.

    Inside fp8_autocast: input and weight are cast to FP8 (E4M3 with HYBRID) and multiplied by a
    cuBLASLt FP8 GEMM; backward casts grad_output (E5M2 with HYBRID) and runs dgrad and wgrad in
    FP8. Any number of rows works. Layers whose in_features or out_features is not a multiple of
    16, and float64 inputs, run in high precision (with a one-time warning).

    Arguments as torch.nn.Linear's (in_features, out_features, bias, device, dtype), then, by
    keyword, Transformer Engine's: params_dtype (another name for dtype), init_method (called on
    the weight, bias zeroed; default: nn.Linear's initialisation), return_bias (forward returns
    (out, bias) without adding it), parameters_split (the weight and bias as several Parameters,
    e.g. query_weight / key_weight / value_weight), fuse_wgrad_accumulation and
    delay_wgrad_compute (wgrad.py); tp_group, tp_size, parallel_mode ("column", "row") and
    sequence_parallel: Transformer Engine's tensor parallelism, the layer holding its shard
    (te_tensor_parallel.py); its other parallelism options are accepted at their defaults
    (te_args.py). recipe: the recipe the layer will train with, which sizes its amax histories
    now rather than at the first FP8 forward. fp8_all_gather: under FSDP2's fully_shard the
    weight is all-gathered in FP8 (fsdp/all_gather.py; not with parameters_split,
    fuse_wgrad_accumulation or delay_wgrad_compute). Tensor parallelism: parallelize_module's
    ColwiseParallel and RowwiseParallel (tensor_parallel.py).
    """


def strip_fp8_state(state_dict: dict) -> dict:
    """A copy of a state_dict without the FP8 state (and the scale_invs of FP8 weights, whose
    dequantised values it keeps), loadable into plain torch.nn.Linear models with strict=True."""
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"strip_fp8_state: state_dict must be a mapping (a module's "
                        f"state_dict()), got {type(state_dict).__name__}")
    return {k: v for k, v in state_dict.items()
            if k.rsplit(".", 1)[-1] not in FP8_STATE_KEYS and not k.endswith(SCALE_INV_SUFFIX)}
