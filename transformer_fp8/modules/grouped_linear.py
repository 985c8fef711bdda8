"""GroupedLinear (Transformer Engine's module): G independent Linear layers applied to G
consecutive row blocks of one input, the experts of a mixture-of-experts layer.

forward(inp, m_splits): the rows of inp [tokens, in_features] (or [..., in_features], taken as
rows) are split into blocks of m_splits[i] rows (sum = tokens; a block may be empty); block i
goes through weight{i} / bias{i}; the results are joined in the same order. It is one module
with G GEMMs on Fp8StateMixin: each expert has its own input, weight and grad_output scales
(forward history columns 2i, 2i+1, backward column i), and its GEMMs run in FP8 as Linear's do.
Outside fp8_autocast it computes exactly torch.cat([F.linear(x_i, weight{i}, bias{i})]).
"""
from __future__ import annotations

import operator
from typing import Callable, Optional, Sequence, Union

import torch
import torch.nn.functional as F

from ..quantization import model_init
from ..quantization.history import history_len_for
from .base import Fp8StateMixin
from .fp8_primary_weights import make_fp8_primary_weights
from .linear import _Fp8LinearFunction
from ..quantization.recipe import Recipe
from .te_args import (check_positive, check_te_options, one_dtype, te_default_init,
                      te_only_arguments)
from .te_module import TeModuleMixin
from .weight_rng import drawing_weights, weight_rng


def _as_int(value) -> Optional[int]:
    """An integer m_splits entry as a Python int (a numpy integer too); None for anything else
    (a bool, a float)."""
    if type(value) is int:
        return value
    if isinstance(value, bool):
        return None
    if isinstance(value, torch.Tensor) and (value.dim() != 0 or value.dtype == torch.bool):
        return None  # (operator.index takes a one-element tensor and a bool tensor)
    try:
        return operator.index(value)
    except TypeError:
        return None


