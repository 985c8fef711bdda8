"""Transformer Engine's MoE token permutation (moe_permute, moe_permute_with_probs, moe_unpermute,
moe_sort_chunks_by_index, moe_sort_chunks_by_index_with_probs) against straightforward
references written here with loops over the permuted rows, bit for bit on the CPU: outputs,
row_id_map and every gradient, for both map types, with and without dropping, with merging
probs; gradcheck in float64; round trips; empty inputs; an MoE of GroupedLinear experts trained
in FP8 against the same model with a loop over experts; torch.compile; errors.

The order of the permuted rows (Transformer Engine's tests' torch references): by expert, then
token (index map: then column); num_out_tokens keeps the first rows of that order."""
from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
import torch.nn.functional as F

import transformer_fp8 as te
from conftest import assert_bitwise_equal, randn, sqnr
from transformer_fp8 import DelayedScaling

N, E, H = 13, 4, 8


# ----------------------------------------------------------------------------- references

def routing(gen, map_type, topk, num_tokens=N, experts=E, device="cpu"):
    """Each token picks topk distinct experts at random: a bool mask [N, E] or ids [N, topk]."""
    ids = torch.stack([torch.randperm(experts, generator=gen)[:topk] for _ in range(num_tokens)]) \
        if num_tokens else torch.zeros(0, topk, dtype=torch.int64)
    if map_type == "index":
        return ids.to(torch.int32).to(device)
    mask = torch.zeros(num_tokens, experts, dtype=torch.bool)
    mask.scatter_(1, ids, True)
    return mask.to(device)


def reference_rows(routing_map, map_type, num_out_tokens):
    """[(token, slot)] of each permuted row: the routed slots sorted by (expert, token, column),
    the first num_out_tokens kept (-1: all; index map: 0 too)."""
    rm = routing_map.tolist()
    num_tokens = len(rm)
    slots_per_token = routing_map.shape[1]
    if map_type == "mask":
        slots = [(e, t, e) for e in range(slots_per_token) for t in range(num_tokens) if rm[t][e]]
    else:
        slots = sorted((rm[t][k], t, k) for t in range(num_tokens) for k in range(slots_per_token))
    keep_all = num_out_tokens == -1 or (map_type == "index" and num_out_tokens == 0)
    kept = slots if keep_all else slots[:num_out_tokens]
    return [(t, s) for _, t, s in kept]


def acc_dtype(dtype):
    return torch.promote_types(dtype, torch.float32)


def ref_permute(x, rows, num_rows):
    out = torch.zeros(num_rows, x.shape[1], dtype=x.dtype)
    for r, (t, _) in enumerate(rows):
        out[r] = x[t]
    return out


def ref_permute_grad(grad, rows, num_tokens, dtype):
    acc = torch.zeros(num_tokens, grad.shape[1], dtype=acc_dtype(dtype))
    for r, (t, _) in enumerate(rows):
        acc[t] += grad[r].to(acc.dtype)
    return acc.to(dtype)


def ref_row_id_map(rows, num_tokens, slots):
    expected = torch.full((num_tokens, slots), -1, dtype=torch.int64)
    for r, (t, s) in enumerate(rows):
        expected[t, s] = r
    return expected


def ref_unpermute(y, rows, num_tokens, probs=None):
    acc = torch.zeros(num_tokens, y.shape[1], dtype=acc_dtype(y.dtype))
    for r, (t, s) in enumerate(rows):
        term = y[r].to(acc.dtype)
        if probs is not None:
            term = term * probs[t, s].to(acc.dtype)
        acc[t] += term
    return acc.to(y.dtype)


def ref_unpermute_grads(y, grad, rows, probs=None):
    """(grad of y, grad of probs) of ref_unpermute for the output gradient ``grad``."""
    a = acc_dtype(y.dtype)
    grad_y = torch.zeros_like(y)
    grad_p = None if probs is None else torch.zeros_like(probs)
    for r, (t, s) in enumerate(rows):
        if probs is None:
            grad_y[r] = grad[t]
        else:
            grad_y[r] = (grad[t].to(a) * probs[t, s].to(a)).to(y.dtype)
            grad_p[t, s] = (y[r].to(a) * grad[t].to(a)).sum().to(probs.dtype)
    return grad_y, grad_p


def merging_probs_for(gen, routing_map, map_type, dtype=torch.float32, device="cpu"):
    """Positive weights on the routed slots summing to 1 per token (0 elsewhere)."""
    p = torch.rand(routing_map.shape, generator=gen, dtype=torch.float64) + 0.1
    if map_type == "mask":
        p = p * routing_map.cpu()
    p = p / p.sum(1, keepdim=True).clamp(min=1e-30)
    return p.to(dtype).to(device)


def leaf(t, device="cpu"):
    """A copy of t on device that requires grad (a leaf of its own)."""
    return t.detach().to(device, copy=True).requires_grad_()


def check(out, ref, what, exact=True):
    """Bit for bit (the CPU, or a copy), else float rounding (CUDA's sums add in another
    order)."""
    out = out.detach().cpu()
    if exact:
        assert_bitwise_equal(out, ref, what)
    else:
        torch.testing.assert_close(out, ref, msg=what)


