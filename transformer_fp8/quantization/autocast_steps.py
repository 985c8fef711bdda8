"""This thread's fp8_autocast stack, and the steps its outermost context collects: an FP8 module
running with delayed scaling registers its scaling states with them (record_forward), and the
outermost exit reduces and updates them, or discards them (_exit_outermost). The context itself
(entry, exit, its AutocastState objects) is autocast.py's; the steps are amax_step.py's (AmaxStep)
and backward_step.py's (BackwardStep).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Optional

import torch

from . import checkpoint_stack
from .amax_step import AmaxStep, update_all
from .backward_step import BackwardStep, hold_for_compiled_backward
from .recipe import Recipe
from .scaling_state import ScalingState


@dataclass(frozen=True)
class AutocastState:
    """What an FP8 module sees when it runs: whether FP8 is on, the recipe, the group."""

    enabled: bool
    recipe: Recipe
    group: Optional["torch.distributed.ProcessGroup"]
    # Calibration: modules that run in high precision record their GEMM inputs' and weights'
    # amaxes (delayed scaling; see calibration.py), updated at the outermost exit as usual.
    calibrating: bool = False
    # The key of this (recipe, group)'s steps: one object per equal (recipe, group), hashed by
    # identity (a tuple key would hash the recipe's fields at every record).
    step_key: object = field(default=None, compare=False, repr=False)


class _ThreadAutocast(threading.local):
    """This thread's context stack and the steps recorded under its outermost context (the
    stack is per thread, as torch.autocast's is)."""

    def __init__(self):
        self.stack: list[AutocastState] = []
        # The steps of the (recipe, group)s used under the outermost context, by step_key.
        self.forward_steps: dict = {}
        self.backward_steps: dict = {}
        # The steps of every (recipe, group) this thread has used, kept from one outermost
        # context to the next: each covers its modules' states from step to step (see
        # AmaxStep), so that a step registers nothing new and reuses its prepared update.
        self.kept_steps: dict = {}
        self.pass_id = 0  # of the outermost context last entered (see autocast.forward_pass_id)
        self.isolated = False  # inside autocast.isolated_fp8_autocast
        self.calibrating = False  # a calibrating context was entered under the outermost one
        # Forward states an evaluation forward recorded into under a step other than theirs
        # (record_forward): their amaxes are forgotten at the exit, their step kept.
        self.evaluated: list = []


_LOCAL = _ThreadAutocast()
LOCAL = _LOCAL  # (read by the modules' forward: base.py's _dispatch)


# How many (recipe, group)s keep their AutocastState (autocast.py's _state_for) and steps: a
# recipe made anew at every step (a new lambda as amax_compute_algo compares unequal to the last)
# made one more of each at every step, never freed. Beyond this, the least recently used are
# forgotten; used again, they are made anew (the modules' states join the new steps, as they do
# at a recipe change).
MAX_KEPT_RECIPES = 64


def _prepare_steps(state: AutocastState):
    """The forward and backward steps of ``state``'s recipe and group under the outermost
    context, taken when a context is entered (eagerly, outside any compiled region) or at the
    first record: this thread's kept steps, made at the first use of the recipe and group.
    A compiled forward records its amaxes but registers nothing: the steps cover every module
    of the recipe (see AmaxStep._plan_for_step). An isolated context (a graphed callable's)
    has steps of its own, which cover exactly the modules that run in it."""
    local = _LOCAL  # (each attribute read once: a thread-local's cost several plain reads)
    k = state.step_key
    forward_steps = local.forward_steps
    if k not in forward_steps:
        if local.isolated:
            steps = _new_steps(state, include_unrecorded=False)
        else:
            kept = local.kept_steps
            steps = kept.get(k)
            if steps is None or next(reversed(kept)) is not k:  # (else the most recently
                steps = _kept_steps(kept, k, state, forward_steps)  # used already)
        forward_steps[k], local.backward_steps[k] = steps
    return k


def _new_steps(state: AutocastState, include_unrecorded: bool) -> tuple:
    return (AmaxStep(state.recipe, state.group, role="fwd",
                     include_unrecorded=include_unrecorded),
            BackwardStep(state.recipe, state.group, include_unrecorded=include_unrecorded))


