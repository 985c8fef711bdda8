"""Transformer Engine 2.8's get_cpu_offload_context: the tensors that the first ``num_layers`` of
``model_layers`` layers save for backward are kept in CPU memory between forward and backward.

    context, synchronizer = get_cpu_offload_context(True, num_layers=2, model_layers=4)
    for layer in layers:
        with context:
            x = layer(x)
        x = synchronizer(x)

The context installs torch.autograd.graph.saved_tensors_hooks. A layer is the code run in the
context between two synchronizer calls, counted from 0 in each forward (the count starts again
after ``model_layers`` calls). What an offloaded layer saves goes to CPU memory when it is a
plain tensor (not a Parameter or a view of one, not a tensor subclass: FP8 weights, DTensors)
with more than one element (not a per-tensor scale or amax), on the CPU or a CUDA device:
activations, the FP8 copies of activations and the FP8 weight casts made for the step (the FP8
layers' state buffers are not saved for backward); an expanded view (stride 0) is copied
at its unexpanded size. Everything else is saved as without the context. Layers not offloaded
get no hooks (PyTorch's check that a saved tensor was not modified in place stays on); in an
offloaded layer the same check runs at unpack (for an offloaded tensor, while it still lives).
A forward that an exception stops inside the context restarts the count at layer 0. Entering
the context during CUDA graph capture raises a RuntimeError.

On CUDA each copy runs on a side stream, after the work that made the tensor, into pinned
memory; the tensor's memory goes back to the allocator (record_stream) once the copy is done, so
the forward never waits. The synchronizer puts a pre-hook on the node that made its output (its
grad_fn); the hook starts copying layers back, on the side stream, ahead of their
backward: layer i when backward reaches layer _reload_points(...)[i] (Transformer Engine 2.8's
schedule). The compute stream waits for a
tensor only where backward reads it. A CPU tensor is copied into new CPU memory (on a CPU model
this frees nothing; it runs the same save and restore as on CUDA).

Where other saved-tensor hooks are active when the context is entered (an enclosing
torch.utils.checkpoint without reentrancy, whose recomputation must see what its forward saw),
and in backward (a checkpoint's recomputation), the context installs nothing.
"""
from __future__ import annotations

import contextlib
import warnings
import weakref

import torch

__all__ = ["get_cpu_offload_context"]

_SIDE_STREAMS: dict = {}  # CUDA device index -> the stream the copies run on


def _side_stream(device: torch.device):
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SIDE_STREAMS:
        _SIDE_STREAMS[index] = torch.cuda.Stream(device=index)
    return _SIDE_STREAMS[index]


def _offloadable(t: torch.Tensor) -> bool:
    return (type(t) is torch.Tensor and t.layout is torch.strided and not t.is_nested
            and t.numel() > 1  # (a sparse or nested tensor is kept where it is)
            and t.device.type in ("cpu", "cuda")
            and (t._base is None or type(t._base) is torch.Tensor))


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _check_version(source, version: int) -> None:
    """PyTorch's check that a saved tensor was not modified in place after it was saved (which
    saved-tensor hooks turn off): ``source`` is the tensor or a weak reference to it."""
    t = source() if isinstance(source, weakref.ref) else source
    if t is not None and t._version != version:
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an "
            f"inplace operation: [{t.type()} {list(t.shape)}] is at version {t._version}; "
            f"expected version {version} instead (saved in a layer offloaded by "
            "get_cpu_offload_context)")


class _Kept:
    """A tensor an offloaded layer keeps as is, with its version at save time."""

    __slots__ = ("tensor", "version")

    def __init__(self, t: torch.Tensor):
        self.tensor, self.version = t, t._version

    def get(self) -> torch.Tensor:
        _check_version(self.tensor, self.version)
        return self.tensor


