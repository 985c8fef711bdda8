"""FP8 primary weights (Transformer Engine's ``quantized_model_init``): the FP8 modules built
inside ``quantized_model_init(enabled=True, recipe=...)`` hold each GEMM weight as an Fp8Weight
(quantization/fp8_weight.py), 1 byte per element and its scale, instead of a high-precision
Parameter.

* At construction the initialised weight is quantised with its own scale (DelayedScaling: that
  scale and the weight's amax become the layer's weight state, see WeightCast); with
  ``preserve_high_precision_init_val=True`` the initial value is kept on the CPU
  (``param.get_high_precision_init_val()``, ``param.clear_high_precision_init_val()``) to seed a
  master copy.
* The weight gradient reaches the parameter in its nominal dtype; an optimizer on a master copy
  writes back with ``param.copy_(master)``, which quantises (see WeightCast for the scale).
* ``state_dict`` holds the dequantised weight (a plain tensor of its nominal dtype, loadable by
  a high-precision module) and ``<name>_fp8_scale_inv``, the scale_inv it was cast with; loading
  both gives back the same FP8 data and scale_inv, bit for bit. A checkpoint without the
  scale_inv (a high-precision one) is quantised with each weight's own scale.

Recipes with one scale per weight only (DelayedScaling, Float8CurrentScaling); block recipes,
weights split into parts (parameters_split), stored transposed (Conv1D), with gradient routing
(fuse_wgrad_accumulation, delay_wgrad_compute), built on "meta", or under FSDP2's FP8
all-gather are refused.
"""
from __future__ import annotations

import torch

from ..quantization import model_init
from ..quantization.fp8_weight import Fp8Weight, WeightCast
from ..quantization.recipe import DelayedScaling, Float8CurrentScaling
from .fsdp.enable import _weight_parameter_names
from .fsdp.weight import ShardedWeight

SCALE_INV_SUFFIX = "_fp8_scale_inv"  # state_dict key of an FP8 weight's scale_inv


def make_fp8_primary_weights(module: torch.nn.Module) -> None:
    """The last step of an FP8 module's constructor: inside an enabled quantized_model_init,
    its GEMM weights become Fp8Weights quantised by the context's recipe (see the module
    docstring); elsewhere nothing changes."""
    settings = model_init.init_fp8_weights()
    if settings is None:
        return
    recipe, preserve = settings
    _check_module(module, recipe)
    for gemm, name in _weight_parameter_names(module):
        param = module._parameters[name]
        with torch.no_grad():
            fp8 = WeightCast(module, gemm, recipe).quantize(param, param.device)
        if preserve:
            fp8.hp_init = param.detach().to("cpu", copy=True)
        module._parameters[name] = torch.nn.Parameter(Fp8Weight(fp8, param.dtype),
                                                      requires_grad=param.requires_grad)
    if not getattr(module, "_fp8_weight_hooks", False):
        module.register_state_dict_post_hook(_plain_weights_in_state_dict)
        module.register_load_state_dict_pre_hook(_fp8_weights_from_state_dict)
        module._fp8_weight_hooks = True
    # The weights' amaxes are recorded when they are written (the optimizer step), not in the
    # forward: a discarded step (an exception, an evaluation forward) must leave them.
    module._fp8_weights_record_on_write = True
    module._bind_scaling_states()


