"""ScalingState: one module's delayed-scaling state for one role ("fwd": input and weight of each
GEMM; "bwd": grad_output of each GEMM), the object the step machinery (amax_step.py) registers,
reduces and updates: the module's amax history [L, n], scale [n] and scale_inv [n] buffers. (The
format maximum and the margin are the step's recipe's: every state a step covers has adopted it.)

The step machinery keeps prepared updates (update_plan.py) built from these tensors. So that it
never updates a tensor the module no longer holds, every change of what a state holds goes
through ``bind``, which bumps one process-wide generation number: a prepared update made under
an older generation is made again. The states' owner (quantization/state.py's Fp8State) binds
them when its buffers are made, moved, replaced, reloaded or re-sized, or its recipe changes.
"""
from __future__ import annotations

import weakref
from typing import Callable, Optional

import torch

_current = [0]  # the generation number now; read on every step


def generation() -> int:
    return _current[0]


def bump_generation() -> None:
    """Something the prepared updates were built from has changed: they are made again."""
    _current[0] += 1  # (a plain list item: torch.compile traces it as a side effect)


class ScalingState:
    """One module's (history, scale, scale_inv) for one role. ``key`` is the module's
    creation index: it orders the states of a step identically on every rank. ``recipe_code``
    is the owner's recipe record (None: no recipe adopted yet); ``takes_recipe(recipe)`` asks
    the owner whether a step under ``recipe`` covers this state, adopting the recipe if it has
    none (see amax_step.AmaxStep)."""

    __slots__ = ("key", "role", "owner_type", "history", "scale", "scale_inv", "device", "step",
                 "weight_amaxes_from_writes", "loaded_row", "_takes_recipe", "__weakref__")

    def __init__(self, key: int, role: str, takes_recipe: Callable[[object], bool],
                 owner_type: Optional[type] = None):
        self.key, self.role = key, role
        self.owner_type = owner_type  # the owner module's class (amax_step.note_compiled)
        self._takes_recipe = takes_recipe
        self.history = self.scale = self.scale_inv = None
        self.device = None
        self.step = None  # the step (amax_step.AmaxStep) that covers it, where one does
        # Whether the weight columns (2g + 1 of a forward state) record when a weight is
        # written (FP8 primary weights: at the optimizer step, outside any fp8_autocast), so
        # that a discarded step leaves them (update_plan.UpdatePlan.discard).
        self.weight_amaxes_from_writes = False
        # A grad_output state's row 0 as a load_state_dict left it (note_loaded_row), put back
        # at the next grad_output update or when it joins a step (restore_loaded_row).
        self.loaded_row = None

    def bind(self, history: torch.Tensor, scale: torch.Tensor, scale_inv: torch.Tensor,
             weight_amaxes_from_writes: bool = False) -> None:
        self.history, self.scale, self.scale_inv = history, scale, scale_inv
        self.device = history.device
        self.weight_amaxes_from_writes = weight_amaxes_from_writes
        bump_generation()

    def takes_recipe(self, recipe) -> bool:
        return self._takes_recipe(recipe)

    def __repr__(self) -> str:
        shape = None if self.history is None else tuple(self.history.shape)
        return f"ScalingState(key={self.key}, role={self.role!r}, history={shape})"


def weak_method(method) -> Callable:
    """A callable that calls ``method`` (bound) without keeping its object alive: a state must
    not keep its module alive (False once the module is gone)."""
    ref = weakref.WeakMethod(method)

    def call(*args):
        bound = ref()
        return False if bound is None else bound(*args)
    return call


# Every state of the process by (creation index, role), weakly: the layout of the cross-rank
# reduction, identical on every rank that built the same model. A state that goes away does NOT
# bump the generation: it goes when the garbage collector frees its module, at a moment that
# differs from rank to rank (a dead model held in reference cycles), and a plan made again on
# one rank only would change that rank's reduction alone. Plans keep the tensors of the states
# they were made with; the reduction drops dead states when all ranks make their plans again
# (amax_step: a change of the reduction's layout collects the garbage and is agreed on).
_STATES: dict = {}


def register(state: ScalingState) -> None:
    k = (state.key, state.role)

    def gone(_ref, k=k):
        if _STATES.get(k) is _ref:
            del _STATES[k]
    _STATES[k] = weakref.ref(state, gone)
    bump_generation()


def registered(role: str) -> list[ScalingState]:
    """The live states of ``role``, by creation index."""
    found = []
    for (key, r), ref in sorted(list(_STATES.items())):
        state = ref()
        if r == role and state is not None:
            found.append(state)
    return found


_DEVICES: dict = {}  # role -> (generation, the devices of its live states)


def devices(role: str) -> frozenset:
    """The devices of the live states of ``role`` (made again when the generation changes: a
    state registered, bound or moved)."""
    cached = _DEVICES.get(role)
    if cached is not None and cached[0] == _current[0]:
        return cached[1]
    found = frozenset(state.device for state in registered(role) if state.device is not None)
    _DEVICES[role] = (_current[0], found)
    return found


def find(key: int, role: str) -> Optional[ScalingState]:
    ref = _STATES.get((key, role))
    return None if ref is None else ref()


# The grad_output states whose row 0 a load left (ScalingState.loaded_row). The backward of a
# forward made before the load records its amax there, where the update at the end of that
# backward does not cover the loaded state in one process (or covers it and folds the stale
# amax in, where ranks reduce or a class was compiled): so that update, and the state's next
# joining a step, put row 0 back first. Read at every update: empty but for such loads.
LOADED_ROWS: "weakref.WeakSet[ScalingState]" = weakref.WeakSet()


def note_loaded_row(state: ScalingState) -> None:
    state.loaded_row = state.history[0].detach().clone()
    LOADED_ROWS.add(state)


def restore_loaded_row(state: ScalingState) -> None:
    """Row 0 back to what the load left, and forgotten (None: nothing to put back)."""
    row, state.loaded_row = state.loaded_row, None
    LOADED_ROWS.discard(state)
    if row is not None and row.shape == state.history[0].shape:
        with torch.no_grad():
            state.history[0].copy_(row)


def forget_loaded_row(state: ScalingState) -> None:
    """Its row 0 is now another update's (a reset, an owed update)."""
    state.loaded_row = None
    LOADED_ROWS.discard(state)
