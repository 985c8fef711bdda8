"""fp8_autocast (TE 2.x: autocast): where FP8 modules record their amaxes and where delayed scales
get updated; quantized_model_init: building FP8 modules for a recipe.

Inside the outermost context every FP8 module that runs with delayed scaling records the amax of
its input and weight into row 0 of its forward history (in the same pass as the cast). When the
outermost context exits, the recorded rows of all modules are all-reduced (MAX) across fp8_group
in ONE collective, then ONE update_delayed_scaling call (per device) rolls every history and sets
every scale. The backward amaxes (grad_output) go the same way, once per backward pass: at the
end of each backward pass that ran through the modules of a forward pass.

The reduced buffer is laid out by the modules' creation order, which is the same on every rank
that built the same model; ranks may run different subsets of the modules (see AmaxStep).
"""
from __future__ import annotations

import contextlib
import itertools
import threading
import weakref
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch

from . import replay as checkpointing

from .. import ops
from .recipe import RECIPE_TYPES, DelayedScaling, Recipe

# What a module hands over for the update: () -> (history [L, n], scale [n], scale_inv [n], fp8_max)
StateGetter = Callable[[], tuple]


@dataclass(frozen=True)
class AutocastState:
    """What an FP8 module sees when it runs: whether FP8 is on, the recipe, the group."""

    enabled: bool
    recipe: Recipe
    group: Optional["torch.distributed.ProcessGroup"]
    # Calibration: modules that run in high precision record their GEMM inputs' and weights'
    # amaxes (delayed scaling; see calibration.py), updated at the outermost exit as usual.
    calibrating: bool = False


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


def _adopt_for_waiting_modules(recipe: DelayedScaling) -> None:
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
    if torch._C._current_graph_task_id() != -1:
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


class _ThreadAutocast(threading.local):
    """This thread's context stack and the steps recorded under its outermost context (the
    stack is per thread, as torch.autocast's is)."""

    def __init__(self):
        self.stack: list[AutocastState] = []
        self.forward_steps: dict = {}
        self.backward_steps: dict = {}
        self.pass_id = 0  # of the outermost context last entered (see forward_pass_id)
        self.isolated = False  # inside isolated_fp8_autocast


_LOCAL = _ThreadAutocast()
_pass_ids = itertools.count(1)


def forward_pass_id() -> int:
    """A number that identifies this thread's current (or last) outermost fp8_autocast, unique
    across threads and increasing with time: the forward pass a module runs in."""
    return _LOCAL.pass_id


def _key(state: AutocastState):
    return (state.recipe, state.group)


def current_state() -> Optional[AutocastState]:
    """The innermost active fp8_autocast of this thread, or None outside any."""
    return _LOCAL.stack[-1] if _LOCAL.stack else None


def _prepare_steps(state: AutocastState):
    """The forward and backward steps of ``state``'s recipe and group under the outermost
    context, made when a context is entered (eagerly, outside any compiled region) or at the
    first record. A compiled forward records its amaxes but registers nothing: the steps cover
    every module of the recipe (see AmaxStep._add_unrecorded_modules)."""
    k = _key(state)
    if k not in _LOCAL.forward_steps:
        everywhere = not _LOCAL.isolated
        _LOCAL.forward_steps[k] = AmaxStep(state.recipe, state.group, role="fwd",
                                           include_unrecorded=everywhere)
        _LOCAL.backward_steps[k] = BackwardStep(state.recipe, state.group,
                                                include_unrecorded=everywhere)
    return k


def record_forward(state: AutocastState, key: int, fwd_getter: StateGetter,
                   bwd_getter: StateGetter) -> BackwardStep:
    """Called by an FP8 module running with delayed scaling: registers its forward state for the
    update at context exit and its backward state with the forward pass's BackwardStep, which
    it returns (its backward calls on_backward())."""
    k = _prepare_steps(state)
    _LOCAL.forward_steps[k].add(key, fwd_getter)
    _LOCAL.backward_steps[k].add(key, bwd_getter)
    return _LOCAL.backward_steps[k]


