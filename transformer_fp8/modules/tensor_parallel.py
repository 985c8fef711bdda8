"""Tensor parallelism on DTensor: ``parallelize_module(model, tp_mesh, {"fc1": ColwiseParallel(),
"fc2": RowwiseParallel()})`` (torch.distributed.tensor.parallel) on transformer_fp8.Linear.

The styles make the weight a DTensor sharded over a 1-D mesh, Shard(0) (colwise: rows are output
features) or Shard(1) (rowwise: input features), the bias Shard(0) or Replicate, and hand the
module a DTensor input: Replicate (colwise) or Shard(-1) (rowwise). Our operators have no DTensor
sharding rules, so inside fp8_autocast the module's FP8 GEMMs run on the local tensors and the
output is wrapped back as the DTensor that torch's own F.linear would give:

* colwise: out_local = x @ w_local^T + b_local is the output's Shard(-1). A rank's input
  gradient covers its output columns only: it is handed back as Partial, and the redistribution
  of the input (the style's, in backward) sums the ranks'.
* rowwise: out_local = x_local @ w_local^T is one rank's part of a sum (Partial), which the
  style's output hook all-reduces. The bias is added by the first rank of the mesh only, so the
  sum holds it once (torch's DTensor linear adds bias / ranks on every rank); every rank
  computes the whole bias gradient from the replicated grad_output.

Per-tensor scales are the same on every rank when the step's amaxes are reduced over the mesh's
ranks (fp8_autocast's fp8_group contains them, reduce_amax=True): the shards' amaxes MAX to the
full tensor's, so each rank's FP8 weight shard is exactly the shard of the full weight's cast.
Float8CurrentScaling all-reduces each tensor's amax over fp8_group in the cast itself (one
collective per cast), with the same result. When the reduction does not cover the mesh, each
rank scales its shards with their own amaxes (valid, but the ranks' FP8 states differ and the
results are not those of one process): a one-time warning says so. Block recipes scale the
local shards' blocks, whose edges are the shard's.

Outside fp8_autocast, and where a local shard's GEMM sizes are not multiples of 16, the module
runs torch's DTensor F.linear: exactly what torch.nn.Linear computes under the same styles.
parallelize_module also turns every buffer into a replicated DTensor, the FP8 state included;
it is kept in plain tensors (Fp8State._fp8_state_to_local).
"""
from __future__ import annotations

import warnings

from .._dtensor import group_ranks, is_dtensor
from ..quantization.quantizer import Fp8Plan
from ..quantization.recipe import DelayedScaling, Float8CurrentScaling

_warned: set = set()
_SCALES_AGREE: dict = {}  # (autocast step key, mesh) -> whether the ranks' scales agree


def _placements():
    from torch.distributed.tensor import Partial, Replicate, Shard
    return Partial, Replicate, Shard


def check_module(module, inp) -> None:
    """Refuse what the tensor-parallel forward does not cover, naming it."""
    name = type(module).__name__
    if not getattr(module, "_supports_tensor_parallel", False):
        raise NotImplementedError(
            f"{name}: tensor parallelism (DTensor weights) is supported for "
            "transformer_fp8.Linear only (parallelize_module's ColwiseParallel / "
            f"RowwiseParallel), got {name} with DTensor weights")
    refused = [option for option, on in (
        ("parameters_split", len(module._parts.get("weight", ())) != 1),
        ("fuse_wgrad_accumulation", module.fuse_wgrad_accumulation),
        ("delay_wgrad_compute", module.delay_wgrad_compute),
        # (torch's styles take one output tensor: an AttributeError on the tuple before)
        ("return_bias", getattr(module, "return_bias", False))) if on]
    if refused:
        raise NotImplementedError(f"{name}: tensor parallelism (DTensor weights) cannot be "
                                  f"combined with {refused}")
    if not is_dtensor(inp):
        raise TypeError(f"{name}: the weight is a DTensor (tensor parallelism), so the input "
                        "must be a DTensor too (parallelize_module's ColwiseParallel and "
                        "RowwiseParallel make it one), got a torch.Tensor")


def layout(module, weight, bias) -> str:
    """"colwise" or "rowwise", from the weight's placement; checks the mesh and the bias."""
    _, Replicate, Shard = _placements()
    name = type(module).__name__
    if weight.device_mesh.ndim != 1 or weight.placements[0] not in (Shard(0), Shard(1)):
        raise ValueError(f"{name}: a DTensor weight must be sharded on a 1-D device mesh as "
                         "Shard(0) (ColwiseParallel) or Shard(1) (RowwiseParallel), got "
                         f"placements {tuple(weight.placements)} on a "
                         f"{weight.device_mesh.ndim}-D mesh")
    kind = "colwise" if weight.placements[0] == Shard(0) else "rowwise"
    if bias is not None:
        expected = Shard(0) if kind == "colwise" else Replicate()
        if (not is_dtensor(bias) or bias.device_mesh != weight.device_mesh
                or tuple(bias.placements) != (expected,)):
            got = (tuple(bias.placements) if is_dtensor(bias) else "a torch.Tensor")
            raise ValueError(f"{name}: with a {kind} weight the bias must be a DTensor on the "
                             f"weight's mesh with placement {expected}, got {got}")
    return kind


