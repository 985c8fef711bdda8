"""Transformer Engine's ``parallel_cross_entropy``: cross entropy over logits whose vocabulary
may be split across a process group (tensor-parallel output layers), in plain torch.

    loss = parallel_cross_entropy(logits, target)                    # [B, SQ] float32
    loss = parallel_cross_entropy(logits_shard, target, dist_process_group=tp_group,
                                  reduce_loss=True, label_smoothing=0.1)

``inp`` is [B, SQ, V] (or [SQ, B, V]); with ``dist_process_group`` each rank holds an equal
slice of the vocabulary, rank r the columns [r * V_r, (r + 1) * V_r). ``target`` [B, SQ] holds
ids of the whole vocabulary. The result is torch's ``cross_entropy`` over the whole
vocabulary (``ignore_index=ignore_idx``, ``label_smoothing``), the same on every rank:
per token [B, SQ] float32, or with ``reduce_loss`` its mean over the tokens not ignored (0 if
all are). The gradient of each rank's slice is computed in float32 and returned in ``inp``'s
dtype. Two all-reduces per forward, none in backward.
"""
from __future__ import annotations

import numbers
import operator
from typing import Optional

import torch
import torch.distributed as dist


def _group_rank_and_size(group) -> tuple:
    if group is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _check_options(label_smoothing, reduce_loss, group, ignore_idx) -> None:
    """The non-tensor arguments: once converted by float(), bool() or int(), a string
    label_smoothing, a reduce_loss of "no" (truthy) or an ignore_idx of 1.5 (int: 1) would be
    taken for other values without a word."""
    if isinstance(label_smoothing, bool) or not isinstance(label_smoothing,
                                                           (numbers.Real, torch.Tensor)):
        raise TypeError("parallel_cross_entropy: label_smoothing must be a number in [0, 1], "
                        f"got {_describe(label_smoothing)} {label_smoothing!r}")
    if reduce_loss not in (True, False):
        raise TypeError(f"parallel_cross_entropy: reduce_loss must be True or False, got "
                        f"{_describe(reduce_loss)} {reduce_loss!r}")
    if isinstance(ignore_idx, bool):
        raise TypeError(f"parallel_cross_entropy: ignore_idx must be an int, got {ignore_idx!r}")
    try:
        operator.index(ignore_idx)
    except TypeError:
        raise TypeError(f"parallel_cross_entropy: ignore_idx must be an int, got "
                        f"{_describe(ignore_idx)} {ignore_idx!r}") from None
    if group is not None and not (dist.is_available() and isinstance(group, dist.ProcessGroup)):
        raise TypeError("parallel_cross_entropy: dist_process_group must be None or a "
                        f"torch.distributed.ProcessGroup, got {_describe(group)}")


def _check(inp, target, label_smoothing) -> None:
    if not isinstance(inp, torch.Tensor) or inp.dim() != 3 or not inp.is_floating_point() \
            or inp.shape[-1] == 0:
        raise ValueError("parallel_cross_entropy: inp must be a floating-point tensor [B, SQ, V] "
                         f"(or [SQ, B, V]); got {_describe(inp)}")
    if not isinstance(target, torch.Tensor) or target.is_floating_point() \
            or target.dtype == torch.bool or target.is_complex():
        raise ValueError("parallel_cross_entropy: target must be an integer tensor of token "
                         f"ids; got {_describe(target)}")
    if tuple(target.shape) != tuple(inp.shape[:2]):
        # (the same layout as inp's first two dims: a [B, SQ] target for [SQ, B, V] logits
        # has the right count and pairs the wrong tokens)
        raise ValueError("parallel_cross_entropy: target must hold one id per token of inp, "
                         f"shape {tuple(inp.shape[:2])}; got shape {tuple(target.shape)}")
    if target.device != inp.device:
        raise ValueError(f"parallel_cross_entropy: target is on {target.device}, inp on "
                         f"{inp.device}")
    if not 0.0 <= float(label_smoothing) <= 1.0:
        raise ValueError("parallel_cross_entropy: label_smoothing must be in [0, 1]; got "
                         f"{label_smoothing}")


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return type(value).__name__


