"""The step machinery of delayed scaling: the amax states (ScalingState: history, scale,
scale_inv) recorded under one recipe and process group, reduced across ranks in ONE collective
and updated in ONE call per device (AmaxStep), once at the outermost fp8_autocast's exit for the
forward and once per backward pass for grad_output (BackwardStep); the updates held back for
reentrant checkpointing and compiled backwards. The registry of states that lays out the
cross-rank reduction is scaling_state.py's; the prepared updates, update_plan.py's.
"""
from __future__ import annotations

import gc
import threading
import weakref
from typing import Optional

import torch

from .. import _C
from . import replay as checkpointing
from . import scaling_state
from .recipe import DelayedScaling
from .scaling_state import ScalingState
from .update_plan import (UpdatePlan, all_reduce_max,  # noqa: F401 (all_reduce_max: quantizer's)
                          check_same_layout, layout_of, world_size)


# The forward states of FP8 modules with no recipe yet (built without one, reset, or reloaded):
# an fp8_autocast with a DelayedScaling recipe adopts it for them at its entry, before any of
# them runs, so that a compiled region never has to resize a history. Empty in steady state.
_AWAITING_RECIPE: "weakref.WeakValueDictionary[int, ScalingState]" = \
    weakref.WeakValueDictionary()


def await_recipe(state: ScalingState) -> None:
    _AWAITING_RECIPE[state.key] = state


def recipe_adopted(key: int) -> None:
    _AWAITING_RECIPE.pop(key, None)


def adopt_recipe_for_waiting_modules(recipe: DelayedScaling) -> None:
    """Called when an fp8_autocast under ``recipe`` is entered (see _AWAITING_RECIPE)."""
    if not _AWAITING_RECIPE:
        return  # the steady state: every module has its recipe
    for state in list(_AWAITING_RECIPE.values()):
        if not state.scale.is_meta:  # (a meta module adopts when materialised)
            state.takes_recipe(recipe)


# Plans of the steps that cover every state of a recipe (ranks reduce), by (recipe, role,
# devices, compiled count): the same whichever states recorded. Entries of older generations
# are dropped when a new one is made.
_EVERY_STATE_PLANS: dict = {}
# The layout of the last plan made under each such key, kept when the plan is dropped: a plan
# made again with the same layout (one rank built a layer on another device, say) needs no
# agreement; a new layout is agreed on by the ranks (see AmaxStep._plan_for_step).
_LAST_LAYOUT: dict = {}


def _collect_dead_layers() -> None:
    """The garbage collector frees the dead layers (held in reference cycles) that some ranks
    have freed and others not: what a rank reduces must not depend on when its collector ran.
    Called only where the ranks make a plan of the reduction again."""
    gc.collect()


def _can_synchronize() -> bool:
    """Whether a plan being made may collect garbage and wait for a collective's result: not
    while torch.compile traces, nor while a CUDA graph is captured."""
    if torch.compiler.is_compiling():
        return False
    return not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