def local_gemm_dims(module) -> list:
    """(out, in) features of each GEMM's local weight shard, the same on every rank: with
    uneven shards (the sharded dim not divisible by the mesh size) the ranks' shards differ,
    and each would choose FP8 or high precision on its own (under Float8CurrentScaling, with
    mismatched collectives); such a weight gives a size of 1 on every rank: high precision."""
    dims = []
    for w in module.fp8_weights():
        sizes, ranks = list(w.shape), w.device_mesh.size()
        if not w.placements[0].is_shard():  # (replicated: the same on every rank)
            dims.append(tuple(w.to_local().shape))
            continue
        dim = w.placements[0].dim % len(sizes)
        sizes[dim] = sizes[dim] // ranks if sizes[dim] % ranks == 0 else 1
        dims.append(tuple(sizes))
    return dims


def prepare(module, state, inp) -> None:
    """Before a forward of a module with DTensor weights: the checks above, the FP8 state in
    plain tensors, and (inside an enabled fp8_autocast) whether the ranks' scales agree."""
    check_module(module, inp)
    module._fp8_state_to_local()
    if state is None or not (state.enabled or state.calibrating):
        return
    warn_unless_scales_agree(module, state, module.fp8_weights()[0].device_mesh)


def warn_unless_scales_agree(module, state, ranks) -> None:
    """Inside an enabled (or calibrating) fp8_autocast: warn once per step key and ``ranks``
    (a device mesh, or the process group of Transformer Engine's tensor parallelism:
    te_tensor_parallel.py) where the ranks' per-tensor scales differ."""
    key = (state.step_key, ranks)
    agree = _SCALES_AGREE.get(key)
    if agree is None:
        group = ranks.get_group() if hasattr(ranks, "get_group") else ranks
        agree = _SCALES_AGREE.setdefault(key, _scales_agree(state, group))
    if not agree and key not in _warned:
        _warned.add(key)
        warnings.warn(
            f"transformer_fp8.{type(module).__name__} with tensor parallelism: under "
            f"{type(state.recipe).__name__} the amaxes are not reduced over the tensor-parallel "
            "ranks (reduce_amax=False, or an fp8_group that does not contain them), so each "
            "rank scales its weight, input and grad_output shards with their own amaxes: the "
            "ranks' FP8 states differ and the results differ from one process's beyond FP8 "
            "rounding. Pass fp8_group=<a group containing the tensor-parallel ranks> and "
            "reduce_amax=True for scales that are the full tensors'.", stacklevel=6)


def _scales_agree(state, group) -> bool:
    """Whether every rank of the process group casts with the same per-tensor scales."""
    recipe = state.recipe
    if not isinstance(recipe, (DelayedScaling, Float8CurrentScaling)):
        return True  # block recipes: every block its own scale, no state
    if isinstance(recipe, DelayedScaling) and not recipe.reduce_amax:
        return False
    return state.group is None or group_ranks(group) <= group_ranks(state.group)


def sharded_linear(fp8_linear, module, inp, weight, bias, plan: Fp8Plan):
    """``fp8_linear(x, w, b, plan, add_bias)`` (the module's FP8 autograd function) on the
    local tensors of a tensor-parallel Linear; the output as a DTensor (see the docstring)."""
    from torch.distributed.tensor import DTensor
    Partial, Replicate, Shard = _placements()
    kind = layout(module, weight, bias)
    mesh = weight.device_mesh
    needed = Replicate() if kind == "colwise" else Shard(inp.dim() - 1)
    if inp.device_mesh != mesh:
        raise ValueError(f"{type(module).__name__}: the input DTensor is on another device "
                         f"mesh ({inp.device_mesh}) than the weight ({mesh})")
    if tuple(inp.placements) != (needed,):
        inp = inp.redistribute(mesh, [needed])
    if kind == "colwise":
        # Each rank's input gradient sums over its own output columns only: a Partial.
        x = inp.to_local(grad_placements=[Partial()])
        out = fp8_linear(x, weight.to_local(), None if bias is None else bias.to_local(),
                         plan, True)
        shape = out.shape[:-1] + (weight.shape[0],)
        return DTensor.from_local(out, mesh, [Shard(out.dim() - 1)], run_check=False,
                                  shape=shape, stride=_contiguous_strides(shape))
    # rowwise: a partial sum per rank; the bias added once, by the mesh's first rank.
    add_bias = mesh.get_local_rank() == 0
    out = fp8_linear(inp.to_local(), weight.to_local(),
                     None if bias is None else bias.to_local(), plan, add_bias)
    return DTensor.from_local(out, mesh, [Partial()], run_check=False)


def _contiguous_strides(shape) -> tuple:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))
