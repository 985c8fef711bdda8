"""Where a weight gradient goes: Transformer Engine's fuse_wgrad_accumulation and
delay_wgrad_compute.

fuse_wgrad_accumulation (Megatron-LM's gradient buffers): every weight has a ``main_grad``
tensor (usually float32); its gradient is added to main_grad instead of .grad (written over it
when the forward ran with is_first_microbatch=True, or when the weight has
``overwrite_main_grad = True``: by the first gradient handed over after that forward; a module
run twice in it adds its second, also under reentrant checkpointing; known limitation: a
compiled module whose backward is traced too writes over it with each gradient). Autograd then
gets no gradient for the weight, or zeros when
the weight has a ``grad_added_to_main_grad`` attribute, which is set to True (Megatron's DDP
reads it), as Transformer Engine does.

delay_wgrad_compute: the backward pass leaves the weights' and biases' gradients aside;
``module.backward_dw()`` hands them over later (to main_grad or .grad as above), oldest
backward first. Pipeline schedules call it to order the weight-gradient work after the
input-gradient work of other stages.

Both are applied by an identity autograd function on each parameter, between the parameter and
the module's computation (WgradRoute); its backward receives the parameter's gradient, computed
in the parameter's dtype, so with fuse_wgrad_accumulation the gradient is rounded to the
weight's dtype before it is added to main_grad (Transformer Engine's GEMM adds in float32).
The GEMMs themselves run in backward as usual: delay_wgrad_compute changes when the gradients
reach the parameters, not when they are computed.
"""
from __future__ import annotations

from collections import deque
from typing import Optional

import torch

from ..quantization import checkpoint_stack


def _main_grad(param: torch.nn.Parameter) -> torch.Tensor:
    getter = getattr(param, "get_main_grad", None)
    main_grad = getter() if callable(getter) else getattr(param, "main_grad", None)
    if not isinstance(main_grad, torch.Tensor):
        raise RuntimeError("fuse_wgrad_accumulation=True needs every weight to have a "
                           "'main_grad' tensor (its gradient buffer) before backward; a weight "
                           f"of shape {tuple(param.shape)} has none")
    if main_grad.shape != param.shape:
        raise RuntimeError(f"a weight's main_grad must have its shape {tuple(param.shape)}, got "
                           f"{tuple(main_grad.shape)}")
    return main_grad


def add_to_main_grad(param: torch.nn.Parameter, grad: torch.Tensor, overwrite: bool) -> None:
    """overwrite: write over main_grad (the first gradient of a backward pass whose forward
    ran with is_first_microbatch=True, or of a weight with overwrite_main_grad), else add."""
    main_grad = _main_grad(param)
    with torch.no_grad():
        if overwrite:
            main_grad.copy_(grad)
        else:
            main_grad.add_(grad.to(main_grad.dtype))


def _overwrites(param: torch.nn.Parameter, first: Optional[bool]) -> bool:
    return bool(first) or bool(getattr(param, "overwrite_main_grad", False))


def add_to_grad(param: torch.nn.Parameter, grad: torch.Tensor) -> None:
    with torch.no_grad():
        grad = grad.to(param.dtype)
        param.grad = grad if param.grad is None else param.grad + grad


def _autograd_result(param: torch.nn.Parameter) -> Optional[torch.Tensor]:
    """What autograd receives for a weight whose gradient went to main_grad."""
    if hasattr(param, "grad_added_to_main_grad"):
        param.grad_added_to_main_grad = True
        return torch.zeros_like(param)
    return None