def _check_module(module, recipe) -> None:
    owner = type(module).__name__
    if not isinstance(recipe, (DelayedScaling, Float8CurrentScaling)):
        raise ValueError(
            f"{owner}: quantized_model_init keeps weights in FP8 with one scale per weight "
            f"(DelayedScaling or Float8CurrentScaling), got {type(recipe).__name__}; build the "
            f"module with recipe={type(recipe).__name__}(...) instead, which keeps its weights "
            "in high precision")
    weights = module.fp8_weights()
    if any(w.is_meta for w in weights):
        raise ValueError(f"{owner}: FP8 primary weights (quantized_model_init) are quantised at "
                         "construction and cannot be built on the 'meta' device; build the "
                         "module on a real device")
    if any(isinstance(w, ShardedWeight) for w in weights):
        raise ValueError(f"{owner}: fp8_all_gather=True (FSDP2) does not combine with FP8 "
                         "primary weights (quantized_model_init); use one or the other")
    if len(_weight_parameter_names(module)) != len(weights) or \
            getattr(module, "_wgrad", None) is not None:
        raise ValueError(
            f"{owner}: quantized_model_init cannot keep this module's weights in FP8: each GEMM "
            "weight must be one Parameter with no gradient routing (not parameters_split, e.g. "
            "MultiheadAttention without fuse_qkv_params=True; not a transposed Conv1D weight; "
            "not fuse_wgrad_accumulation or delay_wgrad_compute)")


def has_fp8_weights(module: torch.nn.Module) -> bool:
    return any(isinstance(p, Fp8Weight) for p in module._parameters.values())


def stored_bytes(module: torch.nn.Module) -> int:
    """Bytes held by the parameters and buffers of ``module`` and its children (an FP8 weight:
    its FP8 data, scale and scale_inv)."""
    total = 0
    for tensor in list(module.parameters()) + list(module.buffers()):
        total += tensor.stored_bytes() if isinstance(tensor, Fp8Weight) else \
            tensor.numel() * tensor.element_size()
    return total


def _plain_weights_in_state_dict(module, state_dict, prefix, local_metadata) -> None:
    """state_dict: each FP8 weight as its dequantised value and its scale_inv (plain tensors,
    loadable with torch.load(weights_only=True)); with keep_vars the Parameter is kept."""
    for name, param in module._parameters.items():
        if not isinstance(param, Fp8Weight):
            continue
        key = prefix + name
        if key in state_dict and state_dict[key] is not param:
            state_dict[key] = param.dequantize()
        state_dict[key + SCALE_INV_SUFFIX] = param.fp8_scale_inv.detach().clone()


def _fp8_weights_from_state_dict(module, state_dict, prefix, local_metadata, strict,
                                 missing_keys, unexpected_keys, error_msgs) -> None:
    """load_state_dict: each FP8 weight's entry quantised before the module copies it (an
    Fp8Weight is copied as it is): with the saved scale_inv when the checkpoint has it (the
    same FP8 data again), else with the value's own scale."""
    for name, param in module._parameters.items():
        if not isinstance(param, Fp8Weight):
            continue
        key = prefix + name
        scale_inv = state_dict.pop(key + SCALE_INV_SUFFIX, None)
        value = state_dict.get(key)
        if (not isinstance(value, torch.Tensor) or isinstance(value, Fp8Weight)
                or value.shape != param.shape):
            continue  # nothing to quantise here; torch reports what is wrong with it
        cast = param._fp8.cast
        if scale_inv is not None:
            error = _scale_inv_error(scale_inv)
            if error is not None:
                error_msgs.append(f"{key + SCALE_INV_SUFFIX}: {error}")
                del state_dict[key]  # (the weight keeps its value)
                continue
            scale_inv = scale_inv.detach().reshape(1).to(param.device, torch.float32)
            scales = (scale_inv.reciprocal(), scale_inv)
        else:
            _, scale = cast.own_scale(value.detach().to(param.device))
            scales = (scale, scale.reciprocal())
        with torch.no_grad():
            state_dict[key] = Fp8Weight(cast.quantize(value, param.device, scales), param.dtype)


def _scale_inv_error(scale_inv) -> "str | None":
    if not isinstance(scale_inv, torch.Tensor) or scale_inv.numel() != 1 or \
            not scale_inv.is_floating_point():
        return f"expected a 1-element floating-point tensor, got {scale_inv!r}"
    value = float(scale_inv.reshape(()).float())
    if not (value > 0 and value != float("inf")):
        return f"expected a finite positive scale_inv, got {value}"
    return None
