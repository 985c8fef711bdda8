"""The argument checks of the C++ operators, for their fake kernels.

A fake kernel runs where no real kernel does: under torch.compile (FakeTensor) and for meta
tensors, and the dispatcher also picks it when ONE argument is on "meta" and the rest on the CPU
(the meta key wins). Without these checks such a call returned uninitialised memory and skipped
the in-place update, and a fake accepted what the real kernel refuses. ``register_fake`` wraps
each fake with the checks every backend makes, with the C++ messages (csrc/checks/checks.h): every
tensor argument on one device, then the dtype and size of each argument by its name, which
means the same thing in every schema of the library.
"""
from __future__ import annotations

import functools
import inspect
from typing import Callable

import torch

_HP_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_HIGH_PRECISION_INPUTS = {"x", "dy"}  # float32, bfloat16 or float16 tensors
_FP8_INPUTS = {"x_fp8", "a", "b", "q"}
_ONE_ELEMENT_F32 = {"scale", "amax", "scale_inv", "a_scale_inv", "b_scale_inv"}
_F32 = {"amax_histories", "scales", "scale_invs"}
# (operator, argument) where a name above means a float32 tensor of any size
_ANY_SIZE_F32 = {("compute_scale_from_amax", "amax"), ("fp8_gemm_blockwise", "a_scale_inv"),
                 ("fp8_gemm_blockwise", "b_scale_inv")}


def _fail(message: str):
    # RuntimeError, as TORCH_CHECK raises: the same exception on every backend.
    raise RuntimeError(f"transformer_fp8: {message}")


def _describe(t: torch.Tensor) -> str:
    return f"{t.dtype} tensor of shape {list(t.shape)} on {t.device}"


def _tensors(arguments: dict):
    for name, value in arguments.items():
        if isinstance(value, torch.Tensor):
            yield name, value
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                if isinstance(item, torch.Tensor):
                    yield f"{name}[{i}]", item


def check_arguments(op: str, arguments: dict) -> None:
    """The checks of every backend, for ``op`` called with ``arguments`` (name -> value)."""
    tensors = list(_tensors(arguments))
    if tensors:
        ref_name, ref = tensors[0]
        for name, t in tensors[1:]:
            if t.device != ref.device:
                _fail(f"argument '{name}' must be on the same device as '{ref_name}' "
                      f"({ref.device}), got {_describe(t)}")
    for name, value in arguments.items():
        if name == "fp8_dtype" and value not in _FP8_DTYPES:
            _fail(f"argument 'fp8_dtype' must be torch.float8_e4m3fn or torch.float8_e5m2, "
                  f"got {value}")
        if name in ("dtype", "out_dtype") and value not in _HP_DTYPES:
            _fail(f"argument '{name}' must be torch.float32, torch.bfloat16 or torch.float16, "
                  f"got {value}")
        if not isinstance(value, torch.Tensor):
            continue
        if name in _HIGH_PRECISION_INPUTS and value.dtype not in _HP_DTYPES:
            _fail(f"argument '{name}' must be float32, bfloat16 or float16, got "
                  f"{_describe(value)}")
        if name in _FP8_INPUTS and value.dtype not in _FP8_DTYPES:
            _fail(f"argument '{name}' must be a float8_e4m3fn or float8_e5m2 tensor, got "
                  f"{_describe(value)}")
        if name in _ONE_ELEMENT_F32 and (op, name) not in _ANY_SIZE_F32 and \
                (value.dtype != torch.float32 or value.numel() != 1):
            _fail(f"argument '{name}' must be a 1-element float32 tensor, got {_describe(value)}")
        if (name in _F32 or (op, name) in _ANY_SIZE_F32) and value.dtype != torch.float32:
            _fail(f"argument '{name}' must be a float32 tensor, got {_describe(value)}")
    for name in _F32:
        for i, t in enumerate(arguments.get(name) or ()):
            if t.dtype != torch.float32:
                _fail(f"argument '{name}[{i}]' must be a float32 tensor, got {_describe(t)}")


def register_fake(qualname: str) -> Callable:
    """torch.library.register_fake(qualname), the fake preceded by check_arguments."""
    op = qualname.split("::")[-1]

    def decorator(fake: Callable) -> Callable:
        signature = inspect.signature(fake)

        @functools.wraps(fake)
        def checked(*args, **kwargs):
            check_arguments(op, signature.bind(*args, **kwargs).arguments)
            return fake(*args, **kwargs)

        torch.library.register_fake(qualname)(checked)
        return fake

    return decorator


def check_wrapper_arguments(op: str, tensors: dict = (), dtypes: dict = (),
                            ints: dict = ()) -> None:
    """Checks the dispatcher would report obscurely, made before the call: a None where a tensor
    is needed ("There were no tensor arguments to this function"), an int where a dtype is
    needed (5 would read as torch.float16), an int beyond int64 ("Expected int ... found int")."""
    for name, value in dict(tensors).items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{op}: argument '{name}' must be a tensor, got "
                            f"{type(value).__name__}")
        if name == "amax" and not torch.compiler.is_compiling() and \
                (value.is_neg() or value.is_conj()):
            # (the kernel writes the slot's memory, which a lazy negation would misread)
            raise ValueError(f"{op}: argument 'amax' is written in place and must not be a "
                             "negated or conjugated view; pass amax.resolve_neg()")
    for name, value in dict(dtypes).items():
        if not isinstance(value, torch.dtype):
            raise TypeError(f"{op}: argument '{name}' must be a torch.dtype, got {value!r}")
    for name, value in dict(ints).items():
        if isinstance(value, bool) or not isinstance(value, int) or \
                not -2**63 <= value < 2**63:
            raise ValueError(f"{op}: argument '{name}' must be an integer in the int64 range, "
                             f"got {value!r}")
