"""FP8 weight all-gather under FSDP2 (``torch.distributed.fsdp.fully_shard``).

``enable_fp8_all_gather(model)`` (fsdp/enable.py) turns the GEMM weights of the model's FP8
modules into ShardedWeight (fsdp/weight.py). When FSDP2 all-gathers such a weight:

* in the forward, inside an enabled fp8_autocast with DelayedScaling: each rank casts its shard
  with the module's current weight scale (the same on every rank: the scales are the result of
  the step's all-reduced amaxes) and records the shard's amax into the weight's history slot.
  One byte per element crosses the wire; the gathered data is bit for bit the cast of the full
  weight, and the step's amax reduction (MAX across the group, which must contain the FSDP
  group) turns the shards' amaxes into the full weight's, with no extra collective. The module's
  GEMMs take the gathered FP8 weight as their operand (quantizer.Fp8Plan.quantize_weight).
* in the forward, inside an enabled fp8_autocast with Float8CurrentScaling: each rank casts its
  shard with the scale of the full weight's amax. The first FP8 all-gather of a step takes the
  amax of every weight shard of the FSDP group and all-reduces them (MAX) in ONE collective
  (fsdp/current_scale.py); the scale follows TensorQuantizer.current's rule (rounded down to
  a power of two under use_power_2_scales), so the gathered data is bit for bit
  TensorQuantizer.current's cast of the full weight.
* in the forward, inside an enabled fp8_autocast with Float8BlockScaling and 128x128 weight
  blocks (w_block_scaling_dim=2), where FSDP2's row shards hold whole 128-row blocks: each rank
  quantises its shard's blocks, and the FP8 data travels with the blocks' scale_invs
  (block_gather.py); what arrives is bit for bit the block cast of the full weight.
* in the backward (FSDP2 gathers again where it resharded after forward): the form of the
  weight's last all-gather outside backward, with its scale and no amax recorded, so the
  backward sees the forward's weight. Where another forward ran in between (an evaluation,
  which FSDP2 gathers for under no_grad like any other), that is the other forward's form: a
  checkpoint's recomputation checks that the gathered weight is its forward's operand and
  otherwise casts it again from the high-precision shards (high_precision.py).
* a weight FSDP2 left gathered from an earlier forward pass (it reshards neither the root
  after forward nor any module after backward while gradients accumulate): under
  DelayedScaling its scale may have changed since and this pass has not recorded its amax, so
  the module's forward gathers it again, here (``gather_again``: the same all-gather, on the
  FSDP group, at the same point on every rank).
* anywhere else (outside fp8_autocast, calibration, a module that runs in high precision, a
  recipe other than these, 1x128 weight blocks, shards that cut a 128x128 block, DelayedScaling
  amaxes not reduced over the FSDP group, backward_override="high_precision", a weight whose
  owner for FSDP2 is not an FP8 layer): the high-precision shard, so that the module
  computes exactly what it computes without FSDP. A recipe, block dimension or shard size that
  keeps FP8 off is said once in a warning. (The delayed-scaling check of the amax reduction's group
  does not apply to current scaling, which reduces over the FSDP group itself.)

The form is chosen at the all-gather, under the context current then: FSDP2's forward prefetch
gathers a layer's weight before that layer's forward opens a context of its own. A layer that
computes in high precision with a weight gathered in FP8 all-gathers the high-precision shards
as well (high_precision.py), so it never computes with the FP8-rounded weight.

FSDP2 sizes its all-gather buffers at the first all-gather of a weight and reuses them; when a
weight switches between the FP8 and the high-precision form, its buffers are dropped so that
FSDP2 makes new ones (``_drop_fsdp_buffers``, which reads FSDP2's per-parameter state of torch
2.11); a gradient that later reaches the dropped Parameter (a graph recorded before the switch)
raises rather than being lost.
"""
from __future__ import annotations

import math
import warnings
from typing import NamedTuple, Optional

import torch

from ... import ops
from ..._dtensor import group_ranks
from ...ops.blockwise import BLOCK
from ...quantization import autocast as _autocast
from ...quantization.blockwise import BlockQuantizer
from ...quantization.quantizer import ALIGN, power_2_floor
from ...quantization.recipe import (
    FP8_ALL_GATHER_RECIPES,
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    Format,
)
from ...quantization.roles import delayed_quantizers
from .block_gather import (
    block_shard_inputs,
    gathered_block_weight,
    shards_hold_whole_blocks,
)
from .current_scale import current_weight_scale
from .gathered_weight import GatheredFp8Weight


