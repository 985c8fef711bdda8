"""fp8_operand_stats (the debug statistics in one operator, CPU and CUDA kernels) against the
pure-torch reference (transformer_fp8.debug.stats.operand_stats_reference): counts, extremes and
scales bit for bit, the float64 sums (added in another order) within 1e-12 relative, on random
tensors of every dtype and block layout, tensors of several units, padded q rows, non-contiguous
x and block scales, the edge values (0, tiny, huge, +-inf, NaN, empty), and bad arguments."""
from __future__ import annotations

import math

import pytest
import torch
from conftest import HP_DTYPES, randn

from transformer_fp8 import ops
from transformer_fp8.debug.stats import FIELD_INDEX, FIELDS, operand_stats_reference
from transformer_fp8.ops.blockwise import quantize_blockwise
from transformer_fp8.ops.operand_stats import fp8_operand_stats

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8_MAX = {E4M3: 448.0, E5M2: 57344.0}
# float64 sums, and a ratio of two: added in another order than torch's
SUMMED = {FIELD_INDEX[name] for name in ("signal", "noise", "block_worst_noise_ratio")}
# (block_rows, block_cols) of the blockwise quantiser's modes; (0, 0) is per-tensor scaling
BLOCK_MODES = {"tensor": (0, 0), "1x128": (1, 128), "128x128": (128, 128), "rowwise": (1, -1)}