class WgradRouting:
    """A module's setting (fuse, delay) and the gradients its delayed backward passes left."""

    def __init__(self, fuse: bool, delay: bool):
        self.fuse, self.delay = bool(fuse), bool(delay)
        self.pending: deque = deque()  # per backward pass: [(param, is_weight, first, grad)]
        self._open: Optional[list] = None
        self._open_task = -1  # the autograd graph task that last added to the open entry
        # id(param) of each weight whose next gradient writes over its main_grad: set by a
        # forward that asks for it (is_first_microbatch=True, overwrite_main_grad), taken by
        # the first gradient handed over after it. A module run twice in that forward gets two
        # gradients (in one backward pass, or each in a reentrant checkpoint's own), and the
        # second adds to the first.
        self._overwrite_next: set = set()
        # A compiled forward marks nothing (the walk up the stack below cannot be traced, nor
        # a side effect inside the compiled module's autograd functions): its nodes carry
        # (TRACED, first), and the first gradient of each backward pass writes over main_grad
        # (id(param) -> the graph task that last did).
        self._overwritten: dict = {}

    def mark(self, param, is_weight: bool, first: Optional[bool]) -> None:
        """Called by every forward that uses ``param`` (see _overwrite_next): a training
        forward, or a checkpointed region's first forward (a reentrant one runs without
        gradients); not a checkpoint's recomputation, which runs in backward, after gradients
        of the same forward may have been handed over."""
        if not (self.fuse and is_weight and _overwrites(param, first)):
            return
        context = checkpoint_stack.checkpoint_context()  # (a walk up the stack: here only)
        if context.recomputation is not None:
            return
        if not torch.is_grad_enabled() and not context.regions:
            return  # (an evaluation forward: no gradient follows)
        self._overwrite_next.add(id(param))

    def _takes_overwrite(self, param, first, in_backward_pass: bool) -> bool:
        """Whether this gradient of ``param`` writes over its main_grad (``in_backward_pass``:
        else handed over by backward_dw, whose entry dedupes)."""
        if type(first) is tuple:  # (TRACED, first): a compiled forward's
            if not _overwrites(param, first[1]):
                return False
            if not in_backward_pass or torch.compiler.is_compiling():
                return True  # (a traced backward cannot ask for its graph task: known limitation)
            task = torch._C._current_graph_task_id()
            fresh = self._overwritten.get(id(param)) != task
            self._overwritten[id(param)] = task
            return fresh
        if id(param) not in self._overwrite_next:
            return False
        self._overwrite_next.discard(id(param))
        return True

    def routes(self, is_weight: bool) -> bool:
        return self.delay or (self.fuse and is_weight)

    def take(self, param, is_weight: bool, first: Optional[bool], grad: torch.Tensor):
        """Backward of WgradRoute: the gradient for autograd (None: handled here)."""
        if self.delay:
            # The parameters of one forward reach their backward in one backward pass; a new
            # entry starts when a parameter already in the open one comes again from another
            # pass (from the same one: the module ran twice in the forward, its gradients add).
            task = torch._C._current_graph_task_id()
            if self._open is None or ((task == -1 or task != self._open_task)
                                      and any(p is param for p, *_ in self._open)):
                self._open = []
                self.pending.append(self._open)
            self._open_task = task
            self._open.append((param, is_weight, first, grad))
            return None
        overwrite = self._takes_overwrite(param, first, in_backward_pass=True)
        add_to_main_grad(param, grad, overwrite)
        return _autograd_result(param)

    def backward_dw(self) -> None:
        """Hand over the gradients of the oldest delayed backward pass (one must be pending)."""
        entry = self.pending[0]
        if self.fuse:  # every main_grad checked before anything is handed over (a retry works)
            for param, is_weight, *_ in entry:
                if is_weight:
                    _main_grad(param)
        self.pending.popleft()
        if entry is self._open:
            self._open = None
        written = set()  # (a compiled forward's parameters this entry has written over)
        for param, is_weight, first, grad in entry:
            if self.fuse and is_weight:
                overwrite = id(param) not in written and self._takes_overwrite(param, first,
                                                                               False)
                written.add(id(param))
                add_to_main_grad(param, grad, overwrite)
                if hasattr(param, "grad_added_to_main_grad"):
                    param.grad_added_to_main_grad = True
            else:
                add_to_grad(param, grad)


class WgradRoute(torch.autograd.Function):
    """Identity on a parameter; its backward hands the parameter's gradient to a
    WgradRouting."""

    @staticmethod
    def forward(ctx, param, routing, is_weight, first):
        ctx.param, ctx.routing, ctx.is_weight, ctx.first = param, routing, is_weight, first
        return param.view_as(param)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        return ctx.routing.take(ctx.param, ctx.is_weight, ctx.first, grad), None, None, None


def route(param, routing: Optional[WgradRouting], is_weight: bool, first: Optional[bool]):
    """The parameter as the module's computation should use it."""
    if routing is None or param is None or not param.requires_grad \
            or not routing.routes(is_weight):
        return param
    if torch.compiler.is_compiling():
        if not torch.is_grad_enabled():
            return param
        return WgradRoute.apply(param, routing, is_weight, (TRACED, first))
    routing.mark(param, is_weight, first)
    if not torch.is_grad_enabled():
        return param
    return WgradRoute.apply(param, routing, is_weight, first)


TRACED = "traced"  # (first element of a compiled forward's ``first``: see WgradRouting)
