"""Refused inputs: the error names the argument and what was expected, and a refused call
modifies nothing in place."""
from __future__ import annotations

import pytest
import torch
from conftest import CUDA_SKIP, assert_bitwise_equal, rand_positive, randn, scalar

from transformer_fp8 import ops

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
MAX_ALGO = lambda window: window.amax(0)  # noqa: E731  (a callable: the Python path)


def fp8(gen, *shape, dtype=E4M3):
    return ops.cast_to_fp8(randn(gen, *shape, scale=10.0), scalar(1.0), dtype)


def recorded_history(gen, L, n):
    """A history whose row 0 is non-zero everywhere, so a call that ran would change it."""
    return rand_positive(gen, L, n)


def scaling_lists(gen, shapes=((4, 3), (2, 2), (8, 5))):
    hs = [recorded_history(gen, L, n) for L, n in shapes]
    ss = [rand_positive(gen, n) for _, n in shapes]
    return hs, ss, [1.0 / s for s in ss], [448.0] * len(shapes)


# ----------------------------------------------------------------------------- messages

def cast_cases(gen):
    x, s = randn(gen, 4, 6), scalar(2.0)
    return {
        "x_int32": (lambda: ops.cast_to_fp8(x.int(), s, E4M3),
                    r"'x' must be float32, bfloat16 or float16, got Int"),
        "x_float64": (lambda: ops.cast_to_fp8(x.double(), s, E4M3),
                      r"'x' must be float32, bfloat16 or float16, got Double"),
        "scale_2_elements": (lambda: ops.cast_to_fp8(x, torch.ones(2), E4M3),
                             r"'scale' must be a 1-element float32 tensor, got .*shape \[2\]"),
        "scale_float64": (lambda: ops.cast_to_fp8(x, s.double(), E4M3),
                          r"'scale' must be a 1-element float32 tensor, got Double"),
        "amax_float16": (lambda: ops.cast_to_fp8(x, s, E4M3, torch.zeros(1).half()),
                         r"'amax' must be a 1-element float32 tensor, got Half"),
        "amax_2_elements": (lambda: ops.cast_to_fp8(x, s, E4M3, torch.zeros(2)),
                            r"'amax' must be a 1-element float32 tensor"),
        "fp8_dtype_float32": (lambda: ops.cast_to_fp8(x, s, torch.float32),
                              r"'fp8_dtype' must be torch.float8_e4m3fn or torch.float8_e5m2"),
        "fp8_dtype_fnuz": (lambda: ops.cast_to_fp8(x, s, torch.float8_e4m3fnuz),
                           r"'fp8_dtype' must be torch.float8_e4m3fn or torch.float8_e5m2"),
        "transpose_3d": (lambda: ops.cast_transpose_to_fp8(x.view(2, 2, 6), s, E4M3),
                         r"'x' of cast_transpose_to_fp8 must be 2-D, got .*\[2, 2, 6\]"),
        "transpose_x_int": (lambda: ops.cast_transpose_to_fp8(x.int(), s, E4M3),
                            r"'x' must be float32, bfloat16 or float16"),
        "amax_op_int64": (lambda: ops.amax(x.long()), r"'x' must be float32, bfloat16 or float16"),
        "from_fp8_float_input": (lambda: ops.cast_from_fp8(x, s, torch.float32),
                                 r"'x_fp8' must be a float8_e4m3fn or float8_e5m2 tensor"),
        "from_fp8_bad_dtype": (lambda: ops.cast_from_fp8(fp8(gen, 3), s, torch.float64),
                               r"'dtype' must be torch.float32, torch.bfloat16 or torch.float16"),
        "from_fp8_scale_inv": (lambda: ops.cast_from_fp8(fp8(gen, 3), torch.ones(3), torch.float32),
                               r"'scale_inv' must be a 1-element float32 tensor"),
    }


