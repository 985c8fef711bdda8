"""What LayerNormLinear and LayerNormMLP share: a norm over the input, then FP8 GEMMs.

NormFirstModule holds the norm's parameters (layer_norm_weight, layer_norm_bias), the FP8 state
of its GEMMs (Fp8StateMixin, which also dispatches the forward: high precision outside
fp8_autocast, the subclass's FP8 autograd function inside it), the arguments these modules share
and Transformer Engine's return convention.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..quantization import model_init
from ..quantization.history import history_len_for
from .base import Fp8StateMixin
from .fp8_primary_weights import make_fp8_primary_weights
from .normalization import (NormStep, check_eps, check_normalization,
                            check_zero_centered_gamma, norm_hp, reset_norm_parameters)
from .te_args import check_positive, check_te_options, te_default_init  # noqa: F401
from .te_module import TeModuleMixin
from .weight_rng import weight_rng

# (Re-exported: other modules import them from here.)
check_unsupported = check_te_options

# The norm's options, checked as the constructor checks them when set on a built module.
_NORM_OPTIONS = {"normalization": check_normalization, "eps": check_eps,
                 "zero_centered_gamma": check_zero_centered_gamma}


class NormFirstModule(TeModuleMixin, Fp8StateMixin, torch.nn.Module):
    """Base of the modules that normalise their input and then run FP8 GEMMs. Subclasses set
    ``_gemm_dims()`` (the (out, in) features of each GEMM), ``fp8_weights()``,
    ``_high_precision(inp, linear=F.linear)`` (the torch composition, its GEMMs done by
    ``linear``) and ``_fp8_apply(inp, plans)``."""

    def __setattr__(self, name, value):
        check = _NORM_OPTIONS.get(name)
        if check is not None and "_norm_step" in self.__dict__:
            if (name == "normalization" and check(value) == "RMSNorm"
                    and self.layer_norm_bias is not None):
                raise ValueError(
                    f"{type(self).__name__}: normalization='RMSNorm' has no bias, and this "
                    "module's layer_norm_bias would be left unused (its gradient None); remove "
                    "it first (module.layer_norm_bias = None) or build the module with "
                    "normalization='RMSNorm'")
            # The Python path's norm runs from _norm_step, the C++ steps and the
            # high-precision form from the attributes: a change after construction (layer.eps
            # = ...) reaches all of them (the Python path kept the constructor's values).
            super().__setattr__(name, check(value))
            super().__setattr__("_norm_step", NormStep(self.normalization, self.eps,
                                                       self.zero_centered_gamma))
            return
        super().__setattr__(name, value)

    def _init_options(self, te_options: dict, dtype, params_dtype, return_bias,
                      return_layernorm_output, init_method, fuse_wgrad_accumulation=False,
                      delay_wgrad_compute=False) -> Optional[torch.dtype]:
        """The arguments every such module takes; returns the parameters' dtype."""
        name = type(self).__name__
        rng = weight_rng(name, te_options.pop("get_rng_state_tracker", None),
                         te_options.pop("rng_tracker_name", None))
        check_te_options(name, te_options)
        self._init_te_module(fuse_wgrad_accumulation, delay_wgrad_compute)
        self._weight_rng = rng
        if dtype is not None and params_dtype is not None and dtype != params_dtype:
            raise ValueError(f"{name}: 'dtype' ({dtype}) and 'params_dtype' ({params_dtype}) "
                             "name the same thing and must agree; pass one")
        self.return_bias = bool(return_bias)
        self.return_layernorm_output = bool(return_layernorm_output)
        self.init_method = init_method or te_default_init
        return dtype or params_dtype

    def _init_norm(self, hidden_size: int, eps, normalization, zero_centered_gamma, device,
                   dtype) -> None:
        """The norm's options and Parameters, registered first (Transformer Engine's parameter
        order: layer_norm_weight, layer_norm_bias, then the GEMMs' weights and biases, so that
        an optimizer state_dict of Transformer Engine's module fits, parameter for parameter)."""
        self.eps = check_eps(eps)
        self.normalization = check_normalization(normalization)
        self.zero_centered_gamma = check_zero_centered_gamma(zero_centered_gamma)
        fill = torch.zeros if self.zero_centered_gamma else torch.ones
        factory = dict(device=device, dtype=dtype)
        self.layer_norm_weight = torch.nn.Parameter(fill(hidden_size, **factory))
        self.layer_norm_bias = torch.nn.Parameter(torch.zeros(hidden_size, **factory)) \
            if self.normalization == "LayerNorm" else None
        self._norm_step = NormStep(self.normalization, self.eps, self.zero_centered_gamma)

    def _init_state(self, recipe, num_gemms: int) -> None:
        """The FP8 state, after the Parameters."""
        if recipe is None:
            recipe = model_init.init_recipe()  # from quantized_model_init, if any
        self._register_fp8_state(self.layer_norm_weight.device, history_len_for(recipe),
                                 num_gemms)
        self.prepare_fp8_recipe(recipe)

    def _initialise(self) -> None:
        """The last step of __init__: initial values, unless built on "meta" (then the caller
        initialises after to_empty())."""
        if not self.layer_norm_weight.is_meta:
            self._init_parameters()
        make_fp8_primary_weights(self)  # inside quantized_model_init

    def reset_parameters(self, defer_init: Optional[bool] = False) -> None:
        """Initialise the parameters again and start a fresh FP8 state (Transformer Engine's
        defer_init=True: do nothing, the caller initialises later)."""
        if defer_init:
            return
        self._init_parameters()
        self.reset_fp8_state()

    def _forward(self, inp, is_first_microbatch, in_features, returned_bias: str):
        """Transformer Engine's return convention: out, then the bias ``returned_bias`` names
        if return_bias (it was not added; empty without one), then the norm's output if
        return_layernorm_output."""
        if self._wgrad is not None:  # (no attribute write otherwise: torch.compile)
            self._wgrad_first = is_first_microbatch
        result = self._dispatch(inp, is_first_microbatch, in_features)
        out, ln_out = result if self.return_layernorm_output else (result, None)
        if ln_out is not None and ln_out.dtype != out.dtype:
            # Under torch.autocast the FP8 path's norm output is in the input's dtype: returned
            # in the autocast dtype, as the high-precision path (and Transformer Engine) return it.
            ln_out = ln_out.to(out.dtype)
        outputs = [out]
        if self.return_bias:
            outputs.append(self._returned_bias(returned_bias, out))
        if self.return_layernorm_output:
            outputs.append(ln_out)
        return outputs[0] if len(outputs) == 1 else tuple(outputs)

    def _norm_hp(self, inp: torch.Tensor) -> torch.Tensor:
        """The norm in torch ops (the first step of the high-precision form)."""
        return norm_hp(inp, self.normalization, self.layer_norm_weight, self.layer_norm_bias,
                       self.eps, self.zero_centered_gamma)

    def reset_norm_parameters(self) -> None:
        reset_norm_parameters(self.layer_norm_weight, self.layer_norm_bias,
                              self.zero_centered_gamma)
