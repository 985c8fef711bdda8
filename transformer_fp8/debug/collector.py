"""Fp8Stats: per-layer FP8 statistics of a model's selected layers, every ``frequency`` steps.

    with tfp8.debug.collect_stats(model, layers="blocks.*", frequency=10,
                                  path="fp8_stats.jsonl") as stats:
        for batch in loader:
            ...forward in fp8_autocast, backward, optimizer step...
            stats.step()

During a logged step the casts of the selected layers compute their statistics on the device
(stats.py) and keep them there; ``step()`` combines them (microbatches: per operand), reduces
them across ranks (two all_reduce calls), copies them to the host once and writes them. Other
steps and other layers run exactly as without a collector. Off (outside the context), the FP8
modules pay one ``is None`` test per forward. Under torch.compile no statistics are collected
(the casts are traced without them); a logged step that saw no cast says so in a warning.
"""
from __future__ import annotations

import fnmatch
import warnings
from typing import Callable, Optional, Sequence, Union

import torch

from .. import _fp8_hooks
from ..modules.base import Fp8StateMixin
from . import observer as _observer
from .stats import FIELDS, MAX_FIELDS, MIN_FIELDS, SUM_FIELDS, combine, derive
from .writers import JsonLinesWriter, TensorBoardWriter

LayerFilter = Union[str, Sequence[str], Callable[[str], bool]]


def _matcher(layers: LayerFilter) -> Callable[[str], bool]:
    if callable(layers):
        return layers
    if isinstance(layers, str):
        layers = [layers]
    if not (isinstance(layers, (list, tuple)) and all(isinstance(p, str) for p in layers)):
        raise TypeError("layers must be a glob pattern, a list of them or a callable "
                        f"name -> bool, got {layers!r}")
    return lambda name: any(fnmatch.fnmatchcase(name, p) for p in layers)


def select_layers(model: torch.nn.Module, layers: LayerFilter) -> dict:
    """{module: name} of the FP8 modules of ``model`` whose qualified name matches."""
    match = _matcher(layers)
    return {m: name for name, m in model.named_modules()
            if isinstance(m, Fp8StateMixin) and match(name)}


