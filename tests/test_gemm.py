"""fp8_gemm against reference.fp8_gemm_reference (exact product in float64), by SQNR.

Operands are real quantised tensors: random data cast with cast_to_fp8 at a per-tensor scale, so
scale_inv is never 1. On CUDA, M, N and K must be multiples of 16; the odd shapes run on CPU.
"""
from __future__ import annotations

import pytest
import torch
from conftest import (CUDA_SKIP, DEVICE_PARAMS, FP8_MAX, HP_DTYPES, assert_bitwise_equal, randn,
                      scalar, sqnr)

from transformer_fp8 import ops
from transformer_fp8 import reference as ref

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
OPERAND_DTYPES = [(E4M3, E4M3), (E4M3, E5M2), (E5M2, E4M3)]
MIN_SQNR_DB = 40.0


def quantise(gen, rows: int, cols: int, fp8_dtype, device, magnitude: float = 3.0):
    """(x_fp8, scale_inv) for random data of the given magnitude, scaled to use the FP8 range."""
    x = randn(gen, rows, cols, scale=magnitude, device=device)
    amax = ops.amax(x).clamp_min(1e-3)
    # A scale that is no power of two, so that scale_inv really scales the product.
    scale = (FP8_MAX[fp8_dtype] / amax * 0.71).reshape(1)
    return ops.cast_to_fp8(x, scale, fp8_dtype), 1.0 / scale


def operands(gen, M, N, K, a_dtype, b_dtype, device):
    a, a_si = quantise(gen, M, K, a_dtype, device, magnitude=2.0)
    b, b_si = quantise(gen, N, K, b_dtype, device, magnitude=0.05)
    return a, a_si, b, b_si


def check_against_reference(a, a_si, b, b_si, out_dtype, bias=None, use_fast_accum=False):
    out = ops.fp8_gemm(a, a_si, b, b_si, out_dtype, bias, use_fast_accum)
    assert out.shape == (a.shape[0], b.shape[0]) and out.dtype == out_dtype
    assert out.device == a.device
    expected = ref.fp8_gemm_reference(a.cpu(), a_si.cpu(), b.cpu(), b_si.cpu(), torch.float64,
                                      None if bias is None else bias.cpu())
    assert torch.isfinite(out.float()).all()
    db = sqnr(expected, out)
    assert db >= MIN_SQNR_DB, f"SQNR {db:.1f} dB < {MIN_SQNR_DB} dB"
    return out


SHAPES = [pytest.param((32, 64, 48), id="M32-N64-K48"),
          pytest.param((16, 16, 16), id="M16-N16-K16"),
          pytest.param((128, 48, 256), id="M128-N48-K256")]
ODD_SHAPES = [pytest.param((5, 7, 3), id="M5-N7-K3"), pytest.param((1, 1, 1), id="M1-N1-K1"),
              pytest.param((33, 17, 65), id="M33-N17-K65")]


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("a_dtype,b_dtype", OPERAND_DTYPES)
@pytest.mark.parametrize("out_dtype", HP_DTYPES)
@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("use_fast_accum", [False, True], ids=["exact_accum", "fast_accum"])
def test_fp8_gemm_matches_reference(device, gen, shape, a_dtype, b_dtype, out_dtype, with_bias,
                                    use_fast_accum):
    M, N, K = shape
    a, a_si, b, b_si = operands(gen, M, N, K, a_dtype, b_dtype, device)
    bias = randn(gen, N, dtype=out_dtype, device=device) if with_bias else None
    check_against_reference(a, a_si, b, b_si, out_dtype, bias, use_fast_accum)