class GroupedLinear(TeModuleMixin, Fp8StateMixin, torch.nn.Module):
    """Transformer Engine's GroupedLinear: num_gemms Linear layers (Parameters weight0..,
    bias0..) over the row blocks m_splits of one input; see the module docstring.

    Arguments in Transformer Engine's order: init_method (each weight; default normal with std
    0.023, biases zero), bias, return_bias (forward returns (out, [bias0, ...]) without adding
    them; empty tensors with bias=False), params_dtype (or dtype), device,
    fuse_wgrad_accumulation and delay_wgrad_compute (wgrad.py); the parallelism and layout
    options are accepted at their defaults (te_args.py). recipe sizes the amax histories.
    """
    _TE_STATE_LAYOUT = "grouped_linear"  # by role up to Transformer Engine 2.2, then by GEMM

    def __init__(self, num_gemms: int, in_features: int, out_features: int,
                 sequence_parallel: bool = False, fuse_wgrad_accumulation: bool = False,
                 tp_group=None, tp_size: int = 1, get_rng_state_tracker=None,
                 rng_tracker_name=None, init_method: Optional[Callable] = None,
                 bias: bool = True, return_bias: bool = False,
                 params_dtype: Optional[torch.dtype] = None, parallel_mode=None, device=None,
                 ub_overlap_rs: bool = False, ub_overlap_ag: bool = False, ub_name=None,
                 delay_wgrad_compute: bool = False, save_original_input: bool = False,
                 single_grouped_weight: bool = False, single_grouped_bias: bool = False,
                 name=None, use_grouped_tensor=None, *, dtype: Optional[torch.dtype] = None,
                 recipe: Optional[Recipe] = None):
        owner = "GroupedLinear"
        te_options = te_only_arguments(locals())
        te_options.pop("get_rng_state_tracker"), te_options.pop("rng_tracker_name")
        check_te_options(owner, te_options)
        rng = weight_rng(owner, get_rng_state_tracker, rng_tracker_name)
        super().__init__()
        self.num_gemms = check_positive(owner, "num_gemms", num_gemms)
        self.in_features = check_positive(owner, "in_features", in_features)
        self.out_features = check_positive(owner, "out_features", out_features)
        self._init_te_module(fuse_wgrad_accumulation, delay_wgrad_compute)
        self._weight_rng = rng
        self.return_bias = bool(return_bias)
        self.init_method = init_method or te_default_init
        factory = dict(device=device, dtype=one_dtype(owner, dtype, params_dtype))
        for i in range(num_gemms):  # weight0, bias0, weight1, ...: Transformer Engine's order
            self._register_gemm_parameter(f"weight{i}", torch.empty(out_features, in_features,
                                                                    **factory))
            self._register_gemm_parameter(f"bias{i}",
                                          torch.zeros(out_features, **factory) if bias else None)
        if recipe is None:
            recipe = model_init.init_recipe()  # from quantized_model_init, if any
        self._register_fp8_state(self.weight0.device, history_len_for(recipe), num_gemms)
        self.prepare_fp8_recipe(recipe)
        self._m_splits: list[int] = []
        if not self.weight0.is_meta:
            self._init_parameters()
        make_fp8_primary_weights(self)  # inside quantized_model_init

    def _init_parameters(self) -> None:
        with drawing_weights(self):
            for i in range(self.num_gemms):
                self.init_method(getattr(self, f"weight{i}"))
        for i in range(self.num_gemms):
            bias = getattr(self, f"bias{i}")
            if bias is not None:
                with torch.no_grad():
                    bias.zero_()

    def reset_parameters(self, defer_init: Optional[bool] = False) -> None:
        """Initialise the parameters again and start a fresh FP8 state (Transformer Engine's
        defer_init=True: do nothing, the caller initialises later)."""
        if defer_init:
            return
        self._init_parameters()
        self.reset_fp8_state()

    def _gemm_dims(self):
        return [(self.out_features, self.in_features)] * self.num_gemms

    def fp8_weights(self) -> list[torch.Tensor]:
        return [self._param(f"weight{i}", routed=False) for i in range(self.num_gemms)]

    def _gemm_bias(self, i: int):
        return None if self.return_bias else self._param(f"bias{i}")

    # ---- forward ---------------------------------------------------------------------------

    def _check_splits(self, m_splits, rows: int) -> list[int]:
        owner = "GroupedLinear"
        if isinstance(m_splits, torch.Tensor):
            if m_splits.dim() != 1 or m_splits.is_floating_point():
                raise ValueError(f"{owner}: m_splits must be a 1-D integer tensor or a list of "
                                 f"ints, got a tensor of shape {tuple(m_splits.shape)} and "
                                 f"dtype {m_splits.dtype}")
            m_splits = m_splits.tolist()  # the block sizes are needed on the host
        splits = [_as_int(m) for m in m_splits]  # (numpy integers too, as Transformer Engine)
        if len(splits) != self.num_gemms or any(m is None or m < 0 for m in splits):
            raise ValueError(f"{owner}: m_splits must hold {self.num_gemms} non-negative "
                             f"integers (one per GEMM), got {m_splits!r}")
        if sum(splits) != rows:
            raise ValueError(f"{owner}: m_splits must add up to the input's {rows} rows, got "
                             f"{splits} (sum {sum(splits)})")
        return splits

    def forward(self, inp: torch.Tensor, m_splits: Union[Sequence[int], torch.Tensor],
                is_first_microbatch: Optional[bool] = None, out=None, dgrad_out=None):
        for name, value in (("out", out), ("dgrad_out", dgrad_out)):
            if value is not None:
                raise ValueError(f"GroupedLinear.forward: {name} (a preallocated buffer) is not "
                                 "supported; leave it at None")
        if not isinstance(inp, torch.Tensor):
            raise TypeError(f"GroupedLinear.forward: inp must be a tensor, got "
                            f"{type(inp).__name__}")
        rows = inp.numel() // inp.shape[-1] if inp.dim() and inp.shape[-1] else 0
        self._m_splits = self._check_splits(m_splits, rows)
        if self._wgrad is not None:  # (no attribute write otherwise: torch.compile)
            self._wgrad_first = is_first_microbatch
        result = self._dispatch(inp, is_first_microbatch, self.in_features)
        if self.return_bias:
            return result, [self._returned_bias(f"bias{i}", result)
                            for i in range(self.num_gemms)]
        return result

    def _per_gemm(self, inp: torch.Tensor, gemm: Callable) -> torch.Tensor:
        """gemm(i, rows of expert i) for every expert, joined in order."""
        x = inp.reshape(-1, self.in_features)
        outs = [gemm(i, block) for i, block in enumerate(x.split(self._m_splits))]
        return torch.cat(outs).reshape(*inp.shape[:-1], self.out_features)

    def _high_precision(self, inp: torch.Tensor, linear=F.linear) -> torch.Tensor:
        return self._per_gemm(
            inp, lambda i, x: linear(x, self._param(f"weight{i}"), self._gemm_bias(i)))

    def _fp8_apply(self, inp, plans):
        return self._per_gemm(inp, lambda i, x: _Fp8LinearFunction.apply(
            x, self._param(f"weight{i}"), self._gemm_bias(i), plans[i]))

    def extra_repr(self) -> str:
        return (f"num_gemms={self.num_gemms}, in_features={self.in_features}, "
                f"out_features={self.out_features}, bias={self.bias0 is not None}, fp8=True")
