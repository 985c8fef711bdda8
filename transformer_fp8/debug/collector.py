"""Fp8Stats: per-layer FP8 statistics of a model's selected layers, every ``frequency`` steps.

    with tfp8.debug.collect_stats(model, layers="blocks.*", frequency=10,
                                  path="fp8_stats.jsonl") as stats:
        for batch in loader:
            ...forward in fp8_autocast, backward, optimizer step...
            stats.step()

During a logged step the casts of the selected layers compute their statistics on the device
(stats.py) and keep them there; ``step()`` combines them (microbatches: per operand), reduces
them across ranks (two all_reduce calls; the ranks' operands are agreed once, at the first
logged step), copies them to the host once (the step's only device-to-host transfer; nothing
goes from the host to the device either) and writes them. Other steps and other layers run
exactly as without a collector. Several collectors may be enabled at once, and disabled in any
order: each records its own layers. Off (no collector enabled), the FP8 modules pay one
``is None`` test per forward. Under torch.compile no statistics are collected (the casts are
traced without them); a logged step of an enabled collector that saw no cast says so in a
warning.
"""
from __future__ import annotations

import fnmatch
import math
import warnings
from typing import Callable, Optional, Sequence, Union

import torch

from .. import _fp8_hooks
from ..modules.base import Fp8StateMixin
from . import observer as _observer
from .stats import FIELD_INDEX, MAX_FIELDS, MIN_FIELDS, SUM_FIELDS, combine, derive, neutral
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
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    match = _matcher(layers)
    return {m: name for name, m in model.named_modules()
            if isinstance(m, Fp8StateMixin) and match(name)}


def no_fp8_module_error(model: torch.nn.Module, layers: LayerFilter) -> ValueError:
    """The error for ``layers`` matching no FP8 module: the model's FP8 modules, and a hint
    where it matches a module that holds some (a TransformerLayer: "0.*" matches them)."""
    names = [n for n, m in model.named_modules() if isinstance(m, Fp8StateMixin)]
    shown = ", ".join(names[:20]) + (f", ... ({len(names)} in all)" if len(names) > 20 else "")
    message = (f"layers={layers!r} matches no FP8 module of the model; its FP8 modules are: "
               f"{shown or 'none'}")
    match = _matcher(layers)
    holders = [(n, type(m).__name__) for n, m in model.named_modules()
               if n and match(n) and any(x.startswith(n + ".") for x in names)]
    if holders:
        name, kind = holders[0]
        message += (f" ({name!r} is a {kind}, which holds FP8 modules: match them with "
                     f"{name + '.*'!r})")
    return ValueError(message)


# The enabled collectors, in the order enabled. While there is one, _fp8_hooks.observer is
# _DISPATCH: each module's casts reach every enabled collector that observes the module.
_ENABLED: list = []


class _Dispatch:
    @staticmethod
    def observes(module) -> bool:
        return any(c.observes(module) for c in _ENABLED)

    @staticmethod
    def wrap_quantizers(module, quantizers: list) -> list:
        watchers = [(c, c.selected[module]) for c in _ENABLED if c.observes(module)]
        if not watchers:
            return quantizers
        return _observer.observed_quantizers(module, watchers, quantizers)


_DISPATCH = _Dispatch()


