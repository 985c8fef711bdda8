"""The step machinery of delayed scaling: the amax states (history, scale, scale_inv) recorded
under one recipe and process group, reduced across ranks in ONE collective and updated in ONE
launch per device (AmaxStep), once at the outermost fp8_autocast's exit for the forward and once
per backward pass for grad_output (BackwardStep); the registry of FP8 modules that lays out the
cross-rank reduction; the updates held back for reentrant checkpointing and compiled backwards.
"""
from __future__ import annotations

import threading
import weakref
from typing import Callable

import torch

from .. import ops
from . import replay as checkpointing
from .recipe import DelayedScaling

# What a module hands over for the update: () -> (history [L, n], scale [n], scale_inv [n], fp8_max)
StateGetter = Callable[[], tuple]


def _world_size(group) -> int:
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return 1
    return torch.distributed.get_world_size(group)


def all_reduce_max(buffer: torch.Tensor, group) -> None:
    """In-place MAX across the group (a no-op for a single process)."""
    if _world_size(group) > 1:
        torch.distributed.all_reduce(buffer, op=torch.distributed.ReduceOp.MAX, group=group)


# Every FP8 module of the process by creation index (weak references): the layout of the
# cross-rank reduction, identical on every rank that built the same model.
_MODULES: "weakref.WeakValueDictionary[int, torch.nn.Module]" = weakref.WeakValueDictionary()


def register_module(index: int, module: torch.nn.Module) -> None:
    """Called by an FP8 module for its creation index. The module provides
    _state_for_step(recipe, role) -> StateGetter or None (see AmaxStep)."""
    _MODULES[index] = module


# FP8 modules with no recipe yet (built without one, reset, or reloaded): an fp8_autocast with a
# DelayedScaling recipe adopts it for them at its entry, before any of them runs, so that a
# compiled region never has to resize a history. Empty in steady state: a check per entry.
_AWAITING_RECIPE: "weakref.WeakValueDictionary[int, torch.nn.Module]" = \
    weakref.WeakValueDictionary()


def await_recipe(index: int, module: torch.nn.Module) -> None:
    _AWAITING_RECIPE[index] = module


def recipe_adopted(index: int) -> None:
    _AWAITING_RECIPE.pop(index, None)


def adopt_recipe_for_waiting_modules(recipe: DelayedScaling) -> None:
    """Called when an fp8_autocast under ``recipe`` is entered (see _AWAITING_RECIPE)."""
    for module in list(_AWAITING_RECIPE.values()):
        if not module.fp8_fwd_scale.is_meta:  # (a meta module adopts when materialised)
            module.prepare_fp8_recipe(recipe)


class AmaxStep:
    """The scaling states (history, scale, scale_inv) recorded under one (recipe, group), reduced
    and updated together; role is "fwd" or "bwd". Keys (creation indices) order the states
    identically on every rank.

    Ranks may run different subsets of the modules in a step (mixture-of-experts routing): the
    reduction then covers every module of the process that trains with this recipe, so that
    every rank's buffer has the same layout; a module that ran on no rank keeps its state (the
    update leaves a column with no recorded amax untouched)."""

    def __init__(self, recipe: DelayedScaling, group, role: str = "fwd",
                 include_unrecorded: bool = True):
        self.recipe, self.group, self.role = recipe, group, role
        # False in a graphed callable (see isolated_fp8_autocast): the step covers exactly the
        # modules that recorded, which are the same on every rank (a graph is static).
        self.include_unrecorded = include_unrecorded
        self.states: dict[int, StateGetter] = {}

    def add(self, key: int, getter: StateGetter) -> None:
        self.states.setdefault(key, getter)

    def _add_unrecorded_modules(self, every_module: bool) -> None:
        """The modules of the process that train with this recipe and registered nothing:
        every one when ranks reduce (some may have run on other ranks only), else the compiled
        ones (a compiled forward records its amaxes in the history but registers nothing: a
        traced side effect is refused inside a checkpointed region). A module that recorded
        nothing keeps its state: the update leaves an unrecorded column untouched. Modules on
        another device than the recorded ones are left out (a CPU copy of the model, say),
        unless none recorded."""
        devices = {get()[0].device for get in self.states.values()}
        for index, module in sorted(_MODULES.items()):
            if index not in self.states and (every_module or index in _COMPILED_MODULES):
                getter = module._state_for_step(self.recipe, self.role)
                if getter is not None and (not devices or getter()[0].device in devices):
                    self.states[index] = getter

    def _reduces(self) -> bool:
        return self.recipe.reduce_amax and _world_size(self.group) > 1

    def _complete(self) -> None:
        reduce = self._reduces()
        if self.include_unrecorded and (reduce or _COMPILED_MODULES):
            self._add_unrecorded_modules(every_module=reduce)

    def reduce_and_update(self) -> None:
        self._complete()
        if not self.states:
            return
        reduce = self._reduces()
        tensors = [self.states[key]() for key in sorted(self.states)]
        histories = [t[0] for t in tensors]
        if reduce:
            # One collective for the whole step: gather row 0 of every history, reduce, scatter.
            recorded = torch.cat([h[0] for h in histories])
            all_reduce_max(recorded, self.group)
            torch._foreach_copy_([h[0] for h in histories],
                                 list(recorded.split([h.shape[1] for h in histories])))
        by_device: dict[torch.device, list] = {}
        for t in tensors:
            by_device.setdefault(t[0].device, []).append(t)
        for group in by_device.values():  # one launch per device and 640 tensors
            ops.update_delayed_scaling(
                [t[0] for t in group], [t[1] for t in group], [t[2] for t in group],
                [t[3] for t in group], margin=self.recipe.margin,
                amax_compute_algo=self.recipe.amax_compute_algo,
                scaling_factor_compute_algo=self.recipe.scaling_factor_compute_algo,
                recipe=self.recipe)

    def discard(self) -> None:
        """Forget the amaxes recorded since the last update (after an exception)."""
        self._complete()
        for get in self.states.values():
            get()[0][0].zero_()


