"""Fused norm / activation / dbias operators (transformer_fp8/ops/fused.py).

* CPU kernel against the pure-torch reference (transformer_fp8/reference.py): FP8 bytes,
  amax, dbias and high-precision outputs bit for bit (the norms' references take the kernel's
  own mean / rstd; those are compared with float64 statistics by tolerance).
* Every operator against torch (F.layer_norm, F.rms_norm, the activations, autograd) by
  tolerance.
* CUDA kernel against the CPU kernel: FP8 bytes at most one FP8 code apart on a small fraction
  of the elements (different float rounding of the transcendentals and reductions), bit for bit
  for the plain cast of cast_transpose_dbias; amax and the rest by tolerance.
* Row padding, amax NaN propagation, empty inputs, argument errors, opcheck.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICE_PARAMS, FP8_DTYPES, HP_DTYPES, assert_bitwise_equal, randn, scalar

from transformer_fp8 import fused_ops as fo
from transformer_fp8 import reference as ref

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
OPS = torch.ops.transformer_fp8
# N = 37: the CUDA kernels' one-element path (the others take 4-element vectors).
SHAPES = [(1, 8), (3, 48), (5, 37), (17, 1000), (100, 4096)]
ACTIVATIONS = list(fo.ACTIVATIONS)
# Tolerances against torch for results in each dtype (float32 math, one rounding at the end).
TOL = {torch.float32: {"rtol": 1e-5, "atol": 1e-5},
       torch.bfloat16: {"rtol": 2e-2, "atol": 2e-2},
       torch.float16: {"rtol": 2e-3, "atol": 2e-3}}
# Share of FP8 elements allowed one code apart between CUDA and CPU.
MAX_ONE_CODE_FRACTION = 1e-3


# ----------------------------------------------------------------------------- helpers

def make_x(gen, rows, cols, dtype, device, contiguous=True, scale=3.0):
    """A [rows, cols] input with a non-zero mean per row; non-contiguous: a transposed view."""
    x = randn(gen, rows, cols, scale=scale) + randn(gen, rows, 1)
    if contiguous:
        return x.to(dtype).to(device)
    return x.t().contiguous().to(dtype).to(device).t()


def codes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().view(torch.uint8)


def ordinal(c: torch.Tensor) -> torch.Tensor:
    """FP8 codes as integers in value order (sign-magnitude to two's complement)."""
    mag = (c & 0x7F).to(torch.int32)
    return torch.where(c >= 0x80, -mag, mag)


def assert_fp8_close(out: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """NaN where expected has NaN (any sign); elsewhere at most one code apart, on at most
    MAX_ONE_CODE_FRACTION of the elements (or one)."""
    assert out.dtype == expected.dtype and out.shape == expected.shape, what
    o, e = out.detach().cpu(), expected.detach().cpu()
    o_nan, e_nan = torch.isnan(o.float()), torch.isnan(e.float())
    assert torch.equal(o_nan, e_nan), f"{what}: NaN positions differ"
    diff = (ordinal(codes(o)) - ordinal(codes(e))).abs()[~e_nan]
    assert diff.numel() == 0 or diff.max().item() <= 1, \
        f"{what}: codes differ by up to {diff.max().item()}"
    # (at least one code may differ: on 8 elements one is already 12%)
    allowed = max(1, int(MAX_ONE_CODE_FRACTION * diff.numel()))
    differing = int((diff > 0).sum())
    assert differing <= allowed, \
        f"{what}: {differing} of {diff.numel()} codes differ (at most {allowed})"


def scaled_tol(dtype, reference: torch.Tensor) -> dict:
    """TOL[dtype] with the absolute part relative to the largest finite |reference|."""
    finite = reference.detach().float().abs()
    finite = finite[torch.isfinite(finite)]
    magnitude = max(1.0, finite.max().item()) if finite.numel() else 1.0
    return {"rtol": TOL[dtype]["rtol"], "atol": TOL[dtype]["atol"] * magnitude}


def assert_close(out, expected, what, **tol):
    torch.testing.assert_close(out.detach().cpu(), expected.detach().cpu(), equal_nan=True,
                               msg=lambda m: f"{what}: {m}", **tol)


def check_padding(out_fp8, out_t_fp8, rows, row_multiple, with_transpose):
    rows_pad = -(-rows // row_multiple) * row_multiple
    assert out_fp8.shape[0] == rows_pad and out_fp8.is_contiguous()
    assert (codes(out_fp8[rows:]) == 0).all(), "padding rows must be zero bytes"
    if with_transpose:
        assert out_t_fp8.shape == (out_fp8.shape[1], rows_pad) and out_t_fp8.is_contiguous()
        assert_bitwise_equal(out_t_fp8.cpu(), out_fp8.cpu().t().contiguous(), "transpose")
    else:
        assert out_t_fp8.shape == (0,) and out_t_fp8.dtype == out_fp8.dtype


def run_on_cpu(fn, *args):
    """The CPU kernel's outputs for args moved to the CPU (amax slots cloned)."""
    cpu_args = [a.detach().cpu().clone() if isinstance(a, torch.Tensor) else a for a in args]
    return fn(*cpu_args), cpu_args


# ----------------------------------------------------------------------------- norms

NORM_VARIANTS = {
    # fp8_dtype, with_transpose, return_hp, amax, zero_centered_gamma, bias, contiguous x,
    # weight dtype (None: x's)
    "e4m3_all_outputs": (E4M3, True, True, True, False, True, True, None),
    "e5m2_bare_noncontig": (E5M2, False, False, False, True, False, False, torch.float32),
    "e4m3_hp_only_mixed_weight": (E4M3, False, True, True, True, True, False, torch.bfloat16),
}


def norm_fwd_fp8(norm, x, w, b, eps, zcg, scale, fp8_dtype, amax, with_t, hp, rm):
    if norm == "layernorm":
        return fo.layernorm_fwd_fp8(x, w, b, eps, zcg, scale, fp8_dtype, amax, with_t, hp, rm)
    y_fp8, y_t, y_hp, rstd = fo.rmsnorm_fwd_fp8(x, w, eps, zcg, scale, fp8_dtype, amax, with_t,
                                                hp, rm)
    return y_fp8, y_t, y_hp, None, rstd


def torch_norm(norm, x, w, b, eps, zcg):
    """torch's own norm in float32 (the tolerance reference)."""
    gamma = w.float() + 1.0 if zcg else w.float()
    if norm == "layernorm":
        return F.layer_norm(x.float(), (x.shape[1],), gamma, None if b is None else b.float(), eps)
    return F.rms_norm(x.float(), (x.shape[1],), gamma, eps)


def float64_stats(norm, x, eps):
    x64 = x.detach().cpu().double()
    if norm == "layernorm":
        var, mean = torch.var_mean(x64, dim=1, correction=0)
        return mean, torch.rsqrt(var + eps)
    return None, torch.rsqrt((x64 * x64).mean(dim=1) + eps)


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("dtype", HP_DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("row_multiple", [1, 16])
@pytest.mark.parametrize("variant", list(NORM_VARIANTS))
def test_norm_fwd_fp8(device, gen, norm, dtype, shape, row_multiple, variant):
    fp8_dtype, with_t, hp, use_amax, zcg, use_bias, contiguous, w_dtype = NORM_VARIANTS[variant]
    rows, cols = shape
    eps = 1e-5
    x = make_x(gen, rows, cols, dtype, device, contiguous)
    w = (randn(gen, cols, scale=0.3) + (0.0 if zcg else 1.0)).to(w_dtype or dtype).to(device)
    b = randn(gen, cols, scale=0.5).to(w_dtype or dtype).to(device) if use_bias else None
    if norm == "rmsnorm":
        b = None
    s = scalar(16.0 if fp8_dtype == E4M3 else 256.0, device)
    amax = scalar(0.25, device) if use_amax else None
    args = (norm, x, w, b, eps, zcg, s, fp8_dtype, amax, with_t, hp, row_multiple)
    y_fp8, y_t, y_hp, mean, rstd = norm_fwd_fp8(*args)

    assert y_fp8.shape[1] == cols and y_fp8.dtype == fp8_dtype and y_fp8.device.type == device
    check_padding(y_fp8, y_t, rows, row_multiple, with_t)
    assert rstd.shape == (rows,) and rstd.dtype == torch.float32
    mean64, rstd64 = float64_stats(norm, x, eps)
    assert_close(rstd, rstd64.float(), "rstd", rtol=1e-5, atol=0)
    if norm == "layernorm":
        assert mean.shape == (rows,) and mean.dtype == torch.float32
        assert_close(mean, mean64.float(), "mean", rtol=1e-5, atol=1e-6)
    if hp:
        assert y_hp.shape == x.shape and y_hp.dtype == dtype
        expected = torch_norm(norm, x.cpu(), w.cpu(), None if b is None else b.cpu(), eps, zcg)
        assert_close(y_hp, expected.to(dtype), "y_hp", **TOL[dtype])
    else:
        assert y_hp.shape == (0,) and y_hp.dtype == dtype

    if device == "cpu":
        # The reference with the kernel's own statistics: every output bit for bit.
        ref_amax = scalar(0.25) if use_amax else None
        if norm == "layernorm":
            expected = ref.layernorm_fwd_fp8_reference(x, w, b, eps, zcg, s, fp8_dtype, ref_amax,
                                                       with_t, hp, row_multiple, mean, rstd)
        else:
            expected = ref.rmsnorm_fwd_fp8_reference(x, w, eps, zcg, s, fp8_dtype, ref_amax,
                                                     with_t, hp, row_multiple, rstd)
            expected = (*expected[:3], None, expected[3])
        for name, out, exp in zip(("y_fp8", "y_t_fp8", "y_hp"), (y_fp8, y_t, y_hp), expected):
            assert_bitwise_equal(out, exp, name)
        if use_amax:
            assert_bitwise_equal(amax, ref_amax, "amax")
    else:
        cpu_amax = scalar(0.25) if use_amax else None
        cpu = norm_fwd_fp8(norm, x.cpu(), w.cpu(), None if b is None else b.cpu(), eps, zcg,
                           s.cpu(), fp8_dtype, cpu_amax, with_t, hp, row_multiple)
        assert_fp8_close(y_fp8, cpu[0], "y_fp8 CUDA vs CPU")
        if with_t:
            assert_fp8_close(y_t, cpu[1], "y_t_fp8 CUDA vs CPU")
        if hp:
            assert_close(y_hp, cpu[2], "y_hp CUDA vs CPU", **TOL[dtype])
        assert_close(rstd, cpu[4], "rstd CUDA vs CPU", rtol=1e-5, atol=0)
        if norm == "layernorm":
            assert_close(mean, cpu[3], "mean CUDA vs CPU", rtol=1e-5, atol=1e-6)
        if use_amax:
            assert_close(amax, cpu_amax, "amax CUDA vs CPU", rtol=1e-5, atol=0)


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("dtype", HP_DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("zcg", [False, True])
def test_norm_fwd_hp(device, gen, norm, dtype, shape, zcg):
    rows, cols = shape
    eps = 1e-6
    x = make_x(gen, rows, cols, dtype, device, contiguous=rows % 2 == 1)
    w = (randn(gen, cols, scale=0.3) + (0.0 if zcg else 1.0)).to(device)  # float32 weight
    b = randn(gen, cols, scale=0.5).to(device)
    if norm == "layernorm":
        y, mean, rstd = fo.layernorm_fwd(x, w, b, eps, zcg)
        expected = torch_norm(norm, x.cpu(), w.cpu(), b.cpu(), eps, zcg)
    else:
        y, rstd = fo.rmsnorm_fwd(x, w, eps, zcg)
        expected = torch_norm(norm, x.cpu(), w.cpu(), None, eps, zcg)
    assert y.dtype == dtype and y.shape == x.shape and y.is_contiguous()
    assert_close(y, expected.to(dtype), "y", **TOL[dtype])
    if device == "cpu":
        if norm == "layernorm":
            y_ref = ref.layernorm_reference(x, w, b, eps, zcg, mean, rstd)[0]
        else:
            y_ref = ref.rmsnorm_reference(x, w, eps, zcg, rstd)[0]
        assert_bitwise_equal(y, y_ref.to(dtype), "y against the reference")


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("dtype", HP_DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("zcg", [False, True])
def test_norm_bwd(device, gen, norm, dtype, shape, zcg):
    rows, cols = shape
    eps = 1e-5
    x = make_x(gen, rows, cols, dtype, device, contiguous=cols % 3 == 0)
    w_dtype = torch.float32 if dtype != torch.float32 else torch.bfloat16
    w = (randn(gen, cols, scale=0.3) + (0.0 if zcg else 1.0)).to(w_dtype).to(device)
    dy = randn(gen, rows, cols, dtype=dtype, device=device)
    if norm == "layernorm":
        _, mean, rstd = fo.layernorm_fwd(x, w, None, eps, zcg)
        dx, dw, db = fo.layernorm_bwd(dy, x, mean, rstd, w, zcg)
    else:
        _, rstd = fo.rmsnorm_fwd(x, w, eps, zcg)
        dx, dw = fo.rmsnorm_bwd(dy, x, rstd, w, zcg)
    assert dx.dtype == dtype and dx.shape == x.shape and dw.dtype == w_dtype

    # torch's autograd in float32 (float64 would also be fine; float32 is the contract).
    x32 = x.detach().cpu().float().requires_grad_()
    w32 = w.detach().cpu().float().requires_grad_()
    b32 = torch.zeros(cols, requires_grad=True)
    gamma = w32 + 1.0 if zcg else w32
    if norm == "layernorm":
        out = F.layer_norm(x32, (cols,), gamma, b32, eps)
    else:
        out = F.rms_norm(x32, (cols,), gamma, eps)
    out.backward(dy.cpu().float())
    # dx sums N terms per row, dweight M terms per column: an absolute tolerance in their scale.
    assert_close(dx, x32.grad.to(dtype), "dx", rtol=TOL[dtype]["rtol"],
                 atol=TOL[dtype]["atol"] * 10)
    dw_tol = ({"rtol": 2e-2, "atol": 2e-2 * rows ** 0.5} if w_dtype != torch.float32
              else {"rtol": 1e-4, "atol": 1e-4 * rows ** 0.5})
    assert_close(dw, w32.grad.to(w_dtype), "dweight", **dw_tol)
    if norm == "layernorm":
        assert db.dtype == w_dtype
        assert_close(db, b32.grad.to(w_dtype), "dbias", **dw_tol)

    if device == "cpu":
        if norm == "layernorm":
            expected = ref.layernorm_bwd_reference(dy, x, mean, rstd, w, zcg)
            outs = (dx, dw, db)
        else:
            expected = ref.rmsnorm_bwd_reference(dy, x, rstd, w, zcg)
            outs = (dx, dw)
        for name, out_, exp in zip(("dx", "dweight", "dbias"), outs, expected):
            assert_bitwise_equal(out_, exp, name)
    else:
        stats = (mean.cpu(), rstd.cpu()) if norm == "layernorm" else (rstd.cpu(),)
        bwd = fo.layernorm_bwd if norm == "layernorm" else fo.rmsnorm_bwd
        cpu = bwd(dy.cpu(), x.cpu(), *stats, w.cpu(), zcg)
        dx_tol = scaled_tol(dtype, cpu[0])
        assert_close(dx, cpu[0], "dx CUDA vs CPU", rtol=dx_tol["rtol"], atol=dx_tol["atol"] * 10)
        grads = (dw, db) if norm == "layernorm" else (dw,)
        for name, out_, exp in zip(("dweight", "dbias"), grads, cpu[1:]):
            assert_close(out_, exp, f"{name} CUDA vs CPU", **dw_tol)


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("cols", [16384, 20000, 20001])
def test_norm_wide_rows(device, gen, norm, cols):
    """Rows wider than the CUDA kernels keep in registers (16 elements x 1024 threads, 512 for
    dx): the columns beyond are read again from memory (4-element vectors, or one by one for
    20001)."""
    x = make_x(gen, 3, cols, torch.bfloat16, device)
    w = (randn(gen, cols, scale=0.3) + 1.0).to(device)
    s = scalar(16.0, device)
    slot = scalar(0.0, device)
    y_fp8, _, y_hp, mean, rstd = norm_fwd_fp8(norm, x, w, None, 1e-5, False, s, E4M3, slot,
                                              False, True, 16)
    _, rstd64 = float64_stats(norm, x, 1e-5)
    assert_close(rstd, rstd64.float(), "rstd", rtol=1e-5, atol=0)
    expected = torch_norm(norm, x.cpu(), w.cpu(), None, 1e-5, False)
    assert_close(y_hp, expected.to(torch.bfloat16), "y_hp", **TOL[torch.bfloat16])
    cpu_slot = scalar(0.0)
    cpu = norm_fwd_fp8(norm, x.cpu(), w.cpu(), None, 1e-5, False, s.cpu(), E4M3, cpu_slot,
                       False, True, 16)
    assert_fp8_close(y_fp8, cpu[0], "y_fp8 against the CPU kernel")
    assert_close(slot, cpu_slot, "amax", rtol=1e-5, atol=0)
    dy = randn(gen, 3, cols, dtype=torch.bfloat16, device=device)
    if norm == "layernorm":
        dx, dw, _ = fo.layernorm_bwd(dy, x, mean, rstd, w)
        cpu_dx, cpu_dw, _ = fo.layernorm_bwd(dy.cpu(), x.cpu(), mean.cpu(), rstd.cpu(), w.cpu())
    else:
        dx, dw = fo.rmsnorm_bwd(dy, x, rstd, w)
        cpu_dx, cpu_dw = fo.rmsnorm_bwd(dy.cpu(), x.cpu(), rstd.cpu(), w.cpu())
    assert_close(dx, cpu_dx, "dx", **TOL[torch.bfloat16])
    assert_close(dw, cpu_dw, "dweight", rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------- activations

def torch_activation(x32: torch.Tensor, activation: str) -> torch.Tensor:
    """The activation written with torch.nn.functional (differentiable)."""
    base = {"swiglu": "silu", "geglu": "gelu", "reglu": "relu", "qgeglu": "qgelu",
            "sreglu": "srelu", "glu": "sigmoid"}.get(activation, activation)
    fn = {"gelu": lambda t: F.gelu(t, approximate="tanh"), "relu": F.relu, "silu": F.silu,
          # Transformer Engine's quick gelu and squared relu
          "qgelu": lambda t: t * torch.sigmoid(1.702 * t), "srelu": lambda t: F.relu(t) ** 2,
          "sigmoid": torch.sigmoid}[base]
    if activation in fo.GATED_ACTIVATIONS:
        a, b = x32.chunk(2, dim=1)
        return fn(a) * b
    return fn(x32)


def act_shape(shape, activation):
    rows, cols = shape
    return (rows, 2 * cols) if activation in fo.GATED_ACTIVATIONS else (rows, cols)


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", HP_DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_activation_fwd_bwd_hp(device, gen, activation, dtype, shape):
    rows, in_cols = act_shape(shape, activation)
    x = make_x(gen, rows, in_cols, dtype, device, contiguous=rows != 17)
    y = fo.activation_fwd(x, activation)
    assert y.dtype == dtype and y.shape == shape
    x32 = x.detach().cpu().float().requires_grad_()
    expected = torch_activation(x32, activation)
    assert_close(y, expected.to(dtype), "activation_fwd", **scaled_tol(dtype, expected))
    dy = randn(gen, *shape, dtype=dtype, device=device)
    dx = fo.activation_bwd(dy, x, activation)
    assert dx.dtype == dtype and dx.shape == x.shape
    expected.backward(dy.cpu().float())
    assert_close(dx, x32.grad.to(dtype), "activation_bwd", **scaled_tol(dtype, x32.grad))
    if device == "cpu":
        assert_bitwise_equal(y, ref.activation_reference(x, activation).to(dtype), "fwd ref")
        assert_bitwise_equal(dx, ref.activation_grad_reference(dy, x, activation).to(dtype),
                             "bwd ref")
    else:
        assert_close(y, fo.activation_fwd(x.cpu(), activation), "fwd CUDA vs CPU",
                     **scaled_tol(dtype, expected))
        assert_close(dx, fo.activation_bwd(dy.cpu(), x.cpu(), activation), "bwd CUDA vs CPU",
                     **scaled_tol(dtype, x32.grad))


ACT_VARIANTS = {
    # fp8_dtype, with_transpose, amax, with_dbias (backward only), contiguous x
    "e4m3_transpose_amax_dbias": (E4M3, True, True, True, True),
    "e5m2_bare_noncontig": (E5M2, False, False, False, False),
}


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", HP_DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("row_multiple", [1, 16])
@pytest.mark.parametrize("variant", list(ACT_VARIANTS))
def test_activation_fp8(device, gen, activation, dtype, shape, row_multiple, variant):
    fp8_dtype, with_t, use_amax, with_dbias, contiguous = ACT_VARIANTS[variant]
    rows, in_cols = act_shape(shape, activation)
    x = make_x(gen, rows, in_cols, dtype, device, contiguous)
    dy = randn(gen, *shape, dtype=dtype, device=device)
    s = scalar(32.0 if fp8_dtype == E4M3 else 1024.0, device)
    amax_fwd = scalar(0.5, device) if use_amax else None
    amax_bwd = scalar(0.5, device) if use_amax else None
    fwd = fo.activation_fwd_fp8(x, activation, s, fp8_dtype, amax_fwd, with_t, row_multiple)
    bwd = fo.activation_bwd_fp8(dy, x, activation, s, fp8_dtype, amax_bwd, with_t, with_dbias,
                                row_multiple)
    check_padding(*fwd, rows, row_multiple, with_t)
    check_padding(*bwd[:2], rows, row_multiple, with_t)
    assert fwd[0].shape[1] == shape[1] and bwd[0].shape[1] == in_cols
    dbias = bwd[2]
    if with_dbias:
        assert dbias.shape == (in_cols,) and dbias.dtype == dtype
        dx64 = ref.activation_grad_reference(dy.cpu(), x.cpu(), activation).double()
        assert_close(dbias, dx64.sum(0).to(dtype), "dbias", rtol=TOL[dtype]["rtol"],
                     atol=TOL[dtype]["atol"] * rows ** 0.5)
    else:
        assert dbias.shape == (0,) and dbias.dtype == dtype

    if device == "cpu":
        ref_fwd_amax = scalar(0.5) if use_amax else None
        ref_bwd_amax = scalar(0.5) if use_amax else None
        exp_fwd = ref.activation_fwd_fp8_reference(x, activation, s, fp8_dtype, ref_fwd_amax,
                                                   with_t, row_multiple)
        exp_bwd = ref.activation_bwd_fp8_reference(dy, x, activation, s, fp8_dtype,
                                                   ref_bwd_amax, with_t, with_dbias,
                                                   row_multiple)
        for name, out, exp in zip(("y_fp8", "y_t_fp8", "dx_fp8", "dx_t_fp8", "dbias"),
                                  (*fwd, *bwd), (*exp_fwd, *exp_bwd)):
            assert_bitwise_equal(out, exp, name)
        if use_amax:
            assert_bitwise_equal(amax_fwd, ref_fwd_amax, "forward amax")
            assert_bitwise_equal(amax_bwd, ref_bwd_amax, "backward amax")
    else:
        cpu_fwd_amax = scalar(0.5) if use_amax else None
        cpu_bwd_amax = scalar(0.5) if use_amax else None
        cpu_fwd = fo.activation_fwd_fp8(x.cpu(), activation, s.cpu(), fp8_dtype, cpu_fwd_amax,
                                        with_t, row_multiple)
        cpu_bwd = fo.activation_bwd_fp8(dy.cpu(), x.cpu(), activation, s.cpu(), fp8_dtype,
                                        cpu_bwd_amax, with_t, with_dbias, row_multiple)
        for name, out, exp in zip(("y_fp8", "y_t_fp8", "dx_fp8", "dx_t_fp8"),
                                  (*fwd, *bwd[:2]), (*cpu_fwd, *cpu_bwd[:2])):
            if out.numel():
                assert_fp8_close(out, exp, f"{name} CUDA vs CPU")
        if with_dbias:
            assert_close(dbias, cpu_bwd[2], "dbias CUDA vs CPU", rtol=TOL[dtype]["rtol"],
                         atol=TOL[dtype]["atol"] * rows ** 0.5)
        if use_amax:
            assert_close(amax_fwd, cpu_fwd_amax, "forward amax CUDA vs CPU", rtol=1e-5, atol=0)
            assert_close(amax_bwd, cpu_bwd_amax, "backward amax CUDA vs CPU", rtol=1e-5, atol=0)


# ----------------------------------------------------------------------------- cast_transpose_dbias

SPECIALS = [0.0, -0.0, 1e-30, -1e-30, 1e30, -1e30, float("inf"), float("-inf"), float("nan")]


def with_specials(gen, x: torch.Tensor, count=3) -> torch.Tensor:
    x = x.clone()
    flat = x.view(-1)
    for v in SPECIALS:
        flat[torch.randint(0, flat.numel(), (count,), generator=gen)] = v
    return x


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("dtype", HP_DTYPES)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("row_multiple", [1, 16])
def test_cast_transpose_dbias(device, gen, dtype, fp8_dtype, shape, row_multiple):
    rows, cols = shape
    x = make_x(gen, rows, cols, dtype, device, contiguous=row_multiple == 1, scale=100.0)
    s = scalar(0.37, device)
    amax = scalar(0.5, device)
    x_fp8, x_t, dbias = fo.cast_transpose_dbias(x, s, fp8_dtype, amax, row_multiple)
    check_padding(x_fp8, x_t, rows, row_multiple, True)
    ref_amax = scalar(0.5)
    expected = ref.cast_transpose_dbias_reference(x.cpu(), s.cpu(), fp8_dtype, ref_amax,
                                                  row_multiple)
    # A plain cast: bit for bit on every device.
    assert_bitwise_equal(x_fp8.cpu(), expected[0], "x_fp8")
    assert_bitwise_equal(x_t.cpu(), expected[1], "x_t_fp8")
    assert_bitwise_equal(amax.cpu(), ref_amax, "amax")
    if device == "cpu":
        assert_bitwise_equal(dbias, expected[2], "dbias")
    x64 = x.cpu().double()
    assert_close(dbias, x64.sum(0).to(dtype), "dbias", rtol=TOL[dtype]["rtol"],
                 atol=TOL[dtype]["atol"] * 100 * rows ** 0.5)


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("shape", [(300, 136), (257, 129), (129, 1000), (256, 384), (1000, 3)])
@pytest.mark.parametrize("row_multiple", [1, 16])
def test_transpose_across_tiles(device, gen, shape, row_multiple):
    """The FP8 transpose of the fused operators over several 128 x 128 tiles in both
    directions, with partial edge tiles, rows a multiple of 16 or not (16-byte or byte stores
    of the transpose) and columns a multiple of 8 or not (8-byte or byte loads): bit for bit."""
    rows, cols = shape
    x = make_x(gen, rows, cols, torch.bfloat16, device, scale=100.0)
    x_fp8, x_t, _ = fo.cast_transpose_dbias(x, scalar(0.37, device), E4M3, None, row_multiple)
    check_padding(x_fp8, x_t, rows, row_multiple, True)
    assert_bitwise_equal(x_t.cpu(), x_fp8.cpu().t().contiguous(), "x_t_fp8")


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("dtype", HP_DTYPES)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_edge_values(device, gen, dtype, fp8_dtype):
    """0, tiny, huge, +-inf and NaN through cast_transpose_dbias and relu (bit for bit on every
    device: no transcendental), and through silu / the norms (NaN positions)."""
    rows, cols = 37, 40
    x = with_specials(gen, randn(gen, rows, cols, scale=50.0)).to(dtype)
    s = scalar(2.0, device)
    amax = scalar(0.0, device)
    out = fo.cast_transpose_dbias(x.to(device), s, fp8_dtype, amax, 16)
    expected = ref.cast_transpose_dbias_reference(x, s.cpu(), fp8_dtype, None, 16)
    assert_bitwise_equal(out[0].cpu(), expected[0], "x_fp8")
    assert_bitwise_equal(out[1].cpu(), expected[1], "x_t_fp8")
    assert torch.isnan(amax).item(), "a NaN in x must make the amax NaN"
    assert torch.equal(torch.isnan(out[2].cpu().float()), torch.isnan(expected[2].float()))

    relu_amax = scalar(0.0, device)
    y_fp8, _ = fo.activation_fwd_fp8(x.to(device), "relu", s, fp8_dtype, relu_amax, False, 1)
    assert_bitwise_equal(y_fp8.cpu(), ref.activation_fwd_fp8_reference(x, "relu", s.cpu(),
                                                                       fp8_dtype)[0], "relu")
    assert torch.isnan(relu_amax).item()
    fp8_max = ref.FP8_MAX[fp8_dtype]
    y32 = y_fp8.cpu().float()
    assert (y32[x.float() == float("inf")] == fp8_max).all()

    silu, _ = fo.activation_fwd_fp8(x.to(device), "silu", s, fp8_dtype, None, False, 1)
    assert torch.equal(torch.isnan(silu.cpu().float()),
                       torch.isnan(ref.activation_reference(x, "silu")))
    w = torch.ones(cols, dtype=dtype, device=device)
    ln_amax = scalar(0.0, device)
    y_fp8, _, _, _, _ = fo.layernorm_fwd_fp8(x.to(device), w, None, 1e-5, False, s, fp8_dtype,
                                             ln_amax, False, False, 1)
    bad_rows = ~torch.isfinite(x.float()).all(dim=1)
    assert torch.isnan(y_fp8.cpu().float()[bad_rows]).all(), "rows with inf / NaN become NaN"
    assert not torch.isnan(y_fp8.cpu().float()[~bad_rows]).any()
    assert torch.isnan(ln_amax).item()


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("amax_before", [float("nan"), 3.0])
def test_amax_nan_propagates(device, gen, amax_before):
    """A NaN in the slot stays NaN; a NaN in one row of x makes the slot NaN."""
    x = randn(gen, 5, 16, device=device)
    w = torch.ones(16, device=device)
    s = scalar(1.0, device)
    slot = scalar(amax_before, device)
    fo.rmsnorm_fwd_fp8(x, w, 1e-6, False, s, E4M3, slot, False, False, 16)
    if math.isnan(amax_before):
        assert torch.isnan(slot).item()
    else:
        assert slot.item() >= 3.0
        x[2, 3] = float("nan")
        fo.activation_bwd_fp8(torch.ones(5, 8, device=device), x, "swiglu", s, E5M2, slot,
                              True, True, 16)
        assert torch.isnan(slot).item()


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("row_multiple", [1, 16])
def test_empty_rows(device, row_multiple):
    """M = 0: empty outputs of the right shapes, amax unchanged."""
    x = torch.empty(0, 24, device=device, dtype=torch.bfloat16)
    w = torch.ones(24, device=device)
    s = scalar(1.0, device)
    slot = scalar(-1.0, device)  # any write (even of a zero) would show
    y_fp8, y_t, y_hp, mean, rstd = fo.layernorm_fwd_fp8(x, w, w, 1e-5, False, s, E4M3, slot,
                                                        True, True, row_multiple)
    assert y_fp8.shape == (0, 24) and y_t.shape == (24, 0) and y_hp.shape == (0, 24)
    assert mean.shape == (0,) and rstd.shape == (0,)
    y_fp8, y_t, _, rstd = fo.rmsnorm_fwd_fp8(x, w, 1e-5, True, s, E4M3, slot, True, False,
                                             row_multiple)
    assert y_fp8.shape == (0, 24) and rstd.shape == (0,)
    dx, dw, db = fo.layernorm_bwd(x, x, mean, rstd, w, False)
    assert dx.shape == (0, 24) and (dw == 0).all() and (db == 0).all()
    dx, dw = fo.rmsnorm_bwd(x, x, rstd, w, False)
    assert dx.shape == (0, 24) and (dw == 0).all()
    y_fp8, y_t = fo.activation_fwd_fp8(x, "geglu", s, E4M3, slot, True, row_multiple)
    assert y_fp8.shape == (0, 12) and y_t.shape == (12, 0)
    dx_fp8, dx_t, dbias = fo.activation_bwd_fp8(torch.empty(0, 12, device=device,
                                                            dtype=torch.bfloat16),
                                                x, "reglu", s, E5M2, slot, True, True,
                                                row_multiple)
    assert dx_fp8.shape == (0, 24) and dx_t.shape == (24, 0) and (dbias == 0).all()
    x_fp8, x_t, dbias = fo.cast_transpose_dbias(x, s, E4M3, slot, row_multiple)
    assert x_fp8.shape == (0, 24) and x_t.shape == (24, 0) and dbias.shape == (24,)
    assert fo.activation_fwd(x, "gelu").shape == (0, 24)
    assert slot.item() == -1.0


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_padding_rows_are_zero_and_outside_amax(device, gen):
    """17 rows padded to 32: rows 17..31 are zero bytes in y_fp8 and zero columns in y_t_fp8,
    and the amax is the one of the 17 real rows."""
    x = make_x(gen, 17, 48, torch.bfloat16, device)
    w = torch.ones(48, device=device)
    slot = scalar(0.0, device)
    y_fp8, y_t, _, _, _ = fo.layernorm_fwd_fp8(x, w, None, 1e-5, False, scalar(8.0, device),
                                                  E4M3, slot, True, True, 32)
    assert y_fp8.shape == (32, 48) and y_t.shape == (48, 32)
    assert (codes(y_fp8[17:]) == 0).all() and (codes(y_t[:, 17:]) == 0).all()
    y32 = ref.layernorm_reference(x.cpu(), w.cpu(), None, 1e-5)[0]
    assert_close(slot, y32.abs().max().reshape(1), "amax", rtol=1e-5, atol=0)


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("offset", [1, 2, 4])
def test_misaligned_contiguous_input(device, gen, offset):
    """A contiguous x that starts `offset` elements into its storage: the CUDA kernels fall back
    to one-element accesses unless the start stays 4-element aligned; same results."""
    rows, cols = 9, 64
    storage = randn(gen, offset + rows * cols, dtype=torch.bfloat16, scale=2.0, device=device)
    x = storage[offset:].view(rows, cols)
    assert x.is_contiguous()
    w = torch.ones(cols, device=device)
    s = scalar(8.0, device)
    expected_x = x.cpu().clone()  # aligned, on the CPU
    y_fp8, y_t, y_hp, _, _ = fo.layernorm_fwd_fp8(x, w, None, 1e-5, False, s, E4M3, None, True,
                                                  True, 16)
    cpu = fo.layernorm_fwd_fp8(expected_x, w.cpu(), None, 1e-5, False, s.cpu(), E4M3, None,
                               True, True, 16)
    assert_fp8_close(y_fp8, cpu[0], "layernorm y_fp8")
    assert_fp8_close(y_t, cpu[1], "layernorm y_t_fp8")
    assert_close(y_hp, cpu[2], "layernorm y_hp", **TOL[torch.bfloat16])
    for activation in ("swiglu", "gelu"):
        out = fo.activation_fwd_fp8(x, activation, s, E5M2, None, True, 16)
        exp = fo.activation_fwd_fp8(expected_x, activation, s.cpu(), E5M2, None, True, 16)
        assert_fp8_close(out[0], exp[0], f"{activation} y_fp8")
        dy = torch.ones_like(fo.activation_fwd(x, activation))
        dx = fo.activation_bwd(dy, x, activation)
        assert_close(dx, fo.activation_bwd(dy.cpu(), expected_x, activation), f"{activation} dx",
                     **TOL[torch.bfloat16])


# ----------------------------------------------------------------------------- argument errors

def error_cases(device):
    x = torch.randn(4, 8, device=device)
    w = torch.ones(8, device=device)
    s = scalar(1.0, device)
    rstd = torch.ones(4, device=device)
    i32 = torch.ones(4, 8, dtype=torch.int32, device=device)
    return [
        (lambda: fo.activation_fwd(x, "tanh"), r"'activation' must be one of .*got \"tanh\""),
        (lambda: fo.activation_fwd(torch.randn(4, 7, device=device), "swiglu"),
         r"'x' of a gated activation must have an even last dimension"),
        (lambda: fo.activation_fwd(i32, "relu"), r"'x' must be float32, bfloat16 or float16"),
        (lambda: fo.activation_fwd(torch.randn(8, device=device), "relu"),
         r"'x' of activation_fwd must be a 2-D tensor"),
        (lambda: fo.activation_bwd(torch.randn(4, 8, device=device), x, "swiglu"),
         r"'dy' must have shape \[4, 4\]"),
        (lambda: fo.activation_bwd(x.half(), x, "gelu"), r"'dy' must have the dtype of 'x'"),
        (lambda: fo.activation_fwd_fp8(x, "gelu", torch.ones(2, device=device), E4M3),
         r"'scale' must be a 1-element float32 tensor"),
        (lambda: fo.activation_fwd_fp8(x, "gelu", s.double(), E4M3),
         r"'scale' must be a 1-element float32 tensor"),
        (lambda: fo.activation_fwd_fp8(x, "gelu", s, torch.bfloat16),
         r"'fp8_dtype' must be torch.float8_e4m3fn or torch.float8_e5m2"),
        (lambda: fo.activation_bwd_fp8(x, x, "relu", s, E4M3, row_multiple=0),
         r"'row_multiple' must be an integer in \[1, 65536\], got 0"),
        (lambda: fo.cast_transpose_dbias(x, s, E4M3, torch.zeros(1, 1, 2, device=device)),
         r"'amax' must be a 1-element float32 tensor"),
        (lambda: fo.layernorm_fwd(x, torch.ones(7, device=device), None, 1e-5),
         r"'weight' must have shape \[8\]"),
        (lambda: fo.layernorm_fwd(x, w, torch.ones(8, 1, device=device), 1e-5),
         r"'bias' must have shape \[8\]"),
        (lambda: fo.layernorm_fwd(x, w.int(), None, 1e-5),
         r"'weight' must be float32, bfloat16 or float16"),
        (lambda: fo.rmsnorm_fwd(x, w, -1e-5), r"'eps' must be finite and >= 0, got -1e-05"),
        (lambda: fo.rmsnorm_fwd_fp8(x, w, 1e-5, False, s, E4M3, None, False, False, -3),
         r"'row_multiple' must be an integer in \[1, 65536\], got -3"),
        (lambda: fo.layernorm_fwd_fp8(x, w, None, float("nan"), False, s, E4M3),
         r"'eps' must be finite"),
        (lambda: fo.rmsnorm_bwd(x, x, torch.ones(3, device=device), w),
         r"'rstd' must be a float32 tensor of shape \[4\]"),
        (lambda: fo.layernorm_bwd(x, x, rstd.double(), rstd, w),
         r"'mean' must be a float32 tensor of shape \[4\]"),
        (lambda: fo.layernorm_bwd(x[:, :4], x, rstd, rstd, w), r"'dy' must have shape \[4, 8\]"),
        (lambda: fo.rmsnorm_bwd(x, x, rstd, torch.ones(9, device=device)),
         r"'weight' must have shape \[8\]"),
    ]


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("case", range(len(error_cases("cpu"))))
def test_argument_errors(device, case):
    call, message = error_cases(device)[case]
    with pytest.raises(RuntimeError, match=message):
        call()


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_scale_on_another_device(device):
    if device == "cpu":
        pytest.skip("needs a second device type")
    x = torch.randn(4, 8, device=device)
    with pytest.raises(RuntimeError, match=r"'scale' must be on the same device as 'x'"):
        fo.activation_fwd_fp8(x, "relu", scalar(1.0), E4M3)


# ----------------------------------------------------------------------------- opcheck

def op_cases(gen, device):
    x = randn(gen, 24, 40, dtype=torch.bfloat16, scale=3.0, device=device)
    w = randn(gen, 40, device=device) + 1.0
    b = randn(gen, 40, dtype=torch.bfloat16, device=device)
    s = scalar(4.0, device)
    dy = randn(gen, 24, 40, dtype=torch.bfloat16, device=device)
    dy_gated = randn(gen, 24, 20, dtype=torch.bfloat16, device=device)
    _, mean, rstd = OPS.layernorm_fwd(x, w, b, 1e-5, False)
    _, rms_rstd = OPS.rmsnorm_fwd(x, w, 1e-5, False)
    def slot():
        return scalar(0.5, device)

    return [
        ("layernorm_fwd", OPS.layernorm_fwd.default, (x, w, b, 1e-5, False)),
        ("layernorm_fwd_no_bias", OPS.layernorm_fwd.default, (x, w, None, 1e-5, True)),
        ("layernorm_fwd_fp8", OPS.layernorm_fwd_fp8.default,
         (x, w, b, 1e-5, False, s, E4M3, slot(), True, True, 16)),
        ("layernorm_fwd_fp8_bare", OPS.layernorm_fwd_fp8.default,
         (x, w, None, 1e-5, True, s, E5M2, None, False, False, 1)),
        ("layernorm_bwd", OPS.layernorm_bwd.default, (dy, x, mean, rstd, w, False)),
        ("rmsnorm_fwd", OPS.rmsnorm_fwd.default, (x, w, 1e-5, False)),
        ("rmsnorm_fwd_fp8", OPS.rmsnorm_fwd_fp8.default,
         (x, w, 1e-5, True, s, E4M3, slot(), True, False, 16)),
        ("rmsnorm_bwd", OPS.rmsnorm_bwd.default, (dy, x, rms_rstd, w, True)),
        ("activation_fwd", OPS.activation_fwd.default, (x, "gelu")),
        ("activation_fwd_gated", OPS.activation_fwd.default, (x, "swiglu")),
        ("activation_fwd_fp8", OPS.activation_fwd_fp8.default,
         (x, "geglu", s, E4M3, slot(), True, 16)),
        ("activation_bwd", OPS.activation_bwd.default, (dy, x, "silu")),
        ("activation_bwd_gated", OPS.activation_bwd.default, (dy_gated, x, "reglu")),
        ("activation_bwd_fp8", OPS.activation_bwd_fp8.default,
         (dy_gated, x, "swiglu", s, E5M2, slot(), True, True, 16)),
        ("activation_bwd_fp8_bare", OPS.activation_bwd_fp8.default,
         (dy, x, "relu", s, E4M3, None, False, False, 1)),
        ("cast_transpose_dbias", OPS.cast_transpose_dbias.default, (x, s, E4M3, slot(), 16)),
        ("cast_transpose_dbias_no_amax", OPS.cast_transpose_dbias.default,
         (x.float(), s, E5M2, None, 1)),
    ]


OPCHECK_CASES = [c[0] for c in op_cases(torch.Generator().manual_seed(0), "cpu")]


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("case", OPCHECK_CASES)
def test_opcheck(device, gen, case):
    _, op, args = next(c for c in op_cases(gen, device) if c[0] == case)
    torch.library.opcheck(op, args)


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("dynamic", [False, True])
def test_torch_compile(device, gen, dynamic):
    """A LayerNorm -> gelu chain with in-place amax slots and padded rows traces into one graph
    (fake kernels give the shapes, symbolic ones with dynamic=True) and matches eager."""
    w = (randn(gen, 64) + 1.0).to(device)
    s = scalar(8.0, device)

    def chain(x, w, s, amax):
        y_fp8, y_t, y_hp, mean, rstd = fo.layernorm_fwd_fp8(x, w, None, 1e-5, False, s, E4M3,
                                                            amax, True, True, 16)
        h_fp8, h_t = fo.activation_fwd_fp8(y_hp, "swiglu", s, E5M2, amax, True, 16)
        return y_fp8, y_t, h_fp8, h_t, mean, rstd

    compiled = torch.compile(chain, fullgraph=True, backend="aot_eager", dynamic=dynamic)
    for rows in (24, 37):
        x = randn(gen, rows, 64, dtype=torch.bfloat16, scale=2.0, device=device)
        eager_amax, compiled_amax = scalar(0.0, device), scalar(0.0, device)
        expected = chain(x, w, s, eager_amax)
        got = compiled(x, w, s, compiled_amax)
        for i, (g, e) in enumerate(zip(got, expected)):
            assert_bitwise_equal(g, e, f"output {i}")
        assert_bitwise_equal(compiled_amax, eager_amax, "amax updated in the compiled graph")


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
def test_norm_with_negative_zero_weight_keeps_the_sign(device, gen, norm):
    """A weight of -0.0 (not zero-centred): y = xhat * -0.0 is a zero whose sign is xhat's
    opposite, on every device as on the CPU (the CUDA kernel added gamma_shift 0.0 to the
    weight, which turned -0.0 into +0.0: FP8 byte 0x00 where the CPU writes 0x80)."""
    rows, cols = 5, 64
    x = make_x(gen, rows, cols, torch.float32, device)
    w = torch.full((cols,), -0.0, device=device)
    s = scalar(4.0, device)
    got = norm_fwd_fp8(norm, x, w, None, 1e-5, False, s, E4M3, None, True, True, 16)
    cpu = norm_fwd_fp8(norm, x.cpu(), w.cpu(), None, 1e-5, False, s.cpu(), E4M3, None, True,
                       True, 16)
    assert torch.equal(torch.signbit(got[2]).cpu(), torch.signbit(cpu[2]))
    assert torch.signbit(cpu[2]).any() and (~torch.signbit(cpu[2])).any()
    assert_bitwise_equal(got[0], cpu[0], "y_fp8 bytes")
    assert_bitwise_equal(got[1], cpu[1], "y_t_fp8 bytes")