class GatherForm(NamedTuple):
    """How a weight is all-gathered: in high precision (fp8_dtype None), cast to fp8_dtype
    with ``scale`` (``scale_inv`` its inverse; copies, which the scale update leaves alone), or
    in 128x128 blocks quantised by ``block`` (no scale: the blocks' scales travel along).
    ``made_in``: (the recipe's kind, the forward pass[, the amax reduction]) of a scale; two
    forms made alike have the same scale (delayed scales change at the context's exit only;
    current scaling's amaxes are agreed once per pass, again where the weights changed since:
    an optimizer step inside one context), and a shard keeps one form per pass
    (all_gather_inputs), so that a checkpoint's recomputation knows its forward's operand by
    the scale_inv object (high_precision.replay_operands)."""

    fp8_dtype: Optional[torch.dtype] = None
    scale: Optional[torch.Tensor] = None
    scale_inv: Optional[torch.Tensor] = None
    block: Optional[BlockQuantizer] = None
    made_in: Optional[tuple] = None
    power_2: bool = False  # (Float8CurrentScaling(use_power_2_scales=True): the scale rounded
    # down to a power of two, as the layer's quantizer rounds it)


HIGH_PRECISION = GatherForm()
_warned: set = set()


def _warn_once(key, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, stacklevel=4)


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _amaxes_reduced_over(state, mesh) -> bool:
    """Whether the step's amax reduction covers every rank of the FSDP group (then every rank
    holds the same scales, and the shards' amaxes become the full weight's)."""
    if mesh.size() == 1:
        return True
    if not state.recipe.reduce_amax:
        return False
    if state.group is None:
        return True  # the default group: every rank
    return group_ranks(mesh.get_group()) <= group_ranks(state.group)


def _module_state(module):
    """The fp8_autocast state the module's forward runs under (its override applied), or None."""
    state = _autocast.current_state()
    if module._fp8_override is not None and state is not None:
        state = module._fp8_override.state_for(state)
    return state


def _forward_form(module) -> GatherForm:
    """FP8 where the module's forward will run FP8 GEMMs under DelayedScaling or
    Float8CurrentScaling (the scale is chosen by _cast_shard) or Float8BlockScaling with
    128x128 weight blocks; else high precision (also where FSDP2 names another module as the
    weight's owner: a weight tied to an embedding, which looks it up as its own)."""
    if not hasattr(module, "_fp8_override") or not hasattr(module, "_gemm_dims"):
        return HIGH_PRECISION
    state = _module_state(module)
    if state is None or not state.enabled:
        return HIGH_PRECISION
    if module._fp8_override is not None and module._fp8_override.gemms:
        return HIGH_PRECISION  # (a debug override of some GEMMs: the layer casts the weight
        # itself, for the GEMMs that stay FP8; the others take it in high precision)
    recipe = state.recipe
    if not isinstance(recipe, FP8_ALL_GATHER_RECIPES):
        _warn_once(type(recipe), f"fp8_all_gather: under {type(recipe).__name__} the weights are "
                   "all-gathered in high precision (FP8 all-gather is implemented for "
                   "DelayedScaling, Float8CurrentScaling and Float8BlockScaling with "
                   "w_block_scaling_dim=2 only)")
        return HIGH_PRECISION
    block = isinstance(recipe, Float8BlockScaling)
    if block and recipe.w_block_scaling_dim != 2:
        _warn_once("w_block_scaling_dim", "fp8_all_gather: under Float8BlockScaling with "
                   f"w_block_scaling_dim={recipe.w_block_scaling_dim} the weights are all-gathered "
                   "in high precision (FP8 all-gather needs 128x128 weight blocks: "
                   "w_block_scaling_dim=2)")
        return HIGH_PRECISION
    if recipe.fp8_format is Format.E5M2:
        return HIGH_PRECISION  # the module refuses it in its forward
    if getattr(recipe, "backward_override", None) == "high_precision":
        _warn_once("backward_override", "fp8_all_gather: with backward_override="
                   "'high_precision' the weights are all-gathered in high precision (the "
                   "backward GEMMs take the weight before its cast)")
        return HIGH_PRECISION
    if any(d % ALIGN for dims in module._gemm_dims() for d in dims):
        return HIGH_PRECISION  # the module runs in high precision
    dtype = recipe.fp8_format.fwd_dtype
    if block:  # the weight quantizer of roles._block_roles (equal cache_key)
        return GatherForm(dtype, block=BlockQuantizer(2, dtype, recipe.power_2_scale))
    return GatherForm(dtype, power_2=bool(getattr(recipe, "use_power_2_scales", False)))


