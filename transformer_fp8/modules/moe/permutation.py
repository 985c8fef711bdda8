"""Transformer Engine's MoE token permutation (``moe_permute``, ``moe_permute_with_probs``,
``moe_unpermute``, ``moe_sort_chunks_by_index``, ``moe_sort_chunks_by_index_with_probs``; TE
2.8's signatures) in plain torch: gathers and scatter-adds, no Python loop over tokens, on any
device.

    permuted, row_id_map = moe_permute(x, routing_map, num_out_tokens=n)   # [n, hidden]
    y = experts(permuted, m_splits=tokens_per_expert)                      # e.g. GroupedLinear
    out = moe_unpermute(y, row_id_map, merging_probs=probs)                # [tokens, hidden]

Routing. ``map_type="mask"``: ``routing_map`` [tokens, experts], bool or integer, non-zero where
a token goes to an expert. ``map_type="index"``: ``routing_map`` [tokens, topK], integer expert
ids. The permuted rows are grouped by expert in ascending expert id; within an expert they are
in ascending token order (index map: then in column order, for a token that names an expert
twice). ``num_out_tokens`` keeps the first that many rows of this order and drops the rest (the
highest experts' last tokens): a dropped copy is absent from the permuted tensor and adds
nothing when unpermuting.

``row_id_map`` (what ``moe_permute`` returns and ``moe_unpermute`` takes): an int64 tensor
[tokens, S], S = experts (mask) or topK (index). ``row_id_map[t, s]`` is the permuted row that
holds token t's copy for slot s (expert s of a mask map; column s of an index map), -1 where
that slot is not routed or was dropped. Its columns are those of ``merging_probs``:
``moe_unpermute`` computes ``out[t] = sum_s merging_probs[t, s] * inp[row_id_map[t, s]]`` over
the slots that are not -1 (without merging_probs, the plain sum).

Numerics: the permute is a copy; its gradient, and the unpermute, add a token's copies in
ascending permuted-row order on the CPU (CUDA's index_add_ adds them in any order, or in a fixed
one under ``torch.use_deterministic_algorithms``) in float32 for 16-bit inputs (their dtype
otherwise), rounding once at the end, as Transformer Engine's mask-map kernels do (read in its
source: the same bits there). Its index-map kernels compute in a 16-bit input's own dtype
instead (each merging_prob and each product rounded to it, the copies added in slot order,
rounding after each addition): for bfloat16 this library's index-map results are the more accurate
and differ
from Transformer Engine's by up to a few bfloat16 ulps (float32: in the order of addition only;
measured against an emulation of its kernels, not against Transformer Engine itself).
merging_probs multiply in that precision; their gradient is the float32 dot product of the
output gradient and the permuted row, in merging_probs' dtype.

Checks (checks.py): a negative expert id, a row_id_map value below -1, past inp's rows or naming a
row twice are refused: a ValueError on the CPU, a torch._assert_async on a device (reading the
values there would wait for it). Ids past the last expert are not: num_experts is not given.

Differences from Transformer Engine 2.8 (README, "Transformer Engine's modules"):

* FP8 inputs (its Float8Tensor & co.) are refused: this library has no public FP8 activation
  tensor type. Permute the high-precision tensor; the FP8 GEMMs after it cast it.
* mask map: ``num_out_tokens=-1`` (the default) counts the routed slots, a device sync
  (Transformer Engine requires the count there); ``num_out_tokens`` below the count drops as
  described above (Transformer Engine's mask kernels write out of bounds); rows past the count
  are zeros with no gradient (uninitialised there).
* index map without merging_probs: a token's copies are summed, as with a mask map
  (Transformer Engine returns the [tokens * topK] copies unmerged, a case its tests skip).
* ``moe_permute_with_probs`` zeroes the output rows whose prob is 0 (padding slots), as
  Transformer Engine does, and their gradient is zero (Transformer Engine passes it on).
* ``restore_shape`` is optional: ``row_id_map`` knows the token count (Transformer Engine
  takes the permuted tensor's row count when it is not given).
"""
from __future__ import annotations