class AmaxStep:
    """The scaling states recorded under one (recipe, group), reduced and updated together; role
    is "fwd" or "bwd". Keys (creation indices) order the states identically on every rank.

    Ranks may run different subsets of the modules in a step (mixture-of-experts routing): the
    reduction then covers every state of the process that trains with this recipe, so that
    every rank's buffer has the same layout; a module that ran on no rank keeps its state (the
    update leaves a column with no recorded amax untouched).

    fp8_autocast keeps one step per (recipe, group) and thread from one training step to the
    next (autocast.py): a state, once added, stays covered until it is added to another step
    (a state belongs to one step at most: ``state.step``) or its module is freed. Covering a
    state that recorded nothing this time changes no number (its columns are left untouched),
    and the step's plan (UpdatePlan) is made once, not at every step: adding a state it holds
    is one attribute read."""

    def __init__(self, recipe: DelayedScaling, group, role: str = "fwd",
                 include_unrecorded: bool = True):
        self.recipe, self.group, self.role = recipe, group, role
        # False in a graphed callable (see isolated_fp8_autocast): the step covers exactly the
        # modules that recorded, which are the same on every rank (a graph is static).
        self.include_unrecorded = include_unrecorded
        # The states covered, by creation index, weakly (a freed module's state leaves).
        self._refs: dict[int, weakref.ref] = {}
        self._plan = None  # the plan of the states covered, once made

    @property
    def states(self) -> dict[int, ScalingState]:
        """The live states covered, by creation index."""
        states = {key: ref() for key, ref in list(self._refs.items())}
        return {key: state for key, state in states.items() if state is not None}

    def add(self, state: ScalingState) -> None:
        if state.step is self:
            return  # (the common case: covered since an earlier step)
        if state.step is not None:
            state.step._remove(state)  # it moves here: no other step updates it
        state.step = self
        self._refs[state.key] = weakref.ref(state, self._freed)
        self._plan = None

    def _remove(self, state: ScalingState) -> None:
        ref = self._refs.get(state.key)
        if ref is not None and ref() is state:
            self._refs.pop(state.key, None)
            self._plan = None

    def _freed(self, ref: weakref.ref) -> None:
        """A covered state's module was freed (called by the garbage collector, any thread, at
        a moment that differs from rank to rank): it leaves the step. Where ranks reduce, the
        plan is kept until the next change of the states (scaling_state.generation) or of the
        step's membership, so that the collector's timing never decides a rank's reduction
        (until then the plan holds the freed state's small tensors, and updates them: a column
        with nothing recorded is left untouched); elsewhere the plan goes with it, and with the
        plan the freed state's tensors."""
        for key, held in list(self._refs.items()):
            if held is ref:
                self._refs.pop(key, None)
                if not self._reduces():
                    self._plan = None

    def _reduces(self) -> bool:
        return self.recipe.reduce_amax and world_size(self.group) > 1

    def _recorded_plan(self, reduce: bool = False) -> Optional[UpdatePlan]:
        """The plan of exactly the states covered (made if none is current), or None when no
        state is. ``reduce``: ranks reduce, and where the plan is made again, the garbage
        collector runs first (as _plan_for_step's does), so that a layer freed on one rank and
        not yet on another is covered on neither."""
        plan = self._plan
        if plan is not None and plan.is_current(self.recipe):
            return plan
        if reduce and _can_synchronize():
            _collect_dead_layers()
        states = self.states
        if not states:
            return None
        plan = UpdatePlan([states[key] for key in sorted(states)], self.recipe, self.role)
        self._plan = plan
        return plan

    def _plan_for_step(self, reduce: bool, agree: bool = True):
        """The plan of the step's states, or None when it has none. The step also covers the
        states of the process that train with this recipe and recorded nothing: every one when
        ranks reduce (some may have run on other ranks only), else the compiled ones (a compiled
        forward records its amaxes in the history but registers nothing: a traced side effect
        is refused inside a checkpointed region). A state that recorded nothing keeps its
        values: the update leaves an unrecorded column untouched. States on another device than
        the recorded ones are left out (a CPU copy of the model, say), unless none recorded.
        ``reduce``: whether ranks reduce (_reduces()). ``agree``: False for a step that failed
        on this rank (discard): no collective, and the plan is not kept."""
        if not (self.include_unrecorded and (reduce or _COMPILED_MODULES)):
            return self._recorded_plan()
        recorded = self._recorded_plan(reduce)
        devices = recorded.devices if recorded is not None else frozenset()
        if reduce:
            key = (self.recipe, self.role, devices, len(_COMPILED_MODULES))
            cache = _EVERY_STATE_PLANS
        else:
            key = (self.recipe, self.role, len(_COMPILED_MODULES))
            cache = recorded.completions if recorded is not None else _EVERY_STATE_PLANS
        plan = cache.get(key)
        if plan is not None and plan.is_current(self.recipe):
            return plan
        synchronize = reduce and agree and _can_synchronize()
        if synchronize:
            _collect_dead_layers()  # (first: so that the layout below does not depend on it)
        states = self._covered_states(devices, reduce)
        if not agree:
            return UpdatePlan(states, self.recipe, self.role) if states else None
        if synchronize and states and _LAST_LAYOUT.get(key) != layout_of(states):
            # The reduction's layout changes. In a program that builds and changes the same
            # layers on every rank, it does so on every rank at this step: the ranks agree on
            # it (a rank that made layers of its own on another device keeps its layout and
            # needs no agreement).
            check_same_layout(layout_of(states), self.group, states[0].device)
        if not states:
            return None
        plan = UpdatePlan(states, self.recipe, self.role)
        if reduce:
            _LAST_LAYOUT[key] = plan.layout
        for old in [k for k, p in cache.items() if p.generation != plan.generation]:
            del cache[old]  # (made before a change: they would hold tensors no longer in use)
        cache[key] = plan
        return plan

    def _covered_states(self, devices, reduce: bool) -> list[ScalingState]:
        """The states recorded and, by creation index, those of the process that train with
        this recipe on ``devices`` (every one when ranks reduce, else the compiled ones)."""
        states = dict(self.states)
        for state in scaling_state.registered(self.role):
            if state.key not in states and (reduce or state.key in _COMPILED_MODULES):
                if state.takes_recipe(self.recipe) and (not devices or state.device in devices):
                    states[state.key] = state
        return [states[key] for key in sorted(states)]

    def reduce_and_update(self) -> None:
        reduce = self._reduces()
        plan = self._plan
        if (not reduce and plan is not None and plan.generation == scaling_state._current[0]
                and plan.recipe is self.recipe
                and not (_COMPILED_MODULES and self.include_unrecorded)):
            plan.update()  # (the common case: _plan_for_step's answer, without its calls)
            return
        try:
            plan = self._plan_for_step(reduce)
        except RuntimeError:  # the ranks disagree on the layout: this step changes nothing
            self.discard()
            raise
        if plan is None:
            return
        if reduce:
            plan.reduce(self.group)
        plan.update()

    def discard(self) -> None:
        """Forget the amaxes recorded since the last update (after an exception)."""
        plan = self._plan_for_step(self._reduces(), agree=False)
        if plan is not None:
            plan.discard()


