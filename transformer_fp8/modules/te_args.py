"""Transformer Engine's constructor arguments that this library accepts but does not implement.

A model definition written for Transformer Engine passes them (often at their defaults, often
only because its own config has them). Each is accepted with the values in TE_ACCEPTED (the
first is Transformer Engine's default), and refused with a ValueError that names it otherwise.
An argument no Transformer Engine module takes is a TypeError, as Python would raise.
"""
from __future__ import annotations

import torch

_PARALLEL = "no tensor, sequence or context parallelism, no communication overlap"
# Linear, LayerNormLinear and LayerNormMLP take these (te_tensor_parallel.py,
# te_tensor_parallel_norm.py) and never pass them here.
_TP = ("no tensor or sequence parallelism in this module (transformer_fp8.Linear, "
       "LayerNormLinear, LayerNormMLP, the attention modules and TransformerLayer take "
       "tp_group, tp_size, parallel_mode / set_parallel_mode and sequence_parallel)")
_ENCODER = "an encoder layer has no cross-attention (layer_type='decoder' has)"
_RNG = ("this module draws nothing inside an RNG tracker's fork; the GEMM modules (weights) "
        "and the attention modules (dropout) take the tracker")

# name -> (accepted values, first = Transformer Engine's default; why other values are refused)
TE_ACCEPTED: dict[str, tuple[tuple, str]] = {
    # tensor / sequence parallelism (the GEMM, attention and TransformerLayer modules' own:
    # te_tensor_parallel.py, te_tensor_parallel_norm.py) and communication overlap
    "sequence_parallel": ((False, None), _TP),
    "tp_group": ((None,), _TP),
    "tp_size": ((1,), _TP),
    "parallel_mode": ((None,), _TP),
    "set_parallel_mode": ((False,), _PARALLEL),
    # (the GEMM and attention modules take the tracker: modules/weight_rng.py, dropout)
    "get_rng_state_tracker": ((None,), _RNG),
    "rng_tracker_name": ((None,), _RNG),
    "return_layernorm_output_gathered": ((False,), _PARALLEL),
    "symmetric_ar_type": ((None,), _PARALLEL),
    "ub_tp_comm_overlap": ((False,), _PARALLEL),
    "ub_name": ((None,), _PARALLEL),
    "ub_overlap_ag": ((False,), _PARALLEL),
    "ub_overlap_rs": ((False,), _PARALLEL),
    "ub_overlap_rs_dgrad": ((False,), _PARALLEL),
    "ub_bulk_dgrad": ((False,), _PARALLEL),
    "ub_bulk_wgrad": ((False,), _PARALLEL),
    # memory / layout options of the GEMM modules
    "save_original_input": ((False,), "the FP8 input copy is always the one saved"),
    "single_grouped_weight": ((False,), "one Parameter per expert"),
    "single_grouped_bias": ((False,), "one Parameter per expert"),
    "use_grouped_tensor": ((None, False), "one Parameter per expert"),
    "checkpoint": ((False,), "no selective recomputation inside LayerNormMLP; use "
                   "transformer_fp8.checkpoint around the module"),
    # attention
    "rotary_pos_interleaved": ((False,), "rotary embeddings rotate halves, not pairs"),
    # TransformerLayer
    "enc_dec_attn_mask_type": (("no_mask",), _ENCODER),
    "enc_dec_window_size": ((None,), _ENCODER),
    "enc_dec_bottom_right_diagonal": ((None,), _ENCODER),
}

# Accepted with any value, unused: a debugging label, sizes Transformer Engine uses for
# sequence parallelism only.
TE_IGNORED = frozenset({"name", "seq_length", "micro_batch_size"})


def check_te_options(owner: str, options: dict) -> None:
    """Refuse every option in ``options`` that is not at a value TE_ACCEPTED allows."""
    for name, value in options.items():
        if name in TE_IGNORED:
            continue
        if name not in TE_ACCEPTED:
            raise TypeError(f"{owner}() got an unexpected keyword argument {name!r}")
        allowed, why = TE_ACCEPTED[name]
        if not any(_same(value, a) for a in allowed):
            raise ValueError(f"{owner}: {name}={value!r} is not supported ({why}); leave it at "
                             f"{allowed[0]!r}")


def te_only_arguments(arguments: dict) -> dict:
    """The arguments (a constructor's locals()) that are in TE_ACCEPTED or TE_IGNORED."""
    return {k: v for k, v in arguments.items() if k in TE_ACCEPTED or k in TE_IGNORED}


def _same(value, allowed) -> bool:
    if allowed is None or isinstance(allowed, bool):
        return value is allowed
    if isinstance(allowed, tuple):
        return isinstance(value, (list, tuple)) and tuple(value) == allowed
    if isinstance(allowed, str):
        return value == allowed
    return not isinstance(value, bool) and isinstance(value, (int, float)) and value == allowed


def one_dtype(owner: str, dtype, params_dtype):
    """``dtype`` and Transformer Engine's ``params_dtype`` name the same thing."""
    if dtype is not None and params_dtype is not None and dtype != params_dtype:
        raise ValueError(f"{owner}: 'dtype' ({dtype}) and 'params_dtype' ({params_dtype}) "
                         "name the same thing and must agree; pass one")
    return dtype if dtype is not None else params_dtype


def te_default_init(weight: torch.Tensor) -> None:
    """Transformer Engine's default weight initialisation: normal, std 0.023."""
    with torch.no_grad():
        torch.nn.init.normal_(weight, mean=0.0, std=0.023)


def check_positive(owner: str, name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{owner}: {name} must be a positive integer, got {value!r}")
    return value


def empty_bias(like: torch.Tensor) -> torch.Tensor:
    """What Transformer Engine returns as the bias of a module built with bias=False (with
    return_bias): an empty tensor of the parameters' dtype and device."""
    return torch.empty(0, dtype=like.dtype, device=like.device)


def check_forward_flags(owner: str, fp8_output=False, fp8_grad=False) -> None:
    """forward's fp8_output / fp8_grad (FP8 tensors out of the module): off only."""
    if not (fp8_output or fp8_grad):
        return  # (every step: nothing built)
    for name, value in (("fp8_output", fp8_output), ("fp8_grad", fp8_grad)):
        if value:
            raise ValueError(f"{owner}.forward: {name}=True is not supported (outputs and "
                             "input gradients are high-precision tensors); leave it at False")