# ------------------------------------------------------------------------ against the references

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("drop", [False, True], ids=["all", "dropping"])
@pytest.mark.parametrize("topk", [1, 2, E])
@pytest.mark.parametrize("map_type", ["mask", "index"])
def test_permute_and_unpermute_match_the_reference(gen, device, map_type, topk, drop, dtype):
    routing_map = routing(gen, map_type, topk)
    num_out = N * topk - 7 if drop else -1
    rows = reference_rows(routing_map, map_type, num_out)
    num_rows = len(rows)
    slots = routing_map.shape[1]
    x = randn(gen, N, H, dtype=dtype)
    grad_permuted = randn(gen, num_rows, H, dtype=dtype)
    grad_out = randn(gen, N, H, dtype=dtype)
    # merging_probs in the input's dtype for a mask map, float32 for an index map (as
    # Transformer Engine's tests)
    probs = merging_probs_for(gen, routing_map, map_type,
                              dtype if map_type == "mask" else torch.float32)
    # CUDA adds a token's copies in any order: bit for bit where there are at most two.
    sums_exact = device == "cpu" or topk <= 2

    xd = leaf(x, device)
    permuted, row_id_map = te.moe_permute(xd, routing_map.to(device), num_out_tokens=num_out,
                                          map_type=map_type)
    check(permuted, ref_permute(x, rows, num_rows), "permuted")
    check(row_id_map, ref_row_id_map(rows, N, slots), "row_id_map")
    permuted.backward(grad_permuted.to(device))
    check(xd.grad, ref_permute_grad(grad_permuted, rows, N, dtype), "permute: grad of inp",
          sums_exact)

    # unpermute, plain sum and merged with probs
    y = randn(gen, num_rows, H, dtype=dtype)
    for merging in (None, probs):
        yd = leaf(y, device)
        pd = None if merging is None else leaf(merging, device)
        out = te.moe_unpermute(yd, row_id_map, merging_probs=pd, map_type=map_type)
        what = "unpermute" + ("" if merging is None else " with merging_probs")
        check(out, ref_unpermute(y, rows, N, merging), what, sums_exact)
        out.backward(grad_out.to(device))
        ref_gy, ref_gp = ref_unpermute_grads(y, grad_out, rows, merging)
        check(yd.grad, ref_gy, what + ": grad of inp")
        if merging is not None:
            check(pd.grad, ref_gp, what + ": grad of merging_probs", device == "cpu")


@pytest.mark.parametrize("drop", [False, True], ids=["all", "dropping"])
def test_permute_with_probs_matches_the_reference(gen, device, drop):
    routing_map = routing(gen, "mask", 2)
    num_out = 2 * N - 5 if drop else -1
    rows = reference_rows(routing_map, "mask", num_out)
    x, probs = randn(gen, N, H), merging_probs_for(gen, routing_map, "mask")
    grad, grad_probs = randn(gen, len(rows), H), randn(gen, len(rows))
    xd, pd = leaf(x, device), leaf(probs, device)
    permuted, permuted_probs, row_id_map = te.moe_permute_with_probs(
        xd, pd, routing_map.to(device), num_out_tokens=num_out)
    check(permuted, ref_permute(x, rows, len(rows)), "permuted")
    check(permuted_probs, torch.stack([probs[t, s] for t, s in rows]), "permuted_probs")
    check(row_id_map, ref_row_id_map(rows, N, E), "row_id_map")
    torch.autograd.backward([permuted, permuted_probs], [grad.to(device), grad_probs.to(device)])
    check(xd.grad, ref_permute_grad(grad, rows, N, torch.float32), "grad of inp")
    expected = torch.zeros(N, E)
    for r, (t, s) in enumerate(rows):
        expected[t, s] = grad_probs[r]
    check(pd.grad, expected, "grad of probs")


