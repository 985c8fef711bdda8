"""Where a call runs with respect to torch.utils.checkpoint (both modes), found by a walk up the
stack through the frames of torch/utils/checkpoint.py: inside the first forward of checkpointed
regions (which a backward may recompute), inside a recomputation of one, or inside the nested
backward pass of a reentrant region. replay.py keeps and replays the FP8 records of those regions;
backward_step.py holds back the grad_output updates of nested passes.
"""
from __future__ import annotations

import sys
from typing import NamedTuple, Optional

import torch
import torch.utils.checkpoint as _torch_checkpoint

_CHECKPOINT_FILE = _torch_checkpoint.__file__


class CheckpointContext(NamedTuple):
    """Where a call runs with respect to torch.utils.checkpoint."""
    # (region, key) of the innermost recomputation on the stack, or None; the key tells one
    # recomputation of a region from another (a retained graph backpropagated twice).
    recomputation: Optional[tuple]
    # The regions whose first forward runs on the stack inside that recomputation (or
    # anywhere, if none), innermost first, that a backward may recompute.
    regions: tuple


def checkpoint_context() -> CheckpointContext:
    """The caller's CheckpointContext (a walk up the stack)."""
    regions = []
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_filename == _CHECKPOINT_FILE:
            name = code.co_name
            if name == "backward":  # CheckpointFunction.backward: a reentrant recomputation
                # (one per backward pass through the region: the pass tells them apart)
                recomputation = (frame.f_locals.get("ctx"), torch._C._current_graph_task_id())
                return CheckpointContext(recomputation, tuple(regions))
            if name == "unpack_hook":  # a non-reentrant recomputation (the unpack hook of
                local = frame.f_locals  # _checkpoint_hook, not _recomputation_hook's)
                if "frame" in local:
                    recomputation = (local["frame"], local.get("gid"))
                    return CheckpointContext(recomputation, tuple(regions))
            elif name == "forward":  # CheckpointFunction.forward: a reentrant first forward
                local = frame.f_locals
                if "ctx" in local and "run_function" in local and _reentrant_needs_grad(local):
                    regions.append(local["ctx"])
            elif name == "checkpoint":  # checkpoint(): a non-reentrant first forward
                generator = frame.f_locals.get("gen")
                if getattr(generator, "gi_frame", None) is not None:
                    region = generator.gi_frame.f_locals.get("new_frame")
                    if region is not None and _non_reentrant_needs_grad(region):
                        regions.append(region)
        frame = frame.f_back
    return CheckpointContext(None, tuple(regions))


def _reentrant_needs_grad(local) -> bool:
    """Whether a backward may recompute a reentrant region: one of its inputs requires
    gradients (its forward runs under no_grad; without one torch runs no backward through it)."""
    return any(isinstance(arg, torch.Tensor) and arg.requires_grad
               for arg in local.get("args", ()))


def _non_reentrant_needs_grad(region) -> bool:
    """Whether a backward may recompute a non-reentrant region: it ran with gradients enabled
    (its input saver has a grad_fn; without, torch installs no hook and recomputes nothing)."""
    saver = getattr(region, "input_saver", None)
    return saver is None or getattr(saver, "grad_fn", None) is not None


def _checkpoint_frames(frame):
    """The names of the functions of torch/utils/checkpoint.py on the stack above ``frame``."""
    while frame is not None:
        if frame.f_code.co_filename == _CHECKPOINT_FILE:
            yield frame.f_code.co_name
        frame = frame.f_back


def regions_to_keep() -> tuple:
    """The regions a forward that is not a replay keeps a record for. Cheap where no
    checkpoint can be running (see may_be_checkpointed), also outside any autograd.Function's
    forward without saved-tensor hooks (an evaluation forward under a plain no_grad,
    high-precision ones included): a reentrant first forward runs inside an
    autograd.Function's forward, which disables forward-mode AD, and a non-reentrant one under
    saved-tensor hooks. (inference_mode disables forward-mode AD too: it gets the walk, as an
    inference_mode region inside a reentrant checkpoint must keep its records.)"""
    if torch.compiler.is_compiling() or not may_be_checkpointed():
        return ()
    if torch._C._autograd._top_saved_tensors_default_hooks(False) is None and \
            torch._C._is_fwd_grad_enabled():
        return ()  # (outside any autograd.Function's forward, no saved-tensor hooks)
    return checkpoint_context().regions


# Whether any FP8 forward has kept a replay record in this process: until one has, no FP8 layer
# ran under torch.utils.checkpoint, so no backward pass can be a checkpoint's nested one.
KEPT_ANY = [False]


def in_reentrant_backward() -> bool:
    """Whether the caller runs inside the nested backward pass that a reentrant checkpoint
    runs for its region (the frame of CheckpointFunction.backward is on the stack)."""
    if not KEPT_ANY[0]:
        return False  # (the common case, without the walk up the stack)
    return "backward" in _checkpoint_frames(sys._getframe(1))


def reentrant_depth() -> int:
    """How many reentrant checkpoints' backward calls are on the stack (recomputing or running
    their region's nested pass)."""
    if not KEPT_ANY[0]:
        return 0
    return sum(name == "backward" for name in _checkpoint_frames(sys._getframe(1)))


def may_be_checkpointed() -> bool:
    """Cheap pre-check before checkpoint_context(): a checkpointed first forward runs either
    with grad disabled (reentrant) or under a saved-tensors hook (non-reentrant)."""
    return (not torch.is_grad_enabled()
            or torch._C._autograd._top_saved_tensors_default_hooks(False) is not None)


