"""fp8_autocast (TE 2.x: autocast): where FP8 modules record their amaxes and where delayed scales
get updated; quantized_model_init: building FP8 modules for a recipe, with FP8 weights.

Inside the outermost context every FP8 module that runs with delayed scaling records the amax of
its input and weight into row 0 of its forward history (in the same pass as the cast). When the
outermost context exits, the recorded rows of all modules are all-reduced (MAX) across fp8_group
in ONE collective, then ONE update_delayed_scaling call (per device) rolls every history and sets
every scale. The backward amaxes (grad_output) go the same way, once per backward pass: at the
end of each backward pass that ran through the modules of a forward pass.

This file is the context: its entry, its exit, its AutocastState objects. This thread's stack
and the steps its outermost context collects (record_forward, the exit's reduce and update) are
autocast_steps.py's; the steps themselves, amax_step.py's (AmaxStep) and backward_step.py's
(BackwardStep).
"""
from __future__ import annotations

import contextlib
import itertools
import os
from typing import Iterator, Optional

import torch

from . import adoption_undo
from .amax_step import _AWAITING_RECIPE, adopt_recipe_for_waiting_modules
# The thread's stack and steps (autocast_steps.py), also under this module's names, which their
# readers use: LOCAL (the modules' forward), record_forward (roles.py, calibration.py,
# modules/linear_fused_step.py); _prepare_steps is looked up here at every entry.
from .autocast_steps import (_LOCAL, LOCAL, MAX_KEPT_RECIPES, AutocastState,  # noqa: F401
                             _exit_outermost, _prepare_steps, record_forward)
from .backward_step import (_HELD_BACKWARD_STEPS, _PENDING_BACKWARD_STEPS,
                            _QUEUED_BACKWARD_STEPS, discard_failed_backward_passes,
                            flush_pending_backward_updates, has_pending_backward_updates)
from .recipe import RECIPE_TYPES, DelayedScaling, Recipe
from .transforms import functorch_level as _functorch_level
from .transforms import refuse_functorch_transform


_is_compiling = torch.compiler.is_compiling
_pass_ids = itertools.count(1)


def forward_pass_id() -> int:
    """A number that identifies this thread's current (or last) outermost fp8_autocast, unique
    across threads and increasing with time: the forward pass a module runs in."""
    return _LOCAL.pass_id


def current_state() -> Optional[AutocastState]:
    """The innermost active fp8_autocast of this thread, or None outside any."""
    return _LOCAL.stack[-1] if _LOCAL.stack else None


_STATES: dict = {}
_STEP_KEYS: dict = {}
_LAST_STATE: list = [None]


# adoption_undo's records of the running outermost contexts (.frames: this thread's).
_ADOPTIONS = adoption_undo.THREAD_LOCAL

_DEFAULT_RECIPE: list = [None, None]  # (NVTE_BACKWARD_OVERRIDE when made, the recipe)


def _default_recipe() -> DelayedScaling:
    """DelayedScaling(), made once (a context made without a recipe at every step would make
    and hash a new one each time), again if the environment variable its default reads has
    changed."""
    env = os.environ.get("NVTE_BACKWARD_OVERRIDE")
    if _DEFAULT_RECIPE[1] is None or _DEFAULT_RECIPE[0] != env:
        _DEFAULT_RECIPE[:] = [env, DelayedScaling()]
    return _DEFAULT_RECIPE[1]


def _state_for(enabled: bool, recipe: Recipe, group, calibrating: bool = False) -> AutocastState:
    """One AutocastState object per (enabled, recipe, group, calibrating): torch.compile guards
    on the object a compiled module reads, so a new one at every step would recompile every
    step."""
    last = _LAST_STATE[0]
    if (last is not None and last.recipe is recipe and last.group is group
            and last.enabled is enabled and last.calibrating is calibrating):
        return last  # (the same objects as the last context's: no recipe hashed)
    key = (enabled, recipe, group, calibrating)
    state = _STATES.pop(key, None)
    if state is None:
        step_key = _STEP_KEYS.setdefault((recipe, group), object())
        state = AutocastState(enabled, recipe, group, calibrating, step_key)
    _STATES[key] = state  # (the most recently used last)
    if len(_STATES) > MAX_KEPT_RECIPES:
        _forget_least_recent_state()
    _LAST_STATE[0] = state
    return state



def _forget_least_recent_state() -> None:
    oldest = _STATES.pop(list(_STATES)[0], None)  # (a copy of the keys: another thread may
    if oldest is None:                             # add one meanwhile)
        return
    if all(state.step_key is not oldest.step_key for state in _STATES.values()):
        _STEP_KEYS.pop((oldest.recipe, oldest.group), None)


