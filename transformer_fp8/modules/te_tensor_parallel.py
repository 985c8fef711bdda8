"""Transformer Engine's own tensor parallelism on Linear: ``Linear(in, out, tp_group=g,
tp_size=n, parallel_mode="column" | "row", sequence_parallel=...)``, as Megatron-style model
code builds it. The layer holds its shard of the weight and the collectives run around its
local GEMM (the layer's own forward, FP8 or high precision, unchanged):

* column: weight [out / n, in], bias [out / n] (added by the GEMM); the input is whole on every
  rank and the output is the rank's columns. Backward all-reduces the input gradient (each rank
  holds the part from its own columns). With sequence_parallel the input is the rank's part of
  the sequence (dim 0): it is all-gathered along dim 0 before the GEMM, and the input gradient
  reduce-scattered along dim 0.
* row: weight [out, in / n], bias [out] on every rank; the input is the rank's part of the
  features, the GEMM's output a partial sum, all-reduced (with sequence_parallel:
  reduce-scattered along dim 0, and grad_output all-gathered in backward); the bias is added
  once, after the reduction (not at all with return_bias, which returns it). With
  sequence_parallel each rank's bias gradient covers its part of the sequence only: the
  bias is marked ``sequence_parallel`` for Megatron-LM's reduction of such gradients.
* parallel_mode=None, or a group of one rank: no communication, no sharding.

tp_group given, tp_size is its size (a tp_size other than 1 and the group's is refused); without
tp_group, tp_size shards the features and ``set_tensor_parallel_group`` must give the group
before the first forward.

Scales: under DelayedScaling the step's amaxes are MAX-reduced over fp8_autocast's fp8_group;
when that group covers the tensor-parallel ranks every rank holds the same FP8 state, which is
the unsharded layer's (the weight amax of the full weight; the gathered input's and
grad_output's amaxes). Float8CurrentScaling all-reduces each cast's amax over fp8_group (by
default the tensor-parallel group), with the same effect. Otherwise a one-time warning
(tensor_parallel.warn_unless_scales_agree). Transformer Engine all-gathers the sequence-parallel
input in FP8; here the gather moves the high-precision input and the gathered tensor is cast,
which gives the same FP8 values with the same scale.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from .. import _param_marks as param_marks
from .._dtensor import is_dtensor
from ..quantization import autocast as _autocast
from .te_args import check_forward_flags, check_positive
from .tensor_parallel import warn_unless_scales_agree

MODES = (None, "column", "row")
OPTIONS = ("tp_group", "tp_size", "parallel_mode", "sequence_parallel")


class TensorParallelOptions:
    """What the layer was built with (its tensor-parallel options). Not copied by deepcopy (a
    process group cannot be), not pickled with its group (set it again after loading)."""

    def __init__(self, mode: Optional[str], group, size: int, sequence_parallel: bool):
        self.mode, self.group, self.size = mode, group, size
        self.sequence_parallel = sequence_parallel

    @property
    def communicates(self) -> bool:
        return self.mode is not None and self.size > 1

    def with_group(self, group) -> "TensorParallelOptions":
        return TensorParallelOptions(self.mode, group, self.size, self.sequence_parallel)

    def __deepcopy__(self, memo):
        return self

    def __getstate__(self) -> dict:
        return {**self.__dict__, "group": None}


def configure(owner: str, in_features: int, out_features: int, options: dict,
              names=("in_features", "out_features"), setting: str = ""):
    """Take the tensor-parallel options out of ``options`` (the constructor's Transformer
    Engine keyword arguments): (local in_features, local out_features, TensorParallelOptions or
    None where they are all at their defaults). Refuses bad values naming the argument
    (``names``: what the module calls its in and out features; ``setting``: the argument that
    asked for the sharding, where it is not parallel_mode)."""
    group = options.pop("tp_group", None)
    tp_size = options.pop("tp_size", 1)
    mode = options.pop("parallel_mode", None)
    sequence_parallel = options.pop("sequence_parallel", False)
    if mode not in MODES:
        raise ValueError(f"{owner}: parallel_mode must be None, 'column' or 'row', got {mode!r}")
    check_positive(owner, "tp_size", tp_size)
    if sequence_parallel not in (None, False, True):
        raise TypeError(f"{owner}: sequence_parallel must be True or False, got "
                        f"{sequence_parallel!r}")
    if group is None and tp_size == 1 and mode is None:
        return in_features, out_features, None
    size = tp_size
    if group is not None:
        if not (dist.is_available() and isinstance(group, dist.ProcessGroup)):
            raise TypeError(f"{owner}: tp_group must be a torch.distributed.ProcessGroup or "
                            f"None, got {type(group).__name__}")
        size = dist.get_world_size(group)
        if size < 1:
            raise ValueError(f"{owner}: this rank ({dist.get_rank()}) is not in tp_group")
        if tp_size not in (1, size):
            raise ValueError(f"{owner}: tp_size={tp_size} does not match tp_group, whose size "
                             f"is {size} (give one of them, or both equal)")
    if mode is not None and size > 1:
        name, features = ((names[1], out_features) if mode == "column"
                          else (names[0], in_features))
        if features % size:
            raise ValueError(f"{owner}: {name}={features} is not divisible by the "
                             f"{size} tensor-parallel ranks "
                             f"({setting or f'parallel_mode={mode!r}'})")
        if mode == "column":
            out_features //= size
        else:
            in_features //= size
    return in_features, out_features, TensorParallelOptions(
        mode, group, size, bool(sequence_parallel) and size > 1)


def attach(layer, options: Optional[TensorParallelOptions]) -> None:
    """Give the built layer its options; a layer that communicates skips the C++ step (its
    Python path runs the local GEMM between the collectives) and its Parameters get Transformer
    Engine's attributes, which Megatron-LM reads."""
    if options is None:
        return
    layer._te_parallel = options
    if not options.communicates:
        return
    layer._te_tp = options
    layer._fused_step = None
    if options.mode == "row":  # (on the instance: nothing more to ask on every other layer)
        layer._gemm_bias = no_gemm_bias
    dim = 0 if options.mode == "column" else 1
    for name in layer._parts.get("weight", ["weight"]):
        mark_sharded(layer, name, dim)
    for name in layer._parts.get("bias", ["bias"]):
        if options.mode == "column":
            mark_sharded(layer, name, 0)
        else:
            param_marks.mark(layer, name, sequence_parallel=options.sequence_parallel)


