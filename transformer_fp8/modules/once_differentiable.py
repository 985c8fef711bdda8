"""The FP8 backward passes are once-differentiable: their gradients come from FP8 casts of the
saved operands, which have no derivative of their own.

torch.autograd.function.once_differentiable marks a backward's gradients with a node that
raises when they are differentiated again only when one of the backward's grad_outputs
requires grad. A gradient penalty through an FP8 layer (``autograd.grad(y.sum(), x,
create_graph=True)``) has a constant grad_output, so its gradient came back as a constant and
the penalty's share of the weight gradients was lost without a word. Here, under
create_graph=True (grad mode on in backward), every gradient takes that node: differentiating
it raises, naming the layer (as the C++ steps' once_differentiable in csrc/step_ops.h).
"""
from __future__ import annotations

import functools

import torch


def once_differentiable(what: str):
    """Decorator of an FP8 autograd.Function's backward; ``what``: the layer, for the message."""
    message = (f"transformer_fp8: trying to differentiate twice the FP8 {what} backward, which "
               "is once_differentiable (no double backward); run the layer outside fp8_autocast "
               "for that").encode()

    def decorate(backward):
        @functools.wraps(backward)
        def wrapper(ctx, *grad_outputs):
            with torch.no_grad():
                grads = backward(ctx, *grad_outputs)
            if not torch.is_grad_enabled() or torch.compiler.is_compiling():
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