import warnings
from typing import Optional, Sequence, Tuple

import torch

from .checks import (_accumulation_dtype, _as_int, _check_activation, _check_int_tensor,
                     _check_map_type, _check_row_id_map, _check_values, _described,
                     _fail, _negative_ids)

__all__ = ["moe_permute", "moe_permute_with_probs", "moe_unpermute"]


# ----------------------------------------------------------------------------- routing
# Each returns (row_id_map [N, S], tok [R], pos [R]): for permuted row r, the token it copies
# and its slot's flat position t * S + s in row_id_map (and merging_probs). Rows past the
# routed count (a mask map given more num_out_tokens than it routes) have tok = N and
# pos = N * S, one past the end, so that scatter-adds put them in a spare row.

def _index_map_routing(fn: str, routing_map: torch.Tensor, num_out: int):
    n, k = routing_map.shape
    dev = routing_map.device
    # Flat position t * K + k, sorted by expert; stable, so ties stay in token, column order.
    ids, kept = torch.sort(routing_map.reshape(-1), stable=True)
    if ids.numel():
        # A negative id would sort first and shift every expert's rows (the smallest id is
        # ids[0]: no extra pass over the map). No upper bound: the ids do not say num_experts.
        must = "routing_map must hold expert ids >= 0 for map_type='index'"
        _check_values(fn, (ids[0] >= 0, must,
                           lambda: f"{must}, got {_negative_ids(routing_map)}"))
    kept = kept[:num_out]
    row_of_slot = torch.full((n * k,), -1, dtype=torch.int64, device=dev)
    row_of_slot.scatter_(0, kept, torch.arange(num_out, device=dev))
    return row_of_slot.view(n, k), torch.div(kept, k, rounding_mode="floor"), kept


def _mask_map_routing(routing_map: torch.Tensor, num_out: int):
    n, e = routing_map.shape
    dev = routing_map.device
    if n == 0:
        empty = torch.zeros(0, dtype=torch.int64, device=dev)
        return torch.zeros(0, e, dtype=torch.int64, device=dev), empty, empty
    # Expert-major order (position expert * N + token) is the permuted order: a routed slot's
    # row is the number of routed slots before it.
    routed = (routing_map != 0).t().reshape(-1)
    count = torch.cumsum(routed, 0)
    row = torch.where(routed & (count <= num_out), count - 1, -1)
    row_id_map = row.view(e, n).t().contiguous()
    # Row r copies the slot where the count reaches r + 1 (e * N past the last routed slot).
    slot = torch.searchsorted(count, torch.arange(1, num_out + 1, device=dev))
    real = slot < e * n
    token = torch.remainder(slot, n)
    expert = torch.div(slot, n, rounding_mode="floor")
    tok = torch.where(real, token, n)
    pos = torch.where(real, token * e + expert, n * e)
    return row_id_map, tok, pos


def _rows_of(row_id_map: torch.Tensor, num_rows: int):
    """(tok, pos) of each of ``num_rows`` permuted rows, read back from a row_id_map; a row no
    slot names gets tok = N, pos = N * S."""
    n, s = row_id_map.shape
    dev = row_id_map.device
    flat = row_id_map.reshape(-1).long()
    dest = torch.where((flat >= 0) & (flat < num_rows), flat, num_rows)  # spare slot at the end
    pos = torch.full((num_rows + 1,), n * s, dtype=torch.int64, device=dev)
    pos.scatter_(0, dest, torch.arange(n * s, device=dev))
    pos = pos[:num_rows]
    return torch.div(pos, s, rounding_mode="floor"), pos


# ----------------------------------------------------------------------------- autograd


def _scatter_add_rows(src: torch.Tensor, index: torch.Tensor, num_rows: int,
                      out_dtype: torch.dtype) -> torch.Tensor:
    """[num_rows, H]: row i the sum of the rows of src whose index is i (index num_rows: the
    spare row, dropped), accumulated in _accumulation_dtype."""
    acc = torch.zeros(num_rows + 1, src.shape[1], dtype=_accumulation_dtype(out_dtype),
                      device=src.device)
    acc.index_add_(0, index, src.to(acc.dtype))
    out = acc[:num_rows]
    # A tensor of its own, not a view of acc (a caller may add to it in place: out += shared).
    # (A clone rather than a no-op .to(): torch 2.11's compiled autograd.Function loses the
    # gradient of an output that is a no-op .to() of a view.)
    return out.clone() if out.dtype == out_dtype else out.to(out_dtype)