def gemm_cases(gen):
    a, b, s = fp8(gen, 16, 32), fp8(gen, 16, 32), scalar(0.5)
    return {
        "a_not_fp8": (lambda: ops.fp8_gemm(a.float(), s, b, s, torch.float32),
                      r"'a' must be a float8_e4m3fn or float8_e5m2 tensor"),
        "b_3d": (lambda: ops.fp8_gemm(a, s, b.view(2, 8, 32), s, torch.float32),
                 r"2-D 'a' \[M, K\] and 'b' \[N, K\]"),
        "a_scale_inv_float64": (lambda: ops.fp8_gemm(a, s.double(), b, s, torch.float32),
                                r"'a_scale_inv' must be a 1-element float32 tensor"),
        "b_scale_inv_2_elements": (lambda: ops.fp8_gemm(a, s, b, torch.ones(2), torch.float32),
                                   r"'b_scale_inv' must be a 1-element float32 tensor"),
        "out_dtype_fp8": (lambda: ops.fp8_gemm(a, s, b, s, E4M3), r"'out_dtype' must be"),
        "bias_wrong_dtype": (lambda: ops.fp8_gemm(a, s, b, s, torch.bfloat16, torch.zeros(16)),
                             r"'bias' must be a 1-D BFloat16 tensor of length N = 16"),
        "bias_wrong_length": (lambda: ops.fp8_gemm(a, s, b, s, torch.float32, torch.zeros(15)),
                              r"'bias' must be a 1-D Float tensor of length N = 16"),
    }


def scaling_cases(gen):
    hs, ss, sis, maxes = scaling_lists(gen)
    h_nc = hs[1].t().contiguous().t()
    negative_third = [448.0, 448.0, -448.0]
    return {
        "length_mismatch": (lambda: ops.update_delayed_scaling(hs, ss[:2], sis, maxes),
                            r"must have the same length, got 3, 2, 3 and 3"),
        "length_mismatch_python": (
            lambda: ops.update_delayed_scaling(hs, ss[:2], sis, maxes, amax_compute_algo=MAX_ALGO),
            r"must have the same length, got 3, 2, 3 and 3"),
        "empty_lists": (lambda: ops.update_delayed_scaling([], [], [], []),
                        r"'?amax_histories'? must be a non-empty list"),
        "empty_lists_python": (
            lambda: ops.update_delayed_scaling([], [], [], [], amax_compute_algo=MAX_ALGO),
            r"amax_histories must be a non-empty list"),
        "scale_shape": (lambda: ops.update_delayed_scaling(hs, [ss[0], torch.ones(3), ss[2]], sis,
                                                           maxes),
                        r"'scales\[1\]' must be a contiguous float32 tensor of shape \[2\]"),
        "scale_inv_shape_2d": (lambda: ops.update_delayed_scaling(hs, ss, [sis[0][None], *sis[1:]],
                                                                  maxes),
                               r"'scale_invs\[0\]' must be a contiguous float32 tensor of shape"),
        "history_non_contiguous": (
            lambda: ops.update_delayed_scaling([hs[0], h_nc, hs[2]], ss, sis, maxes),
            r"'amax_histories\[1\]' must be a contiguous float32 tensor of shape \[L >= 1, n\]"),
        "history_1d": (lambda: ops.update_delayed_scaling([hs[0][0], *hs[1:]], ss, sis, maxes),
                       r"'amax_histories\[0\]' must be .*\[L >= 1, n\]"),
        "history_float64": (lambda: ops.update_delayed_scaling([hs[0].double(), *hs[1:]], ss, sis,
                                                               maxes),
                            r"'amax_histories\[0\]' must be a contiguous float32 tensor"),
        "margin_negative": (lambda: ops.update_delayed_scaling(hs, ss, sis, maxes, margin=-1),
                            r"margin must be an integer in \[0, 1000\], got -1"),
        "margin_negative_raw_op": (
            lambda: torch.ops.transformer_fp8.update_delayed_scaling(hs, ss, sis, maxes, -1, "max"),
            r"'margin' must be an integer in \[0, 1000\], got -1"),
        "algo_mean": (lambda: ops.update_delayed_scaling(hs, ss, sis, maxes,
                                                         amax_compute_algo="mean"),
                      r"'amax_compute_algo' must be \"max\" or \"most_recent\", got \"mean\""),
        "algo_mean_python": (
            lambda: ops.update_delayed_scaling(hs, ss, sis, maxes, amax_compute_algo="mean",
                                               scaling_factor_compute_algo=lambda *a: a[1]),
            r"amax_compute_algo must be 'max', 'most_recent' or a callable, got 'mean'"),
        "fp8_max_negative": (lambda: ops.update_delayed_scaling(hs, ss, sis, negative_third),
                             r"'fp8_maxes\[2\]' must be finite and positive, got -448"),
        "fp8_max_zero": (lambda: ops.update_delayed_scaling(hs, ss, sis, [0.0, 448.0, 448.0]),
                         r"'fp8_maxes\[0\]' must be finite and positive"),
        "fp8_max_nan": (lambda: ops.update_delayed_scaling(hs, ss, sis, [448.0, float("nan"),
                                                                         448.0]),
                        r"'fp8_maxes\[1\]' must be finite and positive"),
        "fp8_max_negative_python": (
            lambda: ops.update_delayed_scaling(hs, ss, sis, negative_third,
                                               amax_compute_algo=MAX_ALGO),
            r"fp8_maxes\[2\].* must be finite and positive"),
        "same_history_twice": (
            lambda: ops.update_delayed_scaling([hs[0], hs[0]], [ss[0], ss[0].clone()],
                                               [sis[0], sis[0].clone()], maxes[:2]),
            r"shares memory with"),
        "compute_scale_amax_float16": (
            lambda: ops.compute_scale_from_amax(ss[0].half(), 448.0),
            r"'amax' must be a float32 tensor, got Half"),
        "compute_scale_fp8_max_negative": (lambda: ops.compute_scale_from_amax(ss[0], -448.0),
                                           r"'fp8_max' must be finite and positive, got -448"),
        "compute_scale_fp8_max_inf": (lambda: ops.compute_scale_from_amax(ss[0], float("inf")),
                                      r"'fp8_max' must be finite and positive"),
        "compute_scale_margin_negative": (lambda: ops.compute_scale_from_amax(ss[0], 448.0, -3),
                                          r"margin must be an integer in \[0, 1000\], got -3"),
        "compute_scale_margin_raw_op": (
            lambda: torch.ops.transformer_fp8.compute_scale_from_amax(ss[0], 448.0, 1001),
            r"'margin' must be an integer in \[0, 1000\], got 1001"),
    }