class BackwardStep:
    """The grad_output states of the modules of one forward pass. The first FP8 backward of a
    backward pass queues the update for the end of that pass, so every backward pass (one per
    microbatch, retain_graph, a frozen first layer...) is followed by exactly one update.

    A reentrant activation checkpoint backpropagates its region in a nested backward pass; its
    end is not the end of the step's backward (a layer called in two regions is still to run
    its second backward), so the update waits: it runs at the next update of this step, or at
    the next outermost fp8_autocast, or when a layer's state_dict is taken, whichever is first.
    Until the next backward nothing reads the grad_output scales, so the numbers are the same.
    """

    def __init__(self, recipe: DelayedScaling, group, include_unrecorded: bool = True):
        self.step = AmaxStep(recipe, group, role="bwd", include_unrecorded=include_unrecorded)
        self._queued = False

    def add(self, key: int, getter: StateGetter) -> None:
        self.step.add(key, getter)

    def on_backward(self) -> None:
        if not self._queued:
            self._queued = True
            with _PENDING_LOCK:
                _QUEUED_BACKWARD_STEPS[id(self)] = self
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)

    def _finish(self) -> None:
        self._queued = False
        with _PENDING_LOCK:
            _QUEUED_BACKWARD_STEPS.pop(id(self), None)
        if checkpointing.in_reentrant_backward():
            with _PENDING_LOCK:
                _PENDING_BACKWARD_STEPS[id(self)] = self
            return
        self.update()

    def discard(self) -> None:
        """Its backward pass failed, so its queued update never ran: forget its amaxes."""
        self._queued = False
        self.step.discard()

    def update(self) -> None:
        with _PENDING_LOCK:
            _PENDING_BACKWARD_STEPS.pop(id(self), None)
        self.step.reduce_and_update()


# Backward updates held back at the end of a reentrant checkpoint's nested backward pass (they
# may be recorded on autograd's worker threads, hence a lock rather than thread-local state).
_PENDING_LOCK = threading.Lock()
_PENDING_BACKWARD_STEPS: dict[int, BackwardStep] = {}


# Backward steps whose end-of-pass update is queued. The autograd engine drops the queue when a
# backward pass raises: a step still here when the next outermost fp8_autocast is entered (or a
# state_dict taken) belongs to a pass that failed, and its grad_output amaxes are discarded, as
# an exception leaving fp8_autocast discards the forward's (so a failed step changes no scale).
_QUEUED_BACKWARD_STEPS: dict[int, BackwardStep] = {}


def discard_failed_backward_passes() -> None:
    if not _QUEUED_BACKWARD_STEPS or torch._C._current_graph_task_id() != -1:
        return  # called from inside a backward pass (a recomputed region): none has failed
    with _PENDING_LOCK:
        failed = list(_QUEUED_BACKWARD_STEPS.values())
        _QUEUED_BACKWARD_STEPS.clear()
    for step in failed:
        step.discard()


# The backward steps of the last forward passes in a process that compiles FP8 modules: a
# compiled backward cannot queue its update, which runs at the next outermost fp8_autocast (or
# state_dict). (After an eager backward's own update it finds nothing recorded: a no-op.)
_HELD_BACKWARD_STEPS: list = []

# Creation indices of the FP8 modules that torch.compile has traced (see note_compiled).
_COMPILED_MODULES: set = set()


@torch.compiler.assume_constant_result
def note_compiled(index: int) -> bool:
    """Called by a traced FP8 forward: torch.compile runs it once, while tracing (its result is
    baked into the graph as a constant), so this side effect is allowed even inside a
    checkpointed region, and costs nothing at run time."""
    _COMPILED_MODULES.add(index)
    return True


def hold_for_compiled_backward(backward_steps: list) -> None:
    """The backward steps of a forward pass that has just ended, held for a compiled backward
    when the process compiles FP8 modules (see _HELD_BACKWARD_STEPS)."""
    if _COMPILED_MODULES and torch.is_grad_enabled():
        _HELD_BACKWARD_STEPS.extend(backward_steps)


def has_pending_backward_updates() -> bool:
    return bool(_PENDING_BACKWARD_STEPS or _HELD_BACKWARD_STEPS)


def flush_pending_backward_updates() -> None:
    """Run the backward updates held back (see BackwardStep), oldest first."""
    with _PENDING_LOCK:
        pending = list(_PENDING_BACKWARD_STEPS.values())
        held = list(dict.fromkeys(_HELD_BACKWARD_STEPS))  # each step once, in order
        _HELD_BACKWARD_STEPS.clear()
    for step in pending:
        step.update()
    for step in held:
        if not step._queued:
            step.update()