class _PermuteRows(torch.autograd.Function):
    """out[r] = inp[tok[r]] where keep[r] (everywhere when keep is None), else 0. Backward: the
    matching scatter-add."""

    @staticmethod
    def forward(ctx, inp, tok, keep):
        n = inp.shape[0]
        src = tok.clamp(max=n - 1) if (keep is not None and n > 0) else tok
        out = inp.index_select(0, src)
        if keep is not None:
            out = torch.where(keep.unsqueeze(1), out, 0)
            tok = torch.where(keep, tok, n)
        ctx.save_for_backward(tok)
        ctx.num_tokens = n
        return out

    @staticmethod
    def backward(ctx, grad_out):
        (tok,) = ctx.saved_tensors
        return _scatter_add_rows(grad_out, tok, ctx.num_tokens, grad_out.dtype), None, None


class _UnpermuteRows(torch.autograd.Function):
    """out[t] = sum over rows r with tok[r] == t of inp[r] * weight[r] (weight =
    probs_flat[pos[r]], or 1 without probs), accumulated in float32 for 16-bit inputs."""

    @staticmethod
    def forward(ctx, inp, probs_flat, tok, pos, num_tokens):
        acc_dtype = _accumulation_dtype(inp.dtype)
        src = inp.to(acc_dtype)
        weight = None
        if probs_flat is not None:
            real = tok < num_tokens
            size = probs_flat.shape[0]
            weight = probs_flat.index_select(0, pos.clamp(max=max(size - 1, 0)))
            weight = torch.where(real, weight.to(acc_dtype), 0)
            src = src * weight.unsqueeze(1)
        out = _scatter_add_rows(src, tok, num_tokens, inp.dtype)
        ctx.save_for_backward(tok, pos, weight,
                              inp if probs_flat is not None and ctx.needs_input_grad[1] else None)
        ctx.num_tokens = num_tokens
        ctx.probs_size = None if probs_flat is None else probs_flat.shape[0]
        ctx.probs_dtype = None if probs_flat is None else probs_flat.dtype
        return out

    @staticmethod
    def backward(ctx, grad_out):
        tok, pos, weight, inp = ctx.saved_tensors
        # The output gradient of each row's token; a row of no token (tok = N) gets zeros.
        padded = torch.cat([grad_out, grad_out.new_zeros(1, grad_out.shape[1])])
        grad_rows = padded.index_select(0, tok)
        grad_inp = grad_probs = None
        if ctx.needs_input_grad[0]:
            if weight is None:
                grad_inp = grad_rows
            else:
                acc_dtype = weight.dtype
                grad_inp = (grad_rows.to(acc_dtype) * weight.unsqueeze(1)).to(grad_out.dtype)
        if ctx.needs_input_grad[1]:
            acc_dtype = _accumulation_dtype(inp.dtype)
            dots = (inp.to(acc_dtype) * grad_rows.to(acc_dtype)).sum(1)
            grad_probs = torch.zeros(ctx.probs_size + 1, dtype=ctx.probs_dtype,
                                     device=grad_out.device)
            grad_probs.index_add_(0, pos, dots.to(ctx.probs_dtype))
            grad_probs = grad_probs[:ctx.probs_size]
        return grad_inp, grad_probs, None, None, None


class _SortRows(torch.autograd.Function):
    """out = inp[src], src a permutation of the rows; backward: grad[inverse]."""

    @staticmethod
    def forward(ctx, inp, src, inverse):
        ctx.save_for_backward(inverse)
        return inp.index_select(0, src)

    @staticmethod
    def backward(ctx, grad_out):
        (inverse,) = ctx.saved_tensors
        return grad_out.index_select(0, inverse), None, None


