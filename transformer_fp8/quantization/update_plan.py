"""UpdatePlan: what one step's reduction and update do with a set of ScalingStates, prepared once
and reused by every step that covers the same states while nothing they hold has changed (see
scaling_state.generation): the lists of histories, scales and scale_invs per device, each held by
a DelayedScalingBatch of the C++ library (checked once; one call per step and device, no list
converted or checked again), and the rows that the cross-rank reduction gathers.

Building a plan is O(states) of Python; a step that finds its plan does O(devices) host work.
"""
from __future__ import annotations

import weakref
from typing import Optional

import torch

from .. import _C, ops
from .recipe import DelayedScaling
from .scaling_state import ScalingState, generation


# (None in a library built before it existed: the list operator then runs.)
_BATCH = getattr(_C, "DelayedScalingBatch", None)
_is_compiling = torch.compiler.is_compiling
_len_torch_dispatch_stack = torch._C._len_torch_dispatch_stack


_DISTRIBUTED = torch.distributed.is_available()


def world_size(group) -> int:
    if not (_DISTRIBUTED and torch.distributed.is_initialized()):
        return 1
    return torch.distributed.get_world_size(group)


def all_reduce_max(buffer: torch.Tensor, group) -> None:
    """In-place MAX of amaxes (float32, never negative) across the group (a no-op for a single
    process), a NaN on any rank kept, as one process's amax of the whole batch keeps it.

    A float MAX drops a NaN on some backends depending on which rank holds it (gloo compares
    with ``<``: a NaN on rank 0 survived, one on rank 1 did not). The amaxes are reduced as
    their int32 bit patterns instead: for non-negative floats their order is the floats',
    +inf above every finite value and a positive NaN above +inf. (Inductor cannot lower that
    view of a buffer made by a pointwise op or torch.stack; the step's reduction and FSDP2's
    run outside compiled graphs, and a current-scaling quantizer's ops.amax buffer compiles.)"""
    if world_size(group) > 1:
        if buffer.dtype != torch.float32:
            torch.distributed.all_reduce(buffer, op=torch.distributed.ReduceOp.MAX, group=group)
            return
        # (NaN's sign bit cleared: a NaN with it set would be a negative int32)
        bits = torch.where(buffer.isnan(), float("nan"), buffer).abs().view(torch.int32)
        torch.distributed.all_reduce(bits, op=torch.distributed.ReduceOp.MAX, group=group)
        buffer.copy_(bits.view(torch.float32))


def layout_of(states: list) -> tuple:
    """What the cross-rank reduction gathers, in order: the amaxes per row of each state. (Not
    their creation indices: a rank that made FP8 layers of its own elsewhere, a copy on another
    device, counts its indices differently, and the rows still line up.)"""
    return tuple(s.history.shape[-1] for s in states)


def check_same_layout(layout: tuple, group, device: torch.device) -> None:
    """Raise on every rank if the ranks of ``group`` would reduce differently laid out amaxes
    (one small all_reduce and a host sync: called only when a reduction's layout changes).
    Without it, reductions of different sizes fail (gloo) or hang (NCCL)."""
    count, size = len(layout), sum(layout)
    fingerprint = hash(layout)  # (deterministic across processes for a tuple of ints)
    mine = torch.tensor([count, size, fingerprint], dtype=torch.int64)
    both = torch.cat([mine, -mine]).to(device)
    torch.distributed.all_reduce(both, op=torch.distributed.ReduceOp.MAX, group=group)
    most, least = both[:3].tolist(), [-v for v in both[3:].tolist()]
    if most != least:
        raise RuntimeError(
            "the ranks hold different FP8 layers for the step's amax reduction: this rank has "
            f"{count} scaling states ({size} amaxes); across the ranks the counts range from "
            f"{least[0]} to {most[0]} states ({least[1]} to {most[1]} amaxes). Every rank must "
            "build the same FP8 layers on the step's devices for the recipe it trains with "
            "(a rank-local FP8 copy goes on another device, or is freed before the step); with "
            "reduce_amax=False no amax is reduced across ranks")