def test_the_order_is_transformer_engines_reference_order(gen):
    """The torch formulations of Transformer Engine's tests: index map, a stable sort of the
    flattened ids (copy k of token t at t * topK + k), the first num_out_tokens; mask map, the
    tokens of expert 0, then expert 1, ... (masked_select of the transposed mask)."""
    x = randn(gen, N, H)
    ids = routing(gen, "index", 3)
    order = torch.argsort(ids.reshape(-1), stable=True)
    for num_out in (3 * N, 3 * N - 11):
        permuted, _ = te.moe_permute(x, ids, num_out, map_type="index")
        assert_bitwise_equal(permuted, x.index_select(0, order[:num_out] // 3), str(num_out))
    mask = routing(gen, "mask", 3)
    tokens = torch.arange(N).unsqueeze(0).expand(E, -1).masked_select(mask.t())
    permuted, _ = te.moe_permute(x, mask, int(mask.sum()))
    assert_bitwise_equal(permuted, x.index_select(0, tokens))


def test_dropping_on_a_worked_example():
    """Transformer Engine's kernel comment's map: expert 0 takes tokens 0, 1, 3, expert 1
    tokens 0, 3, expert 2 tokens 1, 2. Keeping 5 rows drops expert 2's two copies: token 2
    comes back as zeros, token 1 with its expert-0 copy only."""
    routing_map = torch.tensor([[1, 1, 0], [1, 0, 1], [0, 0, 1], [1, 1, 0], [0, 0, 0]],
                               dtype=torch.int32)
    x = torch.arange(10.0).reshape(5, 2)
    permuted, row_id_map = te.moe_permute(x, routing_map, num_out_tokens=5)
    assert row_id_map.tolist() == [[0, 3, -1], [1, -1, -1], [-1, -1, -1], [2, 4, -1],
                                   [-1, -1, -1]]
    assert permuted.tolist() == [x[0].tolist(), x[1].tolist(), x[3].tolist(), x[0].tolist(),
                                 x[3].tolist()]
    probs = torch.tensor([[0.25, 0.75, 0], [0.5, 0, 0.5], [0, 0, 1], [0.5, 0.5, 0], [0, 0, 0]])
    out = te.moe_unpermute(permuted, row_id_map, probs)
    assert out.tolist() == [x[0].tolist(), (x[1] * 0.5).tolist(), [0.0, 0.0], x[3].tolist(),
                            [0.0, 0.0]]
    # Every routed copy kept: the map of the kernel comment.
    _, full = te.moe_permute(x, routing_map, num_out_tokens=-1)
    assert full.tolist() == [[0, 3, -1], [1, -1, 5], [-1, -1, 6], [2, 4, -1], [-1, -1, -1]]


def test_rows_past_the_routed_count_are_zeros_without_gradient(gen):
    """A mask map given more num_out_tokens than it routes: the rows after the routed ones are
    zeros (Transformer Engine leaves them uninitialised), take no gradient, and unpermute
    ignores them."""
    routing_map = routing(gen, "mask", 1)
    x = randn(gen, N, H).requires_grad_()
    permuted, row_id_map = te.moe_permute(x, routing_map, num_out_tokens=N + 3)
    assert torch.equal(permuted[N:], torch.zeros(3, H))
    assert torch.equal(permuted[:N], te.moe_permute(x, routing_map)[0])
    permuted.backward(torch.ones(N + 3, H))
    assert torch.equal(x.grad, torch.ones(N, H))
    y = torch.full((N + 3, H), 2.0, requires_grad=True)
    out = te.moe_unpermute(y, row_id_map)
    assert torch.equal(out, torch.full((N, H), 2.0))
    out.backward(torch.ones(N, H))
    assert torch.equal(y.grad[N:], torch.zeros(3, H))
    # with probs too: the spare rows' permuted_probs are 0
    probs = merging_probs_for(gen, routing_map, "mask").requires_grad_()
    _, permuted_probs, _ = te.moe_permute_with_probs(x, probs, routing_map, N + 3)
    assert torch.equal(permuted_probs[N:], torch.zeros(3))


def test_a_slot_of_probability_zero_is_a_zero_row(gen):
    """moe_permute_with_probs: a routed slot whose prob is 0 (padding of the routing map) gives
    zeros, as Transformer Engine's kernel writes; its gradient is zero (the row does not depend
    on inp), and its prob still gets the gradient of permuted_probs."""
    routing_map = routing(gen, "mask", 2)
    probs = merging_probs_for(gen, routing_map, "mask")
    token = 5
    expert = int(routing_map[token].nonzero()[0])
    probs[token, expert] = 0.0
    x = randn(gen, N, H).requires_grad_()
    probs.requires_grad_()
    permuted, permuted_probs, row_id_map = te.moe_permute_with_probs(x, probs, routing_map)
    row = int(row_id_map[token, expert])
    assert torch.equal(permuted[row], torch.zeros(H))
    others = [r for r in range(permuted.shape[0]) if r != row]
    assert torch.equal(permuted[others], te.moe_permute(x, routing_map)[0][others])
    (permuted.sum() + (permuted_probs * 3).sum()).backward()
    expected = torch.zeros(N, H)
    expected.index_add_(0, torch.tensor([t for t, s in reference_rows(routing_map, "mask", -1)
                                         if (t, s) != (token, expert)]), torch.ones(len(others), H))
    assert torch.equal(x.grad, expected)
    assert probs.grad[token, expert] == 3.0


# ----------------------------------------------------------------------------- gradcheck

@pytest.mark.parametrize("map_type", ["mask", "index"])
def test_gradcheck_float64(gen, map_type):
    n, e, h, k = 6, 3, 4, 2
    routing_map = routing(gen, map_type, k, n, e)
    num_out = n * k - 3  # dropping too
    x = randn(gen, n, h, dtype=torch.float64).requires_grad_()
    probs = merging_probs_for(gen, routing_map, map_type, torch.float64).requires_grad_()

    def permute(x):
        return te.moe_permute(x, routing_map, num_out, map_type=map_type)[0]

    _, row_id_map = te.moe_permute(x, routing_map, num_out, map_type=map_type)
    y = randn(gen, num_out, h, dtype=torch.float64).requires_grad_()

    def unpermute(y, p):
        return te.moe_unpermute(y, row_id_map, p, map_type=map_type)

    def round_trip(x, p):
        return te.moe_unpermute(permute(x), row_id_map, p, map_type=map_type)

    assert torch.autograd.gradcheck(permute, (x,))
    assert torch.autograd.gradcheck(lambda y: te.moe_unpermute(y, row_id_map, map_type=map_type),
                                    (y,))
    assert torch.autograd.gradcheck(unpermute, (y, probs))
    assert torch.autograd.gradcheck(round_trip, (x, probs))
    if map_type == "mask":
        assert torch.autograd.gradcheck(
            lambda x, p: te.moe_permute_with_probs(x, p, routing_map, num_out)[:2], (x, probs))


def test_gradcheck_sort_chunks_float64(gen):
    x = randn(gen, 9, 3, dtype=torch.float64).requires_grad_()
    probs = randn(gen, 9, dtype=torch.float64).requires_grad_()
    splits, order = torch.tensor([2, 0, 4, 3]), torch.tensor([3, 1, 0, 2])
    assert torch.autograd.gradcheck(
        lambda x, p: te.moe_sort_chunks_by_index_with_probs(x, p, splits, order), (x, probs))


# ----------------------------------------------------------------------------- round trips

@pytest.mark.parametrize("map_type", ["mask", "index"])
def test_round_trip_returns_the_input(gen, device, map_type):
    x = randn(gen, N, H, device=device)
    # One expert per token: the same rows back, bit for bit.
    rm = routing(gen, map_type, 1, device=device)
    permuted, row_id_map = te.moe_permute(x, rm, map_type=map_type)
    assert_bitwise_equal(te.moe_unpermute(permuted, row_id_map, map_type=map_type), x)
    # Several, merged with probs summing to 1: the input up to rounding.
    rm = routing(gen, map_type, 3, device=device)
    probs = merging_probs_for(gen, rm, map_type, device=device)
    permuted, row_id_map = te.moe_permute(x, rm, map_type=map_type)
    out = te.moe_unpermute(permuted, row_id_map, merging_probs=probs, map_type=map_type)
    torch.testing.assert_close(out, x, rtol=4e-7, atol=1e-7)
    x64 = x.double()
    probs64 = merging_probs_for(gen, rm, map_type, torch.float64, device)
    out = te.moe_unpermute(te.moe_permute(x64, rm, map_type=map_type)[0], row_id_map,
                           merging_probs=probs64, map_type=map_type)
    torch.testing.assert_close(out, x64, rtol=1e-15, atol=1e-15)


def test_chunk_sorts_around_experts_as_transformer_engines_test(gen, device):
    """Transformer Engine's test_permutation_mask_map_alongside_probs: permute with probs, sort
    the chunks (expert-parallel ranks' order), weight the rows by their probs, sort back,
    unpermute without merging: what unpermute with merging_probs gives (bit for bit in
    float32), gradients too."""
    tp = 2
    routing_map = routing(gen, "mask", 2, device=device)
    probs = merging_probs_for(gen, routing_map, "mask", device=device)
    num_out = int(routing_map.sum())
    splits = torch.zeros(E * tp, dtype=torch.int64)
    splits.index_add_(0, torch.randint(0, E * tp, (num_out,), generator=gen),
                      torch.ones(num_out, dtype=torch.int64))
    order = torch.arange(E * tp).reshape(tp, E).t().reshape(-1)
    back = torch.argsort(order)
    x = randn(gen, N, H, device=device)
    grad = randn(gen, N, H, device=device)

    x1, p1 = x.clone().requires_grad_(), probs.clone().requires_grad_()
    permuted, permuted_probs, row_id_map = te.moe_permute_with_probs(x1, p1, routing_map, num_out)
    sorted_rows, sorted_probs = te.moe_sort_chunks_by_index_with_probs(
        permuted, permuted_probs, splits.to(device), order.to(device))
    weighted = sorted_rows * sorted_probs.unsqueeze(-1)
    restored = te.moe_sort_chunks_by_index(weighted, splits[order], back)
    out1 = te.moe_unpermute(restored, row_id_map, restore_shape=x.shape)
    out1.backward(grad)

    x2, p2 = x.clone().requires_grad_(), probs.clone().requires_grad_()
    permuted, row_id_map = te.moe_permute(x2, routing_map, num_out)
    out2 = te.moe_unpermute(permuted, row_id_map, merging_probs=p2, restore_shape=x.shape)
    out2.backward(grad)
    exact = device == "cpu"
    check(out1, out2.detach().cpu(), "output", exact)
    check(x1.grad, x2.grad.cpu(), "grad of inp", exact)
    check(p1.grad, p2.grad.cpu(), "grad of probs", exact)


def test_sort_chunks_matches_split_and_cat(gen, device):
    x = randn(gen, 20, H, device=device).requires_grad_()
    probs = randn(gen, 20, device=device).requires_grad_()
    splits, order = [3, 0, 7, 4, 6], [4, 2, 0, 3, 1]
    out, out_probs = te.moe_sort_chunks_by_index_with_probs(
        x, probs, torch.tensor(splits, device=device), torch.tensor(order, device=device))
    chunks, pchunks = x.split(splits), probs.split(splits)
    assert_bitwise_equal(out, torch.cat([chunks[i] for i in order]))
    assert_bitwise_equal(out_probs, torch.cat([pchunks[i] for i in order]))
    grad, grad_p = randn(gen, 20, H, device=device), randn(gen, 20, device=device)
    torch.autograd.backward([out, out_probs], [grad, grad_p])
    inverse = torch.cat([c for c in grad.split([splits[i] for i in order])])
    gchunks = dict(zip(order, inverse.split([splits[i] for i in order])))
    assert_bitwise_equal(x.grad, torch.cat([gchunks[i] for i in range(len(splits))]))
    pg = dict(zip(order, grad_p.split([splits[i] for i in order])))
    assert_bitwise_equal(probs.grad, torch.cat([pg[i] for i in range(len(splits))]))
    # lists are taken too
    assert_bitwise_equal(te.moe_sort_chunks_by_index(x, splits, order), out)


# ----------------------------------------------------------------------------- shapes and layouts

@pytest.mark.parametrize("map_type", ["mask", "index"])
def test_empty_inputs(device, map_type):
    """0 tokens: empty outputs of the right shapes and gradients; and a mask map that keeps 0
    rows of 13 tokens."""
    x = torch.zeros(0, H, device=device, requires_grad=True)
    slots = E if map_type == "mask" else 2
    rm = torch.zeros(0, slots, dtype=torch.bool if map_type == "mask" else torch.int32,
                     device=device)
    probs = torch.zeros(0, slots, device=device, requires_grad=True)
    for num_out in (-1, 0):
        permuted, row_id_map = te.moe_permute(x, rm, num_out, map_type=map_type)
        assert permuted.shape == (0, H) and row_id_map.shape == (0, slots)
        out = te.moe_unpermute(permuted, row_id_map, probs, map_type=map_type)
        assert out.shape == (0, H)
        out.sum().backward()
        assert x.grad.shape == (0, H) and probs.grad.shape == (0, slots)
    if map_type == "mask":
        permuted, permuted_probs, _ = te.moe_permute_with_probs(x, probs, rm, 0)
        assert permuted.shape == (0, H) and permuted_probs.shape == (0,)
        x13 = torch.ones(N, H, device=device, requires_grad=True)
        rm13 = torch.ones(N, E, dtype=torch.bool, device=device)
        permuted, row_id_map = te.moe_permute(x13, rm13, num_out_tokens=0)
        assert permuted.shape == (0, H) and bool((row_id_map == -1).all())
        out = te.moe_unpermute(permuted, row_id_map, torch.ones(N, E, device=device))
        assert torch.equal(out, torch.zeros(N, H, device=device))
        (permuted.sum() + out.sum()).backward()
        assert torch.equal(x13.grad, torch.zeros(N, H, device=device))
    out, out_probs = te.moe_sort_chunks_by_index_with_probs(
        x, torch.zeros(0, device=device), torch.tensor([0, 0]), torch.tensor([1, 0]))
    assert out.shape == (0, H) and out_probs.shape == (0,)


@pytest.mark.parametrize("map_type", ["mask", "index"])
def test_non_contiguous_inputs(gen, device, map_type):
    """Transposed views of inp, routing_map and probs: the numbers of contiguous copies."""
    rm = routing(gen, map_type, 2, device=device)
    x = randn(gen, H, N, device=device).t()
    probs = merging_probs_for(gen, rm, map_type, device=device).t().contiguous().t()
    grad = randn(gen, N, H, device=device)
    assert not x.is_contiguous() and not probs.is_contiguous()
    results = []
    for xi, rmi, pi in ((x, rm.t().contiguous().t(), probs),
                        (x.contiguous(), rm, probs.contiguous())):
        xi, pi = xi.detach().requires_grad_(), pi.detach().requires_grad_()
        permuted, row_id_map = te.moe_permute(xi, rmi, map_type=map_type)
        y = (permuted * 2).t().contiguous().t()  # a non-contiguous expert output
        out = te.moe_unpermute(y, row_id_map, pi, map_type=map_type)
        out.backward(grad.t().contiguous().t())
        results.append((permuted, row_id_map, out, xi.grad, pi.grad))
    for a, b, what in zip(*results, ["permuted", "row_id_map", "out", "grad x", "grad probs"]):
        if a.is_floating_point():
            assert_bitwise_equal(a, b, what)
        else:
            assert torch.equal(a, b), what


def test_integer_routing_maps_and_ids_of_any_width(gen):
    x = randn(gen, N, H)
    mask = routing(gen, "mask", 2)
    ref = te.moe_permute(x, mask)
    for dtype in (torch.int32, torch.int64, torch.uint8):
        out = te.moe_permute(x, mask.to(dtype))
        assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])
    ids = routing(gen, "index", 2)
    ref = te.moe_permute(x, ids, map_type="index")
    out = te.moe_permute(x, ids.long(), map_type="index")
    assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])
    # A row_id_map of another integer width works the same.
    assert torch.equal(te.moe_unpermute(ref[0], ref[1].int(), map_type="index"),
                       te.moe_unpermute(ref[0], ref[1], map_type="index"))