class BackwardStep:
    """The grad_output states of the modules run under one (recipe, group), kept from step to
    step as AmaxStep's. The first FP8 backward of a backward pass queues the update for the end
    of that pass, so every backward pass (one per microbatch, retain_graph, a frozen first
    layer...) is followed by exactly one update.

    A reentrant activation checkpoint backpropagates its region in a nested backward pass; its
    end is not the end of the step's backward (a layer called in two regions is still to run
    its second backward), so the update waits: it runs at the next update of this step, or at
    the next outermost fp8_autocast, or when a layer's state_dict is taken, whichever is first.
    Until the next backward nothing reads the grad_output scales, so the numbers are the same.
    """

    def __init__(self, recipe: DelayedScaling, group, include_unrecorded: bool = True):
        self.step = AmaxStep(recipe, group, role="bwd", include_unrecorded=include_unrecorded)
        self._queued = False
        self._queued_task = None  # the graph task (backward pass) that queued the update
        self.thread = threading.get_ident()  # whose forward passes it covers (see autocast)
        # Shared by the hooks that the C++ steps attach to their nodes (csrc/step_ops.h): only
        # the first node of a backward pass calls on_backward(); cleared with _queued.
        self._once = _C.BackwardOnce(self)

    def add(self, state: ScalingState) -> None:
        self.step.add(state)

    def on_backward(self) -> None:
        task = _current_graph_task_id()
        if self._queued:
            if task == self._queued_task or checkpointing.in_reentrant_backward():
                return  # queued by this pass (or by the pass whose checkpoint this one runs)
            # Queued by a pass that ended without running its callback: it failed (the engine
            # drops the callbacks of a pass that raises). Its amaxes are discarded, as at the
            # next outermost fp8_autocast, and this pass queues its own update.
            _QUEUED_BACKWARD_STEPS.pop(id(self), None)
            self.discard()
        self._queued, self._queued_task = True, task
        # (One dict operation: atomic, no lock needed; the lock guards the compound ones.)
        _QUEUED_BACKWARD_STEPS[id(self)] = self
        _queue_callback(self._finish)

    def hold_for_compiled_autograd(self) -> None:
        """Called instead of on_backward, on every backward pass that compiled autograd runs
        through a C++ step (csrc/step_ops.h's CallOnBackward: compiled autograd
        has no end-of-pass callback for a hook to queue): the update is held for the next
        outermost fp8_autocast, as every later forward pass's (see note_compiled_backward)."""
        _COMPILED_BACKWARD_SEEN[0] = True
        with _PENDING_LOCK:
            _HELD_BACKWARD_STEPS.append(self)

    def _finish(self) -> None:
        self._queued = False
        self._once.clear()
        _QUEUED_BACKWARD_STEPS.pop(id(self), None)
        if checkpointing._KEPT_ANY[0] and checkpointing.in_reentrant_backward():  # (the call
            # only where a checkpointed FP8 forward ever ran)
            _PENDING_BACKWARD_STEPS[id(self)] = self
            return
        if _PENDING_BACKWARD_STEPS:
            _PENDING_BACKWARD_STEPS.pop(id(self), None)
        self.step.reduce_and_update()  # (update(), inline)

    def discard(self) -> None:
        """Its backward pass failed, so its queued update never ran: forget its amaxes."""
        self._queued = False
        self._once.clear()
        self.step.discard()

    def update(self) -> None:
        if _PENDING_BACKWARD_STEPS:
            _PENDING_BACKWARD_STEPS.pop(id(self), None)
        self.step.reduce_and_update()


_queue_callback = torch.autograd.Variable._execution_engine.queue_callback
_current_graph_task_id = torch._C._current_graph_task_id

# Backward updates held back at the end of a reentrant checkpoint's nested backward pass (they
# may be recorded on autograd's worker threads, hence a lock for the compound operations on
# them rather than thread-local state).
_PENDING_LOCK = threading.Lock()
_PENDING_BACKWARD_STEPS: dict[int, BackwardStep] = {}


