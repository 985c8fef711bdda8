"""amax, cast_to_fp8, cast_transpose_to_fp8 and cast_from_fp8 against the pure-torch references.

Casts must match ``(x.float() * scale).clamp(-max, max).to(fp8)`` bit for bit, NaN included;
the reference always runs on the CPU, so the CUDA kernels are held to the same bits.
"""
from __future__ import annotations

import pytest
import torch
from conftest import (DEVICE_PARAMS, FP8_DTYPES, FP8_MAX, HP_DTYPES, assert_bitwise_equal,
                      assert_same_values, randn, scalar, sqnr)

from transformer_fp8 import ops
from transformer_fp8 import reference as ref

SCALES = [1.0, 2.0, 2.0**7, 2.0**20, 2.0**-1, 2.0**-9, 2.0**-24, 0.37, 3.3, 1e30, 1e-30]
SPECIALS = [float("inf"), float("-inf"), float("nan"), -0.0, 0.0]


def all_16bit_patterns(dtype: torch.dtype) -> torch.Tensor:
    """Every value of a 16-bit float type (bfloat16 or float16), NaNs and infinities included."""
    return torch.arange(65536, dtype=torch.int32).to(torch.int16).view(dtype)


def all_fp8_patterns(fp8_dtype: torch.dtype) -> torch.Tensor:
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fp8_dtype)


def random_f32_patterns(gen: torch.Generator, n: int) -> torch.Tensor:
    """Uniformly random float32 bit patterns: every exponent, subnormals, inf and NaN payloads."""
    return torch.randint(-2**31, 2**31, (n,), generator=gen, dtype=torch.int64) \
        .to(torch.int32).view(torch.float32)


def with_specials(gen: torch.Generator, x: torch.Tensor, values) -> torch.Tensor:
    """x (CPU) with each value in ``values`` written at a few random positions."""
    x = x.clone()
    flat = x.view(-1)
    for v in values:
        idx = torch.randint(0, flat.numel(), (3,), generator=gen)
        flat[idx] = v
    return x


def mixed_magnitudes(gen: torch.Generator, n: int, dtype: torch.dtype) -> torch.Tensor:
    """Normal values, huge and tiny ones (in range of dtype), and the special values."""
    info = torch.finfo(dtype)
    parts = [randn(gen, n), randn(gen, n, scale=info.max / 8), randn(gen, n, scale=info.tiny * 4),
             randn(gen, n, scale=info.smallest_normal / 16)]  # subnormals of dtype
    x = torch.cat(parts)[torch.randperm(4 * n, generator=gen)].to(dtype)
    return with_specials(gen, x, SPECIALS + [info.max, -info.max])


def check_cast(x: torch.Tensor, scale: float, fp8_dtype: torch.dtype, device: str,
               amax_init: float | None = None) -> torch.Tensor:
    """Runs cast_to_fp8 on ``device`` and compares output (and fused amax) with the reference.
    An x already on ``device`` is passed as it is (keeping a non-contiguous layout)."""
    s = scalar(scale)
    amax_slot = None if amax_init is None else scalar(amax_init, device)
    x_dev = x if x.device.type == device else x.to(device)
    out = ops.cast_to_fp8(x_dev, s.to(device), fp8_dtype, amax_slot)
    assert out.device.type == device
    assert_bitwise_equal(out, ref.cast_to_fp8_reference(x.cpu(), s, fp8_dtype),
                         f"cast_to_fp8 {x.dtype}->{fp8_dtype} scale={scale}")
    if amax_slot is not None:
        expected = scalar(amax_init)
        ref.cast_to_fp8_reference(x.cpu(), s, fp8_dtype, expected)
        assert_same_values(amax_slot.cpu(), expected, "fused amax")
    return out


# ----------------------------------------------------------------------------- amax

@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("dtype", HP_DTYPES)
@pytest.mark.parametrize("shape", [(1,), (7,), (3, 5, 7), (40_000,), (129, 257)])
def test_amax_matches_reference(device, gen, dtype, shape):
    x = randn(gen, *shape, dtype=dtype, scale=100.0)
    out = ops.amax(x.to(device))
    assert out.dtype == torch.float32 and out.shape == () and out.device.type == device
    assert_bitwise_equal(out, ref.amax_reference(x))


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("special,expected", [(float("nan"), float("nan")),
                                              (float("inf"), float("inf")),
                                              (float("-inf"), float("inf"))])