# Case name -> the builder that makes it (builders take the test's generator).
CASES = {name: builder for builder in (cast_cases, gemm_cases, scaling_cases)
         for name in builder(torch.Generator())}


@pytest.mark.parametrize("case", sorted(CASES))
def test_error_message(gen, case):
    call, message = CASES[case](gen)[case]
    with pytest.raises((RuntimeError, ValueError), match=message):
        call()


# ----------------------------------------------------------------------------- nothing modified

def bad_third(gen, kind: str):
    """Valid tensors 0 and 1 (row 0 recorded, so a run would change them), a bad tensor 2."""
    hs, ss, sis, maxes = scaling_lists(gen)
    kwargs = {}
    if kind == "scale_shape":
        ss[2] = torch.ones(4)
    elif kind == "history_dtype":
        hs[2] = hs[2].double()
    elif kind == "history_non_contiguous":
        hs[2] = hs[2].t().contiguous().t()
    elif kind == "scale_inv_dtype":
        sis[2] = sis[2].half()
    elif kind == "fp8_max_negative":
        maxes[2] = -1.0
    elif kind == "algo_string":
        kwargs["amax_compute_algo"] = "median"
    elif kind == "scale_shape_python":
        ss[2], kwargs["amax_compute_algo"] = torch.ones(4), MAX_ALGO
    elif kind == "fp8_max_negative_python":
        maxes[2], kwargs["amax_compute_algo"] = -1.0, MAX_ALGO
    return hs, ss, sis, maxes, kwargs


@pytest.mark.parametrize("kind", ["scale_shape", "history_dtype", "history_non_contiguous",
                                  "scale_inv_dtype", "fp8_max_negative", "algo_string",
                                  "scale_shape_python", "fp8_max_negative_python"])
def test_refused_update_modifies_nothing(gen, kind):
    hs, ss, sis, maxes, kwargs = bad_third(gen, kind)
    before = [t.clone() for t in (*hs, *ss, *sis)]
    with pytest.raises((RuntimeError, ValueError)):
        ops.update_delayed_scaling(hs, ss, sis, maxes, **kwargs)
    for t, b in zip((*hs, *ss, *sis), before):
        assert_bitwise_equal(t, b, "modified by a refused call")


