"""Contexts whose tensors must not become FP8 state, which is written in place and outlives them.

torch.func transforms (grad, vmap, jacrev, ...) and FP8 training: not supported. A tensor made
inside one must not reach the state (a history resized inside torch.func.grad stayed behind as a
dead wrapper, and the next training step crashed), and an update must not half-run there.

torch.inference_mode: supported. A tensor made under it is an inference tensor, which no later
training step may write or save for backward (a history resized under it broke the module for
good): the state and the kept FP8 weights are made outside it (``outside_inference_mode``)."""
from __future__ import annotations

import contextlib

import torch

# The level of the innermost torch.func transform running, or None outside any (a C function:
# callers on every step test it inline and call refuse_functorch_transform only inside one).
functorch_level = torch._C._functorch.maybe_current_level


def refuse_functorch_transform(what: str) -> None:
    """Raises, naming ``what``, inside a torch.func transform; else nothing (one C call)."""
    if functorch_level() is not None:
        raise RuntimeError(
            f"transformer_fp8: {what} inside a torch.func transform (grad, vmap, jacrev, ...), "
            "which FP8 training does not support: the FP8 state (amax histories, scales) is "
            "updated in place and outlives the transform. Compute gradients with "
            "loss.backward() or torch.autograd.grad instead.")


@torch.compiler.assume_constant_result
def exporting() -> bool:
    """Whether torch.export (strict or not) is tracing: its program runs without fp8_autocast's
    step machinery, so it must write no FP8 state (see roles._delayed). Asked only while
    tracing (inside ``torch.compiler.is_compiling()``): a constant of the trace, no guard.
    (Not torch.compiler.is_exporting(), which Dynamo answers True under torch.compile too.)"""
    return bool(getattr(torch.compiler, "_is_exporting_flag", False))


def outside_inference_mode():
    """A context that makes normal tensors also under torch.inference_mode (a no-op outside
    it)."""
    if not torch.compiler.is_compiling() and torch.is_inference_mode_enabled():  # (order:
        # Dynamo cannot trace is_inference_mode_enabled)
        return torch.inference_mode(False)
    return contextlib.nullcontext()
