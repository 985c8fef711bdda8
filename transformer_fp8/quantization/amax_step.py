"""The step machinery of delayed scaling: the amax states (ScalingState: history, scale,
scale_inv) recorded under one recipe and process group, reduced across ranks in ONE collective
and updated in ONE call per device (AmaxStep), once at the outermost fp8_autocast's exit for the
forward and once per backward pass for grad_output (backward_step.py, with the updates held
back for reentrant checkpointing and compiled backwards). The registry of states that lays out
the cross-rank reduction is scaling_state.py's; the prepared updates, update_plan.py's.
"""
from __future__ import annotations

import gc
import warnings
import weakref
from typing import Optional

import torch

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


# At most this many entries in each of the two caches above: a recipe made anew at every step
# (a new lambda as amax_compute_algo never equals the last) is a new key each time.
MAX_KEPT_PLANS = 64


def _keep_bounded(cache: dict, key, value) -> None:
    """cache[key] = value, the oldest entries dropped beyond MAX_KEPT_PLANS."""
    cache.pop(key, None)
    cache[key] = value
    while len(cache) > MAX_KEPT_PLANS:
        del cache[next(iter(cache))]


# A count of the states that joined a step (AmaxStep.add): the steps' masks of the states of
# other steps (_others_states) are made again when it changes.
_OWNERSHIP = [0]

# Plans whose update a CUDA graph captured, kept for the life of the process: every replay
# writes their tensors, which may be those of a module outside the captured step (a step
# covers every module of its recipe in the thread: an eager copy, an evaluation model). Freed
# with that module, the plan took them along and the replays wrote freed memory.
_CAPTURED_PLANS: dict = {}
_stream_capturing = torch.cuda.is_current_stream_capturing


def _keep_if_captured(plan: UpdatePlan) -> None:
    if plan.on_cuda and _stream_capturing():
        _CAPTURED_PLANS[id(plan)] = plan


def discard_quietly(step) -> None:
    """step.discard() while an exception propagates: an error of its own is not the one to
    report (the ranks may disagree on the layout, say, which discard re-checks without
    agreeing)."""
    try:
        step.discard()
    except Exception:  # noqa: BLE001
        pass


def update_all(updates: list) -> None:
    """update(step) for each (step, update) in order; after one raises (and has discarded its
    own amaxes), the later steps are discarded: none keeps a step's amaxes for the next."""
    for i, (step, update) in enumerate(updates):
        try:
            update(step)
        except BaseException:
            for later, _ in updates[i + 1:]:
                discard_quietly(later)
            raise


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


_WARNED_RANK_LOCAL = [False]  # (the reduce_amax=False warning, once per process)


