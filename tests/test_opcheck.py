"""torch.library.opcheck on every operator (schema, autograd registration, fake kernel,
AOT dispatch), and a torch.compile(fullgraph=True) smoke test.

Arguments are positional, in the order of the schemas in csrc/registration.cpp.
"""
from __future__ import annotations

import pytest
import torch
from conftest import DEVICE_PARAMS, assert_bitwise_equal, rand_positive, randn, scalar

from transformer_fp8 import ops

OPS = torch.ops.transformer_fp8
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2

# opcheck's test_schema compares every input before and after the call with torch.allclose,
# which PyTorch does not implement for float8 tensors ("mul_cpu_reduced_float" not implemented
# for 'Float8_e4m3fn'). For the operators that take FP8 inputs it cannot run, so they get the
# other three sub-tests, and test_fp8_input_ops_mutate_nothing checks by hand what test_schema
# would: no FP8 input changes, no output aliases an input.
WITHOUT_SCHEMA = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def fp8(gen, *shape, dtype=E4M3, device="cpu"):
    return ops.cast_to_fp8(randn(gen, *shape, scale=20.0, device=device), scalar(1.0, device),
                           dtype)


def history(gen, L, n, device):
    h = rand_positive(gen, L, n)
    h[0, :: 2] = 0.0  # a mix of recorded and unrecorded columns
    return h.to(device)


def delayed_scaling_args(gen, device):
    shapes = [(4, 3), (1, 2), (16, 1)]
    hs = [history(gen, L, n, device) for L, n in shapes]
    ss = [rand_positive(gen, n).to(device) for _, n in shapes]
    return hs, ss, [1.0 / s for s in ss], [448.0, 57344.0, 448.0]


def op_cases(gen, device):
    """(name, op, args, test_utils or None for all) for every operator."""
    x = randn(gen, 24, 40, dtype=torch.bfloat16, scale=5.0, device=device)
    s = rand_positive(gen, 1).to(device)
    a, b = fp8(gen, 32, 48, device=device), fp8(gen, 16, 48, dtype=E5M2, device=device)
    bias = randn(gen, 16, dtype=torch.bfloat16, device=device)
    hs, ss, sis, maxes = delayed_scaling_args(gen, device)
    return [
        ("amax", OPS.amax.default, (x,), None),
        ("cast_to_fp8", OPS.cast_to_fp8.default, (x, s, E4M3, None), None),
        ("cast_to_fp8_amax", OPS.cast_to_fp8.default, (x, s, E5M2, scalar(0.5, device)), None),
        ("cast_transpose_to_fp8", OPS.cast_transpose_to_fp8.default, (x, s, E4M3, None), None),
        ("cast_transpose_to_fp8_amax", OPS.cast_transpose_to_fp8.default,
         (x.float(), s, E4M3, scalar(0.5, device)), None),
        ("cast_from_fp8", OPS.cast_from_fp8.default, (a, s, torch.bfloat16), WITHOUT_SCHEMA),
        ("update_delayed_scaling", OPS.update_delayed_scaling.default,
         (hs, ss, sis, maxes, 1, "max"), None),
        ("update_delayed_scaling_most_recent", OPS.update_delayed_scaling.default,
         (hs, ss, sis, maxes, 0, "most_recent"), None),
        ("compute_scale_from_amax", OPS.compute_scale_from_amax.default,
         (rand_positive(gen, 5).to(device), 448.0, 2), None),
        ("fp8_gemm", OPS.fp8_gemm.default, (a, s, b, s, torch.float32, None, False),
         WITHOUT_SCHEMA),
        ("fp8_gemm_bias", OPS.fp8_gemm.default, (a, s, b, s, torch.bfloat16, bias, True),
         WITHOUT_SCHEMA),
        ("fp8_operand_stats", OPS.fp8_operand_stats.default,
         (randn(gen, 32, 48, device=device), a, s, 448.0, 0, 0), WITHOUT_SCHEMA),
        ("fp8_operand_stats_blocks", OPS.fp8_operand_stats.default,
         (randn(gen, 32, 48, device=device), a, rand_positive(gen, 1, 2).to(device), 448.0, 32,
          32), WITHOUT_SCHEMA),
        # The operators of Python making (ops/__init__.py) that compiled graphs call
        ("record_amax", OPS.record_amax.default, (hs[0], scalar(0.5, device), 2), None),
        ("scale_inverse", OPS.scale_inverse.default, (rand_positive(gen, 2).to(device),), None),
    ]


CASE_NAMES = [c[0] for c in op_cases(torch.Generator().manual_seed(0), "cpu")]


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("case", CASE_NAMES)
def test_opcheck(device, gen, case):
    name, op, args, test_utils = next(c for c in op_cases(gen, device) if c[0] == case)
    if test_utils is None:
        torch.library.opcheck(op, args)
    else:
        torch.library.opcheck(op, args, test_utils=test_utils)


