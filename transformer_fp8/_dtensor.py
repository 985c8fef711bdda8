"""DTensor (torch.distributed.tensor) where this torch has it: the test and the local tensor that
the FP8 state and the tensor-parallel forward (modules/tensor_parallel.py) use; and the ranks of
a process group, which the tensor-parallel and FSDP2 paths compare."""
from __future__ import annotations

import torch

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # a torch built without torch.distributed
    DTensor = None


# (isinstance(parameter, DTensor) costs half a microsecond: plain types answer first.)
_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


def is_dtensor(tensor) -> bool:
    return (DTensor is not None and type(tensor) not in _PLAIN_TYPES
            and isinstance(tensor, DTensor))


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The rank's local tensor of a DTensor (differentiable), else the tensor itself."""
    return tensor.to_local() if is_dtensor(tensor) else tensor


def group_ranks(group) -> frozenset:
    """The global ranks of a torch.distributed process group."""
    import torch.distributed as dist
    return frozenset(dist.get_process_group_ranks(group))
