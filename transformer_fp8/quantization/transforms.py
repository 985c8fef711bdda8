"""torch.func transforms (grad, vmap, jacrev, ...) and FP8 training: not supported. The FP8 state
(amax histories, scales) is written in place and outlives the transform; a tensor made inside
one must not reach it (a history resized inside torch.func.grad stayed behind as a dead
wrapper, and the next training step crashed), and an update must not half-run there."""
from __future__ import annotations

import torch

_current_level = torch._C._functorch.maybe_current_level


def refuse_functorch_transform(what: str) -> None:
    """Raises, naming ``what``, inside a torch.func transform; else nothing (one C call)."""
    if _current_level() is not None:
        raise RuntimeError(
            f"transformer_fp8: {what} inside a torch.func transform (grad, vmap, jacrev, ...), "
            "which FP8 training does not support: the FP8 state (amax histories, scales) is "
            "updated in place and outlives the transform. Compute gradients with "
            "loss.backward() or torch.autograd.grad instead.")
