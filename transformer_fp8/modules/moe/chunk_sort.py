"""Transformer Engine 2.8's moe_sort_chunks_by_index (and _with_probs): the input's row chunks
(split_sizes) put in the order sorted_index gives, as expert-parallel MoE reorders tokens between
the all-to-all and the experts; a gather whose backward is the matching scatter."""
from __future__ import annotations

from typing import Tuple

import torch

from .checks import _check_activation, _check_int_tensor, _check_values, _described, _fail
from .permutation import _SortRows

__all__ = ["moe_sort_chunks_by_index", "moe_sort_chunks_by_index_with_probs"]


def _as_index_tensor(fn: str, name: str, value) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        try:
            value = torch.as_tensor(value)
        except (TypeError, ValueError, RuntimeError):
            _fail(fn, f"{name} must be a 1-D integer tensor, got {_described(value)}", TypeError)
        if value.numel() == 0:
            value = value.long()
    _check_int_tensor(fn, name, value, 1)
    return value


def _sort_chunks(fn: str, inp, split_sizes, sorted_index, probs=None):
    _check_activation(fn, "inp", inp)
    split_sizes = _as_index_tensor(fn, "split_sizes", split_sizes)
    sorted_index = _as_index_tensor(fn, "sorted_index", sorted_index)
    num_chunks = split_sizes.shape[0]
    if sorted_index.shape[0] != num_chunks:
        _fail(fn, f"sorted_index must have split_sizes' length {num_chunks}, got "
              f"{_described(sorted_index)}")
    n = inp.shape[0]
    if probs is not None:
        if not isinstance(probs, torch.Tensor) or not probs.is_floating_point() \
                or tuple(probs.shape) != (n,) or probs.device != inp.device:
            _fail(fn, f"probs must be a 1-D floating tensor of the input's {n} rows on "
                  f"{inp.device}, got {_described(probs)}")
    # Otherwise rows would be dropped, repeated or read past the end: a ValueError where the
    # values are free to read (on the CPU), an assert on the device where they are not.
    if num_chunks:
        with torch.no_grad():
            sizes_ok = (split_sizes.min() >= 0) & (split_sizes.sum() == n)
            order = torch.sort(sorted_index).values
            order_ok = (order == torch.arange(num_chunks, device=order.device)).all()
        must_add_up = f"split_sizes must be non-negative and add up to the input's {n} rows"
        must_permute = f"sorted_index must be a permutation of 0..{num_chunks - 1}"
        _check_values(fn, (sizes_ok, must_add_up,
                           lambda: f"{must_add_up}, got {split_sizes.tolist()}"))
        _check_values(fn, (order_ok, must_permute,
                           lambda: f"{must_permute}, got {sorted_index.tolist()}"))
    if n == 0:
        src = torch.zeros(0, dtype=torch.int64, device=inp.device)
        inverse = src
    else:
        if num_chunks == 0:
            _fail(fn, f"split_sizes is empty but the input has {n} rows")
        with torch.no_grad():
            sizes = split_sizes.to(device=inp.device, dtype=torch.int64)
            order = sorted_index.to(device=inp.device, dtype=torch.int64)
            in_start = torch.cumsum(sizes, 0) - sizes
            out_sizes = sizes.index_select(0, order)
            out_end = torch.cumsum(out_sizes, 0)
            rows = torch.arange(n, device=inp.device)
            # output row j lies in output chunk k = the first whose end is past j
            k = torch.searchsorted(out_end, rows, right=True).clamp(max=num_chunks - 1)
            src = in_start.index_select(0, order.index_select(0, k)) + rows \
                - (out_end - out_sizes).index_select(0, k)
            inverse = torch.empty_like(src).scatter_(0, src, rows)
    output = _SortRows.apply(inp, src, inverse)
    permuted_probs = None
    if probs is not None:
        permuted_probs = _SortRows.apply(probs.unsqueeze(1), src, inverse).squeeze(1)
    return output, permuted_probs


def moe_sort_chunks_by_index(
    inp: torch.Tensor,
    split_sizes: torch.Tensor,
    sorted_index: torch.Tensor,
) -> torch.Tensor:
    """Split inp's rows into chunks of ``split_sizes`` rows and concatenate the chunks in the
    order ``sorted_index`` gives (Transformer Engine's ``moe_sort_chunks_by_index``): output =
    cat([chunk[i] for i in sorted_index]). split_sizes must add up to inp's rows and
    sorted_index be a permutation (a ValueError for index tensors on the CPU, a
    torch._assert_async on a device)."""
    output, _ = _sort_chunks("moe_sort_chunks_by_index", inp, split_sizes, sorted_index)
    return output


def moe_sort_chunks_by_index_with_probs(
    inp: torch.Tensor,
    probs: torch.Tensor,
    split_sizes: torch.Tensor,
    sorted_index: torch.Tensor,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``moe_sort_chunks_by_index``, moving ``probs`` [num_tokens] with the rows. Returns
    ``(output, permuted_probs)``."""
    return _sort_chunks("moe_sort_chunks_by_index_with_probs", inp, split_sizes, sorted_index,
                        probs)