# ----------------------------------------------------------------------------- permute

def _num_out_tokens(fn: str, num_out_tokens, routing_map: torch.Tensor, map_type: str) -> int:
    """The permuted row count: num_out_tokens checked, or what -1 (index map: 0 too) means."""
    n, s = routing_map.shape
    value = _as_int(fn, "num_out_tokens", num_out_tokens)
    bound = n * s
    if map_type == "index":
        if value < -1 or value > bound:
            _fail(fn, f"num_out_tokens must be -1 or 0 (no dropping) or at most num_tokens * "
                  f"topK = {n} * {s} = {bound}, got {value}")
        return bound if value <= 0 else value  # (Transformer Engine: <= 0 keeps every copy)
    if value < -1 or value > bound:
        _fail(fn, f"num_out_tokens must be -1 (every routed slot) or between 0 and num_tokens "
              f"* num_experts = {n} * {s} = {bound}, got {value}")
    if value == -1:
        return int((routing_map != 0).sum().item())  # (waits for the device)
    return value


def _permute(fn: str, inp, routing_map, num_out_tokens, map_type: str, probs=None):
    _check_activation(fn, "inp", inp)
    if map_type == "index":
        _check_int_tensor(fn, "routing_map", routing_map, 2, inp.device,
                          shape_text=" [num_tokens, topK] of expert ids for map_type='index'")
    else:
        _check_int_tensor(fn, "routing_map", routing_map, 2, inp.device, allow_bool=True,
                          shape_text=" [num_tokens, num_experts] for map_type='mask'")
    n, s = routing_map.shape
    if n != inp.shape[0]:
        _fail(fn, f"routing_map must have one row per token of inp ({inp.shape[0]}), got "
              f"{_described(routing_map)}")
    if s < 1:
        column = "topK >= 1" if map_type == "index" else "at least one expert"
        _fail(fn, f"routing_map must have {column} (a column), got {_described(routing_map)}")
    if probs is not None:
        _check_activation(fn, "probs", probs, inp.device)
        if tuple(probs.shape) != (n, s):
            _fail(fn, f"probs must have routing_map's shape {[n, s]}, got {_described(probs)}")
    num_out = _num_out_tokens(fn, num_out_tokens, routing_map, map_type)
    with torch.no_grad():
        if map_type == "index":
            row_id_map, tok, pos = _index_map_routing(fn, routing_map, num_out)
        else:
            row_id_map, tok, pos = _mask_map_routing(routing_map, num_out)
    # Rows past the routed count: only a mask map given num_out_tokens can have them (an
    # index map routes every slot; -1 counted them).
    real = tok < n if map_type == "mask" and num_out_tokens != -1 else None
    permuted_probs = keep = None
    if probs is not None:
        flat = probs.reshape(-1)
        permuted_probs = flat.index_select(0, pos.clamp(max=max(flat.shape[0] - 1, 0)))
        if real is not None:
            permuted_probs = torch.where(real, permuted_probs, 0)
        keep = permuted_probs.detach() != 0  # a slot of probability 0 is padding: a zero row
    else:
        keep = real
    output = _PermuteRows.apply(inp, tok, keep)
    return output, row_id_map, permuted_probs