def _kept_steps(kept: dict, k, state: AutocastState, in_use: dict) -> tuple:
    """The kept steps of step key ``k`` (made at its first use), now the most recently used:
    last in ``kept``. Beyond MAX_KEPT_RECIPES the least recently used not ``in_use`` go."""
    steps = kept.pop(k, None)
    if steps is None:
        steps = _new_steps(state, include_unrecorded=True)
    kept[k] = steps
    if len(kept) > MAX_KEPT_RECIPES:
        for old in [old for old in kept if old not in in_use][:len(kept) - MAX_KEPT_RECIPES]:
            del kept[old]
    return steps


def record_forward(state: AutocastState, fwd_state: ScalingState,
                   bwd_state: ScalingState) -> BackwardStep:
    """Called by an FP8 module running with delayed scaling: registers its forward state for the
    update at context exit and its backward state with the forward pass's BackwardStep, which
    it returns (its backward calls on_backward())."""
    local = _LOCAL
    backward_step = local.backward_steps.get(state.step_key)
    if backward_step is None:  # (steps taken at the first record, see _prepare_steps)
        backward_step = local.backward_steps[_prepare_steps(state)]
    forward_step = local.forward_steps[state.step_key]
    if fwd_state.step is not forward_step:  # (else covered since an earlier step)
        if fwd_state.step is not None and _evaluation(state):
            # An evaluation under another step (another fp8_group, or a recipe that differs
            # in reduce_amax only) took the state from the step that trains it, which then
            # neither reduced nor updated it (a layer that trains on some ranks only drifted
            # apart across them). Its amaxes are forgotten at the exit all the same.
            local.evaluated.append(fwd_state)
        else:
            forward_step.add(fwd_state)
    if bwd_state.step is not backward_step.step and (
            torch.is_grad_enabled() or checkpoint_stack.checkpoint_context().regions):
        # A forward without gradients (no_grad, inference_mode: an evaluation) has no backward
        # pass: its registration would take the state away from the step of a training
        # forward still waiting for its backward (under another delayed recipe), whose update
        # would then never run. A reentrant checkpoint's first forward runs under no_grad but
        # is a training forward: its regions make it register, as _exit_outermost updates.
        backward_step.add(bwd_state)
    return backward_step


def _evaluation(state: AutocastState) -> bool:
    """Whether this forward evaluates: no gradients, not calibrating, not a checkpointed
    region's first forward (a reentrant one runs without gradients)."""
    return (not torch.is_grad_enabled() and not state.calibrating
            and not checkpoint_stack.regions_to_keep())


def _forget_evaluated(states: list) -> None:
    """Zero the amaxes that evaluation forwards recorded (row 0), as a discarded step does
    (update_plan.UpdatePlan.discard)."""
    with torch.no_grad():
        for fwd_state in states:
            row = fwd_state.history[0]
            (row[0::2] if fwd_state.weight_amaxes_from_writes else row).zero_()


def _exit_outermost(failed: bool) -> None:
    local = _LOCAL  # (each attribute read once: a thread-local's cost several plain reads)
    steps, backward_steps = local.forward_steps, local.backward_steps
    calibrating = local.calibrating
    if calibrating:
        local.calibrating = False
    evaluated = local.evaluated
    if evaluated:
        local.evaluated = []
    grad_enabled = torch.is_grad_enabled()
    if steps:
        local.forward_steps, local.backward_steps = {}, {}
        if failed or not (grad_enabled or calibrating
                          or checkpoint_stack.checkpoint_context().regions):
            # A failed step, or an evaluation (no_grad, inference_mode; as in Transformer
            # Engine, the grad mode at the exit): its amaxes are forgotten, no scale changes,
            # so evaluating between training steps leaves their numbers as they were.
            # Calibration, which runs under no_grad, updates; so does a context inside a
            # reentrant checkpoint's first forward (no_grad too, but a training forward).
            for step in steps.values():
                step.discard()
            _forget_evaluated(evaluated)
        elif len(steps) == 1:  # (one recipe, the common case: update_all's work for one)
            for step in steps.values():
                step.reduce_and_update()
        else:
            update_all([(step, AmaxStep.reduce_and_update) for step in steps.values()])
    # (No backward pass follows a forward without gradients: an eval forward keeps the last
    # training one's held steps.)
    if grad_enabled and not failed and not local.isolated:
        hold_for_compiled_backward(list(backward_steps.values()))