def _transposed_storage(t):
    """The same values, stored column-major (a 2-D tensor that is not contiguous)."""
    if isinstance(t, torch.Tensor) and t.dim() == 2 and min(t.shape) > 1:
        return t.t().contiguous().t()
    return t


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("case", CASE_NAMES)
def test_fake_kernels_give_the_real_strides_for_column_major_inputs(device, gen, case):
    """opcheck's fake-tensor test compares shapes and dtypes, not strides; a compiled graph
    takes the fake kernel's strides for the real output's (cast_from_fp8 on the CPU returned
    its input's column-major strides where the fake said row-major: inductor's size asserts
    failed, and without them it read the output as row-major, silently wrong)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    _, op, args, _ = next(c for c in op_cases(gen, device) if c[0] == case)
    args = tuple(_transposed_storage(a) for a in args)
    try:
        real = op(*args)
    except RuntimeError as error:  # (an operator that requires contiguous inputs says so)
        assert "contiguous" in str(error), error
        return
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        def faked(a):
            if isinstance(a, list):
                return [faked(t) for t in a]
            return mode.from_tensor(a) if isinstance(a, torch.Tensor) else a
        fake = op(*[faked(a) for a in args])
    real, fake = (tuple(o) if isinstance(o, (tuple, list)) else (o,) for o in (real, fake))
    for r, f in zip(real, fake, strict=True):
        if isinstance(r, torch.Tensor):
            assert (r.shape, r.stride(), r.dtype) == (f.shape, f.stride(), f.dtype), case


@pytest.mark.parametrize("op", ["record_amax", "scale_inverse"])
def test_python_made_operators_run_without_python_wrappers(op):
    """record_amax and scale_inverse run at every step of a compiled FP8 layer (a
    delayed-scaling Linear's: scale_inverse three times, record_amax once): their kernels are
    called by the dispatcher directly, with no Python Autograd or ADInplaceOrView kernel around
    them (torch.library.custom_op's, which cost several times the kernel's own host time;
    nothing they take has a gradient)."""
    name = f"transformer_fp8::{op}"
    wrapped = [key for key in ("Autograd", "ADInplaceOrView")
               if torch._C._dispatch_has_kernel_for_dispatch_key(name, key)]
    assert not wrapped, f"{name} has kernels for {wrapped}"


def test_record_amax_bumps_the_history_version():
    """Autograd's version check sees the write (as a compiled backward that saved the
    history would)."""
    history = torch.zeros(4, 3)
    version = history._version
    OPS.record_amax.default(history, scalar(2.0), 1)
    assert history._version > version and history[0].tolist() == [0.0, 2.0, 0.0]


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("case", ["cast_from_fp8", "fp8_gemm", "fp8_gemm_bias",
                                  "fp8_operand_stats"])
def test_fp8_input_ops_mutate_nothing(device, gen, case):
    """What test_schema would check for the ops it cannot handle (see WITHOUT_SCHEMA)."""
    _, op, args, _ = next(c for c in op_cases(gen, device) if c[0] == case)
    tensors = [t for t in args if isinstance(t, torch.Tensor)]
    before = [t.clone() for t in tensors]
    out = op(*args)
    for t, b in zip(tensors, before):
        assert_bitwise_equal(t, b, "input modified")
    storages = {t.untyped_storage().data_ptr() for t in tensors}
    assert out.untyped_storage().data_ptr() not in storages


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_torch_compile_cast_and_gemm(device, gen):
    """cast_to_fp8 (with its in-place amax) and fp8_gemm trace into one graph."""
    x = randn(gen, 32, 64, dtype=torch.bfloat16, device=device)
    w = randn(gen, 48, 64, dtype=torch.bfloat16, scale=0.1, device=device)
    x_scale, w_scale = scalar(64.0, device), scalar(2048.0, device)
    bias = randn(gen, 48, dtype=torch.bfloat16, device=device)

    def linear(x, w, bias, x_scale, w_scale, x_amax):
        x_fp8 = ops.cast_to_fp8(x, x_scale, E4M3, x_amax)
        w_fp8 = ops.cast_to_fp8(w, w_scale, E4M3)
        return ops.fp8_gemm(x_fp8, 1.0 / x_scale, w_fp8, 1.0 / w_scale, torch.bfloat16, bias)

    eager_amax, compiled_amax = scalar(0.0, device), scalar(0.0, device)
    expected = linear(x, w, bias, x_scale, w_scale, eager_amax)
    compiled = torch.compile(linear, fullgraph=True, backend="aot_eager")
    out = compiled(x, w, bias, x_scale, w_scale, compiled_amax)
    assert_bitwise_equal(out, expected, "compiled output")
    assert_bitwise_equal(compiled_amax, eager_amax, "amax updated in the compiled graph")
    assert compiled_amax.item() == x.float().abs().max().item()


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("shape", [(5, 1), (1, 5), (1, 1), (0, 3)])
def test_cast_transposes_of_one_row_or_column_are_their_own_tensors(device, gen, shape):
    """The transposed output of a cast, a fused norm or activation cast, and the grad_output
    cast with dbias is a tensor of its own (the schema says the outputs do not alias), also
    when a row or a column is all there is: contiguous() of such a transpose returned the
    output itself on the CPU (opcheck: "Outputs 0 and 1 alias"; writing one changed the other)."""
    from transformer_fp8.ops import fused

    x = randn(gen, *shape, scale=3.0, device=device)
    s, one = scalar(2.0, device), torch.ones(shape[1], device=device)
    cases = [(OPS.cast_transpose_to_fp8.default, (x, s, E4M3, None)),
             (OPS.cast_transpose_dbias.default, (x, s, E5M2, None, 1)),
             (OPS.layernorm_fwd_fp8.default, (x, one, one * 0, 1e-5, False, s, E4M3, None, True,
                                              False, 1)),
             (OPS.rmsnorm_fwd_fp8.default, (x, one, 1e-5, False, s, E4M3, None, True, False, 1)),
             (OPS.activation_fwd_fp8.default, (x, "relu", s, E4M3, None, True, 1))]
    for op, args in cases:
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))
        out, out_t = op(*args)[:2]
        if out.numel():
            assert out.untyped_storage().data_ptr() != out_t.untyped_storage().data_ptr(), op
    assert fused  # (the operators above are registered by importing transformer_fp8.ops.fused)