def moe_permute(
    inp: torch.Tensor,
    routing_map: torch.Tensor,
    num_out_tokens: int = -1,
    max_token_num: int = -1,
    map_type: str = "mask",
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Group the tokens' rows by expert (Transformer Engine's ``moe_permute``).

    inp: [num_tokens, hidden_size]. routing_map: ``map_type="mask"``: [num_tokens, num_experts],
    bool or integer, non-zero where the token goes to the expert; ``"index"``: [num_tokens,
    topK] integer expert ids. num_out_tokens: how many permuted rows to keep (the rest, the
    highest experts' last tokens, are dropped); -1 keeps every routed copy (index map: 0 too,
    as Transformer Engine). max_token_num: accepted and unused (Transformer Engine's workspace
    size). Returns ``(permuted [num_out_tokens, hidden_size], row_id_map)``, for
    ``moe_unpermute``. See the module docstring for the order of the rows and row_id_map's
    layout.
    """
    fn = "moe_permute"
    _check_map_type(fn, map_type)
    _as_int(fn, "max_token_num", max_token_num)
    output, row_id_map, _ = _permute(fn, inp, routing_map, num_out_tokens, map_type)
    return output, row_id_map


def moe_permute_with_probs(
    inp: torch.Tensor,
    probs: torch.Tensor,
    routing_map: torch.Tensor,
    num_out_tokens: int = -1,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``moe_permute`` with a mask map, permuting ``probs`` [num_tokens, num_experts] with the
    tokens (Transformer Engine's ``moe_permute_with_probs``). Returns ``(permuted,
    permuted_probs [num_out_tokens], row_id_map)``. A row whose prob is 0 (a padding slot of
    the routing map) is zeros; probs gets the gradient of permuted_probs.
    """
    fn = "moe_permute_with_probs"
    output, row_id_map, permuted_probs = _permute(fn, inp, routing_map, num_out_tokens, "mask",
                                                  probs)
    return output, permuted_probs, row_id_map


def moe_unpermute(
    inp: torch.Tensor,
    row_id_map: torch.Tensor,
    merging_probs: Optional[torch.Tensor] = None,
    restore_shape: Optional[Sequence[int]] = None,
    map_type: str = "mask",
    probs: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Put the permuted rows back in token order, summing each token's copies, weighted by
    ``merging_probs`` when given (Transformer Engine's ``moe_unpermute``).

    inp: [num_out_tokens, hidden_size], moe_permute's output (or an expert's output of the
    same rows). row_id_map: moe_permute's. merging_probs: [num_tokens, num_experts] (mask) or
    [num_tokens, topK] (index), row_id_map's shape; gets a gradient. restore_shape:
    (num_tokens, hidden_size), optional (checked when given). map_type: moe_permute's (the
    row_id_map layout is the same for both). probs: the old name of merging_probs (deprecated).
    Returns [num_tokens, hidden_size]; a token whose copies were all dropped gets zeros.
    """
    fn = "moe_unpermute"
    if probs is not None:
        if merging_probs is not None:
            _fail(fn, "merging_probs and probs were both given: probs is merging_probs' "
                  "deprecated name, pass merging_probs only")
        warnings.warn(f"{fn}: probs is deprecated, pass merging_probs", FutureWarning,
                      stacklevel=2)
        merging_probs = probs
    _check_map_type(fn, map_type)
    _check_activation(fn, "inp", inp)
    _check_int_tensor(fn, "row_id_map", row_id_map, 2, inp.device,
                      shape_text=" [num_tokens, num_experts or topK] (moe_permute's row_id_map)")
    n, s = row_id_map.shape
    hidden = inp.shape[1]
    if restore_shape is not None:
        shape = tuple(restore_shape) if isinstance(restore_shape, (tuple, list, torch.Size)) \
            else None
        if shape is None or shape != (n, hidden):
            _fail(fn, f"restore_shape must be (num_tokens, hidden_size) = ({n}, {hidden}) "
                  f"(row_id_map's tokens, inp's hidden size), got {restore_shape!r}")
    probs_flat = None
    if merging_probs is not None:
        _check_activation(fn, "merging_probs", merging_probs, inp.device)
        if tuple(merging_probs.shape) != (n, s):
            _fail(fn, f"merging_probs must have row_id_map's shape {[n, s]} ([num_tokens, "
                  f"{'topK' if map_type == 'index' else 'num_experts'}]), got "
                  f"{_described(merging_probs)}")
        probs_flat = merging_probs.reshape(-1)
    if s < 1:
        _fail(fn, f"row_id_map must have at least one column, got {_described(row_id_map)}")
    with torch.no_grad():
        tok, pos = _rows_of(row_id_map, inp.shape[0])
        if row_id_map.numel():
            _check_row_id_map(fn, row_id_map, inp, pos)
    return _UnpermuteRows.apply(inp, probs_flat, tok, pos, n)