def assert_same_stats(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == torch.float64 and got.shape == (len(FIELDS),)
    assert got.device == want.device
    for i, (name, _) in enumerate(FIELDS):
        g, w = got[i].item(), want[i].item()
        if math.isnan(w) or math.isnan(g):
            assert math.isnan(w) and math.isnan(g), f"{name}: {g} vs {w}"
        elif i in SUMMED and math.isfinite(w):
            assert g == pytest.approx(w, rel=1e-12, abs=0), f"{name}: {g} vs {w}"
        else:
            assert g == w, f"{name}: {g} vs {w}"


def quantised(x: torch.Tensor, mode: str, fp8_dtype, gen):
    """(q, scale, block_rows, block_cols) of x cast as the recipes cast it."""
    block_rows, block_cols = BLOCK_MODES[mode]
    if mode == "tensor":
        amax = x.float().abs().max().item() if x.numel() else 0.0
        scale = torch.tensor([FP8_MAX[fp8_dtype] / amax if 0 < amax < math.inf else 1.0],
                             device=x.device) * (0.5 + torch.rand(1, generator=gen)).to(x.device)
        return ops.cast_to_fp8(x, scale, fp8_dtype), scale, 0, 0
    if block_cols == -1:
        block_cols = x.shape[1]
    q, scale_inv, _, _ = quantize_blockwise(x, block_rows, block_cols, fp8_dtype, True)
    return q, scale_inv.reciprocal(), block_rows, block_cols


def check(x, q, scale, fp8_max, block_rows, block_cols):
    got = fp8_operand_stats(x, q, scale, fp8_max, block_rows, block_cols)
    want = operand_stats_reference(x, q, scale, fp8_max, block_rows, block_cols)
    assert_same_stats(got, want)
    return got


@pytest.mark.parametrize("mode", list(BLOCK_MODES))
@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", HP_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 1), (16, 64), (130, 300), (257, 129)])
def test_matches_the_reference(gen, device, mode, fp8_dtype, dtype, shape):
    x = randn(gen, *shape, scale=3.0, dtype=dtype, device=device)
    x[0, 0] = 0.0
    if shape[0] > 2:
        x[2] *= 1e-6  # some values flush to zero
    q, scale, br, bc = quantised(x, mode, fp8_dtype, gen)
    check(x, q, scale, FP8_MAX[fp8_dtype], br, bc)


@pytest.mark.parametrize("mode", ["tensor", "128x128"])
def test_blocks_of_several_units(gen, device, mode):
    """Per-tensor scaling over 5 units of 16384 elements, and a 128x128 block of 16384
    elements split from its neighbours; the scale below saturates some values."""
    x = randn(gen, 300, 260, scale=2.0, device=device)
    q, scale, br, bc = quantised(x, mode, E4M3, gen)
    scale = scale * 4  # (the same scale for q and the statistics: q is what it is)
    stats = check(x, q, scale, 448.0, br, bc)
    assert stats[FIELD_INDEX["saturated"]] > 0


def test_padded_q_rows_and_non_contiguous_arguments(gen, device):
    base = randn(gen, 200, 70, scale=5.0, device=device)
    x = base.t()  # [70, 200], not contiguous
    scale = torch.tensor([30.0], device=device)
    q = ops.cast_to_fp8(torch.nn.functional.pad(x, (0, 0, 0, 10)), scale, E4M3)  # 80 rows
    check(x, q, scale, 448.0, 0, 0)
    # block scales in the blockwise quantiser's column-major 1x128 layout
    qb, scale_inv, _, _ = quantize_blockwise(x.contiguous(), 1, 128, E4M3, True)
    block_scale = scale_inv.reciprocal()
    assert not block_scale.is_contiguous()
    check(x, qb, block_scale, 448.0, 1, 128)


@pytest.mark.parametrize("mode", ["tensor", "1x128", "128x128"])
def test_edge_values(gen, device, mode):
    x = randn(gen, 40, 136, device=device)
    x[0, :6] = torch.tensor([0.0, -0.0, 1e-30, -1e-38, 3e38, -3e38])
    x[1, :3] = torch.tensor([math.inf, -math.inf, 2.0 ** -149])
    q, scale, br, bc = quantised(x, mode, E4M3, gen)
    check(x, q, scale, 448.0, br, bc)
    x[5, 7] = math.nan  # NaN propagates to the extremes and the sums, as torch's do
    q, scale, br, bc = quantised(x, mode, E4M3, gen)
    check(x, q, scale, 448.0, br, bc)


def test_zero_tensor_and_zero_scale(device):
    x = torch.zeros(16, 32, device=device)
    scale = torch.ones(1, device=device)
    q = ops.cast_to_fp8(x, scale, E5M2)
    check(x, q, scale, 57344.0, 0, 0)
    check(x, q, torch.zeros(1, device=device), 57344.0, 0, 0)  # x / 0: NaN and inf products


@pytest.mark.parametrize("shape", [(0, 64), (8, 0), (0, 0)])
@pytest.mark.parametrize("mode", ["tensor", "1x128"])
def test_empty(device, shape, mode):
    x = torch.zeros(shape, device=device)
    q = x.to(E4M3)
    scale = torch.ones((1,) if mode == "tensor" else (1, 1), device=device)
    br, bc = BLOCK_MODES[mode]
    check(x, q, scale, 448.0, br, bc)
    rows_cut = fp8_operand_stats(torch.ones(4, 8, device=device), q[:0].reshape(0, 8)
                                 if shape[1] == 0 else torch.zeros(0, 8, dtype=E4M3,
                                                                   device=device),
                                 torch.ones(1, device=device), 448.0)
    assert rows_cut[FIELD_INDEX["blocks"]].item() == 0  # min(4, 0) rows: nothing counted


@pytest.mark.parametrize("bad, message", [
    (dict(x=torch.ones(8)), "argument 'x' must be 2-D"),
    (dict(x=torch.ones(4, 8, dtype=torch.float64)), "argument 'x' must be float32"),
    (dict(q=torch.ones(4, 9).to(E4M3)), "argument 'q' must be 2-D with x's 8 columns"),
    (dict(q=torch.ones(4, 8)), "argument 'q' must be a float8_e4m3fn or float8_e5m2"),
    (dict(x_scale=torch.ones(2)), "argument 'x_scale' must have 1 element"),
    (dict(x_scale=torch.ones(1, dtype=torch.int32)), "argument 'x_scale' must be a floating"),
    (dict(fp8_max=0.0), "argument 'fp8_max' must be finite and positive"),
    (dict(fp8_max=math.inf), "argument 'fp8_max' must be finite and positive"),
    (dict(block_rows=1), "must be both 0 (per-tensor scaling) or both positive"),
    (dict(block_rows=-1, block_cols=-1), "must be both 0 (per-tensor scaling) or both"),
    (dict(block_rows=2, block_cols=4, x_scale=torch.ones(2, 1)),
     "argument 'x_scale' must be 2-D with at least [2, 2] blocks"),
])
def test_bad_arguments_are_named(bad, message):
    args = dict(x=torch.ones(4, 8), q=torch.ones(4, 8).to(E4M3), x_scale=torch.ones(1),
                fp8_max=448.0, block_rows=0, block_cols=0)
    args.update(bad)
    with pytest.raises(RuntimeError, match=message.replace("[", r"\[").replace("(", r"\(")
                       .replace(")", r"\)")):
        fp8_operand_stats(**args)


def test_wrapper_type_errors():
    with pytest.raises(TypeError, match="argument 'q' must be a tensor"):
        fp8_operand_stats(torch.ones(4, 8), None, torch.ones(1), 448.0)
    with pytest.raises(ValueError, match="argument 'block_rows' must be an integer"):
        fp8_operand_stats(torch.ones(4, 8), torch.ones(4, 8).to(E4M3), torch.ones(1), 448.0,
                          1.5, 2)


def test_blocks_larger_than_x_are_x(gen, device):
    """A block larger than x covers x: the same figures as one block of x's shape, without a
    workspace sized by the block."""
    x = randn(gen, 6, 40, device=device)
    q = ops.cast_to_fp8(x, torch.ones(1, device=device), E4M3)
    scale = torch.full((1, 1), 2.0, device=device)
    whole = check(x, q, scale, 448.0, 6, 40)
    assert_same_stats(fp8_operand_stats(x, q, scale, 448.0, 2 ** 40, 2 ** 40), whole)


def test_the_field_count_is_the_same_everywhere():
    from transformer_fp8.ops.operand_stats import STATS_FIELDS
    assert STATS_FIELDS == len(FIELDS) == fp8_operand_stats(
        torch.ones(2, 2), torch.ones(2, 2).to(E4M3), torch.ones(1), 448.0).numel()