def test_deprecated_probs_keyword_and_restore_shape(gen):
    rm = routing(gen, "mask", 2)
    probs = merging_probs_for(gen, rm, "mask")
    permuted, row_id_map = te.moe_permute(randn(gen, N, H), rm)
    expected = te.moe_unpermute(permuted, row_id_map, merging_probs=probs)
    with pytest.warns(FutureWarning, match="probs is deprecated, pass merging_probs"):
        out = te.moe_unpermute(permuted, row_id_map, probs=probs)
    assert torch.equal(out, expected)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for shape in (torch.Size([N, H]), (N, H), [N, H]):
            assert torch.equal(te.moe_unpermute(permuted, row_id_map, probs, shape), expected)


# ----------------------------------------------------------------------------- torch.compile

@pytest.mark.parametrize("map_type", ["mask", "index"])
def test_compiles_without_graph_breaks(gen, device, map_type):
    """With num_out_tokens given, permute -> unpermute compiles to one graph
    (fullgraph=True) with the eager numbers, gradients included."""
    torch._dynamo.reset()
    rm = routing(gen, map_type, 2, device=device)
    probs = merging_probs_for(gen, rm, map_type, device=device)
    num_out = 2 * N - 3

    def step(x, p, w):
        permuted, row_id_map = te.moe_permute(x, rm, num_out, map_type=map_type)
        return te.moe_unpermute(torch.tanh(permuted * w), row_id_map, p, map_type=map_type)

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    x, w = randn(gen, N, H, device=device), randn(gen, H, device=device)
    grad = randn(gen, N, H, device=device)
    results = []
    for fn in (step, compiled):
        xi, pi = x.clone().requires_grad_(), probs.clone().requires_grad_()
        out = fn(xi, pi, w)
        out.backward(grad)
        results.append((out, xi.grad, pi.grad))
    for a, b, what in zip(*results, ["out", "grad x", "grad probs"]):
        assert_bitwise_equal(a, b, what)
    torch._dynamo.reset()


