"""Typed wrappers over ``torch.ops.transformer_fp8`` and their fake kernels.

Every operator has a CPU and a CUDA kernel (csrc/cpu, csrc/cuda) with the same numerics, and a
fake kernel registered here so that torch.compile can trace it. Scales, scale_invs and amax
slots are 1-element float32 tensors on the data's device: nothing here reads them on the host.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence, Union

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true as _statically_known_true

from .. import _C  # noqa: F401  (loads the library and registers the operators)
from .. import _fp8_hooks
from .checks import check_wrapper_arguments, register_fake
from .update_callable import check_delayed_scaling_lists, delayed_scaling_result

_ops = torch.ops.transformer_fp8

# How update_delayed_scaling picks the amax of a history window (a recipe's amax_compute_algo).
AmaxComputeAlgo = Union[str, Callable[[torch.Tensor], torch.Tensor]]

GEMM_ALIGN = 16  # on CUDA, fp8_gemm's M, N and K must be multiples of 16
_is_compiling = torch.compiler.is_compiling


def pad_rows(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] with zero rows up to a multiple of GEMM_ALIGN, as a GEMM operand: zero rows
    change no amax or block scale, and the product rows they give are dropped. While debug
    statistics are collected (eagerly), the padded tensor carries M as ``real_rows``: the
    statistics of its cast leave the padding out (its zero blocks were counted)."""
    extra = (-x.shape[0]) % GEMM_ALIGN
    # (Without a guard on a dynamic row count's remainder, GroupedLinear's splits under
    # torch.compile: one compilation per remainder. Such a count is padded whatever it is.)
    if _statically_known_true(extra == 0) if _is_compiling() else not extra:
        return x
    padded = torch.nn.functional.pad(x, (0, 0, 0, extra))
    if _fp8_hooks.observer is not None and not torch.compiler.is_compiling():
        padded.real_rows = x.shape[0]
    return padded


def function_output(out: torch.Tensor, rows: int, shape) -> torch.Tensor:
    """A GEMM output [padded rows, N] (or any contiguous result) as the tensor of ``shape`` made
    of its first ``rows`` rows, returned by an autograd.Function's forward. Not a view (no
    copy either): autograd refuses in-place changes to a custom Function's output that is a
    view, and torch.nn.Linear's output takes them (``out += residual``, in-place dropout)."""
    if (not _statically_known_true(out.shape[0] == rows) if _is_compiling()
            else out.shape[0] != rows):  # (no guard on a dynamic count: see pad_rows)
        out = out[:rows]
    return torch.ops.aten._unsafe_view(out, shape)



# The wrappers check their arguments' types (check_wrapper_arguments) only when a cheap test
# fails: these calls sit on every FP8 step's hot path.
def _cast_arguments_suspect(x, scale, fp8_dtype, amax) -> bool:
    if not (isinstance(x, torch.Tensor) and isinstance(scale, torch.Tensor)
            and isinstance(fp8_dtype, torch.dtype)):
        return True
    # (a lazily negated amax slot would be written through its raw memory; the check is eager
    # only: torch.compile cannot trace is_neg)
    return amax is not None and not torch.compiler.is_compiling() and \
        (amax.is_neg() or amax.is_conj())


def amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| as a float32 0-dim tensor; NaN propagates; 0 for an empty x."""
    if not isinstance(x, torch.Tensor):
        check_wrapper_arguments("amax", tensors={"x": x})
    return _ops.amax(x)


def cast_to_fp8(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype,
                amax: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Saturating cast ``(x.float() * scale).clamp(-max, max).to(fp8_dtype)``, bit for bit.

    x: float32, bfloat16 or float16, any shape, contiguous or not. Rounds to nearest even;
    finite overflow and +-inf become +-448 (E4M3) or +-57344 (E5M2); NaN stays NaN.
    If ``amax`` (1-element float32) is given it becomes max(amax, max |x|), in the same pass.
    """
    if _cast_arguments_suspect(x, scale, fp8_dtype, amax):
        check_wrapper_arguments("cast_to_fp8", tensors={"x": x, "scale": scale} if amax is None
                                else {"x": x, "scale": scale, "amax": amax},
                                dtypes={"fp8_dtype": fp8_dtype})
    if amax is None and torch.compiler.is_compiling():
        # Inductor cannot lower this operator (one output, an optional mutated argument) when
        # the argument is None ("getitem is not an OpOverload"): give it a scratch slot.
        amax = torch.zeros(1, dtype=torch.float32, device=x.device)
    return _ops.cast_to_fp8(x, scale, fp8_dtype, amax)