def no_gemm_bias():
    """A row-parallel layer's _gemm_bias: the GEMM adds none (forward adds it once, after the
    ranks' partial products are summed)."""
    return None


def mark_sharded(module, name: str, dim: int) -> None:
    """Transformer Engine's marks of a Parameter sharded along ``dim`` (_param_marks.py)."""
    param_marks.mark(module, name, tensor_model_parallel=True, partition_dim=dim,
                     partition_stride=1)


def check_combination(owner: str, options, fp8_all_gather) -> None:
    if options is not None and options.communicates and fp8_all_gather:
        raise ValueError(f"{owner}: fp8_all_gather cannot be combined with parallel_mode="
                         f"{options.mode!r} (tensor parallelism); leave it at its default")


def split_shards(options) -> int:
    """How many parts each parameters_split part of the whole layer is cut into: the ranks of
    a column-parallel layer (its output features are sharded), else 1."""
    if options is not None and options.mode == "column":
        return options.size
    return 1


class TensorParallelMixin:
    """Transformer Engine's tensor-parallel attributes of the layer and
    set_tensor_parallel_group."""

    _te_parallel: Optional[TensorParallelOptions] = None

    @property
    def tp_group(self):
        return None if self._te_parallel is None else self._te_parallel.group

    @property
    def tp_size(self) -> int:
        return 1 if self._te_parallel is None else self._te_parallel.size

    @property
    def parallel_mode(self) -> Optional[str]:
        return None if self._te_parallel is None else self._te_parallel.mode

    @property
    def sequence_parallel(self) -> bool:
        return self._te_parallel is not None and self._te_parallel.sequence_parallel

    def set_tensor_parallel_group(self, tp_group) -> None:
        """The process group of the tensor-parallel ranks, for a layer built with tp_size and
        no tp_group (Transformer Engine's); its size must be the layer's tp_size."""
        name = type(self).__name__
        size = 1 if tp_group is None else dist.get_world_size(tp_group)
        if size != self.tp_size or (tp_group is None and self._te_tp is not None):
            raise ValueError(f"{name}.set_tensor_parallel_group: tp_group has {size} ranks, "
                             f"the layer was built for tp_size={self.tp_size}")
        if self._te_parallel is None:
            return  # (one rank, no options: nothing to hold)
        options = self._te_parallel.with_group(tp_group)
        self._te_parallel = options
        if options.communicates:
            self._te_tp = options


def forward(layer, inp, is_first_microbatch, fp8_output, fp8_grad):
    """Linear.forward of a layer whose tensor-parallel options communicate."""
    options = layer._te_tp
    checked_group(layer, inp)
    if fp8_output or fp8_grad:
        check_forward_flags(type(layer).__name__, fp8_output, fp8_grad)
    x = to_gemm_input(inp, options) if options.mode == "column" else inp
    if layer._wgrad is not None:
        layer._wgrad_first = is_first_microbatch
    out = layer._dispatch(x, is_first_microbatch, layer.in_features)
    if options.mode == "row":
        out = reduce_output(out, options)
        if not layer.return_bias:
            bias = layer._param("bias")
            if bias is not None:  # once, after the sum of the ranks' partial products
                out = out + bias.to(out.dtype)
    if layer.return_bias:
        return out, layer._returned_bias("bias", out)
    return out