class _Offloaded:
    """A saved tensor's copy in CPU memory, and its way back (what the pack hook returns)."""

    __slots__ = ("cpu", "device", "on_device", "ready", "stream", "source", "version", "shape",
                 "__weakref__")

    def __init__(self, t: torch.Tensor):
        self.device, self.on_device, self.ready, self.stream = t.device, None, None, None
        # in-place writes after the save are checked at unpack while the tensor lives
        self.source, self.version, self.shape = weakref.ref(t), t._version, None
        if any(stride == 0 and size > 1 for size, stride in zip(t.shape, t.stride())):
            # an expanded view: copy what it reads (the expanded dimensions at size 1)
            self.shape = t.shape
            t = t[tuple(slice(0, 1) if stride == 0 else slice(None) for stride in t.stride())]
        if t.device.type == "cpu":
            self.cpu = t.clone()
            return
        self.cpu = torch.empty_like(t, device="cpu", pin_memory=True)
        side = _side_stream(t.device)
        side.wait_stream(torch.cuda.current_stream(t.device))  # after the work that made t
        with torch.cuda.stream(side):
            self.cpu.copy_(t, non_blocking=True)
        t.record_stream(side)  # its memory is reused only after the copy

    def reload(self) -> None:
        """Start the copy back to the device (CUDA), if not started yet."""
        if self.device.type == "cpu" or self.on_device is not None:
            return
        compute = torch.cuda.current_stream(self.device)
        self.on_device = torch.empty_like(self.cpu, device=self.device)  # a compute-stream block
        side = _side_stream(self.device)
        side.wait_stream(compute)  # (queued compute work may still use that memory)
        with torch.cuda.stream(side):
            self.on_device.copy_(self.cpu, non_blocking=True)
        self.on_device.record_stream(side)  # (freed unread: after the copy all the same)
        self.ready, self.stream = side.record_event(), compute

    def get(self) -> torch.Tensor:
        _check_version(self.source, self.version)
        if self.device.type == "cpu":
            return self._expanded(self.cpu)
        self.reload()
        current = torch.cuda.current_stream(self.device)
        current.wait_event(self.ready)
        if current != self.stream:
            self.on_device.record_stream(current)
        return self._expanded(self.on_device)

    def _expanded(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.shape is None else t.expand(self.shape)


def _unpack(saved):
    return saved.get()


def _reload_points(num_layers: int, model_layers: int) -> list:
    """The layer whose backward starts the copy back of offloaded layer i, for each i: the
    offloaded layers spread over the model (Transformer Engine 2.8's window map)."""
    step, extra = divmod(model_layers, num_layers)
    return [step * (i + 1) - 1 + min(i + 1, extra) for i in range(num_layers)]


class _Layer:
    """One layer of one forward: its offloaded tensors (held weakly: autograd owns them)."""

    def __init__(self, index: int, offload: bool, forward: list):
        self.index, self.offload, self.forward = index, offload, forward
        self.saved: list = []
        forward.append(self)

    def reload(self) -> None:
        for ref in self.saved:
            saved = ref()
            if saved is not None:
                saved.reload()


def _reload_prehook(layer: _Layer, points: list):
    """A pre-hook for the node that made a layer's output (the layer's backward is next): it
    starts copying back the layers of that forward due by now (as Transformer Engine 2.10 hooks
    the output's grad_fn; a node of its own would make the output a view that in-place ops
    refuse)."""
    def prehook(grad_outputs):
        for other in layer.forward:
            if other.offload and points[other.index] >= layer.index:
                other.reload()
    return prehook


class _CpuOffloadContext:
    """The context of get_cpu_offload_context (one per model; see the module docstring)."""

    def __init__(self, num_layers: int, model_layers: int):
        self.num_layers, self.model_layers = num_layers, model_layers
        self.reload_points = _reload_points(num_layers, model_layers) if num_layers else []
        self._index = 0        # the layer the next synchronizer call ends
        self._forward = None   # the layers of the forward under way
        self._layer = None     # the layer under way (from its first entry)
        self._hooks: list = []
        self._observer = None  # tests: called with (layer index, tensor) for each offload

    def _current(self) -> _Layer:
        if self._layer is None:
            if self._forward is None:
                self._forward = []
            self._layer = _Layer(self._index, self._index < self.num_layers, self._forward)
        return self._layer

    def __enter__(self):
        if torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("get_cpu_offload_context: the context was entered while a CUDA "
                               "graph is being captured; CPU offloading does not support CUDA "
                               "graphs (make_graphed_callables, torch.cuda.graph, "
                               "torch.compile(mode='reduce-overhead'))")
        hooks = None
        if not _in_backward() and torch._C._autograd._top_saved_tensors_default_hooks(
                False) is None:
            layer = self._current()
            if layer.offload:  # (no hooks elsewhere: PyTorch's in-place check stays on)
                hooks = torch.autograd.graph.saved_tensors_hooks(
                    lambda t: self._pack(layer, t), _unpack)
                hooks.__enter__()
        self._hooks.append(hooks)
        return self

    def __exit__(self, *exc):
        hooks = self._hooks.pop()
        if hooks is not None:
            hooks.__exit__(*exc)
        if exc[0] is not None and not _in_backward():
            # the forward stopped mid-model: the next one starts at layer 0
            self._index, self._layer, self._forward = 0, None, None

    def _pack(self, layer: _Layer, t: torch.Tensor):
        if not _offloadable(t):
            return _Kept(t)
        saved = _Offloaded(t)
        layer.saved.append(weakref.ref(saved))
        if self._observer is not None:
            self._observer(layer.index, t)
        return saved

    def synchronize(self, tensor: torch.Tensor) -> torch.Tensor:
        """Ends the layer: returns ``tensor`` itself, with a pre-hook on its grad_fn (if any)
        that starts copying layers back."""
        if _in_backward():  # a checkpoint's recomputation: counted in its forward
            return tensor
        layer = self._current()
        self._layer = None
        self._index += 1
        if self._index == self.model_layers:
            self._index, self._forward = 0, None
        if (torch.is_grad_enabled() and isinstance(tensor, torch.Tensor)
                and tensor.grad_fn is not None):
            tensor.grad_fn.register_prehook(_reload_prehook(layer, self.reload_points))
        return tensor


def _check_count(name: str, value, low: int, high=None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"get_cpu_offload_context: {name} must be an int, got {value!r}")
    if value < low or (high is not None and value > high):
        bound = f"between {low} and {high} (model_layers)" if high is not None else f">= {low}"
        raise ValueError(f"get_cpu_offload_context: {name} must be {bound}, got {value}")


def get_cpu_offload_context(enabled: bool = False, num_layers: int = 1, model_layers: int = 1,
                            offload_activations: bool = True, offload_weights: bool = False,
                            double_buffering: bool = False):
    """Transformer Engine 2.8's CPU offloading: ``(context, synchronizer)``. Run each of the
    model's ``model_layers`` layers inside ``context`` and pass its output through
    ``synchronizer``; what the first ``num_layers`` layers save for backward waits in CPU
    memory until their backward. Disabled: ``(contextlib.nullcontext(), identity)``.
    ``offload_weights`` is deprecated and does nothing (as there); ``double_buffering`` is
    accepted and unused (the reload buffers come from PyTorch's caching allocator).
    """
    if not offload_weights and not offload_activations:
        raise ValueError("get_cpu_offload_context: offload_activations and offload_weights are "
                         "both False: nothing to offload")
    if offload_weights:
        warnings.warn("get_cpu_offload_context: offloading weights is deprecated; "
                      "offload_weights=True has no effect", DeprecationWarning, stacklevel=2)
        if not offload_activations:
            return contextlib.nullcontext(), lambda x: x
    if not enabled:
        return contextlib.nullcontext(), lambda x: x
    _check_count("model_layers", model_layers, 1)
    _check_count("num_layers", num_layers, 0, model_layers)
    context = _CpuOffloadContext(num_layers, model_layers)
    return context, context.synchronize