@pytest.mark.parametrize("call", [
    lambda x, amax: ops.cast_to_fp8(x, torch.ones(2), E4M3, amax),
    lambda x, amax: ops.cast_to_fp8(x, scalar(1.0).double(), E4M3, amax),
    lambda x, amax: ops.cast_to_fp8(x, scalar(1.0), torch.float16, amax),
    lambda x, amax: ops.cast_transpose_to_fp8(x.view(2, 3, 10), scalar(1.0), E5M2, amax),
    lambda x, amax: ops.cast_transpose_to_fp8(x, torch.ones(1, 2), E5M2, amax),
], ids=["scale_2_elements", "scale_float64", "fp8_dtype_float16", "transpose_3d",
        "transpose_bad_scale"])
def test_refused_cast_leaves_amax(gen, call):
    x = randn(gen, 6, 10, scale=100.0)
    amax = scalar(0.125)
    with pytest.raises(RuntimeError):
        call(x, amax)
    assert amax.item() == 0.125


# ----------------------------------------------------------------------------- devices

def cuda_mismatch_cases(gen):
    x, s = randn(gen, 16, 32, device="cuda"), scalar(1.0, "cuda")
    a = ops.cast_to_fp8(x, s, E4M3)
    hs, ss, sis, maxes = scaling_lists(gen)
    hs_mixed = [hs[0].cuda(), hs[1].cuda(), hs[2]]
    return {
        "scale_on_cpu": (lambda: ops.cast_to_fp8(x, s.cpu(), E4M3),
                         r"'scale' must be on the same device as 'x'"),
        "amax_on_cpu": (lambda: ops.cast_to_fp8(x, s, E4M3, scalar(0.0)),
                        r"'amax' must be on the same device as 'x'"),
        "x_on_cpu_scale_on_cuda": (lambda: ops.cast_to_fp8(x.cpu(), s, E4M3),
                                   r"'scale' must be on the same device as 'x'"),
        "scale_inv_on_cpu": (lambda: ops.cast_from_fp8(a, s.cpu(), torch.float32),
                             r"'scale_inv' must be on the same device as 'x_fp8'"),
        "gemm_b_on_cpu": (lambda: ops.fp8_gemm(a, s, a.cpu(), s, torch.float32),
                          r"'b' must be on the same device as 'a'"),
        "gemm_bias_on_cpu": (lambda: ops.fp8_gemm(a, s, a, s, torch.float32, torch.zeros(16)),
                             r"'bias' must be on the same device as 'a'"),
        "histories_mixed": (
            lambda: ops.update_delayed_scaling(hs_mixed, [t.cuda() for t in ss],
                                               [t.cuda() for t in sis], maxes),
            r"must be on cuda.*at index 2"),
    }


@CUDA_SKIP
@pytest.mark.parametrize("case", ["scale_on_cpu", "amax_on_cpu", "x_on_cpu_scale_on_cuda",
                                  "scale_inv_on_cpu", "gemm_b_on_cpu", "gemm_bias_on_cpu",
                                  "histories_mixed"])
def test_device_mismatch(gen, case):
    call, message = cuda_mismatch_cases(gen)[case]
    with pytest.raises(RuntimeError, match=message):
        call()