def _first_rank_of(group) -> bool:
    """Whether this process writes the group's records (one process: it does)."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return True
    return dist.get_rank(group) == 0


class Fp8Stats:
    """Collects per-layer FP8 statistics (see the module docstring). Arguments:
    model; layers: glob pattern(s) on the qualified module names (fnmatch, e.g. "blocks.1*")
    or a callable name -> bool, default every FP8 module; frequency: log every n-th step
    (steps 0, n, 2n, ...); path: JSON lines file (one record per step, layer, GEMM and
    tensor) or None; tensorboard_dir: also write TensorBoard scalars there (needs the
    tensorboard package: ImportError without it); both written by the group's first rank
    only (the reduced records are the same on every rank); group: the process group to reduce over
    (default: the world, when torch.distributed is initialised); keep_records: keep every
    written record in ``self.records`` (default True)."""

    def __init__(self, model: torch.nn.Module, layers: LayerFilter = "*", frequency: int = 1,
                 path: Optional[str] = None, tensorboard_dir: Optional[str] = None,
                 group=None, keep_records: bool = True):
        if isinstance(frequency, bool) or not isinstance(frequency, int) or frequency < 1:
            raise ValueError(f"frequency must be a positive integer, got {frequency!r}")
        self.selected = select_layers(model, layers)
        if not self.selected:
            raise no_fp8_module_error(model, layers)
        self.frequency, self.group = frequency, group
        # The reduced records are the same on every rank of the group: its first rank writes
        # them (ranks writing one path wrote each record once per rank); each rank keeps them.
        writes = _first_rank_of(group)
        tensorboard = TensorBoardWriter.create(tensorboard_dir if writes else None)
        self.writers = [w for w in (JsonLinesWriter(path) if path and writes else None,
                                    tensorboard) if w]
        self.keep_records = keep_records
        self.records: list = []
        self.step_index = 0
        self._pending: dict = {}  # key -> list of FIELDS vectors on the device
        self._enabled = False
        self._warned_nothing = False
        self._all_keys = None  # distributed: every rank's operands, gathered once
        self._failed_writers: set = set()  # (ids of writers already reported failing)

    # ---- switching on and off ------------------------------------------------------------

    def enable(self) -> "Fp8Stats":
        """Start collecting, beside any other enabled collector (enabled already: nothing)."""
        if not self._enabled:
            _ENABLED.append(self)
            _fp8_hooks.observer = _DISPATCH
            self._enabled = True
        return self

    def disable(self) -> None:
        """Stop collecting, in any order among enabled collectors; the writers are closed."""
        if self._enabled:
            _ENABLED.remove(self)
            if not _ENABLED:
                _fp8_hooks.observer = None
            self._enabled = False
            for writer in self.writers:
                self._run_writer(writer.close)

    def __enter__(self) -> "Fp8Stats":
        return self.enable()

    def __exit__(self, *exc) -> None:
        self.disable()

    @property
    def logging_this_step(self) -> bool:
        return self.step_index % self.frequency == 0

    # ---- called by the FP8 modules (modules/base.py) -------------------------------------

    def observes(self, module) -> bool:
        """Whether this step's casts of ``module`` are observed (selected and logged)."""
        return self.logging_this_step and module in self.selected

    def record(self, key: tuple, values: torch.Tensor) -> None:
        self._pending.setdefault(key, []).append(values)

    # ---- once per step --------------------------------------------------------------------

    def step(self) -> list:
        """End of a training step: on a logged step, gather, reduce, write and return its
        records (a list of dicts); else []."""
        records = []
        if self.logging_this_step:
            records = self._gather()
            if not records and self._enabled and not self._warned_nothing:
                warnings.warn("transformer_fp8.debug: a logged step saw no FP8 cast of the "
                              "selected layers (no FP8 forward ran, or the model is compiled: "
                              "statistics are collected in eager mode only)", stacklevel=2)
                self._warned_nothing = True
            if self.keep_records:
                self.records.extend(records)
            for writer in self.writers:
                self._run_writer(writer.write, records)
        self.step_index += 1
        return records

    def _run_writer(self, call, *args) -> None:
        """A writer's write or close: one that fails (a full disk, a closed file) is reported
        once, with a warning, and training goes on (the step counted, the records kept)."""
        try:
            call(*args)
        except Exception as error:  # noqa: BLE001
            writer = getattr(call, "__self__", call)
            if id(writer) not in self._failed_writers:
                self._failed_writers.add(id(writer))
                warnings.warn(f"transformer_fp8.debug: {type(writer).__name__} failed "
                              f"({type(error).__name__}: {error}); its output is incomplete, "
                              "training goes on", stacklevel=3)

    def _gather(self) -> list:
        pending, self._pending = self._pending, {}
        rows = _combined_rows(pending)
        keys = self._agreed_keys(rows) if self._distributed() else sorted(rows)
        if not keys:
            return []
        device = next(iter(rows.values())).device if rows else self._idle_device()
        empty = neutral(device) if len(rows) < len(keys) else None
        table = torch.stack([rows.get(k, empty) for k in keys])
        self._all_reduce(table)
        values = table.tolist()  # the one device-to-host copy of the step
        blocks = FIELD_INDEX["blocks"]
        return [{"step": self.step_index, "layer": layer, "gemm": gemm, "tensor": tensor,
                 **derive(row)}
                for (layer, gemm, tensor), row in zip(keys, values) if row[blocks] > 0]

    def _distributed(self) -> bool:
        return torch.distributed.is_available() and torch.distributed.is_initialized() and \
            torch.distributed.get_world_size(self.group) > 1

    def _idle_device(self) -> torch.device:
        """Where a rank that ran no selected layer this step puts its neutral rows."""
        if self._distributed() and torch.distributed.get_backend(self.group) != "gloo":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _agreed_keys(self, rows: dict) -> list:
        """Every key any rank may record (ranks may run different layers): the union of the
        ranks' selected layers' operands, gathered once; operands that ran on no rank this
        step reduce to blocks == 0 and are left out by _gather."""
        if self._all_keys is None:
            local = sorted((name, gemm, role) for module, name in self.selected.items()
                           for gemm in _observer.gemm_names(module)
                           for role in _observer.ROLES + _observer.TRANSPOSED_ROLES)
            gathered = [None] * torch.distributed.get_world_size(self.group)
            torch.distributed.all_gather_object(gathered, local, group=self.group)
            self._all_keys = sorted({tuple(k) for rank_keys in gathered for k in rank_keys})
        unknown = set(rows) - set(self._all_keys)
        if unknown:
            raise RuntimeError(f"transformer_fp8.debug: statistics of {sorted(unknown)} are not "
                               "among the selected layers' operands agreed across ranks")
        return self._all_keys

    def _all_reduce(self, table: torch.Tensor) -> None:
        if not self._distributed():
            return
        dist = torch.distributed
        sums = table[:, SUM_FIELDS].contiguous()
        maxes = torch.cat([table[:, MAX_FIELDS], -table[:, MIN_FIELDS]], dim=1)
        # A NaN (an operand holding one) must win the MAX on every backend, as in one process
        # (gloo's MAX drops it): reduced as a flag beside the values, in the same collective.
        nan = maxes.isnan()
        both = torch.cat([torch.where(nan, -math.inf, maxes), nan.to(maxes.dtype)], dim=1)
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=self.group)
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self.group)
        width = maxes.shape[1]
        maxes = torch.where(both[:, width:] > 0, math.nan, both[:, :width])
        n_max = MAX_FIELDS.stop - MAX_FIELDS.start
        table[:, SUM_FIELDS] = sums
        table[:, MAX_FIELDS] = maxes[:, :n_max]
        table[:, MIN_FIELDS] = -maxes[:, n_max:]


def _combined_rows(pending: dict) -> dict:
    """{key: one FIELDS vector}: each key's casts (microbatches) combined, the keys with the
    same number of casts together, so that a step costs a few operators whatever the number of
    layers."""
    by_count: dict = {}
    for key, vectors in pending.items():
        by_count.setdefault(len(vectors), []).append(key)
    rows = {}
    for count, keys in by_count.items():
        if count == 1:
            rows.update((k, pending[k][0]) for k in keys)
        else:
            stacked = torch.stack([v for k in keys for v in pending[k]])
            rows.update(zip(keys, combine(stacked.view(len(keys), count, -1)).unbind()))
    return rows


def collect_stats(model: torch.nn.Module, layers: LayerFilter = "*", frequency: int = 1,
                  path: Optional[str] = None, tensorboard_dir: Optional[str] = None,
                  group=None, keep_records: bool = True) -> Fp8Stats:
    """An Fp8Stats to use as a context (``with collect_stats(model, ...) as stats:``) or to
    switch with ``.enable()`` / ``.disable()``; call ``stats.step()`` after each step."""
    return Fp8Stats(model, layers, frequency, path, tensorboard_dir, group, keep_records)
