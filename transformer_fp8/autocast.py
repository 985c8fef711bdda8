"""fp8_autocast: where FP8 modules record their amaxes and where delayed scales get updated.

Inside the outermost context every FP8 module that runs with delayed scaling records the amax of
its input and weight into row 0 of its forward history (in the same pass as the cast). When the
outermost context exits, the recorded rows of all modules are all-reduced (MAX) across fp8_group
in ONE collective, then ONE update_delayed_scaling call rolls every history and sets every scale.
The backward amaxes (grad_output) go the same way, once per backward pass: when the backward of
the first module of the forward pass finishes.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterator, Optional

import torch

from . import ops
from .recipe import DelayedScaling, Float8CurrentScaling, Recipe


@dataclass(frozen=True)
class AutocastState:
    """What an FP8 module sees when it runs: whether FP8 is on, the recipe, the group."""

    enabled: bool
    recipe: Recipe
    group: Optional["torch.distributed.ProcessGroup"]


def _world_size(group) -> int:
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return 1
    return torch.distributed.get_world_size(group)


def all_reduce_max(buffer: torch.Tensor, group) -> None:
    """In-place MAX across the group (a no-op for a single process)."""
    if _world_size(group) > 1:
        torch.distributed.all_reduce(buffer, op=torch.distributed.ReduceOp.MAX, group=group)


@dataclass
class AmaxStep:
    """The scaling states (history, scale, scale_inv) that recorded amaxes in one step, for one
    (recipe, group): reduced and updated together."""

    recipe: DelayedScaling
    group: object
    states: dict = field(default_factory=dict)  # id -> getter returning (history, scale, scale_inv, fp8_max)

    def add(self, key: int, getter) -> None:
        self.states.setdefault(key, getter)

    def reduce_and_update(self) -> None:
        if not self.states:
            return
        tensors = [get() for get in self.states.values()]
        histories = [t[0] for t in tensors]
        if self.recipe.reduce_amax and _world_size(self.group) > 1:
            # One collective for the whole step: gather row 0 of every history, reduce, scatter.
            recorded = torch.cat([h[0] for h in histories])
            all_reduce_max(recorded, self.group)
            torch._foreach_copy_([h[0] for h in histories],
                                 list(recorded.split([h.shape[1] for h in histories])))
        ops.update_delayed_scaling(
            histories, [t[1] for t in tensors], [t[2] for t in tensors], [t[3] for t in tensors],
            margin=self.recipe.margin, amax_compute_algo=self.recipe.amax_compute_algo,
            scaling_factor_compute_algo=self.recipe.scaling_factor_compute_algo,
            recipe=self.recipe)
        self.states.clear()

    def discard(self) -> None:
        """Forget this step's amaxes (after an exception): histories and scales stay as they
        were before the step."""
        for get in self.states.values():
            get()[0][0].zero_()
        self.states.clear()


class BackwardStep:
    """The grad_output states of one forward pass; updated when the backward of the first
    module of that forward pass has run."""

    def __init__(self, recipe: DelayedScaling, group):
        self.step = AmaxStep(recipe, group)

    def add(self, key: int, getter) -> None:
        self.step.add(key, getter)

    def finish(self) -> None:
        self.step.reduce_and_update()


class _Autocast:
    """The context stack and the steps recorded under the outermost context (module-level,
    one per process; the contexts are not meant to be shared across threads)."""

    def __init__(self):
        self.stack: list[AutocastState] = []
        self.forward_steps: dict = {}
        self.backward_steps: dict = {}

    def current(self) -> Optional[AutocastState]:
        return self.stack[-1] if self.stack else None

    def _key(self, state: AutocastState):
        return (state.recipe, id(state.group))

    def forward_step(self, state: AutocastState) -> AmaxStep:
        key = self._key(state)
        if key not in self.forward_steps:
            self.forward_steps[key] = AmaxStep(state.recipe, state.group)
        return self.forward_steps[key]

    def backward_step(self, state: AutocastState) -> tuple[BackwardStep, bool]:
        """The backward step of the current forward pass, and whether the caller is the first
        module of it (the one whose backward finishes the step)."""
        key = self._key(state)
        is_first = key not in self.backward_steps
        if is_first:
            self.backward_steps[key] = BackwardStep(state.recipe, state.group)
        return self.backward_steps[key], is_first

    def exit_outermost(self, failed: bool) -> None:
        steps = list(self.forward_steps.values())
        self.forward_steps.clear()
        self.backward_steps.clear()
        for step in steps:
            if failed:
                step.discard()
            else:
                step.reduce_and_update()


_AUTOCAST = _Autocast()


def current_state() -> Optional[AutocastState]:
    """The innermost active fp8_autocast, or None outside any."""
    return _AUTOCAST.current()


def record_forward(state: AutocastState, key: int, fwd_getter, bwd_getter):
    """Called by an FP8 module running with delayed scaling: registers its forward state for the
    update at context exit and its backward state for the backward update. Returns
    (backward_step, is_first_module)."""
    _AUTOCAST.forward_step(state).add(key, fwd_getter)
    backward_step, is_first = _AUTOCAST.backward_step(state)
    backward_step.add(key, bwd_getter)
    return backward_step, is_first


@contextlib.contextmanager
def fp8_autocast(enabled: bool = True, fp8_recipe: Optional[Recipe] = None,
                 fp8_group=None) -> Iterator[None]:
    """Run the FP8 modules inside with FP8 GEMMs.

    enabled: False runs them in high precision (as torch.nn.Linear would).
    fp8_recipe: DelayedScaling() by default, or Float8CurrentScaling().
    fp8_group: the process group whose ranks share amaxes (default: the whole world).
    Call backward outside the context. Nested contexts: the innermost one decides how modules
    run; the outermost one's exit reduces and updates. If the block raises, the amaxes recorded
    in it are discarded and no scale changes.
    """
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be True or False, got {type(enabled).__name__}")
    if fp8_recipe is None:
        fp8_recipe = DelayedScaling()
    if not isinstance(fp8_recipe, (DelayedScaling, Float8CurrentScaling)):
        raise TypeError("fp8_recipe must be a DelayedScaling or Float8CurrentScaling, got "
                        f"{type(fp8_recipe).__name__}")
    if fp8_group is not None and not (torch.distributed.is_available()
                                      and isinstance(fp8_group, torch.distributed.ProcessGroup)):
        raise TypeError("fp8_group must be None or a torch.distributed.ProcessGroup, got "
                        f"{type(fp8_group).__name__}")
    outermost = not _AUTOCAST.stack
    _AUTOCAST.stack.append(AutocastState(enabled, fp8_recipe, fp8_group))
    failed = False
    try:
        yield
    except BaseException:
        failed = True
        raise
    finally:
        _AUTOCAST.stack.pop()
        if outermost:
            _AUTOCAST.exit_outermost(failed)