class AmaxStep:
    """The scaling states recorded under one (recipe, group), reduced and updated together; role
    is "fwd" or "bwd". Keys (creation indices) order the states identically on every rank.

    Ranks may run different subsets of the modules in a step (mixture-of-experts routing): the
    reduction then covers every state of the process that trains with this recipe, so that
    every rank's buffer has the same layout; a module that ran on no rank keeps its state (the
    update leaves a column with no recorded amax untouched).

    fp8_autocast keeps one step per (recipe, group) and thread from one training step to the
    next (autocast_steps.py): a state, once added, stays covered until it is added to another step
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
        self._others = None  # (plan, _OWNERSHIP, positions): see _others_states
        if not recipe.reduce_amax and not _WARNED_RANK_LOCAL[0] and world_size(group) > 1:
            _WARNED_RANK_LOCAL[0] = True
            warnings.warn(
                "transformer_fp8: DelayedScaling(reduce_amax=False) with several ranks: each "
                "rank's FP8 state (amax histories, scales) is its own. Under "
                "DistributedDataParallel pass broadcast_buffers=False: its default broadcasts "
                "rank 0's buffers, FP8 state included, at every forward, and the other ranks "
                "cast with rank 0's scales (saturated inputs, wrong gradients).", stacklevel=4)

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
        elif state.loaded_row is not None:  # (joining after a load: scaling_state.LOADED_ROWS)
            scaling_state.restore_loaded_row(state)
        state.step = self
        self._refs[state.key] = weakref.ref(state, self._freed)
        self._plan = self._others = None  # (the mask's plan may be this one)
        _OWNERSHIP[0] += 1  # (the other steps' masks of it are made again: _others_states)

    def _remove(self, state: ScalingState) -> None:
        ref = self._refs.get(state.key)
        if ref is not None and ref() is state:
            self._refs.pop(state.key, None)
            self._plan = self._others = None  # (the mask's plan may be this one)

    @staticmethod
    def leave(state: ScalingState) -> None:
        """``state`` leaves the step that covers it, if any (a loaded state: its history's row
        0 may hold amaxes of the step it was saved in, which a step that covered it without its
        module running would fold in as this step's; it joins a step again when it records)."""
        if state.step is not None:
            state.step._remove(state)
            state.step = None
            _OWNERSHIP[0] += 1  # (the other steps' masks of it are made again: _others_states)

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
                    self._plan = self._others = None  # (the mask's plan may be this one)

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
        # A rank that recorded nothing covers every device, as the devices of every state do:
        # the key (whether this rank checks the layout with the others below) must not depend
        # on what each rank recorded (a rank whose step ran none of its layers checked alone:
        # mismatched collectives).
        devices = (recorded.devices if recorded is not None
                   else scaling_state.devices(self.role))
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
            _keep_bounded(_LAST_LAYOUT, key, plan.layout)
        for old in [k for k, p in cache.items() if p.generation != plan.generation]:
            del cache[old]  # (made before a change: they would hold tensors no longer in use)
        _keep_bounded(cache, key, plan)
        return plan

    def _covered_states(self, devices, reduce: bool) -> list[ScalingState]:
        """The states recorded and, by creation index, those of the process that train with
        this recipe on ``devices`` (every one when ranks reduce, else the compiled ones): the
        layout of the reduction, the same on every rank whichever step each state ran under
        (which steps the states belong to differs from rank to rank: _others_states)."""
        states = dict(self.states)
        for state in scaling_state.registered(self.role):
            if state.key not in states and (reduce or compiled(state)):
                if state.takes_recipe(self.recipe) and (not devices or state.device in devices):
                    states[state.key] = state
        return [states[key] for key in sorted(states)]

    def reduce_and_update(self) -> None:
        """Reduce (where ranks do) and update every state covered. If that raises (the ranks
        disagree on the layout, a collective or a recipe callable fails, an interrupt), the
        amaxes recorded since the last update are discarded, as after a failed step: left in
        history row 0, the next step's amaxes were folded into them."""
        if scaling_state.LOADED_ROWS and self.role == "bwd":
            for state in list(scaling_state.LOADED_ROWS):  # (see LOADED_ROWS)
                scaling_state.restore_loaded_row(state)
        try:
            reduce = self.recipe.reduce_amax and world_size(self.group) > 1  # (_reduces())
            plan = self._plan
            if (not reduce and plan is not None
                    and plan.generation == scaling_state._current[0]
                    and plan.recipe is self.recipe
                    and not (_COMPILED_MODULES and self.include_unrecorded)):
                plan.update()  # (the common case: _plan_for_step's answer, without its calls)
                if plan.on_cuda:
                    _keep_if_captured(plan)
                return
            plan = self._plan_for_step(reduce)
            if plan is None:
                return
            others = self._others_states(plan)
            if reduce:
                plan.reduce(self.group, others)
            plan.without(others).update()
            _keep_if_captured(plan)  # (its plans without some states with it)
        except BaseException:
            discard_quietly(self)
            raise

    def discard(self) -> None:
        """Forget the amaxes recorded since the last update (after an exception)."""
        plan = self._plan_for_step(self._reduces(), agree=False)
        if plan is not None:
            plan.without(self._others_states(plan)).discard()

    def _others_states(self, plan: UpdatePlan) -> frozenset:
        """The positions in ``plan`` of the states that belong to another step (which ran under
        another group, another recipe with the same record, such as another reduce_amax, or in
        another thread): that step's alone. This step neither updates them nor gives the
        reduction their amaxes (zeros in their place: the layout stays the same on every rank,
        where the states' steps differ). A compiled module's state belongs to no step (a traced
        forward registers nothing). Made again when a state changes steps."""
        cached = self._others
        if cached is not None and cached[0] is plan and cached[1] == _OWNERSHIP[0]:
            return cached[2]
        others = frozenset(i for i, state in enumerate(ref() for ref in plan.state_refs)
                           if state is not None and state.step is not None
                           and state.step is not self and not compiled(state))
        self._others = (plan, _OWNERSHIP[0], others)
        return others


# The classes of the FP8 modules whose forward torch.compile has traced (see note_compiled).
_COMPILED_MODULES: set = set()


def compiled(state: ScalingState) -> bool:
    """Whether ``state``'s module may run compiled: its forward then records amaxes without
    registering its states with the step (roles._delayed). (A subclass counts: FSDP2 gives the
    modules it shards a subclass of their class after they are made.)"""
    owner = state.owner_type
    return owner is not None and any(issubclass(owner, traced) or issubclass(traced, owner)
                                     for traced in _COMPILED_MODULES)


@torch.compiler.assume_constant_result
def note_compiled(owner_type: type) -> bool:
    """Called by a traced FP8 forward: torch.compile runs it once, while tracing (its result is
    baked into the graph as a constant), so this side effect is allowed even inside a
    checkpointed region, and costs nothing at run time. By class, not by module: a graph traced
    for one module serves every module of its class (the modules are the graph's inputs), and
    guarding on which module it is would compile the same code again for every layer."""
    _COMPILED_MODULES.add(owner_type)
    return True
