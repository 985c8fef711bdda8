"""What LayerNormLinear and LayerNormMLP share: a norm over the input, then FP8 GEMMs.

NormFirstModule holds the norm's parameters (layer_norm_weight, layer_norm_bias), the FP8 state
of its GEMMs (Fp8StateMixin) and the forward's dispatch: high precision outside fp8_autocast
(the torch composition, exactly), the FP8 autograd function of the subclass inside it.
"""
from __future__ import annotations

import warnings
from typing import Optional

import torch

from . import fp8_context as _autocast
from .blockwise_linear import blockwise_linear, is_block_recipe
from .fp8_state import ALIGN, FP8_INPUT_DTYPES, Fp8StateMixin, history_len_for
from .normalization import NormStep, check_eps, check_normalization, reset_norm_parameters

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
        self._warned_high_precision = False

    def reset_norm_parameters(self) -> None:
        reset_norm_parameters(self.layer_norm_weight, self.layer_norm_bias,
                              self.zero_centered_gamma)

    def _fp8_or_high_precision(self, inp: torch.Tensor, is_first_microbatch, in_features):
        """The module's output: FP8 inside an enabled fp8_autocast, else the torch
        composition."""
        name = type(self).__name__
        if inp.shape[-1:] != (in_features,):
            raise ValueError(f"{name}: input must have shape [..., {in_features}], "
                             f"got {tuple(inp.shape)}")
        if self._in_recompute():
            return self._fp8_replay(inp)
        state = _autocast.current_state()
        if state is None or not state.enabled:
            return self._high_precision(inp)
        weight_dtype = self.fp8_weights()[0].dtype
        if inp.dtype != weight_dtype and not torch.is_autocast_enabled(inp.device.type):
            raise RuntimeError(f"{name}: input dtype {inp.dtype} differs from the weights' "
                               f"{weight_dtype}, which the torch composition refuses too; cast "
                               "the input or the module, or run under torch.autocast")
        dims = [d for out_in in self._gemm_dims() for d in out_in]
        if any(d % ALIGN for d in dims) or inp.dtype not in FP8_INPUT_DTYPES:
            if not self._warned_high_precision:
                warnings.warn(f"transformer_fp8.{name} with GEMM sizes {self._gemm_dims()} and "
                              f"{inp.dtype} input runs in high precision: FP8 GEMMs need sizes "
                              "that are multiples of 16 and a float32, bfloat16 or float16 "
                              "input.", stacklevel=3)
                self._warned_high_precision = True
            return self._high_precision(inp)
        if is_block_recipe(state.recipe):
            # Per-block scales come from each tensor as it is cast: the torch composition with
            # its GEMMs block-scaled (no fused norm or activation cast, no FP8 state).
            def linear(x, weight, bias):
                return blockwise_linear(x, weight, bias, state.recipe)
            return self._high_precision(inp, linear)
        return self._fp8_run(inp, state, is_first_microbatch)


def split_outputs(out, ln_out: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                  return_bias: bool, return_layernorm_output: bool):
    """Transformer Engine's return convention: out, then the bias (if return_bias: it was not
    added), then the norm's output (if return_layernorm_output)."""
    result = [out]
    if return_bias:
        result.append(bias)
    if return_layernorm_output:
        result.append(ln_out)
    return result[0] if len(result) == 1 else tuple(result)