def checked_group(layer, inp):
    """Before the forward of a layer (or module) whose options communicate: its process group,
    after the checks (a group given, a plain tensor input, a first dimension the ranks divide
    where it is scattered) and the one-time warning where the ranks' scales cannot agree."""
    options = layer._te_tp
    name = type(layer).__name__
    group = options.group
    if group is None:
        raise RuntimeError(f"{name}: built with tp_size={options.size} and no tp_group: call "
                           "set_tensor_parallel_group(tp_group) before the forward pass")
    if not isinstance(inp, torch.Tensor):
        raise TypeError(f"{name}: input must be a tensor, got {type(inp).__name__}")
    if is_dtensor(layer._weight_for_checks()) or is_dtensor(inp):
        raise TypeError(f"{name}: parallel_mode={options.mode!r} shards the layer itself: its "
                        "weight and input must be plain tensors, not DTensors (for DTensor "
                        "tensor parallelism build the layer without parallel_mode)")
    stack = _autocast.LOCAL.stack
    state = stack[-1] if stack else None
    if state is not None and (state.enabled or state.calibrating):
        warn_unless_scales_agree(layer, state, group)
    if options.sequence_parallel and (inp.dim() < 2 or (options.mode == "row"
                                                        and inp.shape[0] % options.size)):
        raise ValueError(f"{name}: with sequence_parallel the first dimension is the sequence, "
                         f"split over the {options.size} ranks (row: the output's, the same "
                         f"as the input's); got an input of shape {tuple(inp.shape)}")
    return group


def to_gemm_input(x: torch.Tensor, options: TensorParallelOptions) -> torch.Tensor:
    """A column-parallel GEMM's input from the rank's: all-gathered along dim 0 with
    sequence_parallel (its gradient reduce-scattered), else as it is (its gradient
    all-reduced)."""
    if options.sequence_parallel:
        return _GatherFirstDim.apply(x, options.group)
    return _CopyToGroup.apply(x, options.group)


def reduce_output(partial: torch.Tensor, options: TensorParallelOptions) -> torch.Tensor:
    """A row-parallel GEMM's output from the ranks' partial products: reduce-scattered along
    dim 0 with sequence_parallel (its gradient all-gathered), else all-reduced."""
    if options.sequence_parallel:
        return _ReduceScatterFirstDim.apply(partial, options.group)
    return _AllReduce.apply(partial, options.group)


def sum_gradient_over(tensor: torch.Tensor, group) -> torch.Tensor:
    """``tensor`` as it is; its gradient summed over the ranks of ``group`` (a weight every
    rank holds whole and applies to its own share of the data)."""
    return _CopyToGroup.apply(tensor, group)


# ---- the collectives, as autograd functions (dim 0: the sequence, in Megatron's layout) ------

class _CopyToGroup(torch.autograd.Function):
    """Forward: the input as it is (whole on every rank). Backward: the sum of the ranks'
    gradients (each from its own output columns)."""

    @staticmethod
    def forward(ctx, inp, group):
        ctx.group = group
        return inp

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _AllReduce(torch.autograd.Function):
    """Forward: the sum of the ranks' partial outputs (in place). Backward: the gradient as
    it is (the same on every rank)."""

    @staticmethod
    def forward(ctx, partial, group):
        if partial.is_contiguous():
            ctx.mark_dirty(partial)  # (the GEMM's output, which nothing else holds)
        else:
            partial = partial.contiguous()
        dist.all_reduce(partial, group=group)
        return partial

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFirstDim(torch.autograd.Function):
    """Forward: the ranks' parts concatenated along dim 0. Backward: the gradient summed over
    the ranks, each keeping its own part (reduce-scatter)."""

    @staticmethod
    def forward(ctx, inp, group):
        ctx.group = group
        return _all_gather(inp, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, ctx.group, "the input gradient"), None


class _ReduceScatterFirstDim(torch.autograd.Function):
    """Forward: the ranks' partial outputs summed, each rank keeping its part of dim 0.
    Backward: the ranks' gradients concatenated along dim 0 (all-gather)."""

    @staticmethod
    def forward(ctx, partial, group):
        ctx.group = group
        return _reduce_scatter(partial, group, "the output")

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.group), None


def _all_gather(tensor: torch.Tensor, group) -> torch.Tensor:
    tensor = tensor.contiguous()
    ranks = dist.get_world_size(group)
    out = tensor.new_empty((tensor.shape[0] * ranks, *tensor.shape[1:]))
    dist.all_gather_into_tensor(out, tensor, group=group)
    return out


def _reduce_scatter(tensor: torch.Tensor, group, what: str) -> torch.Tensor:
    ranks = dist.get_world_size(group)
    if tensor.dim() == 0 or tensor.shape[0] % ranks:
        raise ValueError(f"sequence_parallel: {what}'s first dimension (the sequence), "
                         f"{tuple(tensor.shape)[:1]}, is not divisible by the {ranks} "
                         "tensor-parallel ranks")
    out = tensor.new_empty((tensor.shape[0] // ranks, *tensor.shape[1:]))
    dist.reduce_scatter_tensor(out, tensor.contiguous(), group=group)
    return out
