"""The grad_output half of delayed scaling's step machinery: one BackwardStep per (recipe, group)
and thread queues its AmaxStep's update for the end of every backward pass; the updates that
cannot run there are kept here until the next outermost fp8_autocast (or state_dict): those of
passes that failed (discarded), of reentrant checkpoints' nested passes and of compiled
backwards (run).
"""
from __future__ import annotations

import functools
import threading

import torch

from .. import _C
from . import checkpoint_stack
from .amax_step import _COMPILED_MODULES, AmaxStep, update_all
from .recipe import DelayedScaling
from .scaling_state import ScalingState


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
            if task == self._queued_task or checkpoint_stack.in_reentrant_backward():
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
        if checkpoint_stack.KEPT_ANY[0] and checkpoint_stack.in_reentrant_backward():  # (the call
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
    """Discard the amaxes of this thread's backward passes that failed: its steps still queued,
    and those held back by reentrant checkpoints' nested passes whose enclosing pass never
    ended (update_at_end_of_pass). (Another thread's queued step may belong to a backward pass
    running now.)"""
    if torch._C._current_graph_task_id() != -1:
        return  # called from inside a backward pass (a recomputed region): none has failed
    thread = threading.get_ident()
    failed = []
    with _PENDING_LOCK:
        if _QUEUED_BACKWARD_STEPS:
            failed = [step for step in _QUEUED_BACKWARD_STEPS.values() if step.thread == thread]
            for step in failed:
                del _QUEUED_BACKWARD_STEPS[id(step)]
        unfinished = [task for task, owner in _PASSES_TO_END.items() if owner == thread]
        if unfinished:  # an enclosing pass that queued its end-of-pass update, then failed
            for task in unfinished:
                del _PASSES_TO_END[task]
            held_back = [step for step in _PENDING_BACKWARD_STEPS.values()
                         if step.thread == thread]
            for step in held_back:
                del _PENDING_BACKWARD_STEPS[id(step)]
            failed += held_back
    for step in failed:
        step.discard()


# The backward passes that will run, when they end, the updates held back by the reentrant
# checkpoints in them (update_at_end_of_pass): graph task id -> the thread whose steps they
# update (its forward ran them; the pass itself may run on autograd's device threads). A pass
# still here when that thread is outside any backward pass failed.
_PASSES_TO_END: dict = {}


def update_at_end_of_pass(thread: int) -> None:
    """Called before the backward of a reentrant checkpoint's region (of layers run by
    ``thread``), in the backward pass that reached the checkpoint: the grad_output updates
    that the region's nested pass (and those of regions nested in it) hold back
    (BackwardStep._finish) run when that pass ends, as a pass without checkpointing updates at
    its end (two backward passes between fp8_autocast entries each update). If it fails, they
    are discarded at the next outermost fp8_autocast, as a failed pass's are. A region inside
    another one's nested pass leaves it to the outermost region."""
    task = _current_graph_task_id()
    if task == -1 or checkpoint_stack.reentrant_depth() != 0:
        return
    with _PENDING_LOCK:
        if task in _PASSES_TO_END:
            return
        _PASSES_TO_END[task] = thread
    _queue_callback(functools.partial(_end_of_pass, task, thread))


def _end_of_pass(task: int, thread: int) -> None:
    with _PENDING_LOCK:
        _PASSES_TO_END.pop(task, None)
        steps = [step for step in _PENDING_BACKWARD_STEPS.values() if step.thread == thread]
    update_all([(step, BackwardStep.update) for step in steps])


# The backward steps of the last forward passes in a process that compiles FP8 modules: a
# compiled backward cannot queue its update, which runs at the next outermost fp8_autocast (or
# state_dict). (After an eager backward's own update it finds nothing recorded: a no-op.)
_HELD_BACKWARD_STEPS: list = []

# Whether a backward pass through FP8 modules was traced (note_compiled_backward) or compiled
# autograd ran one (hold_for_compiled_autograd) in this process.
_COMPILED_BACKWARD_SEEN = [False]


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
    """The backward steps of a forward pass with gradients that has just ended (called by
    fp8_autocast's outermost exit under grad mode only: an eval forward keeps the last
    training one's), held for a compiled backward when the process compiles FP8 modules or
    runs compiled autograd (see _HELD_BACKWARD_STEPS)."""
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
    update_all([(step, BackwardStep.update) for step in pending]
               + [(step, _update_unless_queued) for step in held])


def _update_unless_queued(step: BackwardStep) -> None:
    if not step._queued:  # (a held step whose next pass is running queues its own update)
        step.update()
