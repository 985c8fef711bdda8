"""quantize_blockwise and fp8_gemm_blockwise against the pure-torch references.

The quantisation must match reference.quantize_blockwise_reference bit for bit (values, scales,
their strides, the transposes), on fresh random inputs and on edge values; the GEMM is held to
the exact float64 product of its dequantised operands by SQNR. CUDA cases compare with the CPU
reference too, so the CUDA kernels are held to the same bits.
"""
from __future__ import annotations

import os

import pytest
import torch
from conftest import (CUDA_SKIP, DEVICE_PARAMS, FP8_DTYPES, HP_DTYPES, assert_bitwise_equal,
                      assert_same_values, randn, sqnr)

from transformer_fp8 import _C
from transformer_fp8 import reference as ref
from transformer_fp8.ops.blockwise import fp8_gemm_blockwise, quantize_blockwise

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
OPS = torch.ops.transformer_fp8
MODES = {"1x128": (1, 128), "128x128": (128, 128), "rowwise": (1, -1)}
SHAPES = [(256, 384), (130, 200), (1, 1), (7, 129), (129, 7), (300, 64)]


def blocks(mode, cols):
    block_rows, block_cols = MODES[mode]
    return block_rows, block_cols


def mixed(gen, rows, cols, dtype=torch.float32, specials=(), spread=20):
    """Normal values whose magnitude varies per 64 x 64 region by up to 2**+-spread (so that
    blocks differ), with the given special values at random places."""
    x = randn(gen, rows, cols, dtype=torch.float64)
    region = torch.randint(-spread, spread + 1, ((rows + 63) // 64, (cols + 63) // 64),
                           generator=gen)
    x = x * torch.exp2(region.double()).repeat_interleave(64, 0).repeat_interleave(64, 1)[
        :rows, :cols]
    flat = x.view(-1)
    for v in specials:
        flat[torch.randint(0, flat.numel(), (2,), generator=gen)] = v
    return x.to(dtype)


def check_quantize(x, mode, fp8_dtype, power_2_scale, device="cpu", with_transpose=True):
    block_rows, block_cols = blocks(mode, x.shape[1])
    got = quantize_blockwise(x.to(device) if x.device.type != device else x, block_rows,
                             block_cols, fp8_dtype, power_2_scale, with_transpose)
    want = ref.quantize_blockwise_reference(x, block_rows, block_cols, fp8_dtype,
                                            power_2_scale, with_transpose)
    names = ("x_fp8", "scale_inv", "x_t_fp8", "scale_inv_t")
    for name, g, w in zip(names, got, want):
        assert g.device.type == device, name
        if g.dtype == torch.float32:  # scales: the padded layout cuBLASLt reads
            assert g.stride() == w.stride(), f"{name}: strides {g.stride()} != {w.stride()}"
            assert_bitwise_equal(g, w, name)
        else:
            assert_same_values(g, w, name)
    return got


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("power_2_scale", [True, False], ids=["pow2", "fp32_scale"])
@pytest.mark.parametrize("shape", SHAPES)
def test_quantize_matches_reference(gen, device, mode, fp8_dtype, power_2_scale, shape):
    x = mixed(gen, *shape)
    check_quantize(x, mode, fp8_dtype, power_2_scale, device)


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("dtype", HP_DTYPES)
@pytest.mark.parametrize("mode", list(MODES))
def test_quantize_edge_values(gen, device, dtype, mode):
    """0, tiny, huge, +-inf and NaN: a block holding inf or NaN gets scale 1 (the cast saturates
    inf, keeps NaN); an all-zero block gets scale 1; tiny blocks get huge (clamped) scales."""
    info = torch.finfo(dtype)
    x = mixed(gen, 256, 256, specials=[0.0, -0.0, info.tiny, info.max, -info.max, float("inf"),
                                        float("-inf"), float("nan")]).to(dtype)
    x[:128, :128] = 0.0  # an all-zero 128x128 block and 1x128 tiles
    x[128:, 128:] = randn(gen, 128, 128, scale=info.tiny, dtype=dtype)  # tiny blocks
    for power_2_scale in (True, False):
        check_quantize(x, mode, E4M3, power_2_scale, device)


def test_quantize_scale_rules(gen):
    """The scale of a block is fp8_max / amax, a power of two rounded down with power_2_scale,
    and x_fp8 * scale_inv gives x back to FP8 precision."""
    x = randn(gen, 4, 256, scale=3.0)
    x[0, :128] *= 1000.0
    q, s, _, _ = quantize_blockwise(x, 1, 128, E4M3, True)
    amax = x.abs().reshape(4, 2, 128).amax(-1)
    scale = 1.0 / s
    assert torch.equal(scale, torch.exp2(torch.floor(torch.log2(448.0 / amax.double()))).float())
    assert (scale * amax <= 448.0).all()
    _, s32, _, _ = quantize_blockwise(x, 1, 128, E4M3, False)
    assert torch.equal(s32, (1.0 / (448.0 / amax.double()).float()))
    back = ref.dequantize_blockwise_reference(q, s).float()
    assert sqnr(x, back) > 28


@pytest.mark.parametrize("mode", list(MODES))
def test_quantize_non_contiguous_input(gen, mode):
    x = mixed(gen, 200, 300)
    check_quantize(x.t(), mode, E4M3, True)          # a transposed view
    check_quantize(x[::2, 1::3], mode, E5M2, False)  # a strided slice


def test_quantize_transpose_semantics(gen):
    """1x128 tiles of x^T are 128x1 column blocks of x; 128x128 blocks give the transposed
    bytes and scales; row-wise x^T has one scale per column of x."""
    x = mixed(gen, 256, 384, dtype=torch.bfloat16)
    q, s, qt, st = quantize_blockwise(x, 128, 128, E4M3, True, True)
    assert torch.equal(qt.view(torch.uint8), q.t().contiguous().view(torch.uint8))
    assert torch.equal(st, s.t())
    _, _, qt1, st1 = quantize_blockwise(x, 1, 128, E4M3, True, True)
    direct = quantize_blockwise(x.t().contiguous(), 1, 128, E4M3, True)
    assert torch.equal(qt1.view(torch.uint8), direct[0].view(torch.uint8))
    assert torch.equal(st1, direct[1]) and st1.shape == (384, 2)
    _, sr, _, srt = quantize_blockwise(x, 1, 384, E4M3, True, True)  # 1 x cols: row-wise
    assert sr.shape == (256, 1) and srt.shape == (384, 1)
    # A 128-column x: (1, 128) is 1x128 tiles, (1, -1) row-wise; the transposes differ.
    x128 = x[:, :128]
    assert quantize_blockwise(x128, 1, 128, E4M3, True, True)[3].shape == (128, 2)
    assert quantize_blockwise(x128, 1, -1, E4M3, True, True)[3].shape == (128, 1)


def test_without_transpose_returns_empty_tensors(gen):
    x = randn(gen, 32, 256)
    q, s, qt, st = quantize_blockwise(x, 1, 128, E4M3, True, False)
    assert q.shape == (32, 256) and s.shape == (32, 2)
    assert qt.numel() == 0 and qt.dtype == E4M3 and st.numel() == 0 and st.dtype == torch.float32


def test_empty_inputs():
    for shape in [(0, 256), (16, 0), (0, 0)]:
        check_quantize(torch.zeros(shape), "1x128", E4M3, True)
        check_quantize(torch.zeros(shape), "128x128", E4M3, True)
    check_quantize(torch.zeros(0, 256), "rowwise", E4M3, True)


# ------------------------------------------------------------------ 1x128 with the transpose
# On CUDA, 1x128 quantisation with_transpose runs one kernel (blockwise_transpose.cu) for x and
# x^T; it must give the bits that quantising x and x.t().contiguous() separately gives. There
# are two such kernels, chosen by the environment variable below (read once by the operator;
# _C._reread_blockwise_transpose_kernel() reads it again): the CUDA cases run under each.

TRANSPOSE_KERNEL_VARIABLE = "TRANSFORMER_FP8_BLOCKWISE_TRANSPOSE_KERNEL"
TRANSPOSE_KERNELS = ("registers", "staged")
# (device, transpose_kernel): the CPU once, CUDA under each kernel.
DEVICE_AND_KERNEL = [pytest.param("cpu", None, id="cpu"),
                     *(pytest.param("cuda", k, id=f"cuda-{k}", marks=CUDA_SKIP)
                       for k in TRANSPOSE_KERNELS)]


def select_transpose_kernel(value):
    """Sets (value: a str) or unsets (None) the variable and has the operator read it again;
    returns the kernel it then runs."""
    if value is None:
        os.environ.pop(TRANSPOSE_KERNEL_VARIABLE, None)
    else:
        os.environ[TRANSPOSE_KERNEL_VARIABLE] = value
    return _C._reread_blockwise_transpose_kernel()


@pytest.fixture
def transpose_kernel(request):
    """The 1x128-with-transpose CUDA kernel for this test (indirect parameter; None: leave it);
    the variable's previous value is back, and read again, after the test."""
    kernel = request.param
    if kernel is None:
        yield None
        return
    before = os.environ.get(TRANSPOSE_KERNEL_VARIABLE)
    assert select_transpose_kernel(kernel) == kernel
    try:
        yield kernel
    finally:
        select_transpose_kernel(before)


def with_kernels(test):
    """Runs a (device, transpose_kernel) test on the CPU and on CUDA under each kernel."""
    return pytest.mark.parametrize("device,transpose_kernel", DEVICE_AND_KERNEL,
                                   indirect=["transpose_kernel"])(test)


TRANSPOSE_SHAPES = [(129, 257), (1, 128), (128, 1), (300, 5), (1, 1), (127, 129), (256, 384),
                    (16, 136), (513, 8), (8, 513), (1000, 24), (16384, 72), (72, 2048)]


def storage_of(scale_inv):
    """Every float32 of a scale tensor's storage, the padding of its layout included."""
    n = scale_inv.untyped_storage().nbytes() // 4
    return torch.as_strided(scale_inv, (n,), (1,), 0)


def assert_transpose_is_separate_quantisation(x, fp8_dtype, power_2_scale):
    got = quantize_blockwise(x, 1, 128, fp8_dtype, power_2_scale, True)
    x_only = quantize_blockwise(x, 1, 128, fp8_dtype, power_2_scale, False)
    t_only = quantize_blockwise(x.t().contiguous(), 1, 128, fp8_dtype, power_2_scale, False)
    want = (x_only[0], x_only[1], t_only[0], t_only[1])
    names = ("x_fp8", "scale_inv", "x_t_fp8", "scale_inv_t")
    what = f"{tuple(x.shape)} {x.dtype} -> {fp8_dtype}, power_2_scale={power_2_scale}"
    for name, g, w in zip(names, got, want):
        assert g.stride() == w.stride(), f"{name} of {what}: strides {g.stride()} != {w.stride()}"
        assert_bitwise_equal(g, w, f"{name} of {what}")  # NaN bytes with their sign
        if name.startswith("scale"):
            assert_bitwise_equal(storage_of(g), storage_of(w), f"{name} storage of {what}")


def spread_of(dtype):
    """Magnitudes that mostly stay finite in dtype (float16 ends at 65504)."""
    return 8 if dtype == torch.float16 else 20


def with_specials(gen, x):
    """x with an all-zero column and row, a column holding +-inf, one holding NaN, and a
    128 x 128 region of values below the smallest normal of x's dtype (subnormals, zeros)."""
    x = x.clone()
    rows, cols = x.shape
    r, c = (torch.randint(0, n, (4,), generator=gen).tolist() for n in (rows, cols))
    x[:, c[0]] = 0.0
    x[r[0], :] = 0.0
    x[r[1], c[1]] = float("inf")
    x[r[2], c[1]] = float("-inf")
    x[r[3], c[2]] = float("nan")
    tiny = torch.finfo(x.dtype).tiny
    x[:128, -128:] = randn(gen, min(rows, 128), min(cols, 128), scale=tiny / 8, dtype=x.dtype)
    return x


@with_kernels
@pytest.mark.parametrize("shape", TRANSPOSE_SHAPES)
def test_1x128_transpose_is_bitwise_separate_quantisation(gen, device, transpose_kernel, shape):
    for dtype in HP_DTYPES:
        x = with_specials(gen, mixed(gen, *shape, dtype=dtype, spread=spread_of(dtype))).to(device)
        for fp8_dtype in FP8_DTYPES:
            for power_2_scale in (True, False):
                assert_transpose_is_separate_quantisation(x, fp8_dtype, power_2_scale)
    check_quantize(x.cpu(), "1x128", E5M2, False, device)  # and the reference


@with_kernels
def test_1x128_transpose_random_shapes(gen, device, transpose_kernel):
    for _ in range(24):
        rows, cols = (int(v) for v in torch.randint(1, 700, (2,), generator=gen))
        dtype = HP_DTYPES[int(torch.randint(0, 3, (1,), generator=gen))]
        fp8_dtype = FP8_DTYPES[int(torch.randint(0, 2, (1,), generator=gen))]
        power_2_scale = bool(torch.randint(0, 2, (1,), generator=gen))
        x = with_specials(gen, mixed(gen, rows, cols, dtype=dtype, spread=spread_of(dtype)))
        x = x.to(device)
        assert_transpose_is_separate_quantisation(x, fp8_dtype, power_2_scale)


@with_kernels
@pytest.mark.parametrize("dtype", HP_DTYPES)
def test_1x128_transpose_of_views(gen, device, transpose_kernel, dtype):
    """Misaligned (the scalar loads), transposed and strided inputs."""
    flat = mixed(gen, 1, 1 + 264 * 320, dtype=dtype, spread=spread_of(dtype)).reshape(-1)
    flat = flat.to(device)
    views = [flat[1:].view(264, 320),             # starts one element past an aligned address
             flat[1:1 + 320 * 264].view(320, 264).t(),
             flat[:200 * 300].view(200, 300)[::2, 1::3]]
    for x in views:
        assert_transpose_is_separate_quantisation(x, E4M3, True)
        check_quantize(x.cpu(), "1x128", E4M3, True, device)


@with_kernels
@pytest.mark.parametrize("dtype", HP_DTYPES)
@pytest.mark.parametrize("shape", [(256, 384), (200, 300)], ids=["vector", "scalar"])
def test_1x128_transpose_edge_values(gen, device, transpose_kernel, dtype, shape):
    """Huge (+-finfo.max), tiny (smallest normal, subnormals), +-0, +-inf and NaN, an all-zero
    tile and an all-huge tile, partial tiles; (256, 384): the vector loads and stores, (200, 300):
    the element-by-element ones."""
    info = torch.finfo(dtype)
    x = mixed(gen, *shape, dtype=dtype, spread=spread_of(dtype),
              specials=[0.0, -0.0, info.tiny, -info.tiny, info.max, -info.max, float("inf"),
                        float("-inf"), float("nan")])
    x[:128, :128] = 0.0
    x[128:, :128] = info.max * torch.sign(randn(gen, shape[0] - 128, 128, dtype=dtype))
    x[:64, 128:] = randn(gen, 64, shape[1] - 128, scale=info.tiny / 8, dtype=dtype)
    x = x.to(device)
    for fp8_dtype in FP8_DTYPES:
        for power_2_scale in (True, False):
            assert_transpose_is_separate_quantisation(x, fp8_dtype, power_2_scale)
            check_quantize(x.cpu(), "1x128", fp8_dtype, power_2_scale, device)


@CUDA_SKIP
def test_transpose_kernel_variable():
    """TRANSFORMER_FP8_BLOCKWISE_TRANSPOSE_KERNEL: unset or empty is `registers`; another value
    than `registers` or `staged` is an error naming the variable and the values, raised again by
    every 1x128 quantisation with the transpose until the variable is fixed."""
    before = os.environ.get(TRANSPOSE_KERNEL_VARIABLE)
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    try:
        assert select_transpose_kernel(None) == "registers"
        assert select_transpose_kernel("") == "registers"
        assert select_transpose_kernel("staged") == "staged"
        message = (f"{TRANSPOSE_KERNEL_VARIABLE} must be 'registers' \\(the default\\) or "
                   "'staged', got 'Staged'")
        with pytest.raises(RuntimeError, match=message):
            select_transpose_kernel("Staged")
        with pytest.raises(RuntimeError, match=message):
            quantize_blockwise(x, 1, 128, E4M3, True, True)
        quantize_blockwise(x, 1, 128, E4M3, True, False)  # the variable is not read here
        assert select_transpose_kernel("registers") == "registers"
        quantize_blockwise(x, 1, 128, E4M3, True, True)
    finally:
        select_transpose_kernel(before)


def launched_kernels(fn):
    """The names of the CUDA kernels fn launches (torch.profiler)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.key for e in prof.key_averages() if e.device_time_total > 0]


@CUDA_SKIP
@pytest.mark.parametrize("kernel", TRANSPOSE_KERNELS)
def test_transpose_kernel_variable_picks_the_kernel(kernel):
    """`staged` launches the staged kernel for bf16 and fp16 x and the registers kernel for
    float32 x; `registers` the registers kernel for all three."""
    before = os.environ.get(TRANSPOSE_KERNEL_VARIABLE)
    try:
        select_transpose_kernel(kernel)
        for dtype in HP_DTYPES:
            x = torch.randn(256, 384, device="cuda", dtype=dtype)
            names = [n for n in launched_kernels(
                lambda: quantize_blockwise(x, 1, 128, E4M3, True, True))
                     if "quantize_rows_and_cols" in n]
            staged = kernel == "staged" and dtype != torch.float32
            want = ("quantize_rows_and_cols_staged_kernel" if staged
                    else "quantize_rows_and_cols_kernel")
            assert len(names) == 1 and want in names[0], (kernel, dtype, names)
    finally:
        select_transpose_kernel(before)


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_128x128_transpose_is_the_transposed_bytes(gen, device):
    """128x128 blocks: x_t_fp8 is x_fp8's bytes transposed (on CUDA by the byte-transpose
    kernel of cast_transpose), scale_inv_t the transposed scales in their own layout."""
    for shape in TRANSPOSE_SHAPES:
        x = with_specials(gen, mixed(gen, *shape, dtype=torch.bfloat16)).to(device)
        q, s, qt, st = quantize_blockwise(x, 128, 128, E5M2, False, True)
        assert qt.is_contiguous() and qt.shape == (shape[1], shape[0])
        assert_bitwise_equal(qt, q.t().contiguous(), f"x_t_fp8 of {shape}")
        assert_bitwise_equal(st, s.t(), f"scale_inv_t of {shape}")
        row_blocks = -(-shape[0] // 128)  # the K blocks of x^T, padded to 4 per row
        assert st.stride() == ((row_blocks + 3) // 4 * 4, 1)


# ----------------------------------------------------------------------------- GEMM

GEMM_PAIRS = [("1x128", "1x128"), ("1x128", "128x128"), ("128x128", "1x128"),
              ("rowwise", "rowwise")]
GEMM_SHAPES = [(256, 384, 512), (128, 128, 128), (64, 32, 272)]


def quantised(gen, rows, cols, mode, fp8_dtype, device):
    x = mixed(gen, rows, cols, spread=3).to(device)  # products stay in float16's range
    block_rows, block_cols = blocks(mode, cols)
    q, s, _, _ = quantize_blockwise(x, block_rows, block_cols, fp8_dtype, True)
    return q, s


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("a_mode,b_mode", GEMM_PAIRS)
@pytest.mark.parametrize("shape", GEMM_SHAPES)
@pytest.mark.parametrize("out_dtype", HP_DTYPES)
@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias"])
def test_gemm_matches_reference(gen, device, a_mode, b_mode, shape, out_dtype, with_bias):
    M, N, K = shape
    a, a_si = quantised(gen, M, K, a_mode, E4M3, device)
    b, b_si = quantised(gen, N, K, b_mode, E4M3, device)
    bias = randn(gen, N, dtype=out_dtype, device=device) if with_bias else None
    out = fp8_gemm_blockwise(a, a_si, b, b_si, out_dtype, bias)
    assert out.shape == (M, N) and out.dtype == out_dtype and out.device.type == device
    expected = ref.fp8_gemm_blockwise_reference(a, a_si, b, b_si, torch.float64, bias)
    assert torch.isfinite(out.float()).all()
    assert sqnr(expected, out) >= 40.0


@pytest.mark.parametrize("shape", [(5, 7, 3), (33, 17, 200), (1, 1, 1), (130, 3, 129)])
@pytest.mark.parametrize("a_mode,b_mode", GEMM_PAIRS)
def test_gemm_odd_shapes_cpu(gen, shape, a_mode, b_mode):
    M, N, K = shape
    a, a_si = quantised(gen, M, K, a_mode, E4M3, "cpu")
    b, b_si = quantised(gen, N, K, b_mode, E5M2, "cpu")
    out = fp8_gemm_blockwise(a, a_si, b, b_si, torch.float32)
    expected = ref.fp8_gemm_blockwise_reference(a, a_si, b, b_si, torch.float64)
    assert sqnr(expected, out) >= 60.0  # float32 accumulation of exact products


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_gemm_accepts_any_scale_strides(gen, device):
    a, a_si = quantised(gen, 64, 256, "1x128", E4M3, device)
    b, b_si = quantised(gen, 32, 256, "128x128", E4M3, device)
    out = fp8_gemm_blockwise(a, a_si, b, b_si, torch.float32)
    again = fp8_gemm_blockwise(a, a_si.contiguous(), b, b_si.t().contiguous().t(), torch.float32)
    assert torch.equal(out, again)


def test_gemm_blockwise_beats_per_tensor_on_outlier_blocks(gen):
    """Outlier 128-column blocks: per-tensor scaling flushes the ordinary values, per-block does
    not (the reason the recipe exists)."""
    from transformer_fp8 import ops

    x = randn(gen, 256, 1024)
    x[:, 256:384] *= 1e5  # one block of outlier columns
    w = randn(gen, 128, 1024, scale=0.02)
    w[:, 256:384] = 0.0  # the output is the ordinary values' product
    exact = x.double() @ w.double().T
    xq, xs, _, _ = quantize_blockwise(x, 1, 128, E4M3, True)
    wq, ws, _, _ = quantize_blockwise(w, 128, 128, E4M3, True)
    block = fp8_gemm_blockwise(xq, xs, wq, ws, torch.float32)
    # Per-tensor current scaling of the same operands.
    sx = ops.compute_scale_from_amax(ops.amax(x).reshape(1), 448.0)
    sw = ops.compute_scale_from_amax(ops.amax(w).reshape(1), 448.0)
    tensor = ops.fp8_gemm(ops.cast_to_fp8(x, sx, E4M3), 1 / sx, ops.cast_to_fp8(w, sw, E4M3),
                          1 / sw, torch.float32)
    x_back_block = ref.dequantize_blockwise_reference(xq, xs)
    x_back_tensor = ops.cast_to_fp8(x, sx, E4M3).double() / sx.double()
    ordinary = torch.ones_like(x, dtype=torch.bool)
    ordinary[:, 256:384] = False
    assert sqnr(x[ordinary], x_back_block[ordinary]) > 25
    assert (x_back_tensor[ordinary] == 0).double().mean() > 0.5  # most flushed to zero
    assert (x_back_block[ordinary] == 0).double().mean() < 0.01
    assert sqnr(x[ordinary], x_back_tensor[ordinary]) < 10
    assert sqnr(exact, block) > 25 and sqnr(exact, block) > sqnr(exact, tensor) + 15


# ----------------------------------------------------------------------------- errors

def test_quantize_errors_name_the_argument(gen):
    x = randn(gen, 16, 256)
    with pytest.raises(RuntimeError, match="'block_rows' x 'block_cols'.*got 2 x 64"):
        quantize_blockwise(x, 2, 64)
    with pytest.raises(RuntimeError, match="argument 'x'.*2-D"):
        quantize_blockwise(x.reshape(-1), 1, 128)
    with pytest.raises(RuntimeError, match="argument 'x'.*float32, bfloat16 or float16"):
        quantize_blockwise(x.double(), 1, 128)
    with pytest.raises(RuntimeError, match="argument 'fp8_dtype'"):
        quantize_blockwise(x, 1, 128, torch.bfloat16)
    # (the operator's bool would take None as False: an fp32 scale where 2**k was asked)
    with pytest.raises(TypeError, match="power_2_scale must be True or False, got NoneType"):
        quantize_blockwise(x, 1, 128, torch.float8_e4m3fn, None)
    with pytest.raises(TypeError, match="with_transpose must be True or False, got int"):
        quantize_blockwise(x, 1, 128, torch.float8_e4m3fn, True, 1)


def test_gemm_errors_name_the_argument(gen):
    a, a_si = quantised(gen, 32, 256, "128x128", E4M3, "cpu")
    b, b_si = quantised(gen, 16, 256, "128x128", E4M3, "cpu")
    with pytest.raises(RuntimeError, match="2D x 2D is not a supported GEMM"):
        fp8_gemm_blockwise(a, a_si, b, b_si, torch.float32)
    _, a_row = quantised(gen, 32, 256, "rowwise", E4M3, "cpu")
    _, b_vec = quantised(gen, 16, 256, "1x128", E4M3, "cpu")
    with pytest.raises(RuntimeError, match="row-wise scales only with row-wise"):
        fp8_gemm_blockwise(a, a_row, b, b_vec, torch.float32)
    with pytest.raises(RuntimeError, match="argument 'a_scale_inv' must have shape"):
        fp8_gemm_blockwise(a, torch.ones(3, 3), b, b_vec, torch.float32)
    with pytest.raises(RuntimeError, match="argument 'b_scale_inv' must be a 2-D float32"):
        fp8_gemm_blockwise(a, a_row, b, b_vec.double(), torch.float32)
    with pytest.raises(RuntimeError, match="must share K"):
        fp8_gemm_blockwise(a, a_row, b[:, :128], b_vec, torch.float32)
    with pytest.raises(RuntimeError, match="argument 'out_dtype'"):
        fp8_gemm_blockwise(a, a_row, b, torch.ones(16, 1), torch.float64)
    with pytest.raises(RuntimeError, match="argument 'bias'"):
        fp8_gemm_blockwise(a, a_row, b, torch.ones(16, 1), torch.float32, torch.ones(3))
    with pytest.raises(RuntimeError, match="argument 'a' must be a float8"):
        fp8_gemm_blockwise(a.float(), a_row, b, torch.ones(16, 1), torch.float32)


# ----------------------------------------------------------------------------- opcheck

# opcheck's test_schema needs torch.allclose on the inputs, which float8 tensors lack: the
# GEMM (FP8 inputs) gets the other sub-tests, as in test_opcheck.py.
WITHOUT_SCHEMA = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("mode", list(MODES))
def test_opcheck(gen, device, mode):
    x = mixed(gen, 160, 272, dtype=torch.bfloat16).to(device)
    block_rows, block_cols = blocks(mode, 272)
    for with_transpose in (False, True):
        torch.library.opcheck(OPS.quantize_blockwise.default,
                              (x, block_rows, block_cols, E4M3, True, with_transpose))
    q, s, qt, st = quantize_blockwise(x, block_rows, block_cols, E4M3, True, True)
    b_mode = "1x128" if mode == "128x128" else mode
    b, b_si = quantised(gen, 48, 272, b_mode, E4M3, device)
    bias = randn(gen, 48, dtype=torch.bfloat16, device=device)
    torch.library.opcheck(OPS.fp8_gemm_blockwise.default,
                          (q, s, b, b_si, torch.bfloat16, bias), test_utils=WITHOUT_SCHEMA)


@CUDA_SKIP
def test_cuda_matches_cpu_bitwise(gen):
    """The same input quantised on the GPU and on the CPU gives the same bits (the CPU kernel
    is held to the reference by the tests above)."""
    x = mixed(gen, 384, 520, dtype=torch.bfloat16, specials=[float("nan"), float("inf")])
    for mode in MODES:
        block_rows, block_cols = blocks(mode, 520)
        dev = quantize_blockwise(x.cuda(), block_rows, block_cols, E4M3, True, True)
        cpu = quantize_blockwise(x, block_rows, block_cols, E4M3, True, True)
        for d, c in zip(dev, cpu):
            assert d.stride() == c.stride()
            if d.dtype == torch.float32:
                assert_bitwise_equal(d, c, mode)
            else:
                assert_same_values(d, c, mode)


# ----------------------------------------------------------------------------- scale layout probe

PROBE_M, PROBE_N, PROBE_K = 384, 128, 1280  # 10 K-blocks: the padded scale stride matters


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("a_mode,b_mode", GEMM_PAIRS)
@pytest.mark.parametrize("marked", ["a", "b"])
@pytest.mark.parametrize("out_dtype", HP_DTYPES)
@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias"])
def test_gemm_scale_layout_probe(device, a_mode, b_mode, marked, out_dtype, with_bias):
    """All-ones operands, every scale_inv 1 except one set to 4: the one in the marked
    operand's last row-block and last K-block. Exactly the output tile that this scale feeds
    must change (by 3 x 128 per element: 3 extra copies of one K-block's 128 unit products;
    x 3 x 1280 for row-wise scales, whose one block is the whole row), so a scale read from
    the wrong place of the padded layout shows as a wrong tile. Every value is exact in each
    output dtype."""
    ones_a = torch.ones(PROBE_M, PROBE_K, device=device)
    ones_b = torch.ones(PROBE_N, PROBE_K, device=device)
    a, a_si, _, _ = quantize_blockwise(ones_a, *blocks(a_mode, PROBE_K), E4M3, True)
    b, b_si, _, _ = quantize_blockwise(ones_b, *blocks(b_mode, PROBE_K), E4M3, True)
    # ones quantise to 256 with scale_inv 1/256: make the operands 1 and every scale 1
    a, b = torch.ones_like(a), torch.ones_like(b)
    a_si.fill_(1.0)
    b_si.fill_(1.0)
    marked_si, marked_mode = (a_si, a_mode) if marked == "a" else (b_si, b_mode)
    marked_si[-1, -1] = 4.0
    bias = (64.0 * (torch.arange(PROBE_N, device=device) % 4)).to(out_dtype) if with_bias else None

    out = fp8_gemm_blockwise(a, a_si, b, b_si, out_dtype, bias)

    rows = PROBE_M if marked == "a" else PROBE_N
    block_rows = {"1x128": 1, "128x128": 128, "rowwise": 1}[marked_mode]
    hit = torch.zeros(rows, dtype=torch.bool)
    hit[(rows - 1) // block_rows * block_rows:] = True
    extra = 3.0 * (PROBE_K if marked_mode == "rowwise" else 128)
    expected = torch.full((PROBE_M, PROBE_N), float(PROBE_K), dtype=torch.float64)
    if marked == "a":
        expected[hit, :] += extra
    else:
        expected[:, hit] += extra
    if with_bias:
        expected += bias.cpu().double()
    assert torch.equal(out.cpu().double(), expected), (
        f"changed elements: {(out.cpu().double() != float(PROBE_K)).nonzero().tolist()[:8]}")
    assert torch.equal(out.cpu(), ref.fp8_gemm_blockwise_reference(
        a, a_si, b, b_si, out_dtype, bias))


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("power_2_scale", [True, False], ids=["pow2", "fp32_scale"])
@pytest.mark.parametrize("a_mode,b_mode", GEMM_PAIRS)
def test_gemm_keeps_subnormal_scale_inv(gen, device, power_2_scale, a_mode, b_mode):
    """Blocks of amax near float32's smallest normal get a scale clamped to the largest float
    and a subnormal scale_inv: the GEMM must use it, not flush it to zero."""
    x = (randn(gen, 256, 384, dtype=torch.float64) * 1e-38).float().to(device)
    w = randn(gen, 128, 384, device=device)
    a, a_si, _, _ = quantize_blockwise(x, *blocks(a_mode, 384), E4M3, power_2_scale)
    b, b_si, _, _ = quantize_blockwise(w, *blocks(b_mode, 384), E4M3, power_2_scale)
    smallest_normal = torch.finfo(torch.float32).tiny
    assert (a_si < smallest_normal).all() and (a_si > 0).all()  # the case under test
    out = fp8_gemm_blockwise(a, a_si, b, b_si, torch.float32)
    expected = ref.fp8_gemm_blockwise_reference(a, a_si, b, b_si, torch.float64)
    assert (out != 0).float().mean() > 0.99
    assert sqnr(expected, out) >= 40.0
