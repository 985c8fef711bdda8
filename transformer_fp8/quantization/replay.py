"""Activation checkpointing (torch.utils.checkpoint, both modes) of FP8 layers.

A checkpointed forward runs twice: once normally, and again during backward (the
recomputation). By the time of the recomputation the fp8_autocast context has exited, the
delayed scales have moved on, and the recomputation may even run outside any context. To give
the same gradients as a run without checkpointing, the recomputation must repeat the original
forward's FP8 casts exactly (same scales, same recipe) and record no amax a second time.

So an FP8 layer whose forward runs under torch.utils.checkpoint keeps a replay record (the
scales it used, its backward plan, the checkpointed region it ran in), and when the same layer
runs inside a recomputation it takes a record and replays it: the first one its region kept
(a region is recomputed in the order it first ran, which matters for a layer called more than
once in it). Where the region cannot be told, one of the oldest forward pass that has records
left (forward passes are backpropagated in order, as in gradient accumulation and pipelines),
and within that pass the latest (regions are recomputed last first). The phases are told apart by the frames of
torch/utils/checkpoint.py on the call stack: `CheckpointFunction.backward` (reentrant) and
`recompute_fn` (non-reentrant) recompute; any other of its frames is an original forward.
"""
from __future__ import annotations

import enum
import functools
import sys
import weakref

import torch
import torch.utils.checkpoint as _torch_checkpoint

_CHECKPOINT_FILE = _torch_checkpoint.__file__
_RECOMPUTE_FRAMES = frozenset({"backward", "recompute_fn"})
_MAX_FRAMES = 200  # how far up the stack to look
MAX_RECORDS_PER_LAYER = 1024  # replay records a layer keeps before dropping the oldest


class Phase(enum.Enum):
    NONE = 0  # not under torch.utils.checkpoint
    ORIGINAL = 1  # the first forward of a checkpointed region
    RECOMPUTE = 2  # its recomputation during backward


def _checkpoint_frames(frame):
    """The names of the functions of torch/utils/checkpoint.py on the stack above ``frame``."""
    for _ in range(_MAX_FRAMES):
        if frame is None:
            return
        if frame.f_code.co_filename == _CHECKPOINT_FILE:
            yield frame.f_code.co_name
        frame = frame.f_back


def phase() -> Phase:
    """Where the caller runs with respect to torch.utils.checkpoint (a walk up the stack)."""
    seen_checkpoint = False
    for name in _checkpoint_frames(sys._getframe(1)):
        if name in _RECOMPUTE_FRAMES:
            return Phase.RECOMPUTE
        seen_checkpoint = True
    return Phase.ORIGINAL if seen_checkpoint else Phase.NONE


def _region() -> object:
    """The checkpointed region the caller runs in, the same object in its original forward and
    in its recomputation (None where it cannot be told): a reentrant region's autograd context
    (``ctx`` of CheckpointFunction.forward / backward), a non-reentrant region's frame object
    (``new_frame`` of the generator that checkpoint() runs it with, ``frame`` of the unpack
    hook that recomputes it)."""
    names = {"forward": "ctx", "backward": "ctx", "unpack_hook": "frame"}
    frame = sys._getframe(1)
    for _ in range(_MAX_FRAMES):
        if frame is None:
            return None
        code = frame.f_code
        if code.co_filename == _CHECKPOINT_FILE:
            if code.co_name in names:
                return frame.f_locals.get(names[code.co_name])
            generator = frame.f_locals.get("gen")  # checkpoint(): the non-reentrant generator
            if code.co_name == "checkpoint" and getattr(generator, "gi_frame", None) is not None:
                return generator.gi_frame.f_locals.get("new_frame")
        frame = frame.f_back
    return None


def _weak(region) -> object:
    """A weak reference to the region where one can be made (a record must not keep a
    reentrant region's saved inputs alive), else the region."""
    try:
        return weakref.ref(region)
    except TypeError:
        return region


