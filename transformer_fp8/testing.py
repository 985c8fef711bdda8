"""Numeric-parity checks of an FP8 model against a high-precision reference, for users' tests.

    from transformer_fp8.testing import assert_fp8_parity, compare_to_reference, sqnr

``compare_to_reference`` runs the FP8 model inside ``fp8_autocast`` and the reference (a
float32 / bfloat16 copy, or the same model, which then runs outside the context) on the same
inputs, and reports the SQNR and relative error of the output, the loss, every input gradient
and every parameter gradient, by parameter name. ``assert_fp8_parity`` raises AssertionError
naming the tensors under the thresholds, and also when nothing ran in FP8 (the model's output
inside fp8_autocast equals its output outside: layers not converted, or skipped). Nothing here
changes the parameters or their ``.grad`` (gradients come from ``torch.autograd.grad``); under
delayed scaling the FP8 model first runs one calibrating high-precision step with its backward
(every scale, the gradients' included, set from these inputs: a first FP8 step at scale 1
flushes small E5M2 gradients to zero, and the zeros cascade one layer per step), then ``steps``
FP8 training steps (default 2), the last one compared; its FP8 state advances as those steps'
would. A gradient that one run produces and the other does not (an FP8 path that cuts the
graph) reads -inf dB and fails; a gradient under GRAD_NOISE_FLOOR that is zero in math (a
float64 run of the reference, made then, disagrees with it: rounding noise) is measured against
that floor, and a small gradient that is real (the float64 run agrees: a LayerScale branch's)
against its own size; an output dtype the FP8 path changed fails (where model and reference
have one parameter dtype); the reference runs outside FP8 even inside a caller's
``fp8_autocast``, and both runs record their graphs under a caller's no_grad too. Models with
fuse_wgrad_accumulation or delay_wgrad_compute, whose weight gradients bypass autograd, are
refused.

Default thresholds (DEFAULT_MIN_SQNR_DB, DEFAULT_GRAD_MIN_SQNR_DB) come from measurements
against float32 copies (benchmarks/bench_parity.py, results in benchmarks/results/parity-cpu/:
HYBRID delayed scaling, 2 steps, hidden size 256, minimum over 8 seeds, commit c29695f). One
FP8 GEMM (Linear, LayerNormLinear): output 28.4 dB, gradients 23.8 dB. Two chained
(LayerNormMLP, Linear-GELU-Linear): output 25.3 dB, gradients 20.6 dB. TransformerLayer (four
GEMMs; the residual carries most of the output): output 41.3 dB, weight gradients 19.6 dB. The
unit tests' bounds on smaller layers, over many random seeds, are 23 / 19 dB (one GEMM) and
21 / 15 dB (two). The defaults, 15 dB for outputs and losses and 10 dB for gradients, leave
~10 dB for deeper models and still fail a wrong scale (a factor 2 is 0 dB) or a wrong operand
(< 3 dB). A model much deeper than a few layers loses more: measure it with compare_to_reference
and pass your bounds.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from .quantization.autocast import fp8_autocast
from .quantization.recipe import DelayedScaling
from ._parity_runs import GRAD_NOISE_FLOOR  # noqa: F401 (documented here)
from ._parity_runs import (SameRandomness, float_dtype, inputs_tuple, one_run, rng_trackers,
                           zero_in_math_floors)

DEFAULT_MIN_SQNR_DB = 15.0       # output and loss
DEFAULT_GRAD_MIN_SQNR_DB = 10.0  # input and parameter gradients


def _as_float64(t: torch.Tensor, what: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
    return t.detach().to(device="cpu", dtype=torch.float64)


def _pair(actual, expected, what: str = ""):
    a, e = _as_float64(actual, "actual"), _as_float64(expected, "expected")
    if a.shape != e.shape:
        raise ValueError(f"{what + ': ' if what else ''}actual and expected must have the same "
                         f"shape, got {tuple(a.shape)} and {tuple(e.shape)}")
    return a, e


def sqnr(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Signal-to-quantisation-noise ratio of ``actual`` against ``expected`` in dB:
    20 log10(||expected|| / ||actual - expected||), in float64. inf when they are equal, -inf
    when expected is zero and actual is not, nan when either holds a NaN. Equal elements add
    no noise (an inf in both at one place); an inf where the other is not makes the noise
    infinite: -inf. The signal is the finite part of expected."""
    return _sqnr_of(*_noise_and_signal(actual, expected))


