"""What LayerNormLinear and LayerNormMLP share: a norm over the input, then FP8 GEMMs.

NormFirstModule holds the norm's parameters (layer_norm_weight, layer_norm_bias), the FP8 state
of its GEMMs (Fp8StateMixin, which also dispatches the forward: high precision outside
fp8_autocast, the subclass's FP8 autograd function inside it), the arguments these modules share
and Transformer Engine's return convention.
"""
from __future__ import annotations

from typing import Optional

import torch

from . import fp8_context as _autocast
from .fp8_state import Fp8StateMixin, history_len_for
from .normalization import (NormStep, check_eps, check_normalization, norm_hp,
                            reset_norm_parameters)

# Transformer Engine arguments for tensor/sequence parallelism, communication overlap and the
# like: accepted with their default (off) values so that a model definition runs unchanged,
# refused when switched on.
_PARALLEL_DEFAULTS = {"sequence_parallel": False, "fuse_wgrad_accumulation": False,
                      "tp_group": None, "tp_size": 1, "parallel_mode": None,
                      "get_rng_state_tracker": None, "return_layernorm_output_gathered": False,
                      "parameters_split": None, "set_parallel_mode": False}


_LABELS = ("name",)  # Transformer Engine's debugging label: accepted, unused


def check_unsupported(owner: str, options: dict) -> None:
    """Refuse a Transformer Engine option this library does not implement, unless it has its
    default (off) value; refuse an unknown keyword as Python would."""
    for name, value in options.items():
        if name in _LABELS:
            continue
        if not (name.startswith("ub_") or name in _PARALLEL_DEFAULTS):
            raise TypeError(f"{owner}() got an unexpected keyword argument {name!r}")
        default = _PARALLEL_DEFAULTS.get(name, False)
        if value is not None and value != default:
            raise ValueError(f"{owner}: {name}={value!r} is not supported (no tensor or "
                             "sequence parallelism, no communication overlap); leave it at "
                             f"{default!r}")


def te_default_init(weight: torch.Tensor) -> None:
    """Transformer Engine's default weight initialisation: normal, std 0.023."""
    with torch.no_grad():
        torch.nn.init.normal_(weight, mean=0.0, std=0.023)


def check_positive(owner: str, name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{owner}: {name} must be a positive integer, got {value!r}")
    return value


class NormFirstModule(Fp8StateMixin, torch.nn.Module):
    """Base of the modules that normalise their input and then run FP8 GEMMs. Subclasses set
    ``_gemm_dims()`` (the (out, in) features of each GEMM), ``fp8_weights()``,
    ``_high_precision(inp, linear=F.linear)`` (the torch composition, its GEMMs done by
    ``linear``) and ``_fp8_apply(inp, plans)``."""

    def _init_options(self, te_options: dict, dtype, params_dtype, return_bias,
                      return_layernorm_output, init_method) -> Optional[torch.dtype]:
        """The arguments every such module takes; returns the parameters' dtype."""
        name = type(self).__name__
        check_unsupported(name, te_options)
        if dtype is not None and params_dtype is not None and dtype != params_dtype:
            raise ValueError(f"{name}: 'dtype' ({dtype}) and 'params_dtype' ({params_dtype}) "
                             "name the same thing and must agree; pass one")
        self.return_bias = bool(return_bias)
        self.return_layernorm_output = bool(return_layernorm_output)
        self.init_method = init_method or te_default_init
        return dtype or params_dtype

    def _init_norm_and_state(self, hidden_size: int, eps, normalization, zero_centered_gamma,
                             device, dtype, recipe, num_gemms: int) -> None:
        self.eps = check_eps(eps)
        self.normalization = check_normalization(normalization)
        self.zero_centered_gamma = bool(zero_centered_gamma)
        fill = torch.zeros if self.zero_centered_gamma else torch.ones
        factory = dict(device=device, dtype=dtype)
        self.layer_norm_weight = torch.nn.Parameter(fill(hidden_size, **factory))
        self.layer_norm_bias = torch.nn.Parameter(torch.zeros(hidden_size, **factory)) \
            if self.normalization == "LayerNorm" else None
        if recipe is None:
            recipe = _autocast.init_recipe()  # from quantized_model_init, if any
        self._register_fp8_state(self.layer_norm_weight.device, history_len_for(recipe),
                                 num_gemms)
        self.prepare_fp8_recipe(recipe)
        self._norm_step = NormStep(self.normalization, self.eps, self.zero_centered_gamma)

    def _initialise(self) -> None:
        """The last step of __init__: initial values, unless built on "meta" (then the caller
        initialises after to_empty())."""
        if not self.fp8_weights()[0].is_meta:
            self._init_parameters()

    def reset_parameters(self) -> None:
        self._init_parameters()
        self.reset_fp8_state()

    def _forward(self, inp, is_first_microbatch, in_features, returned_bias):
        """Transformer Engine's return convention: out, then the bias if return_bias (it was
        not added), then the norm's output if return_layernorm_output."""
        result = self._dispatch(inp, is_first_microbatch, in_features)
        out, ln_out = result if self.return_layernorm_output else (result, None)
        outputs = [out]
        if self.return_bias:
            outputs.append(returned_bias)
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