class UpdatePlan:
    """The prepared update of ``states`` (ordered by creation index) under ``recipe``, valid
    while the generation it was built under is the current one."""

    def __new__(cls, states: list[ScalingState], recipe: DelayedScaling, role: str):
        # A plan of FP8 primary weights' states is a _PlanWithWrittenWeights, whose update
        # leaves the written amaxes of the layers that did not run: no work added to the others.
        if cls is UpdatePlan and any(s.weight_amaxes_from_writes for s in states):
            cls = _PlanWithWrittenWeights
        return super().__new__(cls)

    def __init__(self, states: list[ScalingState], recipe: DelayedScaling, role: str):
        self.generation = generation()  # read first: a change while building invalidates it
        # The states, weakly (a plan holds their tensors, never their modules' states: a freed
        # module's state must go, see AmaxStep._freed).
        self.state_refs, self.role = [weakref.ref(s) for s in states], role
        self.recipe = recipe
        self.margin = ops._check_margin(recipe.margin)
        self.devices = frozenset(s.device for s in states)
        self.on_cuda = any(device.type == "cuda" for device in self.devices)
        fp8_max = recipe.fp8_format.max_fwd if role == "fwd" else recipe.fp8_format.max_bwd
        self.histories = [s.history for s in states]
        self.weight_amaxes_from_writes = [s.weight_amaxes_from_writes for s in states]
        self.layout = layout_of(states)
        by_device: dict = {}
        for s in states:
            lists = by_device.setdefault(s.device, ([], [], [], []))
            for target, value in zip(lists, (s.history, s.scale, s.scale_inv, fp8_max)):
                target.append(value)
        self.by_device = list(by_device.items())
        self._batches: Optional[list] = None  # per device: a DelayedScalingBatch or None
        self._single_batch = None  # the one batch, where there is one device and a batch
        self._algo = None
        # Whether the recipe's update is the batch's (the built-in algorithms).
        self._batchable = (isinstance(recipe.amax_compute_algo, str)
                           and recipe.scaling_factor_compute_algo is None)
        self._rows: Optional[tuple] = None
        # Plans of the steps that also cover the unrecorded states (see amax_step), by key.
        self.completions: dict = {}
        self._without: dict = {}  # plans of some of the states: see without()

    def is_current(self, recipe) -> bool:
        return self.generation == generation() and (self.recipe is recipe or self.recipe == recipe)

    def reduce(self, group, others: frozenset = frozenset()) -> None:
        """One collective for the whole step: gather row 0 of every history (in creation-index
        order, the same layout on every rank), MAX-reduce it, scatter it back. ``others``:
        positions of states another step owns on this rank: zeros take their place, and they
        are not written (a MAX with zeros changes no amax)."""
        pointers = [h.data_ptr() for h in self.histories]
        if self._rows is None or self._rows[2] != pointers:
            # (Views made again when a history's memory was swapped behind the plan: .data.)
            rows = [h[0] for h in self.histories]
            self._rows = (rows, [r.shape[0] for r in rows], pointers)
        rows, sizes, _ = self._rows
        if others:
            rows = [torch.zeros_like(r) if i in others else r for i, r in enumerate(rows)]
        recorded = torch.cat(rows)
        all_reduce_max(recorded, group)
        parts = list(recorded.split(sizes))
        if others:
            kept = [i for i in range(len(rows)) if i not in others]
            rows, parts = [rows[i] for i in kept], [parts[i] for i in kept]
        torch._foreach_copy_(rows, parts)

    def without(self, others: frozenset) -> "UpdatePlan":
        """This plan less the states at positions ``others`` (itself when there are none)."""
        if not others:
            return self
        plan = self._without.get(others)
        if plan is None:
            states = [ref() for i, ref in enumerate(self.state_refs) if i not in others]
            plan = self._without[others] = UpdatePlan([s for s in states if s is not None],
                                                      self.recipe, self.role)
        return plan

    def update(self) -> None:
        """The delayed-scaling update of every state, one call per device: a prepared batch for
        the built-in algorithms on the CPU and CUDA, else the operator (recipe callables, meta
        tensors, torch.compile)."""
        # The batch writes the tensors directly: under a dispatch mode (FakeTensorMode, make_fx
        # without compiling) the operator must run, so that the mode sees the update.
        if _is_compiling() or _len_torch_dispatch_stack():
            batched = False
        else:
            single = self._single_batch
            if single is not None:  # (the common case: one device, a built-in algorithm)
                single.update(self.margin, self._algo)
                return
            batched = self._batchable and _BATCH is not None
        recipe = self.recipe
        algo = recipe.amax_compute_algo
        if batched and self._batches is None:
            self._batches = [_BATCH(*lists) if device.type in ("cpu", "cuda") else None
                             for device, lists in self.by_device]
            if len(self._batches) == 1:
                self._single_batch, self._algo = self._batches[0], algo
        margin = self.margin
        for i, (_, lists) in enumerate(self.by_device):
            if batched and self._batches[i] is not None:
                self._batches[i].update(margin, algo)
            else:
                ops.update_delayed_scaling(
                    *lists, margin=margin, amax_compute_algo=algo,
                    scaling_factor_compute_algo=recipe.scaling_factor_compute_algo,
                    recipe=recipe)

    def discard(self) -> None:
        """Forget the amaxes the step recorded (row 0 of every history), but not the weight
        amaxes FP8 primary weights recorded when they were written (the optimizer step before
        the step: columns 2g + 1), which belong to the next update."""
        for history, keep_weights in zip(self.histories, self.weight_amaxes_from_writes):
            (history[0, 0::2] if keep_weights else history[0]).zero_()


class _PlanWithWrittenWeights(UpdatePlan):
    """A plan that holds states of FP8 primary weights (weight_amaxes_from_writes). A
    weight's write (the optimizer step) records the value's amax in row 0 of its column, for the
    next update of a step its layer runs in. But a step covers every state of its recipe in the
    thread, not only those that ran in it (see AmaxStep), and an update rolls every column with
    an amax in row 0: another model's step (an EMA or evaluation model, a GAN's other half)
    rolled the layer's weight columns and set its weight scale."""

    def update(self) -> None:
        """UpdatePlan.update, except that a layer of FP8 weights that recorded no input amax in
        this step (it did not run in it: on no rank, once reduced) keeps its written amaxes for
        a later step, its weight columns left untouched, as the update leaves any column with
        nothing recorded. (Decided on the device: no host synchronisation.)"""
        held = []
        for history, written in zip(self.histories, self.weight_amaxes_from_writes):
            if written:
                row = history[0]
                idle = (row[0::2] == 0).all()  # (inputs in columns 2g, weights in 2g + 1)
                weights = row[1::2]
                held.append((weights, torch.where(idle, weights, 0.0)))
                weights.masked_fill_(idle, 0.0)
        super().update()
        for weights, amaxes in held:
            weights.add_(amaxes)  # (zeros for a layer that ran: its columns rolled)