def _exit_outermost(failed: bool) -> None:
    steps = list(_LOCAL.forward_steps.values())
    backward_steps = list(_LOCAL.backward_steps.values())
    _LOCAL.forward_steps.clear()
    _LOCAL.backward_steps.clear()
    for step in steps:
        if failed:
            step.discard()
        else:
            step.reduce_and_update()
    if _COMPILED_MODULES and not failed and not _LOCAL.isolated and torch.is_grad_enabled():
        _HELD_BACKWARD_STEPS.extend(backward_steps)  # for a compiled backward


_STATES: dict = {}


def _state_for(enabled: bool, recipe: Recipe, group, calibrating: bool = False) -> AutocastState:
    """One AutocastState object per (enabled, recipe, group, calibrating): torch.compile guards
    on the object a compiled module reads, so a new one at every step would recompile every
    step."""
    key = (enabled, recipe, group, calibrating)
    if key not in _STATES:
        _STATES[key] = AutocastState(enabled, recipe, group, calibrating)
    return _STATES[key]


@contextlib.contextmanager
def fp8_autocast(enabled: bool = True, calibrating: bool = False,
                 fp8_recipe: Optional[Recipe] = None, fp8_group=None,
                 _graph: bool = False) -> Iterator[None]:
    """Run the FP8 modules inside with FP8 GEMMs (Transformer Engine's signature).

    enabled: False runs them in high precision (as torch.nn.Linear would).
    calibrating: with enabled=False and a DelayedScaling recipe, the modules still run in high
        precision but record the amaxes of their GEMM inputs and weights; the scales are
        updated from them at the outermost exit (as after an FP8 forward), so that the first
        FP8 step starts with calibrated scales. No effect when enabled.
    fp8_recipe: DelayedScaling() by default, Float8CurrentScaling(), or the per-block recipes
        Float8BlockScaling() and Float8RowwiseScaling() (no state, no collective).
    fp8_group: the process group whose ranks share amaxes (default: the whole world).
    Call backward outside the context. Nested contexts: the innermost one decides how modules
    run; the outermost one's exit reduces and updates. If an exception leaves the outermost
    context, the amaxes recorded in it are discarded and no scale changes.
    """
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be True or False, got {type(enabled).__name__}")
    if not isinstance(calibrating, bool):
        raise TypeError(f"calibrating must be True or False, got {type(calibrating).__name__}")
    if _graph:
        raise ValueError("fp8_autocast: _graph=True (Transformer Engine's internal flag for "
                         "graph capture) is not supported; use make_graphed_callables")
    if fp8_recipe is None:
        fp8_recipe = DelayedScaling()
    if not isinstance(fp8_recipe, RECIPE_TYPES):
        raise TypeError("fp8_recipe must be a DelayedScaling, Float8CurrentScaling, "
                        "Float8BlockScaling or Float8RowwiseScaling, got "
                        f"{type(fp8_recipe).__name__}")
    if fp8_group is not None and not (torch.distributed.is_available()
                                      and isinstance(fp8_group, torch.distributed.ProcessGroup)):
        raise TypeError("fp8_group must be None or a torch.distributed.ProcessGroup, got "
                        f"{type(fp8_group).__name__}")
    if _AWAITING_RECIPE and enabled and isinstance(fp8_recipe, DelayedScaling) and \
            not torch.compiler.is_compiling():
        _adopt_for_waiting_modules(fp8_recipe)
    outermost = not _LOCAL.stack
    if outermost:
        _LOCAL.pass_id = next(_pass_ids)
        # (Not in an isolated context, which a graph may be capturing: the held updates
        # belong to the surrounding step and run at its next outermost context.)
        if _QUEUED_BACKWARD_STEPS and not _LOCAL.isolated:
            discard_failed_backward_passes()
        if has_pending_backward_updates() and not _LOCAL.isolated:
            flush_pending_backward_updates()
    state = _state_for(enabled, fp8_recipe, fp8_group, calibrating and not enabled)
    if enabled and isinstance(fp8_recipe, DelayedScaling):
        _prepare_steps(state)
    _LOCAL.stack.append(state)
    failed = False
    try:
        yield
    except BaseException:
        failed = True
        raise
    finally:
        _LOCAL.stack.pop()
        if outermost:
            _exit_outermost(failed)


