"""Activation checkpointing (torch.utils.checkpoint, both modes) of FP8 layers.

A checkpointed forward runs twice: once normally, and again during backward (the
recomputation). By the time of the recomputation the fp8_autocast context has exited, the
delayed scales have moved on, and the recomputation may even run outside any context. To give
the same gradients as a run without checkpointing, the recomputation must repeat the original
forward's FP8 casts exactly (same scales, same recipe) and record no amax a second time.

So an FP8 layer whose forward runs under torch.utils.checkpoint keeps a replay record (the
scales it used, its backward plan) for each checkpointed region it runs in, and when it runs
inside the recomputation of one of those regions it replays that region's records, in the order
its calls first ran (a layer called twice in a region). A forward that ran in high precision
(outside an enabled fp8_autocast: none, or a nested enabled=False one) keeps the record
HIGH_PRECISION: its recomputation runs in high precision too, recording nothing, even inside an
enabled context (a backward inside the context, or inside a later step's). Nested checkpoints
make a call run several times: in the recomputation of an outer region, an inner checkpoint's
forward is a first forward of a new region, recomputed later in its turn. So a call that
replays an outer region's record keeps it again for the inner regions it runs in, and every
recomputation of every region casts exactly as the very first forward did.

A region is the object torch keeps for it in both phases: a reentrant region's autograd context
(``ctx`` of CheckpointFunction.forward / backward), a non-reentrant region's _CheckpointFrame
(``new_frame`` of the generator that checkpoint() runs it with, ``frame`` of the unpack hook
that recomputes it). Both are found by a walk up the stack through the frames of
torch/utils/checkpoint.py (checkpoint_stack.py). Records go with their region (at the next
drop_freed; ``kept`` says at once when none is alive).

Under torch.compile the walk cannot be traced: a compiled FP8 forward that may be a reentrant
region's first forward (no gradients, in training mode or on an input that requires them) runs
its FP8 step eagerly and keeps its records, and a compiled module that holds records
(ReplayRecords.kept, on which the compiled code guards) looks for its recomputation eagerly
(modules/base.py). A non-reentrant region's first forward cannot be told from a training
forward by what torch.compile guards on: a compiled FP8 layer inside one keeps no record.
"""
from __future__ import annotations

import functools
import threading
import warnings
import weakref

import torch.utils.checkpoint as _torch_checkpoint

from . import checkpoint_stack
from .backward_step import update_at_end_of_pass

MAX_RECORDS_PER_LAYER = 1024  # replay records a layer keeps before dropping the oldest
# The replay record of a forward that ran in high precision (see the module's docstring).
HIGH_PRECISION = "high precision"


def _weak(region, records: "ReplayRecords") -> object:
    """A weak reference to the region where one can be made (a record must not keep a
    reentrant region's saved inputs alive), else the region. When the region is freed,
    ``records.kept`` says at once whether any record's region is still alive (the records go
    at the next drop_freed), so a compiled forward of the layer (which guards on it) takes no
    graph break for a region long gone."""
    owner = weakref.ref(records)

    def freed(_):  # (reads the entries only: it may run inside any code that walks them)
        alive = owner()
        if alive is not None:
            alive.kept = any(_alive(entry[0]) for entry in alive.entries)

    try:
        return weakref.ref(region, freed)
    except TypeError:
        return region


def _alive(kept) -> bool:
    return not isinstance(kept, weakref.ref) or kept() is not None


def _before_reentrant_backward(thread: int, grad_outputs) -> None:
    """Runs before the backward of a reentrant region with FP8 records (a hook on its node), in
    the backward pass that reached it: the grad_output updates that its nested pass and those
    of the regions nested in it hold back run when that pass ends (backward_step.py)."""
    update_at_end_of_pass(thread)


def _is(kept, region) -> bool:
    return (kept() if isinstance(kept, weakref.ref) else kept) is region


_NOT_REPLAYED = object()  # the key of an entry no recomputation has replayed yet


class ReplayRecords:
    """One layer's replay records: [region (weakly), record, key of the last recomputation that
    replayed it] entries, in the order they were kept."""

    def __init__(self):
        self.entries: list = []
        # Whether ``entries`` holds any (a bool the forward reads: torch.compile guards on its
        # value, where it would guard on the list's length and compile again for each length).
        self.kept = False

    def __bool__(self) -> bool:
        """Whether a record waits for its first replay (its region still alive)."""
        return any(key is _NOT_REPLAYED and _alive(kept) for kept, _, key in self.entries)

    def drop_freed(self) -> None:
        """Forget the records of regions that have been freed."""
        self.entries = [entry for entry in self.entries if _alive(entry[0])]
        self.kept = bool(self.entries)

    def keep(self, regions, record) -> None:
        """Keep ``record`` for each of ``regions`` (see checkpoint_stack.checkpoint_context)."""
        if not regions:
            return
        checkpoint_stack.KEPT_ANY[0] = True
        self.drop_freed()
        for region in regions:
            if len(self.entries) >= MAX_RECORDS_PER_LAYER:
                del self.entries[0]  # a forward whose backward never ran
            entry = [_weak(region, self), record, _NOT_REPLAYED]
            self.entries.append(entry)
            self.kept = True
            if hasattr(region, "register_prehook") and "_tfp8_hooked" not in region.__dict__:
                # A reentrant region (an autograd node): see _before_reentrant_backward.
                region._tfp8_hooked = True
                region.register_prehook(
                    functools.partial(_before_reentrant_backward, threading.get_ident()))

    def for_recomputation(self):
        """Inside a recomputation of a region this layer kept records for: (the record this
        call replays, the regions to keep it for again); else None. The record is the region's
        first one this recomputation has not replayed yet."""
        context = checkpoint_stack.checkpoint_context()
        if context.recomputation is None:
            self.drop_freed()  # (a forward outside any recomputation)
            return None
        region, key = context.recomputation
        for entry in self.entries:
            if entry[2] is not key and entry[2] != key and _is(entry[0], region):
                entry[2] = key
                return entry[1], context.regions
        return None  # (none left: it runs as a forward that kept nothing)

    def clear(self) -> None:
        self.entries.clear()
        self.kept = False