# ----------------------------------------------------------------------------- an MoE in FP8

RECIPE = DelayedScaling(amax_history_len=4)


def route(router, x, experts, topk):
    """(probs [N, experts], bool mask [N, experts], ids [N, topk], their probs [N, topk]): the
    router's top-k experts, weighted by the softmax of their logits."""
    top = router(x).topk(topk, dim=-1)
    top_probs = top.values.softmax(-1)
    probs = torch.zeros(x.shape[0], experts, dtype=x.dtype, device=x.device)
    probs = probs.scatter(1, top.indices, top_probs)
    mask = torch.zeros_like(probs, dtype=torch.bool).scatter(1, top.indices, True)
    return probs, mask, top.indices, top_probs


class PermutedMoE(torch.nn.Module):
    """Top-k MoE MLP as written for Transformer Engine: moe_permute, GroupedLinear experts
    (m_splits = rows per expert), moe_unpermute merging with the router's probs."""

    def __init__(self, map_type, hidden=32, ffn=64, experts=4, topk=2):
        super().__init__()
        self.router = torch.nn.Linear(hidden, experts, bias=False)
        self.fc1 = te.GroupedLinear(experts, hidden, ffn)
        self.fc2 = te.GroupedLinear(experts, ffn, hidden)
        self.map_type, self.experts, self.topk = map_type, experts, topk

    def forward(self, x):
        probs, mask, ids, top_probs = route(self.router, x, self.experts, self.topk)
        splits = mask.sum(0).tolist()
        if self.map_type == "mask":
            permuted, row_id_map = te.moe_permute(x, mask, num_out_tokens=sum(splits))
            merging = probs
        else:
            permuted, row_id_map = te.moe_permute(x, ids, map_type="index")
            merging = top_probs
        h = F.gelu(self.fc1(permuted, splits), approximate="tanh")
        return te.moe_unpermute(self.fc2(h, splits), row_id_map, merging, x.shape,
                                map_type=self.map_type)


