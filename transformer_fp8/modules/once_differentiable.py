"""The FP8 backward passes are once-differentiable: their gradients come from FP8 casts of the
saved operands, which have no derivative of their own.

torch.autograd.function.once_differentiable marks a backward's gradients with a node that
raises when they are differentiated again only when one of the backward's grad_outputs
requires grad. A gradient penalty through an FP8 layer (``autograd.grad(y.sum(), x,
create_graph=True)``) has a constant grad_output, so its gradient came back as a constant and
the penalty's share of the weight gradients was lost without a word. Here, under
create_graph=True (grad mode on in backward), every gradient takes that node: differentiating
it raises, naming the layer (as the C++ steps' once_differentiable in csrc/step_ops.h).

Under torch.compile that node cannot be traced. There AOTAutograd's compiled backward refuses
double backward itself ("torch.compile with aot_autograd does not currently support double
backward"), but only where one of the tensors it saved for backward requires grad at run time
(runtime_wrappers.py: CompiledFunction.backward, needs_grad). An FP8 backward saves only FP8
copies, which do not: a penalty through a compiled Linear came back as a constant. So under
torch.compile the forward also saves the weights that take a gradient (``save_for_backward``:
a reference, no copy), and the backward reads them (``_hold``), which makes AOTAutograd keep
them for backward: differentiating the gradients raises its error. A weight joined from its
parts (parameters_split) is no such tensor (computed in the compiled forward, it requires no
grad at run time): under torch.compile it is joined by ``joined_weight``, whose backward holds
one of the parts instead (a Parameter), and the FP8 forward does not hold the joined weight
(``hold_weight=False``: it would keep a high-precision copy of it for backward).
"""
from __future__ import annotations

import functools

import torch


def save_for_backward(ctx, *operands, weights=()) -> None:
    """``ctx.save_for_backward(*operands)``; under torch.compile ``weights`` too (the layer's
    weights that take a gradient), after them. Read the operands with ``saved_operands``."""
    held = tuple(weights) if torch.compiler.is_compiling() else ()
    ctx.held = len(held)
    ctx.save_for_backward(*operands, *held)


def saved_operands(ctx) -> tuple:
    """What ``save_for_backward`` saved as ``operands``."""
    saved = ctx.saved_tensors
    return saved[:len(saved) - ctx.held]


def _hold(held, grad: torch.Tensor) -> None:
    """Reads each held tensor in the traced backward, in an op that reads no element (no row
    of it, picked by an empty index) and is kept (an assert). The index comes from ``grad``,
    so that the op stays in the backward graph (on forward values alone the partitioner moves
    it to the forward) and the partitioner saves the tensor itself (the forward's views of an
    input do not require grad at run time)."""
    index = grad.narrow(0, 0, 0).reshape(-1).long()
    for tensor in held:
        torch.ops.aten._assert_tensor_metadata(tensor.index_select(0, index))


class _JoinedWeight(torch.autograd.Function):
    """torch.cat(parts) (rows), whose backward holds the first part that takes a gradient."""

    @staticmethod
    def forward(ctx, *parts):
        ctx.rows, ctx.dtypes = [p.shape[0] for p in parts], [p.dtype for p in parts]
        ctx.save_for_backward(*[p for p, needs in zip(parts, ctx.needs_input_grad) if needs][:1])
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, grad):
        _hold(ctx.saved_tensors, grad)
        # torch.cat's backward: each part's rows, in its dtype
        return tuple(g if g.dtype == dtype else g.to(dtype)
                     for g, dtype in zip(grad.split(ctx.rows, dim=0), ctx.dtypes))


def joined_weight(parts) -> torch.Tensor:
    """torch.cat(parts, dim=0) for a weight split into parts (parameters_split); under
    torch.compile with a backward that holds one of them (see the module docstring)."""
    if torch.compiler.is_compiling():
        return _JoinedWeight.apply(*parts)
    return torch.cat(parts, dim=0)


def once_differentiable(what: str):
    """Decorator of an FP8 autograd.Function's backward; ``what``: the layer, for the message."""
    message = (f"transformer_fp8: trying to differentiate twice the FP8 {what} backward, which "
               "is once_differentiable (no double backward); run the layer outside fp8_autocast "
               "for that").encode()

    def decorate(backward):
        @functools.wraps(backward)
        def wrapper(ctx, *grad_outputs):
            compiling = torch.compiler.is_compiling()  # (traced once, whatever the grad mode)
            if compiling and ctx.held:
                # (first: grad_output's last read stays the backward's own)
                _hold(ctx.saved_tensors[-ctx.held:], grad_outputs[0])
            with torch.no_grad():
                grads = backward(ctx, *grad_outputs)
            if compiling or not torch.is_grad_enabled():
                return grads
            as_tuple = grads if isinstance(grads, tuple) else (grads,)
            refuse = torch._C._functions.DelayedError(message, len(as_tuple))
            # (an alias of each gradient that requires grad, so that the node is its grad_fn)
            marked = refuse(*[g.detach().requires_grad_() if isinstance(g, torch.Tensor) else g
                              for g in as_tuple])
            marked = marked if isinstance(marked, tuple) else (marked,)
            return marked if isinstance(grads, tuple) else marked[0]
        return wrapper
    return decorate