def cast_transpose_to_fp8(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype,
                          amax: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The cast of a 2-D x and its contiguous transpose, from one read of x (amax fused)."""
    if _cast_arguments_suspect(x, scale, fp8_dtype, amax):
        check_wrapper_arguments("cast_transpose_to_fp8",
                                tensors={"x": x, "scale": scale} if amax is None
                                else {"x": x, "scale": scale, "amax": amax},
                                dtypes={"fp8_dtype": fp8_dtype})
    return _ops.cast_transpose_to_fp8(x, scale, fp8_dtype, amax)


def cast_from_fp8(x_fp8: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Dequantise: ``(x_fp8.float() * scale_inv).to(dtype)``."""
    if not (isinstance(x_fp8, torch.Tensor) and isinstance(scale_inv, torch.Tensor)
            and isinstance(dtype, torch.dtype)):
        check_wrapper_arguments("cast_from_fp8",
                                tensors={"x_fp8": x_fp8, "scale_inv": scale_inv},
                                dtypes={"dtype": dtype})
    return _ops.cast_from_fp8(x_fp8, scale_inv, dtype)


def compute_scale_from_amax(amax: torch.Tensor, fp8_max: float, margin: int = 0) -> torch.Tensor:
    """Current scaling: ``fp8_max / amax / 2**margin`` elementwise (fp64 then rounded to fp32,
    clamped to [FLT_MIN, FLT_MAX]); 1.0 where amax is 0, negative or not finite."""
    if not isinstance(amax, torch.Tensor):
        check_wrapper_arguments("compute_scale_from_amax", tensors={"amax": amax})
    return _ops.compute_scale_from_amax(amax, float(fp8_max), _check_margin(margin))


def fp8_gemm(a: torch.Tensor, a_scale_inv: torch.Tensor, b: torch.Tensor,
             b_scale_inv: torch.Tensor, out_dtype: torch.dtype,
             bias: Optional[torch.Tensor] = None, use_fast_accum: bool = False) -> torch.Tensor:
    """``out[M, N] = (a[M, K] * a_scale_inv) @ (b[N, K] * b_scale_inv).T (+ bias[N])``.

    Both operands are FP8 with K contiguous (the "TN" layout of Hopper's FP8 tensor cores);
    E5M2 x E5M2 is refused. Accumulation in float32 (``use_fast_accum`` lets cuBLASLt skip the
    periodic promotion of partial sums: faster, slightly less accurate). bias has out_dtype.
    On CUDA, M, N and K must be multiples of 16.
    """
    if not (isinstance(a, torch.Tensor) and isinstance(a_scale_inv, torch.Tensor)
            and isinstance(b, torch.Tensor) and isinstance(b_scale_inv, torch.Tensor)
            and isinstance(out_dtype, torch.dtype)
            and (bias is None or isinstance(bias, torch.Tensor))):
        check_wrapper_arguments("fp8_gemm", tensors={"a": a, "a_scale_inv": a_scale_inv,
                                                     "b": b, "b_scale_inv": b_scale_inv,
                                                     **({} if bias is None else {"bias": bias})},
                                dtypes={"out_dtype": out_dtype})
    return _ops.fp8_gemm(a, a_scale_inv, b, b_scale_inv, out_dtype, bias, use_fast_accum)


def update_delayed_scaling(amax_histories: Sequence[torch.Tensor], scales: Sequence[torch.Tensor],
                           scale_invs: Sequence[torch.Tensor], fp8_maxes: Sequence[float],
                           margin: int = 0, amax_compute_algo: AmaxComputeAlgo = "max",
                           scaling_factor_compute_algo: Optional[Callable] = None,
                           recipe=None) -> None:
    """Delayed-scaling update of many tensors, in place (one kernel launch on CUDA).

    Per column i of each history [L, n], with cur = history[0, i] (this step's amax, already
    reduced across ranks):
      * cur == 0: nothing was recorded; the column, its scale and scale_inv stay as they are;
      * otherwise the history rolls (rows 1..L-1 hold the last L-1 amaxes, oldest first, cur in
        row L-1; row 0 is reset to 0), amax = max of the finite values of the window
        {old rows 1..L-1, cur} ("max") or cur ("most_recent"), and if that amax is finite and
        positive, scale = fp8_max / amax / 2**margin (clamped to [FLT_MIN, FLT_MAX], the
        smallest normal and the largest float32); scale_inv = 1/scale.

    Callables (as in Transformer Engine's recipe) run in Python with the same roll:
    ``amax_compute_algo(history)`` gets a copy of the history [L, n] before the roll, as
    Transformer Engine passes it (row 0 cur, rows 1..L-1 the earlier amaxes, oldest first:
    ``h[0]`` is "most_recent", ``h.amax(0)`` "max" on finite values) and returns the amax [n];
    ``scaling_factor_compute_algo(amax, scale, fp8_max, recipe)`` returns the new scale [n],
    taken where it is finite and positive (a positive subnormal raised to FLT_MIN), the old
    scale kept where it is not (inf, NaN, 0, negative: no usable scale).
    Columns with cur == 0 are left untouched either way.
    """
    histories, scales, scale_invs = list(amax_histories), list(scales), list(scale_invs)
    maxes = [float(m) for m in fp8_maxes]
    margin = _check_margin(margin)
    if not histories:  # the dispatcher needs a tensor to choose a kernel: check here
        raise ValueError("amax_histories must be a non-empty list, got an empty list")
    if isinstance(amax_compute_algo, str) and scaling_factor_compute_algo is None:
        _ops.update_delayed_scaling(histories, scales, scale_invs, maxes, margin, amax_compute_algo)
        return
    if not (callable(amax_compute_algo) or amax_compute_algo in ("max", "most_recent")):
        raise ValueError("amax_compute_algo must be 'max', 'most_recent' or a callable, "
                         f"got {amax_compute_algo!r}")
    if not (scaling_factor_compute_algo is None or callable(scaling_factor_compute_algo)):
        raise TypeError("scaling_factor_compute_algo must be None or a callable, "
                        f"got {type(scaling_factor_compute_algo).__name__}")
    # Callables run in torch ops (update_callable.py), with the operator's checks. Every
    # result is computed before any state is written: a callable that fails or returns the
    # wrong shape for one tensor leaves every state as it was.
    check_delayed_scaling_lists(histories, scales, scale_invs, maxes)
    results = [delayed_scaling_result(history, scale, scale_inv, fp8_max, margin,
                                      amax_compute_algo, scaling_factor_compute_algo, recipe)
               for history, scale, scale_inv, fp8_max in zip(histories, scales, scale_invs,
                                                             maxes)]
    with torch.no_grad():
        for state, result in zip(zip(histories, scales, scale_invs), results):
            for old, new in zip(state, result):
                old.copy_(new)


# record_amax and scale_inverse are operators of Python making that compiled graphs call at
# every step: scale_inverse at each delayed or current-scaling cast (three in a Linear step),
# record_amax at each delayed-scaling cast in a backward (the forward's write the history in
# place: quantizer.py's TensorQuantizer._run). They are defined with
# torch.library.Library rather than torch.library.custom_op, whose Python autograd and
# ADInplaceOrView wrappers around each call cost several times its kernel (a fifth of a
# compiled delayed-scaling Linear step's host instructions went to them:
# benchmarks/results/2026-11-27-cpu-compiled-host); here the dispatcher calls the kernel
# itself. Nothing they take has a gradient (module buffers, a scale, a scratch amax slot):
# torch's autograd fallback passes them through. record_amax's in-place write bumps the
# history's version counter, as custom_op's wrapper did.
_LIB = torch.library.Library("transformer_fp8", "FRAGMENT")
_PT2 = (torch.Tag.pt2_compliant_tag,)
_LIB.define("record_amax(Tensor(a0!) history, Tensor amax, SymInt column) -> ()", tags=_PT2)
_LIB.define("scale_inverse(Tensor scale) -> Tensor", tags=_PT2)


def _record_amax_kernel(history: torch.Tensor, amax: torch.Tensor, column: int) -> None:
    _check_record_amax(history, amax, column)
    slot = history[0].narrow(0, column, 1)
    if amax.dim() > 1:  # (a [1] or 0-dim amax broadcasts to the slot as it is)
        amax = amax.reshape(1)
    torch.maximum(slot, amax, out=slot)  # (NaN propagates, as x.abs().amax())


_LIB.impl("record_amax", _record_amax_kernel, "CompositeExplicitAutograd")
_LIB.impl("scale_inverse", torch.reciprocal, "CompositeExplicitAutograd")


@torch.library.register_fake("transformer_fp8::record_amax", lib=_LIB)
def _record_amax_fake(history, amax, column):
    _check_record_amax(history, amax, column)
    return None


@torch.library.register_fake("transformer_fp8::scale_inverse", lib=_LIB)
def _scale_inverse_fake(scale):
    return torch.empty_like(scale)


def record_amax(history: torch.Tensor, amax: torch.Tensor, column: int) -> None:
    """history[0, column] = max(history[0, column], amax), NaN propagating: how a traced (torch.
    compile) cast records its amax (eager casts fold it into the slot in their own kernel)."""
    if isinstance(column, bool) or not isinstance(column, int):
        raise TypeError(f"record_amax: 'column' must be an int, got {type(column).__name__}")
    _check_record_amax(history, amax, column)  # (before the dispatcher reads column as int64)
    _ops.record_amax.default(history, amax, column)


def _check_record_amax(history: torch.Tensor, amax: torch.Tensor, column: int) -> None:
    if history.dim() != 2 or history.dtype != torch.float32 or history.shape[0] < 1:
        raise ValueError("record_amax: 'history' must be a float32 tensor of shape [L >= 1, n], "
                         f"got {history.dtype} of shape {tuple(history.shape)}")
    if not 0 <= column < history.shape[1]:
        raise ValueError(f"record_amax: 'column' must be in [0, {history.shape[1]}) (the "
                         f"history's columns), got {column}")
    if amax.dtype != torch.float32 or amax.numel() != 1:
        raise ValueError("record_amax: 'amax' must be a 1-element float32 tensor, got "
                         f"{amax.dtype} of shape {tuple(amax.shape)}")
    if amax.device != history.device:
        raise ValueError(f"record_amax: 'amax' must be on the history's device "
                         f"({history.device}), got {amax.device}")


def scale_inverse(scale: torch.Tensor) -> torch.Tensor:
    """``1 / scale`` rounded to nearest, as a new tensor: the scale_inv a cast's GEMM operand
    takes, the bits the update and the C++ steps write (csrc's scale_invs_of).

    Under torch.compile through an opaque operator, for two reasons. Inductor's float32
    division is approximate on CUDA (Triton's div.full, up to 2 ulp): an inlined reciprocal
    moved compiled outputs and the next layer's amaxes an ulp off eager's (seen on an H200).
    And the delayed update rewrites the scale buffer in place between the forward and the
    backward: a value the compiler could recompute in backward from the buffer, or drop,
    would give the backward the new scale (an opaque operator is neither recomputed nor
    elided)."""
    if _is_compiling():
        return _ops.scale_inverse.default(scale)
    return scale.reciprocal()


def _check_margin(margin) -> int:
    if isinstance(margin, bool) or not isinstance(margin, int) or not 0 <= margin <= 1000:
        raise ValueError(f"margin must be an integer in [0, 1000], got {margin!r}")
    return margin


# Fake kernels: shapes and dtypes only, for torch.compile and meta tensors.

@register_fake("transformer_fp8::amax")
def _amax_fake(x):
    return x.new_empty((), dtype=torch.float32)


@register_fake("transformer_fp8::cast_to_fp8")
def _cast_to_fp8_fake(x, scale, fp8_dtype, amax=None):
    return x.new_empty(x.shape, dtype=fp8_dtype)


@register_fake("transformer_fp8::cast_transpose_to_fp8")
def _cast_transpose_to_fp8_fake(x, scale, fp8_dtype, amax=None):
    torch._check(x.dim() == 2, lambda: f"cast_transpose_to_fp8 needs a 2-D x, got {x.dim()}-D")
    rows, cols = x.shape
    return x.new_empty((rows, cols), dtype=fp8_dtype), x.new_empty((cols, rows), dtype=fp8_dtype)


@register_fake("transformer_fp8::cast_from_fp8")
def _cast_from_fp8_fake(x_fp8, scale_inv, dtype):
    return x_fp8.new_empty(x_fp8.shape, dtype=dtype)


@register_fake("transformer_fp8::update_delayed_scaling")
def _update_delayed_scaling_fake(amax_histories, scales, scale_invs, fp8_maxes, margin,
                                 amax_compute_algo):
    return None


@register_fake("transformer_fp8::compute_scale_from_amax")
def _compute_scale_from_amax_fake(amax, fp8_max, margin):
    return torch.empty_like(amax, memory_format=torch.contiguous_format)


@register_fake("transformer_fp8::fp8_gemm")
def _fp8_gemm_fake(a, a_scale_inv, b, b_scale_inv, out_dtype, bias=None, use_fast_accum=False):
    torch._check(a.dim() == 2 and b.dim() == 2, lambda: "fp8_gemm needs 2-D a and b")
    torch._check(a.shape[1] == b.shape[1], lambda: "fp8_gemm: a [M, K] and b [N, K] must share K")
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)