def _is_process_group(value) -> bool:
    import torch.distributed as dist

    return dist.is_available() and isinstance(value, dist.ProcessGroup)


def checkpoint(function, *args, distribute_saved_activations: bool = False,
               get_rng_state_tracker=None, tp_group=None, use_reentrant: bool = True, **kwargs):
    """Transformer Engine's ``checkpoint`` over torch.utils.checkpoint.checkpoint: run
    ``function(*args, **kwargs)`` without keeping its activations, recomputing them in
    backward (FP8 layers inside replay their casts exactly, as with torch's own function).

    As in Transformer Engine, keyword arguments go to ``function`` (in both modes; torch's
    reentrant mode takes none itself), except torch's own options context_fn,
    determinism_check and debug. get_rng_state_tracker (a callable returning a
    transformer_fp8.distributed.CudaRNGStatesTracker, or anything with get_states() and
    set_states()): the tracker's states are saved when the forward starts and put back for
    each recomputation (then restored to what they were before it), so dropout drawn inside
    its forks gives the recomputation the forward's masks; torch restores the default
    generators itself. distribute_saved_activations (Transformer Engine's: the saved inputs
    sharded over the tensor-parallel ranks, gathered for the recomputation) is not done here:
    True is refused rather than ignored.
    Transformer Engine's older positional form, ``checkpoint(function,
    distribute_saved_activations, get_rng_state_tracker, tp_group, *args)`` (Megatron-LM's),
    is recognised as Transformer Engine recognises it, with its DeprecationWarning.
    """
    if (len(args) > 3 and isinstance(args[0], bool) and callable(args[1])
            and (args[2] is None or _is_process_group(args[2]))):
        warnings.warn("checkpoint: distribute_saved_activations, get_rng_state_tracker and "
                      "tp_group given as positional arguments (Transformer Engine's deprecated "
                      "form); pass them as keywords", DeprecationWarning, stacklevel=2)
        distribute_saved_activations, get_rng_state_tracker, tp_group = args[:3]
        args = args[3:]
    if distribute_saved_activations:
        raise ValueError("checkpoint: distribute_saved_activations=True (sharding saved "
                         "activations over a tensor-parallel group) is not supported")
    del tp_group  # only meaningful with distribute_saved_activations
    torch_options = {name: kwargs.pop(name) for name in ("context_fn", "determinism_check",
                                                         "debug") if name in kwargs}
    if kwargs:
        # Bound here: the reentrant mode passes no keyword argument to the function.
        function = functools.partial(function, **kwargs)
    if get_rng_state_tracker is not None:
        function = _with_tracker_states(function, get_rng_state_tracker)
    return _torch_checkpoint.checkpoint(function, *args, use_reentrant=use_reentrant,
                                        **torch_options)


def _with_tracker_states(function, get_rng_state_tracker):
    """``function`` whose first call (the forward) saves the tracker's states and whose later
    calls (recomputations) run on those states, restoring the tracker's own afterwards."""
    if not callable(get_rng_state_tracker):
        raise TypeError("checkpoint: get_rng_state_tracker must be a callable that returns the "
                        "RNG tracker (e.g. a function returning a CudaRNGStatesTracker), got "
                        f"{type(get_rng_state_tracker).__name__}")
    tracker = get_rng_state_tracker()
    for method in ("get_states", "set_states"):
        if not callable(getattr(tracker, method, None)):
            raise TypeError(f"checkpoint: get_rng_state_tracker() must return a tracker with "
                            f"get_states() and set_states() (a CudaRNGStatesTracker), got "
                            f"{type(tracker).__name__}")
    at_forward = []  # the states when the forward started (set by the first call)

    def run(*args):
        if not at_forward:
            at_forward.append(tracker.get_states())
            return function(*args)
        current = tracker.get_states()
        tracker.set_states(at_forward[0])
        try:
            return function(*args)
        finally:
            tracker.set_states(current)  # (also when torch stops a recomputation early)

    return run