class ReplayRecords:
    """One layer's replay records: (forward pass id, region, record) in the order they were
    kept (region: a weak reference to the checkpointed region, see _region).

    A recomputation takes its region's records in order. A reentrant region's taken records
    are ``retained`` until the region is freed: a second backward through a retained graph
    (retain_graph=True) recomputes the region again and must replay the same casts (it ran
    the layer's full FP8 forward instead: other scales, amaxes recorded twice, gradients
    wrong)."""

    def __init__(self):
        self.records: list = []
        self.retained: list = []  # taken records of reentrant regions still alive

    def __bool__(self) -> bool:
        return bool(self.records)

    def __len__(self) -> int:
        return len(self.records)

    def drop_freed(self) -> None:
        """Forget the retained records of regions that have been freed."""
        if self.retained:
            self.retained = [entry for entry in self.retained if entry[1]() is not None]

    def keep(self, pass_id: int, record) -> None:
        if not torch.is_grad_enabled() and not _region_may_be_recomputed():
            return
        _KEPT_ANY[0] = True
        self.drop_freed()
        if len(self.records) >= MAX_RECORDS_PER_LAYER:
            del self.records[0]  # a forward whose backward never ran
        region = _region()
        self.records.append((pass_id, None if region is None else _weak(region), record))

    def can_replay(self) -> bool:
        """Whether a recomputation has a record to take: one waiting, or a retained one of
        its region (only those are taken again)."""
        if self.records:
            return True
        region = _region()
        return region is not None and any(_is(entry, region) for entry in self.retained)

    def take(self):
        """The record a recomputation replays (see the module docstring)."""
        region = _region()
        if region is not None:
            if not any(_is(entry, region) for entry in self.records):
                # The region recomputed again (a retained graph): its records, from the first.
                again = [entry for entry in self.retained if _is(entry, region)]
                self.retained = [entry for entry in self.retained if not _is(entry, region)]
                self.records[:0] = again
            for i, entry in enumerate(self.records):
                if _is(entry, region):
                    del self.records[i]
                    if isinstance(entry[1], weakref.ref):  # a reentrant region's
                        self.retained.append(entry)
                    return entry[2]
        oldest = min(pass_id for pass_id, _, _ in self.records)
        index = max(i for i, (pass_id, _, _) in enumerate(self.records) if pass_id == oldest)
        return self.records.pop(index)[2]

    def clear(self) -> None:
        self.records.clear()
        self.retained.clear()


def _is(entry, region) -> bool:
    kept = entry[1]
    return kept is not None and (kept() if isinstance(kept, weakref.ref) else kept) is region


def _region_may_be_recomputed() -> bool:
    """Under no_grad in a checkpointed region's original forward: whether a backward may still
    recompute the region. Not a non-reentrant region (it runs in the caller's grad mode: no
    gradients, no backward); a reentrant one (whose forward always runs under no_grad) only
    if one of its inputs requires gradients (else torch runs no backward through it)."""
    frame = sys._getframe(1)
    for _ in range(_MAX_FRAMES):
        if frame is None:
            break
        if frame.f_code.co_filename == _CHECKPOINT_FILE and frame.f_code.co_name == "forward":
            return any(isinstance(arg, torch.Tensor) and arg.requires_grad
                       for arg in frame.f_locals.get("args", ()))
        frame = frame.f_back
    return False  # (no reentrant region's forward on the stack: a non-reentrant one)


# Whether any FP8 forward has kept a replay record in this process: until one has, no FP8 layer
# ran under torch.utils.checkpoint, so no backward pass can be a checkpoint's nested one.
_KEPT_ANY = [False]


def in_reentrant_backward() -> bool:
    """Whether the caller runs inside the nested backward pass that a reentrant checkpoint
    runs for its region (the frame of CheckpointFunction.backward is on the stack)."""
    if not _KEPT_ANY[0]:
        return False  # (the common case, without the walk up the stack)
    return "backward" in _checkpoint_frames(sys._getframe(1))


def reentrant_depth() -> int:
    """How many reentrant checkpoints' backward calls are on the stack (recomputing or running
    their region's nested pass)."""
    if not _KEPT_ANY[0]:
        return 0
    return sum(name == "backward" for name in _checkpoint_frames(sys._getframe(1)))


def may_be_checkpointed() -> bool:
    """Cheap pre-check before phase(): a checkpointed forward runs either with grad disabled
    (reentrant) or under a saved-tensors hook (non-reentrant)."""
    return (not torch.is_grad_enabled()
            or torch._C._autograd._top_saved_tensors_default_hooks(False) is not None)


def checkpoint(function, *args, distribute_saved_activations: bool = False,
               get_rng_state_tracker=None, tp_group=None, use_reentrant: bool = True, **kwargs):
    """Transformer Engine's ``checkpoint`` over torch.utils.checkpoint.checkpoint: run
    ``function(*args, **kwargs)`` without keeping its activations, recomputing them in
    backward (FP8 layers inside replay their casts exactly, as with torch's own function).

    As in Transformer Engine, keyword arguments go to ``function`` (in both modes; torch's
    reentrant mode takes none itself), except torch's own options context_fn,
    determinism_check and debug. distribute_saved_activations and get_rng_state_tracker serve
    Transformer Engine's tensor parallelism, which this library does not have: they are
    refused rather than ignored.
    """
    if distribute_saved_activations:
        raise ValueError("checkpoint: distribute_saved_activations=True (sharding saved "
                         "activations over a tensor-parallel group) is not supported")
    if get_rng_state_tracker is not None:
        raise ValueError("checkpoint: get_rng_state_tracker (a tensor-parallel RNG tracker) is "
                         "not supported; torch's checkpoint restores the RNG state itself")
    del tp_group  # only meaningful with distribute_saved_activations
    torch_options = {name: kwargs.pop(name) for name in ("context_fn", "determinism_check",
                                                         "debug") if name in kwargs}
    if kwargs:
        # Bound here: the reentrant mode passes no keyword argument to the function.
        function = functools.partial(function, **kwargs)
    return _torch_checkpoint.checkpoint(function, *args, use_reentrant=use_reentrant,
                                        **torch_options)