@CUDA_SKIP
def test_cast_transpose_column_limit():
    """Column tiles of 128 run along gridDim.y (at most 65535 blocks): 8388480 columns at most."""
    s = scalar(1.0, "cuda")
    x = torch.zeros(1, 65535 * 128 + 1, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(RuntimeError, match=r"at most 8388480 columns, got .*\[1, 8388481\]"):
        ops.cast_transpose_to_fp8(x, s, E4M3)
    out, out_t = ops.cast_transpose_to_fp8(x[:, 1:], s, E4M3)
    assert out.shape == (1, 8388480) and out_t.shape == (8388480, 1)
    assert not out.float().any() and not out_t.float().any()


# Every operator that writes an amax slot, called with the slot given: (name, call(amax)).
def _amax_writers(gen, device):
    x = randn(gen, 32, 16, device=device)
    dy = randn(gen, 32, 16, device=device)
    gated = randn(gen, 32, 32, device=device)
    weight, bias = randn(gen, 16, device=device), randn(gen, 16, device=device)
    scale = scalar(2.0, device)
    e4m3 = torch.float8_e4m3fn
    inputs = {"x": x, "dy": dy, "gated": gated, "weight": weight, "bias": bias,
              "scale": scale}
    from transformer_fp8 import fused_ops as fo
    calls = {
        "cast_to_fp8": lambda a: ops.cast_to_fp8(x, scale, e4m3, a),
        "cast_transpose_to_fp8": lambda a: ops.cast_transpose_to_fp8(x, scale, e4m3, a),
        "cast_transpose_dbias": lambda a: fo.cast_transpose_dbias(x, scale, e4m3, a),
        "layernorm_fwd_fp8": lambda a: fo.layernorm_fwd_fp8(x, weight, bias, 1e-5, False,
                                                            scale, e4m3, a),
        "rmsnorm_fwd_fp8": lambda a: fo.rmsnorm_fwd_fp8(x, weight, 1e-5, False, scale,
                                                        e4m3, a),
        "activation_fwd_fp8": lambda a: fo.activation_fwd_fp8(x, "gelu", scale, e4m3, a),
        "activation_bwd_fp8": lambda a: fo.activation_bwd_fp8(dy, x, "gelu", scale, e4m3, a),
    }
    # The arguments a slot could sit inside, per operator.
    shares = {"cast_to_fp8": ("x", "scale"), "cast_transpose_to_fp8": ("x", "scale"),
              "cast_transpose_dbias": ("x", "scale"),
              "layernorm_fwd_fp8": ("x", "scale", "weight", "bias"),
              "rmsnorm_fwd_fp8": ("x", "scale", "weight"),
              "activation_fwd_fp8": ("x", "scale"),
              "activation_bwd_fp8": ("x", "scale", "dy")}
    return calls, shares, inputs


def test_an_amax_slot_inside_an_argument_is_refused(gen, device):
    """The amax slot is written in place: one that shares memory with an argument (a view of
    the input, the scale itself, a weight) is refused naming that argument, and nothing is
    written (it once overwrote x[0] or the scale silently); a negated view is refused by name
    (it once failed inside the dispatcher)."""
    calls, shares, inputs = _amax_writers(gen, device)
    for op, call in calls.items():
        for name in shares[op]:
            before = {k: v.clone() for k, v in inputs.items()}
            slot = inputs[name].reshape(-1)[:1]
            with pytest.raises(RuntimeError, match=f"'amax' is written in place and must not "
                                                   f"share memory with argument '{name}'"):
                call(slot)
            for key, value in inputs.items():
                assert_bitwise_equal(value, before[key], f"{op}: {key} changed")
        negated = torch.zeros(1, dtype=torch.complex64, device=device).conj().imag
        assert negated.is_neg()
        with pytest.raises(ValueError, match="'amax' is written in place and must not be a "
                                             "negated or conjugated view"):
            call(negated)
        call(scalar(0.0, device))  # a slot of its own is taken


@pytest.mark.parametrize("layout", ["transposed_history", "strided_scale", "expanded_history"])
def test_callable_update_refuses_what_the_operator_refuses(gen, layout):
    """A recipe callable runs the update in Python: its checks are the C++ operator's (each
    tensor is rewritten in place, so each must be contiguous), with the argument named, and
    nothing changes (a transposed history or a strided scale was accepted, an expanded
    history failed inside torch)."""
    history = rand_positive(gen, 4, 3)
    scale, scale_inv = rand_positive(gen, 3), rand_positive(gen, 3)
    if layout == "transposed_history":
        history, name = rand_positive(gen, 3, 4).t(), "amax_histories"
    elif layout == "strided_scale":
        scale, name = rand_positive(gen, 6)[::2], "scales"
    else:
        history, name = rand_positive(gen, 1, 3).expand(4, 3), "amax_histories"
    before = [t.clone() for t in (history, scale, scale_inv)]
    for algo in ("max", lambda h: h.amax(0)):
        with pytest.raises((ValueError, RuntimeError), match=rf"{name}\[0\]'? must be a "
                                                             "contiguous float32 tensor"):
            ops.update_delayed_scaling([history], [scale], [scale_inv], [448.0], 0, algo)
    for t, b in zip((history, scale, scale_inv), before):
        assert_bitwise_equal(t, b)