# Backward steps whose end-of-pass update is queued. The autograd engine drops the queue when a
# backward pass raises: a step still here when the next outermost fp8_autocast is entered (or a
# state_dict taken) belongs to a pass that failed, and its grad_output amaxes are discarded, as
# an exception leaving fp8_autocast discards the forward's (so a failed step changes no scale).
_QUEUED_BACKWARD_STEPS: dict[int, BackwardStep] = {}


def discard_failed_backward_passes() -> None:
    """Discard the amaxes of this thread's backward passes that failed: its steps still queued.
    (Another thread's queued step may belong to a backward pass running now.)"""
    if not _QUEUED_BACKWARD_STEPS or torch._C._current_graph_task_id() != -1:
        return  # called from inside a backward pass (a recomputed region): none has failed
    thread = threading.get_ident()
    with _PENDING_LOCK:
        failed = [step for step in _QUEUED_BACKWARD_STEPS.values() if step.thread == thread]
        for step in failed:
            del _QUEUED_BACKWARD_STEPS[id(step)]
    for step in failed:
        step.discard()


# The backward steps of the last forward passes in a process that compiles FP8 modules: a
# compiled backward cannot queue its update, which runs at the next outermost fp8_autocast (or
# state_dict). (After an eager backward's own update it finds nothing recorded: a no-op.)
_HELD_BACKWARD_STEPS: list = []

# Creation indices of the FP8 modules that torch.compile has traced (see note_compiled).
_COMPILED_MODULES: set = set()

# Whether a backward pass through FP8 modules was traced (note_compiled_backward) or compiled
# autograd ran one (hold_for_compiled_autograd) in this process.
_COMPILED_BACKWARD_SEEN = [False]


@torch.compiler.assume_constant_result
def note_compiled(key: str) -> bool:
    """Called by a traced FP8 forward: torch.compile runs it once, while tracing (its result is
    baked into the graph as a constant), so this side effect is allowed even inside a
    checkpointed region, and costs nothing at run time."""
    _COMPILED_MODULES.add(int(key))  # (key: the module's creation index, as a string)
    return True


@torch.compiler.assume_constant_result
def note_compiled_backward() -> bool:
    """Called by an FP8 backward that torch.compile or compiled autograd traces (Fp8Plan.
    on_backward), once per trace: the result is baked into the graph, which calls nothing here
    when it runs. From now on every forward pass's backward steps are held for the next
    outermost fp8_autocast; so are those of this thread's last forward pass, whose backward
    this trace may be (compiled autograd traces at the first backward of the eager forward)."""
    _COMPILED_BACKWARD_SEEN[0] = True
    with _PENDING_LOCK:
        _HELD_BACKWARD_STEPS.extend(getattr(_LAST_FORWARD, "backward_steps", ()))
    _LAST_FORWARD.backward_steps = ()
    return True


# This thread's last forward pass's backward steps, where they were not held.
_LAST_FORWARD = threading.local()


def hold_for_compiled_backward(backward_steps: list) -> None:
    """The backward steps of a forward pass that has just ended, held for a compiled backward
    when the process compiles FP8 modules or runs compiled autograd (see
    _HELD_BACKWARD_STEPS)."""
    if not torch.is_grad_enabled():
        return  # (no backward pass to come: an eval forward keeps the last training one)
    if _COMPILED_MODULES or _COMPILED_BACKWARD_SEEN[0]:
        _HELD_BACKWARD_STEPS.extend(backward_steps)
    else:
        _LAST_FORWARD.backward_steps = backward_steps


def has_pending_backward_updates() -> bool:
    return bool(_PENDING_BACKWARD_STEPS or _HELD_BACKWARD_STEPS)


def flush_pending_backward_updates(this_thread_only: bool = False) -> None:
    """Run the backward updates held back (see BackwardStep), oldest first: every one, or
    (``this_thread_only``, at an outermost fp8_autocast) those of this thread's steps, whose
    backward passes have ended (another thread's may be running)."""
    thread = threading.get_ident()
    with _PENDING_LOCK:
        pending = [step for step in _PENDING_BACKWARD_STEPS.values()
                   if not this_thread_only or step.thread == thread]
        held = list(dict.fromkeys(_HELD_BACKWARD_STEPS))  # each step once, in order
        if this_thread_only:
            _HELD_BACKWARD_STEPS[:] = [step for step in _HELD_BACKWARD_STEPS
                                       if step.thread != thread]
            held = [step for step in held if step.thread == thread]
        else:
            _HELD_BACKWARD_STEPS.clear()
    for step in pending:
        step.update()
    for step in held:
        if not step._queued:
            step.update()