def test_amax_special_values(device, gen, special, expected):
    x = with_specials(gen, randn(gen, 50_000), [special]).to(device)
    assert_same_values(ops.amax(x).cpu(), torch.tensor(expected))


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("shape", [(0,), (3, 0), (0, 4, 2)])
def test_amax_empty_is_zero(device, shape):
    out = ops.amax(torch.empty(shape, device=device))
    assert out.shape == () and out.item() == 0.0


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_amax_non_contiguous_and_0dim(device, gen):
    x = randn(gen, 64, 96, scale=10.0, device=device)
    for view in (x.t(), x[::3, 1::5], x[5, 7]):
        assert_bitwise_equal(ops.amax(view), ref.amax_reference(view.cpu()))


# Lengths for the split of the 1-D CUDA kernels (scalar head up to the first aligned element,
# vectors, scalar tail): shorter than one vector, a few vectors, and longer than one pass of the
# largest grid (about 4.3M 16-bit or 8.7M FP8 elements on an H100), so that the loop wraps.
SPLIT_LENGTHS = [1, 6, 9, 8 * 257 + 5, 9_500_011]


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("dtype", HP_DTYPES)
@pytest.mark.parametrize("offset", [1, 3, 8])
@pytest.mark.parametrize("length", SPLIT_LENGTHS)
def test_amax_misaligned_start(device, gen, dtype, offset, length):
    """x[offset:] (off the vector boundary for offsets 1 and 3): the scalar head reaches the
    boundary, vectors and a scalar tail follow."""
    base = randn(gen, offset + length, dtype=dtype, scale=100.0)
    base[offset + (length - 1) * 2 // 3] = 1e4  # the maximum, in the vector part or the tail
    x = base.to(device)[offset:]
    assert_bitwise_equal(ops.amax(x), ref.amax_reference(base[offset:]))
    base[offset] = float("nan")  # first element: in the scalar head unless offset is aligned
    assert torch.isnan(ops.amax(base.to(device)[offset:])).item()


# ----------------------------------------------------------------------------- cast_to_fp8

@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("hp_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("scale", SCALES)
def test_cast_every_16bit_pattern(device, hp_dtype, fp8_dtype, scale):
    """All 65,536 bfloat16 / float16 values, NaN and inf included, bit-exact with fused amax."""
    x = all_16bit_patterns(hp_dtype)
    check_cast(x, scale, fp8_dtype, device, amax_init=0.0)  # x holds NaN: the amax becomes NaN


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("scale", [1.0, 2.0**-100, 2.0**100, 0.37, 1e30, 1e-30])
def test_cast_random_float32_bit_patterns(device, gen, fp8_dtype, scale):
    check_cast(random_f32_patterns(gen, 1 << 16), scale, fp8_dtype, device, amax_init=0.0)


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("hp_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("scale", [1.0, 2.0**-3, 2.0**5, 0.37, 3.3, 1e30, 1e-30])
def test_cast_random_values_with_specials(device, gen, hp_dtype, fp8_dtype, scale):
    x = mixed_magnitudes(gen, 5000, hp_dtype)
    out = check_cast(x, scale, fp8_dtype, device)
    fp8_max = FP8_MAX[fp8_dtype]
    # Spot checks of the contract, independent of the reference: saturation, NaN, signed zero.
    x32, o32 = x.float(), out.cpu().float()
    assert (o32[x32 == float("inf")] == fp8_max).all()
    assert (o32[x32 == float("-inf")] == -fp8_max).all()
    assert torch.isnan(o32[torch.isnan(x32)]).all()
    neg_zero = (x32 == 0) & torch.signbit(x32)
    assert torch.signbit(o32[neg_zero]).all()


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("hp_dtype", HP_DTYPES)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("layout", ["transposed", "step_slice", "expanded", "permuted_3d"])
def test_cast_non_contiguous(device, gen, hp_dtype, fp8_dtype, layout):
    base = randn(gen, 48, 70, dtype=hp_dtype, scale=30.0, device=device)
    x = {"transposed": lambda: base.t(),
         "step_slice": lambda: base[1::3, ::2],
         "expanded": lambda: base[:1].expand(5, 70),
         "permuted_3d": lambda: base.view(6, 8, 70).permute(2, 0, 1)}[layout]()
    assert not x.is_contiguous()
    out = check_cast(x, 3.3, fp8_dtype, device, amax_init=0.5)
    assert out.shape == x.shape and out.is_contiguous()


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("shape", [(1,), (3,), (17,), (3, 5, 7), (2, 1, 33), (16_385,),
                                   (100_003,), (7, 1, 1, 3)])
def test_cast_odd_shapes(device, gen, fp8_dtype, shape):
    check_cast(randn(gen, *shape, dtype=torch.bfloat16, scale=50.0), 0.37, fp8_dtype, device,
               amax_init=1.0)


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("hp_dtype", HP_DTYPES)
@pytest.mark.parametrize("offset", [1, 3, 8, 16])
@pytest.mark.parametrize("length", SPLIT_LENGTHS)
def test_cast_misaligned_start(device, gen, hp_dtype, offset, length):
    """x[offset:] against a fresh (aligned) out: vectors where x's offset is a multiple of 8
    elements, the scalar path otherwise; bit-exact either way, fused amax included."""
    base = with_specials(gen, randn(gen, offset + length, dtype=hp_dtype, scale=300.0),
                         [float("inf"), -0.0])
    check_cast(base.to(device)[offset:], 0.37, torch.float8_e4m3fn, device, amax_init=0.5)


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("out_dtype", HP_DTYPES)
@pytest.mark.parametrize("offset", [1, 3, 8])
@pytest.mark.parametrize("length", SPLIT_LENGTHS)
def test_cast_from_fp8_misaligned_start(device, gen, out_dtype, offset, length):
    codes = torch.randint(0, 256, (offset + length,), generator=gen, dtype=torch.int32)
    x = codes.to(torch.uint8).view(torch.float8_e5m2)[offset:]
    out = ops.cast_from_fp8(x.to(device), scalar(3.3, device), out_dtype)
    assert_same_values(out.cpu(), ref.cast_from_fp8_reference(x, scalar(3.3), out_dtype))


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("shape", [(0,), (3, 0), (0, 5, 2)])
def test_cast_empty_leaves_amax(device, gen, shape):
    amax_slot = randn(gen, 1, device=device).abs() + 0.5
    previous = amax_slot.clone()
    out = ops.cast_to_fp8(torch.empty(shape, device=device), scalar(2.0, device),
                          torch.float8_e4m3fn, amax_slot)
    assert out.shape == shape and out.dtype == torch.float8_e4m3fn
    assert_bitwise_equal(amax_slot, previous)


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_cast_0dim(device, gen, fp8_dtype):
    x = randn(gen, dtype=torch.float32, scale=100.0)
    out = check_cast(x, 1.5, fp8_dtype, device, amax_init=0.0)
    assert out.shape == ()


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("hp_dtype", HP_DTYPES)
@pytest.mark.parametrize("slot_shape", [(1,), ()])
def test_fused_amax_max_accumulates(device, gen, hp_dtype, slot_shape):
    x = randn(gen, 33, 65, dtype=hp_dtype, scale=7.0, device=device)
    x_amax = ops.amax(x).item()
    assert x_amax == ref.amax_reference(x.cpu()).item()
    for prior, expected in [(0.0, x_amax), (x_amax / 3, x_amax), (x_amax * 3, x_amax * 3)]:
        slot = torch.full(slot_shape, prior, device=device)
        ops.cast_to_fp8(x, scalar(1.0, device), torch.float8_e4m3fn, slot)
        assert slot.shape == slot_shape
        assert slot.item() == torch.tensor(expected, dtype=torch.float32).item(), prior


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("prior", [0.0, 1e30, float("inf")])
def test_fused_amax_nan_in_x(device, gen, prior):
    x = with_specials(gen, randn(gen, 20_000), [float("nan")]).to(device)
    slot = scalar(prior, device)
    ops.cast_to_fp8(x, scalar(1.0, device), torch.float8_e5m2, slot)
    assert torch.isnan(slot).all()


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_fused_amax_nan_slot_stays_nan(device, gen):
    slot = scalar(float("nan"), device)
    ops.cast_to_fp8(randn(gen, 100, device=device), scalar(1.0, device), torch.float8_e4m3fn,
                    slot)
    assert torch.isnan(slot).all()


# ----------------------------------------------------------------------------- cast_transpose

@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("hp_dtype", HP_DTYPES)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (3, 5), (64, 64), (65, 130), (128, 8), (1, 257),
                                   (300, 1), (0, 5)])
def test_cast_transpose(device, gen, hp_dtype, fp8_dtype, shape):
    x = randn(gen, *shape, dtype=hp_dtype, scale=200.0, device=device)
    if x.numel():
        x = with_specials(gen, x.cpu(), [float("inf"), -0.0]).to(device)
    scale = scalar(0.37 if fp8_dtype == torch.float8_e4m3fn else 3.3, device)
    slot, slot_ref = scalar(0.25, device), scalar(0.25, device)
    out, out_t = ops.cast_transpose_to_fp8(x, scale, fp8_dtype, slot)
    expected = ops.cast_to_fp8(x, scale, fp8_dtype, slot_ref)
    assert_bitwise_equal(out, expected, "out")
    assert_bitwise_equal(out, ref.cast_to_fp8_reference(x.cpu(), scale.cpu(), fp8_dtype), "ref")
    assert out_t.shape == (shape[1], shape[0]) and out_t.is_contiguous()
    assert_bitwise_equal(out_t, out.t().contiguous(), "out_t")
    assert_same_values(slot, slot_ref, "fused amax")


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_cast_transpose_non_contiguous_input(device, gen):
    x = randn(gen, 70, 33, dtype=torch.bfloat16, scale=20.0, device=device).t()
    scale = scalar(2.0, device)
    out, out_t = ops.cast_transpose_to_fp8(x, scale, torch.float8_e4m3fn)
    assert_bitwise_equal(out, ops.cast_to_fp8(x, scale, torch.float8_e4m3fn))
    assert_bitwise_equal(out_t, ops.cast_to_fp8(x.t(), scale, torch.float8_e4m3fn))


# Shapes around the CUDA kernel's 128 x 128 tiles: phase 1 (out) vectorises when cols % 8 == 0,
# phase 2 (out_t) when rows % 16 == 0, each with partial edge tiles; otherwise element-wise.
TRANSPOSE_EDGE_SHAPES = [
    (16, 8), (128, 128), (256, 384),  # full tiles
    (144, 200), (1040, 2056),         # both vectorised, edge tiles in both directions
    (130, 136), (1, 64), (127, 1000), # out vectorised, out_t element-wise
    (160, 100), (176, 131), (48, 3),  # out element-wise, out_t vectorised (partial word columns)
    (129, 129), (17, 197), (100, 77),  # both element-wise
]


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("hp_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("shape", TRANSPOSE_EDGE_SHAPES)
def test_cast_transpose_tile_edges(device, gen, hp_dtype, fp8_dtype, shape):
    # 1e6 saturates (x 0.37 > 448) and is the amax of the blocks that hold it.
    x = with_specials(gen, randn(gen, *shape, dtype=hp_dtype, scale=200.0), [1e6, -1e6, -0.0])
    scale = scalar(0.37)
    slot = scalar(0.25, device)
    out, out_t = ops.cast_transpose_to_fp8(x.to(device), scale.to(device), fp8_dtype, slot)
    expected = ref.cast_to_fp8_reference(x, scale, fp8_dtype)
    assert_bitwise_equal(out, expected, "out")
    assert_bitwise_equal(out_t, expected.t().contiguous(), "out_t")
    assert_bitwise_equal(slot.cpu(), scalar(max(0.25, x.float().abs().max().item())), "amax")


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("offset", [1, 8])
@pytest.mark.parametrize("shape", [(144, 200), (160, 96)])
def test_cast_transpose_misaligned_start(device, gen, offset, shape):
    """A contiguous x that starts off the 16-byte boundary: out goes element-wise (offset 1) or
    by vectors (offset 8 bf16 elements = 16 bytes); out_t is unaffected."""
    rows, cols = shape
    base = randn(gen, offset + rows * cols, dtype=torch.bfloat16, scale=50.0)
    x = base[offset:].view(rows, cols)
    out, out_t = ops.cast_transpose_to_fp8(base.to(device)[offset:].view(rows, cols),
                                           scalar(2.0, device), torch.float8_e5m2)
    expected = ref.cast_to_fp8_reference(x, scalar(2.0), torch.float8_e5m2)
    assert_bitwise_equal(out, expected, "out")
    assert_bitwise_equal(out_t, expected.t().contiguous(), "out_t")


# ----------------------------------------------------------------------------- cast_from_fp8

@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("dtype", HP_DTYPES)
@pytest.mark.parametrize("scale_inv", [1.0, 2.0**-7, 2.0**10, 0.37, 3.3, 1e30, 1e-30])
def test_cast_from_every_fp8_pattern(device, fp8_dtype, dtype, scale_inv):
    x = all_fp8_patterns(fp8_dtype)
    s = scalar(scale_inv)
    out = ops.cast_from_fp8(x.to(device), s.to(device), dtype)
    assert out.dtype == dtype and out.device.type == device
    expected = ref.cast_from_fp8_reference(x, s, dtype)
    finite = ~torch.isnan(expected)
    assert_bitwise_equal(out.cpu()[finite], expected[finite])  # NaN-free part: bit for bit
    torch.testing.assert_close(out.cpu(), expected, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_cast_from_fp8_shapes(device, gen, fp8_dtype):
    base = ops.cast_to_fp8(randn(gen, 40, 50, scale=10.0, device=device),
                           scalar(1.0, device), fp8_dtype)
    for x in (base, base.t(), base[::3, 1::2], base[:0], base[0, 0]):
        out = ops.cast_from_fp8(x, scalar(0.5, device), torch.bfloat16)
        assert out.shape == x.shape
        assert_bitwise_equal(out, ref.cast_from_fp8_reference(x.cpu(), scalar(0.5),
                                                              torch.bfloat16))


# ----------------------------------------------------------------------------- round trips

@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_fp8_values_survive_round_trip(device, fp8_dtype):
    """Every finite FP8 value, dequantised and cast again with scale 1, comes back bit for bit."""
    x = all_fp8_patterns(fp8_dtype).to(device)
    for dtype in HP_DTYPES:
        hp = ops.cast_from_fp8(x, scalar(1.0, device), dtype)
        back = ops.cast_to_fp8(hp, scalar(1.0, device), fp8_dtype)
        finite = torch.isfinite(hp.float()).cpu()
        assert_bitwise_equal(back.cpu()[finite], x.cpu()[finite], str(dtype))


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("fp8_dtype,min_db", [(torch.float8_e4m3fn, 28.0),
                                              (torch.float8_e5m2, 22.0)])
@pytest.mark.parametrize("hp_dtype", HP_DTYPES)
def test_round_trip_sqnr(device, gen, fp8_dtype, min_db, hp_dtype):
    x = randn(gen, 256, 128, dtype=hp_dtype, scale=5.0, device=device)
    amax_slot = scalar(0.0, device)
    probe = ops.cast_to_fp8(x, scalar(1.0, device), fp8_dtype, amax_slot)
    assert probe.shape == x.shape
    scale = ops.compute_scale_from_amax(amax_slot, FP8_MAX[fp8_dtype])
    x_fp8 = ops.cast_to_fp8(x, scale, fp8_dtype)
    back = ops.cast_from_fp8(x_fp8, 1.0 / scale, hp_dtype)
    assert back.dtype == hp_dtype
    assert sqnr(x, back) >= min_db
    # The amax element saturates nowhere: |back| <= amax (up to the rounding of scale_inv).
    assert back.float().abs().max().item() <= amax_slot.item() * (1 + 2**-10)


@pytest.mark.parametrize("hp_dtype", HP_DTYPES)
@pytest.mark.parametrize("shape", [(2048, 1536), (1000, 1000)], ids=["tiled", "edges"])
def test_large_tensors_many_blocks(device, gen, hp_dtype, shape):
    """Large enough that the CUDA kernels loop over the grid and fill many tiles (one vectorised
    case, one with edge tiles and an odd element count); fused amax across all blocks."""
    x = with_specials(gen, randn(gen, *shape, dtype=hp_dtype, scale=50.0), [float("nan")])
    x_dev, scale = x.to(device), scalar(5.0, device)
    slot = scalar(0.0, device)
    out, out_t = ops.cast_transpose_to_fp8(x_dev, scale, torch.float8_e4m3fn, slot)
    expected = ref.cast_to_fp8_reference(x, scalar(5.0), torch.float8_e4m3fn)
    assert_bitwise_equal(out, expected, "out")
    assert_bitwise_equal(out_t, expected.t().contiguous(), "out_t")
    assert torch.isnan(slot).all(), "a NaN in any block reaches the fused amax"
    clean = x.nan_to_num(0.0)
    flat_slot = scalar(0.0, device)
    flat = ops.cast_to_fp8(clean.to(device).view(-1), scale, torch.float8_e5m2, flat_slot)
    assert_bitwise_equal(flat, ref.cast_to_fp8_reference(clean.view(-1), scalar(5.0),
                                                         torch.float8_e5m2), "flat")
    assert flat_slot.item() == clean.float().abs().max().item()
    back = ops.cast_from_fp8(flat, scalar(0.2, device), hp_dtype)
    assert_bitwise_equal(back, ref.cast_from_fp8_reference(flat.cpu(), scalar(0.2), hp_dtype),
                         "dequantised")