class LoopMoE(torch.nn.Module):
    """The same MoE (a copy of its weights) with one FP8 Linear per expert and a loop over the
    experts."""

    def __init__(self, moe: PermutedMoE):
        super().__init__()
        self.router = copy.deepcopy(moe.router)
        self.experts, self.topk = moe.experts, moe.topk
        self.fc1, self.fc2 = torch.nn.ModuleList(), torch.nn.ModuleList()
        for i in range(moe.experts):
            for grouped, experts in ((moe.fc1, self.fc1), (moe.fc2, self.fc2)):
                w = getattr(grouped, f"weight{i}")
                linear = te.Linear(w.shape[1], w.shape[0], device=w.device)
                with torch.no_grad():
                    linear.weight.copy_(w)
                    linear.bias.copy_(getattr(grouped, f"bias{i}"))
                experts.append(linear)

    def forward(self, x):
        probs, mask, _, _ = route(self.router, x, self.experts, self.topk)
        out = torch.zeros_like(x)
        for e in range(self.experts):
            idx = mask[:, e].nonzero().squeeze(1)
            h = F.gelu(self.fc1[e](x[idx]), approximate="tanh")
            out = out.index_add(0, idx, self.fc2[e](h) * probs[idx, e].unsqueeze(1))
        return out


@pytest.mark.parametrize("map_type", ["mask", "index"])
def test_moe_trains_in_fp8_as_the_loop_over_experts(device, map_type):
    """Three SGD steps under fp8_autocast: losses, outputs, the input gradient, every
    parameter's gradient and the trained weights of the permuted MoE (GroupedLinear experts)
    against the same MoE computed with a loop over FP8 Linear experts, by SQNR; and its output
    against float32 (FP8's rounding)."""
    torch.manual_seed(0)
    moe = PermutedMoE(map_type).to(device)
    loop = LoopMoE(moe)
    opt_moe = torch.optim.SGD(moe.parameters(), lr=0.1)
    opt_loop = torch.optim.SGD(loop.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    pairs = [("router", moe.router.weight, loop.router.weight)]
    for i in range(moe.experts):
        for name, grouped, experts in (("fc1", moe.fc1, loop.fc1), ("fc2", moe.fc2, loop.fc2)):
            pairs += [(f"{name}.weight{i}", getattr(grouped, f"weight{i}"), experts[i].weight),
                      (f"{name}.bias{i}", getattr(grouped, f"bias{i}"), experts[i].bias)]
    # CPU: bit for bit (measured: every comparison inf dB), as GroupedLinear is one FP8 Linear
    # per expert and unpermute adds a token's expert outputs in expert order, as the loop does.
    # CUDA adds them (and the input gradient's copies) in any order: float32 rounding.
    floor = math.inf if device == "cpu" else 100
    for step in range(3):
        x = (torch.randn(64, 32, generator=gen) * (step + 1)).to(device)
        target = torch.randn(64, 32, generator=gen).to(device)
        results = []
        for model, opt in ((moe, opt_moe), (loop, opt_loop)):
            xi = x.clone().requires_grad_()
            opt.zero_grad()
            with te.fp8_autocast(fp8_recipe=RECIPE):
                out = model(xi)
            loss = F.mse_loss(out, target)
            loss.backward()
            results.append((loss.detach(), out.detach(), xi.grad))
        (loss_a, out_a, gx_a), (loss_b, out_b, gx_b) = results
        checks = [("loss", loss_a, loss_b), ("output", out_a, out_b), ("grad of x", gx_a, gx_b)]
        checks += [(f"grad of {name}", a.grad, b.grad) for name, a, b in pairs]
        for what, a, b in checks:
            assert sqnr(b, a) >= floor, (step, what, sqnr(b, a))
        if step == 0:
            with torch.no_grad():
                high = model_in_high_precision(moe, x)
            # Two E4M3 GEMMs in a row: FP8's rounding (24.5 dB measured, CPU).
            assert sqnr(high, out_a) > 20, sqnr(high, out_a)
        opt_moe.step()
        opt_loop.step()
    for name, a, b in pairs:
        assert sqnr(b.detach(), a.detach()) >= floor, name


def model_in_high_precision(moe, x):
    probs, mask, _, _ = route(moe.router, x, moe.experts, moe.topk)
    out = torch.zeros_like(x)
    for e in range(moe.experts):
        idx = mask[:, e].nonzero().squeeze(1)
        h = F.gelu(F.linear(x[idx], getattr(moe.fc1, f"weight{e}"), getattr(moe.fc1, f"bias{e}")),
                   approximate="tanh")
        y = F.linear(h, getattr(moe.fc2, f"weight{e}"), getattr(moe.fc2, f"bias{e}"))
        out = out.index_add(0, idx, y * probs[idx, e].unsqueeze(1))
    return out


# ----------------------------------------------------------------------------- errors

def test_errors_name_the_argument(gen):
    x = randn(gen, N, H)
    mask = routing(gen, "mask", 2)
    ids = routing(gen, "index", 2)
    permuted, row_id_map = te.moe_permute(x, mask)

    def raises(error, match, fn, *args, **kwargs):
        with pytest.raises(error, match=match):
            fn(*args, **kwargs)

    raises(ValueError, r"moe_permute: map_type must be 'mask' or 'index', got 'sparse'",
           te.moe_permute, x, mask, map_type="sparse")
    raises(ValueError, r"moe_unpermute: map_type must be 'mask' or 'index', got 'Mask'",
           te.moe_unpermute, permuted, row_id_map, map_type="Mask")
    raises(ValueError, r"routing_map must have one row per token of inp \(13\), got a "
           r"torch.bool tensor of shape \[12, 4\]", te.moe_permute, x, mask[:12])
    raises(TypeError, r"routing_map must be a bool or integer tensor, got a torch.float32",
           te.moe_permute, x, mask.float())
    raises(TypeError, r"routing_map must be an integer tensor, got a torch.bool",
           te.moe_permute, x, mask, map_type="index")
    raises(ValueError, r"routing_map must be 2-D \[num_tokens, topK\] of expert ids",
           te.moe_permute, x, ids[:, 0], map_type="index")
    raises(ValueError, r"num_out_tokens must be -1 \(every routed slot\) or between 0 and "
           r"num_tokens \* num_experts = 13 \* 4 = 52, got 53", te.moe_permute, x, mask, 53)
    raises(ValueError, r"num_out_tokens must be -1 or 0 \(no dropping\) or at most num_tokens "
           r"\* topK = 13 \* 2 = 26, got 27", te.moe_permute, x, ids, 27, map_type="index")
    raises(ValueError, r"got -2", te.moe_permute, x, ids, -2, map_type="index")
    raises(TypeError, r"num_out_tokens must be an int, got float 3.0",
           te.moe_permute, x, mask, 3.0)
    raises(TypeError, r"max_token_num must be an int", te.moe_permute, x, mask, max_token_num="8")
    raises(ValueError, r"inp must be 2-D \[num_tokens, hidden_size\], got a torch.float32 "
           r"tensor of shape \[1, 13, 8\]", te.moe_permute, x.unsqueeze(0), mask)
    raises(TypeError, r"moe_permute: inp must be a high-precision tensor, got Tensor holding "
           r"torch.float8_e4m3fn data: this library has no FP8 activation tensor type",
           te.moe_permute, x.to(torch.float8_e4m3fn), mask)
    raises(TypeError, r"inp must be a floating-point tensor, got a torch.int64",
           te.moe_permute, x.long(), mask)
    raises(TypeError, r"inp must be a torch.Tensor, got list", te.moe_permute, x.tolist(), mask)
    raises(ValueError, r"routing_map must be on meta \(the input's device\), got a torch.bool "
           r"tensor of shape \[13, 4\] on cpu", te.moe_permute, x.to("meta"), mask)
    raises(ValueError, r"moe_permute_with_probs: probs must have routing_map's shape \[13, 4\], "
           r"got a torch.float32 tensor of shape \[13, 2\]",
           te.moe_permute_with_probs, x, torch.rand(N, 2), mask)
    # unpermute
    raises(ValueError, r"merging_probs must have row_id_map's shape \[13, 4\] \(\[num_tokens, "
           r"num_experts\]\), got a torch.float32 tensor of shape \[13, 2\]",
           te.moe_unpermute, permuted, row_id_map, torch.rand(N, 2))
    raises(ValueError, r"restore_shape must be \(num_tokens, hidden_size\) = \(13, 8\) "
           r"\(row_id_map's tokens, inp's hidden size\), got \(12, 8\)",
           te.moe_unpermute, permuted, row_id_map, restore_shape=(12, 8))
    raises(ValueError, r"merging_probs and probs were both given",
           te.moe_unpermute, permuted, row_id_map, torch.rand(N, E), probs=torch.rand(N, E))
    raises(TypeError, r"row_id_map must be an integer tensor, got a torch.float32",
           te.moe_unpermute, permuted, row_id_map.float())
    raises(ValueError, r"row_id_map must be 2-D", te.moe_unpermute, permuted, row_id_map[0])
    raises(ValueError, rf"moe_unpermute: inp must have at least {permuted.shape[0]} rows "
           rf"\(row_id_map places copies up to row {permuted.shape[0] - 1}\), got a "
           rf"torch.float32 tensor of shape \[{permuted.shape[0] - 1}, 8\]",
           te.moe_unpermute, permuted[:-1], row_id_map)
    # chunk sort
    sort = te.moe_sort_chunks_by_index
    raises(ValueError, r"sorted_index must have split_sizes' length 3, got a torch.int64 tensor "
           r"of shape \[2\]", sort, x, torch.tensor([3, 4, 6]), torch.tensor([1, 0]))
    raises(ValueError, r"split_sizes must be non-negative and add up to the input's 13 rows, "
           r"got \[3, 4, 5\]", sort, x, torch.tensor([3, 4, 5]), torch.tensor([2, 1, 0]))
    raises(ValueError, r"sorted_index must be a permutation of 0..2, got \[2, 2, 0\]",
           sort, x, torch.tensor([3, 4, 6]), torch.tensor([2, 2, 0]))
    raises(TypeError, r"split_sizes must be an integer tensor, got a torch.float32",
           sort, x, torch.tensor([3.0, 10.0]), torch.tensor([1, 0]))
    raises(ValueError, r"probs must be a 1-D floating tensor of the input's 13 rows",
           te.moe_sort_chunks_by_index_with_probs, x, torch.rand(N, 1), torch.tensor([13]),
           torch.tensor([0]))


def test_values_that_would_shift_or_drop_rows_are_refused(gen):
    """Values that once went through without a word: a negative expert id sorted first and
    shifted every expert's rows; row_id_map values below -1, or a row named by two slots, dropped
    copies; a negative chunk size that still adds up was taken."""
    x = randn(gen, N, H)
    ids = routing(gen, "index", 2)
    bad_ids = ids.clone()
    bad_ids[3, 1], bad_ids[7, 0] = -1, -2
    with pytest.raises(ValueError, match=r"moe_permute: routing_map must hold expert ids >= 0 "
                       r"for map_type='index', got 2 negative id\(s\), the first -1 at \[3, 1\] "
                       r"\(token 3, column 1\)"):
        te.moe_permute(x, bad_ids, map_type="index")
    permuted, row_id_map = te.moe_permute(x, ids, map_type="index")
    below = row_id_map.clone()
    below[2, 0] = -3
    with pytest.raises(ValueError, match=r"moe_unpermute: row_id_map must hold -1 \(a slot not "
                       r"routed\) or permuted row numbers >= 0, got -3 at \[2, 0\]"):
        te.moe_unpermute(permuted, below, map_type="index")
    twice = row_id_map.clone()
    twice[5, 1] = twice[0, 0]
    with pytest.raises(ValueError, match=rf"row_id_map must name each permuted row at most once "
                       rf"\(as moe_permute's does\), got row {int(twice[0, 0])} named by slots "
                       rf"\[0, 0\], \[5, 1\]"):
        te.moe_unpermute(permuted, twice, map_type="index")
    sort = te.moe_sort_chunks_by_index
    with pytest.raises(ValueError, match=r"sorted_index must be a permutation of 0..2, got "
                       r"\[0, 0, 1\]"):
        sort(x, torch.tensor([3, 4, 6]), torch.tensor([0, 0, 1]))
    with pytest.raises(ValueError, match=r"split_sizes must be non-negative and add up to the "
                       r"input's 13 rows, got \[-1, 8, 6\]"):
        sort(x, torch.tensor([-1, 8, 6]), torch.tensor([1, 0, 2]))


def test_value_checks_that_would_wait_for_the_device_assert_there(gen, monkeypatch):
    """On a device (and while compiling) the value checks are a torch._assert_async, with no
    host synchronisation: on the CPU the same path raises its message at once."""
    x = randn(gen, N, H)
    ids = routing(gen, "index", 2)
    permuted, row_id_map = te.moe_permute(x, ids, map_type="index")
    bad_ids = ids.clone()
    bad_ids[3, 1] = -1
    twice = row_id_map.clone()
    twice[5, 1] = twice[0, 0]
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    calls = [
        (r"moe_permute: routing_map must hold expert ids >= 0 for map_type='index'",
         lambda: te.moe_permute(x, bad_ids, map_type="index")),
        (r"moe_unpermute: .*row_id_map must name each permuted row at most once",
         lambda: te.moe_unpermute(permuted, twice, map_type="index")),
        (r"moe_unpermute: .*inp must have at least max\(row_id_map\) \+ 1 rows",
         lambda: te.moe_unpermute(permuted[:-1], row_id_map, map_type="index")),
        (r"sorted_index must be a permutation of 0..2$",
         lambda: te.moe_sort_chunks_by_index(x, torch.tensor([3, 4, 6]),
                                             torch.tensor([0, 0, 1]))),
        (r"split_sizes must be non-negative and add up to the input's 13 rows$",
         lambda: te.moe_sort_chunks_by_index(x, torch.tensor([3, 4, 5]),
                                             torch.tensor([0, 2, 1]))),
    ]
    for message, call in calls:
        with pytest.raises(RuntimeError, match=message):
            call()
    # Values that are fine pass the same path.
    out = te.moe_unpermute(*te.moe_permute(x, ids, map_type="index"), map_type="index")
    assert torch.equal(out, 2 * x)


def test_negative_ids_are_refused_in_a_compiled_graph(gen):
    torch._dynamo.reset()
    x, ids = randn(gen, N, H), routing(gen, "index", 2)
    permute = torch.compile(lambda x, ids: te.moe_permute(x, ids, 2 * N, map_type="index"),
                            fullgraph=True, backend="aot_eager")
    assert torch.equal(permute(x, ids)[0], te.moe_permute(x, ids, map_type="index")[0])
    ids[4, 0] = -1
    with pytest.raises(RuntimeError, match=r"routing_map must hold expert ids >= 0"):
        permute(x, ids)
    torch._dynamo.reset()


def test_exported_as_transformer_engine_exports_them():
    import inspect
    for name in ("moe_permute", "moe_permute_with_probs", "moe_unpermute",
                 "moe_sort_chunks_by_index", "moe_sort_chunks_by_index_with_probs"):
        assert name in te.__all__ and callable(getattr(te, name))
    # TE 2.8's parameters, in order, with its defaults
    params = {name: [(p.name, p.default) for p in
                     inspect.signature(getattr(te, name)).parameters.values()]
              for name in ("moe_permute", "moe_permute_with_probs", "moe_unpermute")}
    empty = inspect.Parameter.empty
    assert params["moe_permute"] == [("inp", empty), ("routing_map", empty),
                                     ("num_out_tokens", -1), ("max_token_num", -1),
                                     ("map_type", "mask")]
    assert params["moe_permute_with_probs"] == [("inp", empty), ("probs", empty),
                                                ("routing_map", empty), ("num_out_tokens", -1)]
    assert params["moe_unpermute"] == [("inp", empty), ("row_id_map", empty),
                                       ("merging_probs", None), ("restore_shape", None),
                                       ("map_type", "mask"), ("probs", None)]
    assert list(inspect.signature(te.moe_sort_chunks_by_index_with_probs).parameters) == [
        "inp", "probs", "split_sizes", "sorted_index"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("with_probs", [False, True])
def test_the_unpermuted_output_takes_in_place_operations(gen, dtype, with_probs):
    """The output is a tensor of its own (it was a view of the float32 accumulator, which
    autograd refuses to modify in place: ``out += shared_expert_out`` raised), and the in-place
    add's gradients are those of the out-of-place one."""
    mask = routing(gen, "mask", 2)
    permuted, row_id_map = te.moe_permute(randn(gen, N, H), mask)
    probs = (torch.rand(N, E, generator=gen) * mask).to(dtype) if with_probs else None
    shared = randn(gen, N, H).to(dtype)
    grads = []
    for in_place in (False, True):
        y = permuted.detach().to(dtype).requires_grad_()
        p = probs.clone().requires_grad_() if with_probs else None
        out = te.moe_unpermute(y, row_id_map, p)
        if in_place:
            out += shared
        else:
            out = out + shared
        out.pow(2).sum().backward()
        grads.append((out.detach(), y.grad, p.grad if with_probs else None))
    for eager, inplace in zip(*grads):
        assert (eager is None and inplace is None) or torch.equal(eager, inplace)