def _cast_shard(shard: torch.Tensor, x: torch.Tensor, module, form: GatherForm,
                mesh) -> tuple:
    """(x, the shard in the all-gather's dtype, cast to FP8; the form with the scale used).
    Without a scale yet (the forward's gather): under Float8CurrentScaling the scale of the full
    weight's amax (agreed by all ranks, fsdp/current_scale.py); under DelayedScaling the
    module's delayed weight scale, the shard's amax recorded into the weight's history slot.
    With one (the backward's): that scale, nothing recorded."""
    if form.scale is not None:
        return ops.cast_to_fp8(x, form.scale, form.fp8_dtype), form
    state = _module_state(module)
    if isinstance(state.recipe, Float8CurrentScaling):
        scale, serial = current_weight_scale(shard, mesh, form.fp8_dtype, x.dtype)
        if form.power_2:
            scale = power_2_floor(scale)
        return (ops.cast_to_fp8(x, scale, form.fp8_dtype),
                GatherForm(form.fp8_dtype, scale, ops.scale_inverse(scale),
                           made_in=("current", _autocast.forward_pass_id(), serial,
                                    form.power_2), power_2=form.power_2))
    module._adopt_recipe(state.recipe)
    quantizer = delayed_quantizers(module, state.recipe.fp8_format)[shard._gemm][1]
    q = quantizer.cast(x, with_transpose=False)
    return q.data, GatherForm(form.fp8_dtype, q.scale.clone(), q.scale_inv,
                              made_in=("delayed", _autocast.forward_pass_id()))