class Fp8Stats:
    """Collects per-layer FP8 statistics (see the module docstring). Arguments:
    model; layers: glob pattern(s) on the qualified module names (fnmatch, e.g. "blocks.1*")
    or a callable name -> bool, default every FP8 module; frequency: log every n-th step
    (steps 0, n, 2n, ...); path: JSON lines file (one record per step, layer, GEMM and
    tensor) or None; tensorboard_dir: also write TensorBoard scalars there (needs the
    tensorboard package); group: the process group to reduce over (default: the world, when
    torch.distributed is initialised); keep_records: keep every written record in
    ``self.records`` (default True)."""

    def __init__(self, model: torch.nn.Module, layers: LayerFilter = "*", frequency: int = 1,
                 path: Optional[str] = None, tensorboard_dir: Optional[str] = None,
                 group=None, keep_records: bool = True):
        if isinstance(frequency, bool) or not isinstance(frequency, int) or frequency < 1:
            raise ValueError(f"frequency must be a positive integer, got {frequency!r}")
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        self.selected = select_layers(model, layers)
        if not self.selected:
            raise ValueError(f"layers={layers!r} matches no FP8 module of the model; its FP8 "
                             "modules are: " + ", ".join(
                                 n for n, m in model.named_modules()
                                 if isinstance(m, Fp8StateMixin)))
        self.frequency, self.group = frequency, group
        self.writers = [w for w in (JsonLinesWriter(path) if path else None,
                                    TensorBoardWriter.create(tensorboard_dir)) if w]
        self.keep_records = keep_records
        self.records: list = []
        self.step_index = 0
        self._pending: dict = {}  # key -> list of FIELDS vectors on the device
        self._enabled = False
        self._previous = None
        self._warned_nothing = False

    # ---- switching on and off ------------------------------------------------------------

    def enable(self) -> "Fp8Stats":
        if not self._enabled:
            self._previous, _fp8_hooks.observer = _fp8_hooks.observer, self
            self._enabled = True
        return self

    def disable(self) -> None:
        if self._enabled:
            _fp8_hooks.observer, self._previous = self._previous, None
            self._enabled = False
            for writer in self.writers:
                writer.close()

    def __enter__(self) -> "Fp8Stats":
        return self.enable()

    def __exit__(self, *exc) -> None:
        self.disable()

    @property
    def logging_this_step(self) -> bool:
        return self.step_index % self.frequency == 0

    # ---- called by the FP8 modules (modules/base.py) -------------------------------------

    def wrap_quantizers(self, module, quantizers: list) -> list:
        name = self.selected.get(module)
        if name is None or not self.logging_this_step:
            return quantizers
        return _observer.observed_quantizers(module, name, quantizers, self)

    def record(self, key: tuple, values: torch.Tensor) -> None:
        self._pending.setdefault(key, []).append(values)

    # ---- once per step --------------------------------------------------------------------

    def step(self) -> list:
        """End of a training step: on a logged step, gather, reduce, write and return its
        records (a list of dicts); else []."""
        records = []
        if self.logging_this_step:
            records = self._gather()
            if not records and not self._warned_nothing:
                warnings.warn("transformer_fp8.debug: a logged step saw no FP8 cast of the "
                              "selected layers (no FP8 forward ran, or the model is compiled: "
                              "statistics are collected in eager mode only)", stacklevel=2)
                self._warned_nothing = True
            for writer in self.writers:
                writer.write(records)
            if self.keep_records:
                self.records.extend(records)
        self.step_index += 1
        return records

    def _gather(self) -> list:
        pending, self._pending = self._pending, {}
        keys = sorted(pending)
        keys = self._agreed_keys(keys)
        if not keys:
            return []
        neutral = torch.tensor([_NEUTRAL[op] for _, op in FIELDS], dtype=torch.float64)
        device = next(iter(pending.values()))[0].device if pending else self._idle_device()
        rows = [combine(torch.stack(pending[k])) if k in pending else neutral.to(device)
                for k in keys]
        table = torch.stack(rows)
        self._all_reduce(table)
        values = table.cpu()  # the one device-to-host copy of the step
        out = []
        for (layer, gemm, tensor), row in zip(keys, values):
            out.append({"step": self.step_index, "layer": layer, "gemm": gemm,
                        "tensor": tensor, **derive(row)})
        return out

    def _distributed(self) -> bool:
        return torch.distributed.is_available() and torch.distributed.is_initialized() and \
            torch.distributed.get_world_size(self.group) > 1

    def _idle_device(self) -> torch.device:
        """Where a rank that ran no selected layer this step puts its neutral rows."""
        if self._distributed() and torch.distributed.get_backend(self.group) != "gloo":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _agreed_keys(self, keys: list) -> list:
        """The union of every rank's keys (ranks may run different layers)."""
        if not self._distributed():
            return keys
        gathered = [None] * torch.distributed.get_world_size(self.group)
        torch.distributed.all_gather_object(gathered, keys, group=self.group)
        return sorted({tuple(k) for rank_keys in gathered for k in rank_keys})

    def _all_reduce(self, table: torch.Tensor) -> None:
        if not self._distributed():
            return
        dist = torch.distributed
        sums = table[:, SUM_FIELDS].contiguous()
        maxes = torch.cat([table[:, MAX_FIELDS], -table[:, MIN_FIELDS]], dim=1).contiguous()
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=self.group)
        dist.all_reduce(maxes, op=dist.ReduceOp.MAX, group=self.group)
        table[:, SUM_FIELDS] = sums
        table[:, MAX_FIELDS] = maxes[:, :len(MAX_FIELDS)]
        table[:, MIN_FIELDS] = -maxes[:, len(MAX_FIELDS):]


_NEUTRAL = {"sum": 0.0, "max": float("-inf"), "min": float("inf")}


def collect_stats(model: torch.nn.Module, layers: LayerFilter = "*", frequency: int = 1,
                  path: Optional[str] = None, tensorboard_dir: Optional[str] = None,
                  group=None, keep_records: bool = True) -> Fp8Stats:
    """An Fp8Stats to use as a context (``with collect_stats(model, ...) as stats:``) or to
    switch with ``.enable()`` / ``.disable()``; call ``stats.step()`` after each step."""
    return Fp8Stats(model, layers, frequency, path, tensorboard_dir, group, keep_records)
