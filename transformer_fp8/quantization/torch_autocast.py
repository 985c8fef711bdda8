"""torch.autocast's state for a tensor's device, also for devices autocast does not know."""
from __future__ import annotations

from typing import Optional

import torch

# torch.is_autocast_enabled raises for device types it has no autocast for ("meta": shape
# inference, meta-device initialisation): there autocast is simply off.
_AUTOCAST_DEVICE_TYPES = frozenset({"cpu", "cuda", "xpu", "mps", "hpu", "mtia", "xla"})


def autocast_dtype(device_type: str) -> Optional[torch.dtype]:
    """The dtype torch.autocast computes in on ``device_type``, or None where it is off."""
    if not torch._C._is_any_autocast_enabled():
        return None  # (the common case, one cheap call)
    if device_type in _AUTOCAST_DEVICE_TYPES and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


def output_dtype(inp: torch.Tensor) -> torch.dtype:
    """The dtype an FP8 GEMM of ``inp`` returns: torch.autocast's on its device, else its own."""
    if not torch._C._is_any_autocast_enabled():
        return inp.dtype
    return autocast_dtype(inp.device.type) or inp.dtype
