"""update_delayed_scaling for recipes whose amax or scaling-factor algorithm is a Python callable
(Transformer Engine's DelayedScaling accepts both): the operator's numerics in torch ops, with
the operator's argument checks. (The C++ kernels run the "max" / "most_recent" algorithms.)"""
from __future__ import annotations

import math
from typing import Callable, Optional, Sequence, Union

import torch

FLT_MAX = torch.finfo(torch.float32).max
FLT_MIN = torch.finfo(torch.float32).tiny  # the smallest normal float32


def scale_from_amax(amax: torch.Tensor, fp8_max: float, margin: int) -> torch.Tensor:
    """fp8_max / amax / 2**margin in fp64, clamped to [FLT_MIN, FLT_MAX] (the smallest normal
    and the largest float32), rounded once to fp32. Only meaningful where amax is finite and
    positive."""
    scale = fp8_max / amax.double() / 2.0 ** margin
    return scale.clamp(FLT_MIN, FLT_MAX).float()


def delayed_scaling_result(
        history: torch.Tensor, scale: torch.Tensor, scale_inv: torch.Tensor, fp8_max: float,
        margin: int = 0,
        amax_compute_algo: Union[str, Callable[[torch.Tensor], torch.Tensor]] = "max",
        scaling_factor_compute_algo: Optional[Callable] = None,
        recipe=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The (history, scale, scale_inv) that the update makes of one state, as new tensors: the
    state itself is untouched, so a callable that fails or returns the wrong shape changes
    nothing."""
    cur = history[0].clone()
    recorded = cur != 0  # NaN counts as recorded
    # The window: old rows 1..L-1 (oldest first) and this step's amax last.
    window = torch.cat([history[1:], cur[None]])
    if callable(amax_compute_algo):
        # Transformer Engine calls it on the history before the roll: row 0 this step's amax,
        # rows 1..L-1 the earlier ones, oldest first (so h[0] is "most_recent"). A copy: the
        # callable may write into it.
        amax = _checked_result(amax_compute_algo(history.clone()), "amax_compute_algo", cur)
    elif amax_compute_algo == "max":
        amax = torch.where(torch.isfinite(window), window, float("-inf")).amax(dim=0)
    elif amax_compute_algo == "most_recent":
        amax = torch.where(torch.isfinite(cur), cur, float("-inf"))
    else:
        raise ValueError(f"amax_compute_algo must be 'max', 'most_recent' or a callable, "
                         f"got {amax_compute_algo!r}")
    if scaling_factor_compute_algo is not None:
        computed = _checked_result(
            scaling_factor_compute_algo(amax.clone(), scale.clone(), fp8_max, recipe),
            "scaling_factor_compute_algo", scale).to(scale.dtype)
        # The callable decides (as in Transformer Engine: a back-off on an inf amax, a static
        # scale), but a result that is no usable scale (inf: fp8_max / 0 of an empty window,
        # NaN, 0, negative) leaves the old scale, never a state whose casts give zeros or NaN.
        # (Positive subnormals are raised to FLT_MIN, so that scale_inv stays finite.)
        new_scale = torch.where(torch.isfinite(computed) & (computed > 0),
                                computed.clamp(min=FLT_MIN), scale)
    else:
        usable = torch.isfinite(amax) & (amax > 0)
        new_scale = torch.where(usable, scale_from_amax(amax, fp8_max, margin), scale)
    rolled = torch.cat([torch.zeros_like(cur)[None], window[1:]])
    new_scale = torch.where(recorded, new_scale, scale)
    return (torch.where(recorded, rolled, history), new_scale,
            torch.where(recorded, 1.0 / new_scale, scale_inv))


def _checked_result(result, name: str, like: torch.Tensor) -> torch.Tensor:
    """A recipe callable's result must be a floating tensor of the state's shape [n]."""
    if not isinstance(result, torch.Tensor):
        raise TypeError(f"{name} must return a torch.Tensor of shape {list(like.shape)}, "
                        f"got {type(result).__name__}")
    if result.shape != like.shape or not result.is_floating_point():
        raise ValueError(f"{name} must return a floating tensor of shape {list(like.shape)} "
                         f"(one value per column of the amax history), got {result.dtype} of "
                         f"shape {list(result.shape)}")
    return result.to(like.device)


def check_delayed_scaling_lists(histories: Sequence[torch.Tensor], scales: Sequence[torch.Tensor],
                                scale_invs: Sequence[torch.Tensor],
                                fp8_maxes: Sequence[float]) -> None:
    """The argument checks of the C++ operator, for this path."""
    if len(histories) == 0:
        raise ValueError("amax_histories must be a non-empty list, got an empty list")
    if not len(histories) == len(scales) == len(scale_invs) == len(fp8_maxes):
        raise ValueError("amax_histories, scales, scale_invs and fp8_maxes must have the same "
                         f"length, got {len(histories)}, {len(scales)}, {len(scale_invs)} and "
                         f"{len(fp8_maxes)}")
    device = histories[0].device
    for i, fp8_max in enumerate(fp8_maxes):
        if not (math.isfinite(fp8_max) and fp8_max > 0):
            raise ValueError(f"fp8_maxes[{i}] must be finite and positive, got {fp8_max}")
    for i, (h, s, si) in enumerate(zip(histories, scales, scale_invs)):
        # (Contiguous, as the C++ operator requires: each is rewritten in place.)
        if h.dim() != 2 or h.shape[0] < 1 or h.dtype != torch.float32 or not h.is_contiguous():
            raise ValueError(f"amax_histories[{i}] must be a contiguous float32 tensor of shape "
                             f"[L >= 1, n], got {h.dtype} of shape {tuple(h.shape)} and strides "
                             f"{tuple(h.stride())}")
        for name, t in (("scales", s), ("scale_invs", si)):
            if t.shape != (h.shape[1],) or t.dtype != torch.float32 or not t.is_contiguous():
                raise ValueError(f"{name}[{i}] must be a contiguous float32 tensor of shape "
                                 f"[{h.shape[1]}], got {t.dtype} of shape {tuple(t.shape)} and "
                                 f"strides {tuple(t.stride())}")
        if not h.device == s.device == si.device == device:
            raise ValueError(f"every tensor must be on {device}; at index {i} got "
                             f"{h.device}, {s.device}, {si.device}")
    _check_no_overlap({"amax_histories": histories, "scales": scales, "scale_invs": scale_invs})


def _check_no_overlap(lists: dict) -> None:
    """No two tensors of the update share memory (each is rewritten in place once)."""
    ranges = []
    for name, tensors in lists.items():
        for i, t in enumerate(tensors):
            if t.numel():
                begin = t.data_ptr()
                end = begin + _span(t) * t.element_size()
                ranges.append((begin, end, f"{name}[{i}]"))
    ranges.sort()
    furthest_end, furthest = 0, None
    for begin, end, label in ranges:
        if furthest is not None and begin < furthest_end:
            raise ValueError(f"update_delayed_scaling: '{label}' shares memory with "
                             f"'{furthest}'; each history, scale and scale_inv must be a tensor "
                             "of its own, overlapping no other")
        if end > furthest_end:
            furthest_end, furthest = end, label


def _span(t: torch.Tensor) -> int:
    """Elements from t's first to its last element in memory (strides >= 0)."""
    return 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