@pytest.mark.parametrize("shape", ODD_SHAPES)
@pytest.mark.parametrize("a_dtype,b_dtype", OPERAND_DTYPES)
@pytest.mark.parametrize("out_dtype", HP_DTYPES)
@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias"])
def test_fp8_gemm_odd_shapes_cpu(gen, shape, a_dtype, b_dtype, out_dtype, with_bias):
    M, N, K = shape
    a, a_si, b, b_si = operands(gen, M, N, K, a_dtype, b_dtype, "cpu")
    bias = randn(gen, N, dtype=out_dtype) if with_bias else None
    check_against_reference(a, a_si, b, b_si, out_dtype, bias)


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_fp8_gemm_non_contiguous_operands(device, gen):
    a, a_si, b, b_si = operands(gen, 64, 32, 96, E4M3, E4M3, device)
    a_nc = a.t().contiguous().t()  # same values, column-major storage
    assert not a_nc.is_contiguous()
    check_against_reference(a_nc, a_si, b, b_si, torch.float32)


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("out_dtype", HP_DTYPES)
@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias"])
def test_fp8_gemm_k_zero(device, gen, out_dtype, with_bias):
    a, a_si, b, b_si = operands(gen, 16, 32, 0, E4M3, E5M2, device)
    bias = randn(gen, 32, dtype=out_dtype, device=device) if with_bias else None
    out = ops.fp8_gemm(a, a_si, b, b_si, out_dtype, bias)
    assert out.shape == (16, 32) and out.dtype == out_dtype
    expected = torch.zeros(16, 32, dtype=out_dtype, device=device)
    if bias is not None:
        expected = expected + bias
    assert torch.equal(out, expected)


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("M,N", [(0, 32), (16, 0), (0, 0)])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias"])
def test_fp8_gemm_empty_output(device, gen, M, N, with_bias):
    a, a_si, b, b_si = operands(gen, M, N, 48, E4M3, E4M3, device)
    bias = randn(gen, N, dtype=torch.bfloat16, device=device) if with_bias else None
    out = ops.fp8_gemm(a, a_si, b, b_si, torch.bfloat16, bias)
    assert out.shape == (M, N) and out.dtype == torch.bfloat16 and out.device == a.device


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_fp8_gemm_refuses_e5m2_x_e5m2(device, gen):
    a, a_si, b, b_si = operands(gen, 16, 16, 16, E5M2, E5M2, device)
    with pytest.raises(RuntimeError, match="float8_e5m2"):
        ops.fp8_gemm(a, a_si, b, b_si, torch.float32)


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_fp8_gemm_refuses_mismatched_k(device, gen):
    a, a_si, _, _ = operands(gen, 16, 16, 32, E4M3, E4M3, device)
    b, b_si = quantise(gen, 16, 48, E4M3, device)
    with pytest.raises(RuntimeError, match=r"share K.*\[16, 32\].*\[16, 48\]"):
        ops.fp8_gemm(a, a_si, b, b_si, torch.float32)


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("offset", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias"])
def test_fp8_gemm_takes_scale_inv_views_at_any_offset(device, gen, offset, with_bias):
    """scale_inv as one element of a larger buffer (the delayed-scaling state's [input, weight]
    scale_invs): the same bits as with a fresh one-element tensor. On CUDA, cuBLASLt refused a
    scale pointer 4 bytes into a buffer (CUBLAS_STATUS_NOT_SUPPORTED at the call)."""
    a, a_si, b, b_si = operands(gen, 32, 48, 64, E4M3, E4M3, device)
    bias = randn(gen, 48, dtype=torch.bfloat16, device=device) if with_bias else None
    want = ops.fp8_gemm(a, a_si, b, b_si, torch.bfloat16, bias, True)
    buffer = torch.zeros(2 * offset + 2, device=device)
    buffer[offset], buffer[2 * offset + 1] = a_si[0], b_si[0]
    a_view, b_view = buffer[offset:offset + 1], buffer[2 * offset + 1:2 * offset + 2]
    assert torch.equal(ops.fp8_gemm(a, a_view, b, b_view, torch.bfloat16, bias, True), want)
    assert torch.equal(ops.fp8_gemm(a, a_view, b, b_si, torch.bfloat16, bias, True), want)
    assert buffer[offset] == a_si[0] and buffer[2 * offset + 1] == b_si[0]  # read, not written


@CUDA_SKIP
def test_fp8_gemm_cuda_refuses_unaligned_shapes(gen):
    a, a_si, b, b_si = operands(gen, 5, 7, 3, E4M3, E4M3, "cuda")
    with pytest.raises(RuntimeError, match="multiples of 16"):
        ops.fp8_gemm(a, a_si, b, b_si, torch.float32)


@CUDA_SKIP
@pytest.mark.parametrize("a_dtype,b_dtype", OPERAND_DTYPES)
@pytest.mark.parametrize("out_dtype", HP_DTYPES)
@pytest.mark.parametrize("use_fast_accum", [False, True], ids=["exact_accum", "fast_accum"])
def test_fp8_gemm_cuda_matches_cpu(gen, a_dtype, b_dtype, out_dtype, use_fast_accum):
    a, a_si, b, b_si = operands(gen, 64, 96, 128, a_dtype, b_dtype, "cpu")
    bias = randn(gen, 96, dtype=out_dtype)
    out_cpu = ops.fp8_gemm(a, a_si, b, b_si, out_dtype, bias)
    out_cuda = ops.fp8_gemm(a.cuda(), a_si.cuda(), b.cuda(), b_si.cuda(), out_dtype, bias.cuda(),
                            use_fast_accum)
    assert out_cuda.is_cuda and out_cuda.dtype == out_dtype
    db = sqnr(out_cpu.double(), out_cuda.cpu())
    assert db >= MIN_SQNR_DB, f"CUDA vs CPU SQNR {db:.1f} dB"


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_fp8_gemm_scale_invs_are_applied(device, gen):
    """Doubling a_scale_inv doubles the output exactly (a power of two rescales exactly)."""
    a, a_si, b, b_si = operands(gen, 32, 16, 64, E4M3, E4M3, device)
    out = ops.fp8_gemm(a, a_si, b, b_si, torch.float32)
    out2 = ops.fp8_gemm(a, a_si * 2, b, b_si * 0.25, torch.float32)
    torch.testing.assert_close(out2, out * 0.5, rtol=1e-6, atol=0)


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("offset", [0, 16, 8, 1], ids=lambda o: f"offset{o}")
def test_operands_of_any_alignment(device, gen, offset):
    """Views that start 16, 8 or 1 bytes into a buffer: the same shapes as an aligned call (so
    a cached algorithm for aligned buffers must not be reused) and a correct product."""
    M, N, K = 32, 48, 64
    a, a_si, b, b_si = operands(gen, M, N, K, E4M3, E4M3, device)
    bias = randn(gen, N + offset, dtype=torch.bfloat16, device=device)[offset:]
    check_against_reference(a, a_si, b, b_si, torch.bfloat16, bias)  # aligned first
    a_buffer = torch.empty(M * K + offset, dtype=torch.uint8, device=device)
    b_buffer = torch.empty(N * K + offset, dtype=torch.uint8, device=device)
    a_view = a_buffer[offset:].view(E4M3).view(M, K)
    b_view = b_buffer[offset:].view(E4M3).view(N, K)
    a_view.copy_(a)
    b_view.copy_(b)
    check_against_reference(a_view, a_si, b_view, b_si, torch.bfloat16, bias)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_cpu_gemms_under_torch_autocast_compute_in_float32(gen, out_dtype):
    """torch.autocast reaches the custom operators' CPU kernels (they have no autocast kernel
    of their own): their float32 products must not become bfloat16 ones (they did: eager
    differed from torch.compile, whose graphs run the kernels with autocast off)."""
    a = ops.cast_to_fp8(randn(gen, 48, 64), scalar(8.0), torch.float8_e4m3fn)
    b = ops.cast_to_fp8(randn(gen, 32, 64), scalar(16.0), torch.float8_e4m3fn)
    a_si, b_si, bias = scalar(0.125), scalar(0.0625), randn(gen, 32).to(out_dtype)
    expected = ops.fp8_gemm(a, a_si, b, b_si, out_dtype, bias)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = ops.fp8_gemm(a, a_si, b, b_si, out_dtype, bias)
    assert_bitwise_equal(got, expected)
    from transformer_fp8.ops.blockwise import fp8_gemm_blockwise
    from transformer_fp8.quantization.blockwise import BlockQuantizer
    quantizer = BlockQuantizer(1, torch.float8_e4m3fn, power_2_scale=True)
    qa, qb = quantizer.cast(randn(gen, 48, 128)), quantizer.cast(randn(gen, 32, 128))
    expected = fp8_gemm_blockwise(qa.data, qa.scale_inv, qb.data, qb.scale_inv, out_dtype)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = fp8_gemm_blockwise(qa.data, qa.scale_inv, qb.data, qb.scale_inv, out_dtype)
    assert_bitwise_equal(got, expected)