@contextlib.contextmanager
def isolated_fp8_autocast(enabled: bool, fp8_recipe: Optional[Recipe], fp8_group) -> Iterator[None]:
    """fp8_autocast as the outermost context, whatever contexts surround it: the modules run
    inside are reduced and updated at its exit, and their backward pass updates at its end, on
    their own. What a graphed callable captures (see cuda_graphs.py): its forward graph then
    holds the forward update and its backward graph the backward update, so every replay does
    what an eager step does. The surrounding contexts are restored afterwards."""
    saved = (_LOCAL.stack, _LOCAL.forward_steps, _LOCAL.backward_steps, _LOCAL.pass_id,
             _LOCAL.isolated)
    _LOCAL.stack, _LOCAL.forward_steps, _LOCAL.backward_steps = [], {}, {}
    _LOCAL.isolated = True
    try:
        with fp8_autocast(enabled=enabled, fp8_recipe=fp8_recipe, fp8_group=fp8_group):
            yield
    finally:
        (_LOCAL.stack, _LOCAL.forward_steps, _LOCAL.backward_steps, _LOCAL.pass_id,
         _LOCAL.isolated) = saved


def autocast(enabled: bool = True, calibrating: bool = False, recipe: Optional[Recipe] = None,
             amax_reduction_group=None, _graph: bool = False):
    """Transformer Engine 2.x's spelling of fp8_autocast, with its argument names:
    ``autocast(enabled, calibrating, recipe, amax_reduction_group)`` is
    ``fp8_autocast(enabled, calibrating, fp8_recipe, fp8_group)``."""
    return fp8_autocast(enabled=enabled, calibrating=calibrating, fp8_recipe=recipe,
                        fp8_group=amax_reduction_group, _graph=_graph)


class _InitRecipe(threading.local):
    def __init__(self):
        self.stack: list = []


_INIT = _InitRecipe()


def init_recipe() -> Optional[Recipe]:
    """The recipe of the innermost quantized_model_init of this thread, or None."""
    return _INIT.stack[-1] if _INIT.stack else None


@contextlib.contextmanager
def quantized_model_init(enabled: bool = True, recipe: Optional[Recipe] = None,
                         preserve_high_precision_init_val: bool = False) -> Iterator[None]:
    """FP8 modules built inside (transformer_fp8.Linear, convert_to_fp8) are built for
    ``recipe`` (default DelayedScaling()): their FP8 state has the recipe's shapes from the start,
    as with their own ``recipe=`` argument, which takes precedence.

    Transformer Engine's context of this name also stores the weights in FP8 only; here the
    parameters always stay in their high-precision dtype (so preserve_high_precision_init_val,
    accepted for the signature's sake, changes nothing). enabled=False builds as outside.
    """
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be True or False, got {type(enabled).__name__}")
    if recipe is not None and not isinstance(recipe, RECIPE_TYPES):
        raise TypeError("recipe must be None, a DelayedScaling, Float8CurrentScaling, "
                        "Float8BlockScaling or Float8RowwiseScaling, got "
                        f"{type(recipe).__name__}")
    _INIT.stack.append((recipe or DelayedScaling()) if enabled else None)
    try:
        yield
    finally:
        _INIT.stack.pop()


fp8_model_init = quantized_model_init  # Transformer Engine 1.x's name