class fp8_autocast(contextlib.ContextDecorator):
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
    context, or it exits under no_grad or inference_mode (an evaluation; calibration excepted),
    the amaxes recorded in it are discarded and no scale changes.

    (A class rather than a generator-based context manager: entered and left on every step, it
    costs less host time. Its arguments are checked when it is made; it may be entered again
    once left, and decorate a function, as contextlib's context managers can.)
    """

    def __init__(self, enabled: bool = True, calibrating: bool = False,
                 fp8_recipe: Optional[Recipe] = None, fp8_group=None, _graph: bool = False):
        last = _LAST_STATE[0]
        if (last is not None and fp8_recipe is last.recipe and fp8_group is last.group
                and enabled is last.enabled and calibrating is False and _graph is False
                and not last.calibrating):
            # The arguments of the last context made (a training loop makes one per step):
            # checked then, and its state (see _state_for).
            self._state = last
            self._delayed = enabled and isinstance(fp8_recipe, DelayedScaling)
            return
        if _is_compiling() and _is_dynamo_compiling():
            _refuse_in_dynamo()  # (the bookkeeping below is more than Dynamo traces)
        if not isinstance(enabled, bool):
            raise TypeError(f"enabled must be True or False, got {type(enabled).__name__}")
        if not isinstance(calibrating, bool):
            raise TypeError("calibrating must be True or False, got "
                            f"{type(calibrating).__name__}")
        if _graph:
            raise ValueError("fp8_autocast: _graph=True (Transformer Engine's internal flag for "
                             "graph capture) is not supported; use make_graphed_callables")
        if fp8_recipe is None:
            fp8_recipe = _default_recipe()
        if not isinstance(fp8_recipe, RECIPE_TYPES):
            raise TypeError("fp8_recipe must be a DelayedScaling, Float8CurrentScaling, "
                            "Float8BlockScaling or Float8RowwiseScaling, got "
                            f"{type(fp8_recipe).__name__}")
        if fp8_group is not None and not (
                torch.distributed.is_available()
                and isinstance(fp8_group, torch.distributed.ProcessGroup)):
            raise TypeError("fp8_group must be None or a torch.distributed.ProcessGroup, got "
                            f"{type(fp8_group).__name__}")
        self._state = _state_for(enabled, fp8_recipe, fp8_group, calibrating and not enabled)
        # Whether the modules inside record delayed-scaling amaxes (steps to prepare).
        self._delayed = enabled and isinstance(fp8_recipe, DelayedScaling)

    def __enter__(self) -> None:
        state, delayed = self._state, self._delayed
        # (The module-level containers read directly: entered on every step, these checks
        # cost less than the calls that would make them.)
        local = _LOCAL
        stack = local.stack
        outermost = not stack
        if state.enabled:
            if _is_compiling():  # (traced: Dynamo refused, torch.export's entry)
                return _enter_traced(state, outermost)
            if _functorch_level() is not None:
                refuse_functorch_transform("fp8_autocast(enabled=True) entered")  # (raises)
        if outermost:  # (a failed step's recipe adoptions are undone at its exit)
            _ADOPTIONS.frames.append(None)
        try:
            if delayed and _AWAITING_RECIPE.data:  # (delayed: enabled, so not compiling)
                adopt_recipe_for_waiting_modules(state.recipe)
            if outermost:
                local.pass_id = next(_pass_ids)
                # (Not in an isolated context, which a graph may be capturing: the held
                # updates belong to the surrounding step and run at its next outermost
                # context. Nor under no_grad: an evaluation forward may come between a training
                # forward and its compiled backward, whose held update must wait for it; a
                # forward without gradients reads no grad_output scale. Nor in a forward that
                # torch.export traces: its program would write the FP8 state; only a disabled
                # context gets here traced.)
                if ((_QUEUED_BACKWARD_STEPS or _PENDING_BACKWARD_STEPS or _HELD_BACKWARD_STEPS)
                        and not local.isolated and (state.enabled or not _is_compiling())):
                    discard_failed_backward_passes()
                    if has_pending_backward_updates() and torch.is_grad_enabled():
                        flush_pending_backward_updates(this_thread_only=True)
            if delayed and state.step_key not in local.forward_steps:
                _prepare_steps(state)
        except BaseException:
            if outermost:
                adoption_undo.end(failed=True)
            raise
        if state.calibrating:
            local.calibrating = True
        stack.append(state)

    def __exit__(self, exc_type, exc, traceback) -> bool:
        # Outermost is this thread's: the object may be entered by several threads at once (a
        # decorator, a shared context) and recursively, so it keeps no state of its own.
        stack = _LOCAL.stack
        stack.pop()
        if not stack:
            failed = exc_type is not None
            try:
                _exit_outermost(failed)
            except BaseException:  # (an update that raises discards its step: a failed one)
                adoption_undo.end(failed=True)
                raise
            frames = _ADOPTIONS.frames
            if failed or frames[-1] is not None:
                if type(frames[-1]) is _TracedFrame:  # (entered traced: see _enter_traced)
                    _LOCAL.isolated = frames[-1].isolated
                adoption_undo.end(failed)
            else:
                frames.pop()  # (nothing adopted: the common case, inline)
        return False


# Where Dynamo traces fp8_autocast (inside torch.compile or a strict torch.export): it cannot
# trace the context's bookkeeping (thread-local steps, counters), and a step's update traced
# into a graph would run at every call of it.
_IN_DYNAMO_MESSAGE = (
    "transformer_fp8: fp8_autocast was entered inside a function that torch.compile "
    "(fullgraph=True) or torch.export (strict=True) traces; enter fp8_autocast outside the "
    "compiled or exported function: `with fp8_autocast(...): compiled_model(x)`, or "
    "`with fp8_autocast(...): torch.export.export(model, args)` (torch.export with "
    "strict=False also traces a forward that enters it)")
_is_dynamo_compiling = getattr(torch.compiler, "is_dynamo_compiling", lambda: True)


def _refuse_in_dynamo() -> None:
    """Called while Dynamo traces fp8_autocast: raises _IN_DYNAMO_MESSAGE, the error under
    torch.compile(fullgraph=True) and a strict torch.export (before, one about a Dynamo
    limitation in the bookkeeping). Without fullgraph Dynamo gives up on the frame, which runs
    eagerly, as it did at that bookkeeping. (Not a graph break: Dynamo traced on after one, and
    a compiled step that entered the context lost its backward update.)"""
    raise RuntimeError(_IN_DYNAMO_MESSAGE)


class _TracedFrame(list):
    """The adoption frame (adoption_undo) of an outermost fp8_autocast entered while traced
    (torch.export, strict=False), holding the thread's ``isolated`` flag to restore at exit."""

    def __init__(self, isolated: bool):
        super().__init__()
        self.isolated = isolated


def _enter_traced(state: AutocastState, outermost: bool) -> None:
    """fp8_autocast(enabled=True) entered while torch.compile or torch.export traces.
    Dynamo: refused (_refuse_in_dynamo). torch.export (strict=False) traces the Python
    forward: the modules inside see the state, and nothing else runs, at the entry or at the
    exit: the exported program has no step machinery (its casts record no amax:
    roles._delayed), and a discard or an update traced at the exit would write the model's FP8
    state at every call of the program."""
    if _is_dynamo_compiling():
        _refuse_in_dynamo()
    local = _LOCAL
    if outermost:
        # The exit's step work (_exit_outermost) then finds no step and, with isolated set,
        # holds no backward step; __exit__ restores isolated from the frame.
        _ADOPTIONS.frames.append(_TracedFrame(local.isolated))
        local.isolated = True
    if state.calibrating:
        local.calibrating = True
    local.stack.append(state)


@contextlib.contextmanager
def isolated_fp8_autocast(enabled: bool, fp8_recipe: Optional[Recipe], fp8_group) -> Iterator[None]:
    """fp8_autocast as the outermost context, whatever contexts surround it: the modules run
    inside are reduced and updated at its exit, and their backward pass updates at its end, on
    their own. What a graphed callable captures (see cuda_graphs.py): its forward graph then
    holds the forward update and its backward graph the backward update, so every replay does
    what an eager step does. The surrounding contexts are restored afterwards."""
    saved = (_LOCAL.stack, _LOCAL.forward_steps, _LOCAL.backward_steps, _LOCAL.pass_id,
             _LOCAL.isolated, _LOCAL.calibrating, _LOCAL.evaluated)  # (not kept_steps: an
    _LOCAL.stack, _LOCAL.forward_steps, _LOCAL.backward_steps = [], {}, {}  # isolated context
    _LOCAL.isolated, _LOCAL.calibrating, _LOCAL.evaluated = True, False, []  # has its own)
    try:
        with fp8_autocast(enabled=enabled, fp8_recipe=fp8_recipe, fp8_group=fp8_group):
            yield
    finally:
        (_LOCAL.stack, _LOCAL.forward_steps, _LOCAL.backward_steps, _LOCAL.pass_id,
         _LOCAL.isolated, _LOCAL.calibrating, _LOCAL.evaluated) = saved


def autocast(enabled: bool = True, calibrating: bool = False, recipe: Optional[Recipe] = None,
             amax_reduction_group=None, _graph: bool = False):
    """Transformer Engine 2.x's spelling of fp8_autocast, with its argument names:
    ``autocast(enabled, calibrating, recipe, amax_reduction_group)`` is
    ``fp8_autocast(enabled, calibrating, fp8_recipe, fp8_group)``."""
    return fp8_autocast(enabled=enabled, calibrating=calibrating, fp8_recipe=recipe,
                        fp8_group=amax_reduction_group, _graph=_graph)