def all_gather_inputs(shard: torch.Tensor, mesh, outer_size, module, mp_policy):
    """fsdp_pre_all_gather: (the tensors this rank contributes, metadata)."""
    if _in_backward() and shard._forward_form is not None:
        form = shard._forward_form
    else:
        form = _forward_form(module)
        if form.fp8_dtype is not None and isinstance(
                _module_state(module).recipe, DelayedScaling) and not _amaxes_reduced_over(
                _autocast.current_state(), mesh):
            _warn_once("group", "fp8_all_gather: the amax reduction of fp8_autocast does not "
                       "cover the FSDP group (reduce_amax=False or another fp8_group): the "
                       "weights are all-gathered in high precision")
            form = HIGH_PRECISION
        if form.block is not None and mesh.size() == 1:
            # FSDP2's one-rank "all-gather" copies the first input only (the block scales would
            # be lost), and saves no bytes: the module quantises the weight it gets
            form = HIGH_PRECISION
        elif form.block is not None and not shards_hold_whole_blocks(outer_size[0], mesh.size()):
            _warn_once("block rows", "fp8_all_gather: under Float8BlockScaling a weight whose "
                       "FSDP shards are not whole 128-row blocks (ceil(rows / ranks) not a "
                       "multiple of 128) is all-gathered in high precision")
            form = HIGH_PRECISION
    x = shard._data
    param_dtype = mp_policy.param_dtype if mp_policy is not None else None
    if param_dtype is not None and param_dtype != x.dtype:
        # FSDP2's mixed precision: the GEMM would cast the weight in param_dtype; so is the
        # shard cast (the same FP8 bytes and amax as the high-precision all-gather's path).
        x = x.to(param_dtype)
    if form.fp8_dtype is None:
        inputs = (x,)
    elif form.block is not None:
        inputs = block_shard_inputs(x, form.block)  # data and block scales, as uint8
    else:
        data, form = _cast_shard(shard, x, module, form, mesh)
        previous = shard._forward_form
        if (previous is not None and form.made_in is not None
                and previous.made_in == form.made_in and previous.fp8_dtype == form.fp8_dtype):
            form = previous  # the same scale, the same objects (see GatherForm.made_in)
        inputs = (data.view(torch.uint8),)  # one byte per element (any backend moves uint8)
    # The forward pass whose delayed scale the cast used (see gather_again), None for any
    # other form; the backward's gather repeats the forward's.
    if _in_backward():
        delayed_pass = shard._forward_pass
    else:
        delayed_pass = None
        if form.fp8_dtype is not None and form.block is None and isinstance(
                _module_state(module).recipe, DelayedScaling):
            delayed_pass = _autocast.forward_pass_id()
        shard._forward_form, shard._forward_pass = form, delayed_pass
    layout = (form.fp8_dtype is None, form.block is None, inputs[0].dtype)
    if shard._last_layout is not None and shard._last_layout != layout:
        _drop_fsdp_buffers(shard)
    shard._last_layout = layout
    # FSDP2 gathers equal pieces: pad this shard's rows (and row blocks) to the padded size.
    padded_rows = math.ceil(outer_size[0] / mesh.size())
    sizes = (padded_rows, padded_rows // BLOCK)  # the data's rows, the block scales' rows
    source = (shard, mesh, outer_size, module, mp_policy)
    return (tuple(_pad_rows(t, n) for t, n in zip(inputs, sizes)),
            (form, outer_size[0], delayed_pass, source))


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    padded = t.new_zeros((rows,) + tuple(t.shape[1:]))
    padded[:t.shape[0]].copy_(t)
    return padded


def gathered_weight(all_gather_outputs, metadata, param_dtype, out):
    """fsdp_post_all_gather: the full weight from what arrived (a GatheredFp8Weight, or the
    high-precision tensor), and the tensors whose storage FSDP2 frees after use."""
    gathered, (form, rows, delayed_pass, source) = all_gather_outputs[0], metadata
    if form.fp8_dtype is None:
        if out is not None:
            return None  # out is a view of the same buffer, which FSDP2 has refilled
        return gathered, (gathered,)
    if form.block is not None:
        data, scale_inv = gathered_block_weight(gathered, all_gather_outputs[1], rows,
                                                form.fp8_dtype)
    else:
        data, scale_inv = gathered.view(form.fp8_dtype)[:rows], form.scale_inv
    if out is not None:
        out._refill(data, form.scale, scale_inv, form.block, form.power_2)
        out._delayed_pass, out._source, out._gather_again = delayed_pass, source, gather_again
        return None
    weight = GatheredFp8Weight(data, form.scale, scale_inv, param_dtype, block=form.block,
                               power_2=form.power_2)
    weight._delayed_pass, weight._source, weight._gather_again = delayed_pass, source, gather_again
    return weight, tuple(all_gather_outputs)


def gather_again(weight: GatheredFp8Weight) -> None:
    """All-gather ``weight`` again, in place, as FSDP2 would for this forward (a weight it left
    gathered from an earlier forward pass cast with that pass's delayed scale: see the module
    docstring): each rank casts its shard with the current scale and records its amax, and
    the pieces are all-gathered on the FSDP group."""
    shard, mesh, outer_size, module, mp_policy = weight._source
    inputs, metadata = all_gather_inputs(shard, mesh, outer_size, module, mp_policy)
    if metadata[0].fp8_dtype is None or metadata[0].block is not None:
        raise RuntimeError("fp8_all_gather: a weight left gathered in FP8 by FSDP2 is to be "
                           "gathered again in another form (the recipe changed between two "
                           "forward passes without a reshard); call reshard() on the FSDP "
                           "modules first")
    (piece,) = inputs
    gathered = piece.new_empty((piece.shape[0] * mesh.size(),) + tuple(piece.shape[1:]))
    torch.distributed.all_gather_into_tensor(gathered, piece.contiguous(), group=mesh.get_group())
    form, rows, delayed_pass, _ = metadata
    # Into FSDP2's buffer, which the weight's data views (same form, same size): FSDP2 frees
    # it at its reshard, as after its own all-gather. (The transposed copies the earlier
    # passes' backward reads are copies of their own.)
    weight._fp8.copy_(gathered.view(form.fp8_dtype)[:rows])
    weight._scale, weight._scale_inv, weight._delayed_pass = (form.scale, form.scale_inv,
                                                              delayed_pass)


def _refuse_lost_gradient(param) -> None:
    raise RuntimeError(
        "fp8_all_gather: a gradient reached a weight whose all-gather switched between FP8 and "
        "high precision after the forward that used it (a forward in another fp8_autocast "
        "context, such as an evaluation, between a forward and its backward, or a layer run "
        "both inside and outside fp8_autocast before one backward): FSDP2 would never reduce "
        "it. Run the backward first, or run those forwards in the same context")


def _drop_fsdp_buffers(shard: torch.Tensor) -> None:
    """Let FSDP2 make the all-gather buffers and the unsharded Parameter of ``shard`` afresh
    (its gathered form changed: other dtype or size)."""
    from torch.distributed._composable_state import _module_state_mapping
    for state_ref in list(_module_state_mapping.values()):
        group = getattr(state_ref(), "_fsdp_param_group", None)
        for fsdp_param in getattr(group, "fsdp_params", ()):
            if fsdp_param.sharded_param._local_tensor is not shard:
                continue
            unsharded = getattr(fsdp_param, "_unsharded_param", None)
            if unsharded is not None and (unsharded.grad is not None
                                          or fsdp_param.unsharded_accumulated_grad is not None):
                raise RuntimeError(
                    "fp8_all_gather: a weight holding an unreduced gradient (gradient "
                    "accumulation without reduce-scatter) cannot switch between FP8 and "
                    "high-precision all-gather; run every microbatch of a step inside or "
                    "outside fp8_autocast alike")
            fsdp_param.all_gather_outputs = []
            fsdp_param._unsharded_inner_tensors = []
            if unsharded is not None:
                if unsharded.requires_grad:
                    # A graph recorded before the switch still leads to this Parameter: its
                    # gradient would be lost silently (FSDP2 reduces the new one's).
                    unsharded.register_post_accumulate_grad_hook(_refuse_lost_gradient)
                del fsdp_param._unsharded_param
            return
    raise RuntimeError("fp8_all_gather: FSDP2's state for a weight was not found")
