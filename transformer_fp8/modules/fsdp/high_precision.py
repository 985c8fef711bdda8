"""The high-precision value of a weight that FSDP2 all-gathered in FP8 (all_gather.py),
all-gathered from the high-precision shards (one more collective, on the FSDP group, at the
same point on every rank) where the FP8 data is not what the module must compute with:

* a module that computes in high precision with a weight gathered in FP8 (FSDP2's forward
  prefetch gathered it under the context of the module before it; or a checkpoint's
  recomputation repeats the form of a forward): ``high_precision_weights``;
* a checkpoint's recomputation of an FP8 forward whose weight FSDP2's backward all-gather
  gathered in another form than that forward's operand (a forward in between, such as an
  evaluation): ``replay_operands``, and the replay casts the high-precision weight with the
  forward's scale.

``dequantize()`` gives that value until ``release_high_precision``.
"""
from __future__ import annotations

import math

import torch

from .all_gather import _pad_rows
from .gathered_weight import GatheredFp8Weight


def high_precision_weights(module) -> list:
    """Before ``module`` computes in high precision: each of its weights that FSDP2 gathered in
    FP8 (gathered ahead of its forward, by FSDP2's forward prefetch, under the context of the
    module before it; or in the form of the forward a checkpoint's recomputation repeats)
    gets its high-precision value, all-gathered now from the high-precision shards (the same
    collective on every rank, at the same point of the forward), which ``dequantize()`` gives
    instead of the FP8 data. Returns those weights (``release_high_precision`` drops the
    values after the computation; what autograd saved of them stays high precision)."""
    gathered = []
    for weight in module.fp8_weights():
        if type(weight) is not GatheredFp8Weight or weight._source is None:
            continue
        _gather_high_precision(weight)
        gathered.append(weight)
    return gathered


def mismatched_forms(module, plans) -> list:
    """Before an FP8 forward of ``module`` (``plans``: one per GEMM): each weight FSDP2 left
    gathered in FP8 in another form than this forward's weight quantizer casts, or in FP8 where
    the forward's backward_override is "high_precision" (gathered under
    another recipe's context and not gathered again since: reshard_after_forward=False, a
    nested fp8_autocast) gets its high-precision value (one all-gather on the FSDP group, as
    every rank runs the same recipe), which the quantizer casts: the operand an unsharded layer
    would multiply with, not the other form's FP8 data. Returns those weights, for
    release_high_precision."""
    gathered = []
    for weight in module._parameters.values():
        if (type(weight) is GatheredFp8Weight and weight._source is not None
                and weight._full_high_precision is None):
            plan = plans[weight._source[0]._gemm]
            quantizer = plan.weight_quantizer
            # (a backward_override of "high_precision": the backward takes the weight before
            # its cast, which all_gather.py gathers for it unless another context gathered)
            if plan.weight_fp8 is None and (weight.fp8_cache_key != quantizer.cache_key
                                            or weight._fp8.dtype != quantizer.dtype
                                            or plan.backward_override == "high_precision"):
                _gather_high_precision(weight)
                gathered.append(weight)
    return gathered


def replay_operands(module, plans) -> list:
    """Before a checkpoint's recomputation of ``module``'s FP8 forward (``plans``: its replay
    record, one plan per GEMM): each weight FSDP2 gathered for this backward whose FP8 data is
    not the operand that forward multiplied with gets its high-precision value, as in
    high_precision_weights (one all-gather on the FSDP group, the same on every rank), and the
    replay's quantizer casts it with the forward's scale: bit for bit the forward's operand
    (the gathered casts of the shards are the cast of the full weight). FSDP2's backward
    all-gather repeats the form of the weight's last all-gather outside backward, and a forward
    after the checkpointed one (an evaluation under no_grad, which FSDP2 gathers for under
    no_grad as any other) changes it: under DelayedScaling its scale is the one updated at the
    training context's exit. Returns those weights, for release_high_precision."""
    gathered = []
    for weight in module._parameters.values():
        if (type(weight) is GatheredFp8Weight and weight._source is not None
                and not _is_forward_operand(weight, plans[weight._source[0]._gemm])):
            _gather_high_precision(weight)
            gathered.append(weight)
    return gathered


def _is_forward_operand(weight: GatheredFp8Weight, plan) -> bool:
    """Whether the replay of ``plan`` takes from ``weight`` the FP8 operand its forward took."""
    quantizer = plan.weight_quantizer
    if plan.weight_fp8 is not None:
        return True  # (a weight kept across microbatches: the gathered one is not read)
    if plan.backward_override == "high_precision":
        return False  # (its backward takes the weight before the cast: mismatched_forms)
    if weight.fp8_cache_key != quantizer.cache_key or weight._fp8.dtype != quantizer.dtype:
        return False  # gathered in another form than the forward's (another recipe since)
    if weight._block is not None:
        return True  # 128x128 blocks: their scales are the weight's own, in every pass
    # One scale per tensor: the replay's quantizer holds the scale_inv object of the forward's
    # operand, the weight that of its all-gather's form: the same object exactly where the
    # backward's all-gather repeats the forward's form (or one of the same pass).
    return weight._scale_inv is getattr(quantizer, "scale_inv", None)


def _gather_high_precision(weight: GatheredFp8Weight) -> None:
    """Set ``weight._full_high_precision``: the full weight all-gathered from the
    high-precision shards (in the dtype of the FP8 all-gather's cast: FSDP2's param_dtype)."""
    shard, mesh, outer_size = weight._source[:3]
    x = shard._data
    if x.dtype != weight.dtype:  # (FSDP2's param_dtype: as the high-precision gather)
        x = x.to(weight.dtype)
    piece = _pad_rows(x, math.ceil(outer_size[0] / mesh.size())).contiguous()
    full = piece.new_empty((piece.shape[0] * mesh.size(),) + tuple(piece.shape[1:]))
    torch.distributed.all_gather_into_tensor(full, piece, group=mesh.get_group())
    weight._full_high_precision = full[:outer_size[0]]


def release_high_precision(weights: list) -> None:
    for weight in weights:
        weight._full_high_precision = None