def _sqnr_of(noise: float, signal: float) -> float:
    if math.isnan(noise) or noise == 0.0:
        return math.nan if math.isnan(noise) else math.inf
    if signal == 0.0 or math.isinf(noise):
        return -math.inf
    return 20.0 * math.log10(signal / noise)


def _noise_and_signal(actual, expected, what: str = "") -> tuple:
    """(||actual - expected|| over the elements that differ, ||finite expected||); the noise is
    nan when either holds a NaN."""
    a, e = _pair(actual, expected, what)
    if torch.isnan(a).any() or torch.isnan(e).any():
        return math.nan, math.nan
    noise = torch.linalg.vector_norm(torch.where(a == e, 0.0, a - e)).item()
    signal = torch.linalg.vector_norm(torch.where(e.isfinite(), e, 0.0)).item()
    return noise, signal


def rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected|| in float64: 0 when equal, inf when expected is zero
    and actual is not, nan when either holds a NaN (infinities as in ``sqnr``)."""
    noise, signal = _noise_and_signal(actual, expected)
    if math.isnan(noise):
        return math.nan
    if noise == 0.0:
        return 0.0
    return math.inf if signal == 0.0 else noise / signal


@dataclass(frozen=True)
class TensorParity:
    """One compared tensor: its name ("output", "loss", "input_grad[0]", "grad:fc1.weight"),
    kind ("output", "loss", "input_grad", "param_grad"), shape and figures."""

    name: str
    kind: str
    shape: tuple
    sqnr_db: float
    rel_error: float

    @property
    def is_gradient(self) -> bool:
        return self.kind in ("input_grad", "param_grad")


@dataclass
class ParityReport:
    """What compare_to_reference measured; ``str(report)`` is a table."""

    entries: list = field(default_factory=list)
    # Whether the FP8 run's output differed from the model's own output outside fp8_autocast
    # (False: nothing ran in FP8).
    ran_in_fp8: bool = True

    def __getitem__(self, name: str) -> TensorParity:
        for entry in self.entries:
            if entry.name == name:
                return entry
        raise KeyError(f"no compared tensor named {name!r}; names: "
                       f"{[e.name for e in self.entries]}")

    def worst(self, n: Optional[int] = None) -> list:
        """Entries by increasing SQNR (NaN first)."""
        ranked = sorted(self.entries, key=lambda e: (not math.isnan(e.sqnr_db),
                                                      e.sqnr_db if not math.isnan(e.sqnr_db)
                                                      else 0.0))
        return ranked if n is None else ranked[:n]

    def failures(self, min_sqnr_db: float, grad_min_sqnr_db: float) -> list:
        """Entries under their threshold (or NaN), worst first."""
        def bound(e):
            return grad_min_sqnr_db if e.is_gradient else min_sqnr_db
        return [e for e in self.worst() if not e.sqnr_db >= bound(e)]

    def table(self) -> str:
        width = max([len("tensor")] + [len(e.name) for e in self.entries])
        lines = [f"{'tensor':<{width}}  {'shape':<16} {'SQNR (dB)':>10} {'rel. error':>11}"]
        for e in self.entries:
            shape = "x".join(map(str, e.shape)) or "scalar"
            lines.append(f"{e.name:<{width}}  {shape:<16} {e.sqnr_db:>10.2f} "
                         f"{e.rel_error:>11.3e}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def compare_to_reference(model: torch.nn.Module, reference: torch.nn.Module, inputs,
                         loss_fn: Optional[Callable] = None, recipe=None, steps: int = 2,
                         fp8_group=None, calibrate: bool = True) -> ParityReport:
    """Run ``model`` in FP8 and ``reference`` in high precision on ``inputs`` and compare.

    model: the FP8 model (its FP8 modules run in FP8 inside ``fp8_autocast(fp8_recipe=recipe)``).
    reference: a high-precision copy with the same parameter names (e.g. ``copy.deepcopy(model)
      .float()``), or ``model`` itself (it then runs outside the context). Floating inputs are
      cast to the reference's parameter dtype for it.
    inputs: a tensor or a tuple of positional arguments.
    loss_fn: output -> one-element tensor; its value is compared too. Default: the sum of each
      output times a fixed random tensor (a random grad_output), not reported.
    steps: FP8 forward + backward passes on the inputs; the last one is compared. The earlier
      ones let delayed scaling take its scales from these inputs (a fresh layer's are 1), as
      they would be in training. No parameter is changed.
    calibrate: under delayed scaling, a calibrating high-precision step with its backward
      first (every scale from these inputs, the gradients' included). False: the FP8 steps
      start from the model's scales as they are (what the first steps of training see; a
      check of the gradients' amax recording in FP8 steps needs it).
    Both runs start from the same RNG state (dropout draws the same masks). Afterwards the
    model runs once more outside fp8_autocast, without gradients, to tell whether the FP8 run
    ran in FP8 at all (report.ran_in_fp8). Buffers other than the FP8 state (a BatchNorm's
    statistics) advance with every forward made here, as in training."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive integer, got {steps!r}")
    for name, m in (("model", model), ("reference", reference)):
        if not isinstance(m, torch.nn.Module):
            raise TypeError(f"{name} must be a torch.nn.Module, got {type(m).__name__}")
    inputs = inputs_tuple(inputs)
    seed_devices = sorted({x.device.index or 0 for x in inputs
                           if isinstance(x, torch.Tensor) and x.device.type == "cuda"})
    model_names = [n for n, p in model.named_parameters() if p.requires_grad]
    ref_names = {n for n, p in reference.named_parameters() if p.requires_grad}
    missing = [n for n in model_names if n not in ref_names]
    if missing:
        raise ValueError(f"reference has no trainable parameter named {missing[:5]} (the "
                         "model's); build it as a copy of the model")
    routed = [n for n, m in (*model.named_modules(), *reference.named_modules())
              if getattr(m, "fuse_wgrad_accumulation", False)
              or getattr(m, "delay_wgrad_compute", False)]
    if routed:
        raise ValueError(f"compare_to_reference: {routed[:3]} use fuse_wgrad_accumulation or "
                         "delay_wgrad_compute, whose weight gradients bypass autograd (main_grad, "
                         "backward_dw()): compare copies built without them")
    randomness = SameRandomness(rng_trackers(model, reference), seed_devices)
    # (autograd on, also when called under no_grad or inference_mode: training steps)
    try:
        with torch.inference_mode(False), torch.enable_grad():
            with fp8_autocast(enabled=False):  # (high precision inside a caller's context)
                ref_out, ref_loss, ref_grads = one_run(reference, inputs, loss_fn,
                                                       float_dtype(reference), randomness)
            if calibrate and (recipe is None or isinstance(recipe, DelayedScaling)):
                # Every delayed scale, the gradients' included, from these inputs first.
                with fp8_autocast(enabled=False, calibrating=True, fp8_recipe=recipe,
                                  fp8_group=fp8_group):
                    one_run(model, inputs, loss_fn, None, randomness)
            for _ in range(steps):
                with fp8_autocast(enabled=True, fp8_recipe=recipe, fp8_group=fp8_group):
                    fp8_out, fp8_loss, fp8_grads = one_run(model, inputs, loss_fn, None,
                                                           randomness)
            # The model itself outside FP8, as its FP8 steps ran (with gradients: a forward
            # may branch on grad mode): whether anything ran in FP8, and the noise of its own
            # dtype (the floor of a gradient that is zero in math).
            with fp8_autocast(enabled=False):
                plain_out, _, plain_grads = one_run(model, inputs, loss_fn, None, randomness)
            floors = zero_in_math_floors(reference, inputs, loss_fn, ref_grads, plain_grads,
                                         randomness)
    finally:
        randomness.restore()
    if len(fp8_out) != len(ref_out):
        raise ValueError(f"model returned {len(fp8_out)} floating tensors, reference "
                         f"{len(ref_out)}")
    if not ref_grads:
        raise ValueError("the reference run produced no gradient (no input or parameter that "
                         "requires grad reaches its output): nothing to compare")
    report = ParityReport()
    report.ran_in_fp8 = not (
        all(a.shape == b.shape and torch.equal(a, b) for a, b in zip(fp8_out, plain_out))
        and fp8_grads.keys() == plain_grads.keys()
        and all(torch.equal(fp8_grads[n], plain_grads[n]) for n in fp8_grads))

    def add(name, kind, actual, expected, floor=0.0):
        noise, signal = _noise_and_signal(actual, expected, name)
        report.entries.append(TensorParity(name, kind, tuple(expected.shape),
                                           _sqnr_of(noise, max(signal, floor)),
                                           rel_error(actual, expected)))

    same_dtype = float_dtype(model) == float_dtype(reference)
    for i, (a, e) in enumerate(zip(fp8_out, ref_out)):
        name = "output" if len(ref_out) == 1 else f"output[{i}]"
        add(name, "output", a, e)
        if same_dtype and a.dtype != e.dtype:  # (the FP8 path changed the output's dtype)
            report.entries.append(TensorParity(f"{name} dtype {a.dtype} (expected {e.dtype})",
                                               "output", tuple(e.shape), -math.inf, math.inf))
    if loss_fn is not None:
        add("loss", "loss", fp8_loss.reshape(()), ref_loss.reshape(()))
    for name in [*ref_grads, *(n for n in fp8_grads if n not in ref_grads)]:
        kind = "input_grad" if name.startswith("input_grad") else "param_grad"
        if name in ref_grads and name in fp8_grads:
            add(name, kind, fp8_grads[name], ref_grads[name], floors.get(name, 0.0))
        else:  # one run produced it, the other not (a graph cut): fails
            shape = tuple((ref_grads.get(name, fp8_grads.get(name))).shape)
            report.entries.append(TensorParity(name, kind, shape, -math.inf, math.inf))
    return report


def assert_fp8_parity(model: torch.nn.Module, reference: torch.nn.Module, inputs,
                      loss_fn: Optional[Callable] = None, recipe=None, steps: int = 2,
                      min_sqnr_db: float = DEFAULT_MIN_SQNR_DB,
                      grad_min_sqnr_db: float = DEFAULT_GRAD_MIN_SQNR_DB,
                      fp8_group=None, max_listed: int = 5,
                      calibrate: bool = True) -> ParityReport:
    """compare_to_reference, then AssertionError if the output or loss is under
    ``min_sqnr_db`` or a gradient under ``grad_min_sqnr_db`` (NaN always fails). The message
    names the worst tensors with their figures and shows the whole table. Returns the report."""
    for name, value in (("min_sqnr_db", min_sqnr_db), ("grad_min_sqnr_db", grad_min_sqnr_db)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
            raise ValueError(f"{name} must be a number of dB, got {value!r}")
    report = compare_to_reference(model, reference, inputs, loss_fn=loss_fn, recipe=recipe,
                                  steps=steps, fp8_group=fp8_group, calibrate=calibrate)
    if not report.ran_in_fp8:
        raise AssertionError("FP8 parity: the model's output inside fp8_autocast equals its "
                             "output outside bit for bit, so nothing ran in FP8 (no layer "
                             "converted, or every one skipped: feature sizes must be multiples "
                             f"of 16; see convert_to_fp8's warning)\n{report.table()}")
    failed = report.failures(min_sqnr_db, grad_min_sqnr_db)
    if failed:
        listed = "; ".join(
            f"{e.name}: {e.sqnr_db:.2f} dB < "
            f"{grad_min_sqnr_db if e.is_gradient else min_sqnr_db} dB "
            f"(rel. error {e.rel_error:.3e})" for e in failed[:max_listed])
        more = f" and {len(failed) - max_listed} more" if len(failed) > max_listed else ""
        raise AssertionError(f"FP8 parity failed for {len(failed)} tensor(s), worst first: "
                             f"{listed}{more}\n{report.table()}")
    return report


__all__: Sequence[str] = ("DEFAULT_GRAD_MIN_SQNR_DB", "DEFAULT_MIN_SQNR_DB", "GRAD_NOISE_FLOOR",
                          "ParityReport",
                          "TensorParity", "assert_fp8_parity", "compare_to_reference",
                          "rel_error", "sqnr")