class _ParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, inp, target, label_smoothing, reduce_loss, group, ignore_idx):
        rank, world = _group_rank_and_size(group)
        local_vocab = inp.shape[-1]
        vocab = local_vocab * world
        x = inp.reshape(-1, local_vocab).float()
        ids = target.reshape(-1).long()
        kept = ids != ignore_idx
        torch._assert_async(((ids >= 0) & (ids < vocab) | ~kept).all(),
                            "parallel_cross_entropy: a target id is outside [0, V) and is not "
                            "ignore_idx")
        # log-sum-exp over the whole vocabulary: the global max first (one MAX all-reduce) so
        # that no rank's exp overflows, then the sums of every rank (one SUM all-reduce).
        row_max = x.amax(-1)
        if world > 1:
            dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
        local = ids - rank * local_vocab
        here = kept & (local >= 0) & (local < local_vocab)
        target_column = local.clamp(0, local_vocab - 1).unsqueeze(1)
        target_logit = torch.where(here, x.gather(1, target_column).squeeze(1), x.new_zeros(()))
        sums = torch.stack([(x - row_max.unsqueeze(1)).exp().sum(-1), target_logit,
                            x.sum(-1) if label_smoothing > 0 else x.new_zeros(x.shape[:1])])
        if world > 1:
            dist.all_reduce(sums, group=group)
        lse = row_max + sums[0].log()
        nll = lse - sums[1]
        if label_smoothing > 0:
            # torch's smoothing: (1 - ls) * nll + ls * mean over the vocabulary of -log p_i
            nll = (1 - label_smoothing) * nll + label_smoothing * (lse - sums[2] / vocab)
        loss = torch.where(kept, nll, nll.new_zeros(()))
        count = kept.sum().clamp(min=1)
        ctx.save_for_backward(inp, lse, ids, kept, count)
        ctx.args = (rank, label_smoothing, reduce_loss, vocab)
        if reduce_loss:
            return loss.sum() / count
        return loss.reshape(inp.shape[:2])

    @staticmethod
    def backward(ctx, grad_output):
        inp, lse, ids, kept, count = ctx.saved_tensors
        rank, label_smoothing, reduce_loss, vocab = ctx.args
        local_vocab = inp.shape[-1]
        x = inp.reshape(-1, local_vocab).float()
        # d loss / d x_i = softmax_i - ls / V - (1 - ls) [i is the target], per kept token
        grad = (x - lse.unsqueeze(1)).exp() - label_smoothing / vocab
        local = ids - rank * local_vocab
        here = kept & (local >= 0) & (local < local_vocab)
        target_column = local.clamp(0, local_vocab - 1).unsqueeze(1)
        grad.scatter_add_(1, target_column, -(1 - label_smoothing) * here.float().unsqueeze(1))
        per_row = grad_output.float() / count if reduce_loss else grad_output.float().reshape(-1)
        # An ignored token's row is 0 whatever its logits (NaN or inf ones times 0 were NaN).
        grad = torch.where(kept.unsqueeze(1), grad * per_row.reshape(-1, 1), grad.new_zeros(()))
        return grad.reshape(inp.shape).to(inp.dtype), None, None, None, None, None


def parallel_cross_entropy(inp: torch.Tensor, target: torch.Tensor, label_smoothing: float = 0.0,
                           reduce_loss: bool = False,
                           dist_process_group: Optional[dist.ProcessGroup] = None,
                           ignore_idx: int = -100, is_cg_capturable: bool = False,
                           ) -> torch.Tensor:
    """Cross entropy over a vocabulary split across ``dist_process_group`` (None: one device);
    see the module's docstring. ``is_cg_capturable`` is accepted for Transformer Engine's
    signature: nothing here synchronises with the host, so it is always capturable."""
    _check_options(label_smoothing, reduce_loss, dist_process_group, ignore_idx)
    _check(inp, target, label_smoothing)
    return _ParallelCrossEntropy.apply(inp, target, float(label_smoothing), bool(reduce_loss),
                                       dist_process_group, operator.index(ignore_idx))
