"""Numeric-parity checks of an FP8 model against a high-precision reference, for users' tests.

    from transformer_fp8.testing import assert_fp8_parity, compare_to_reference, sqnr

``compare_to_reference`` runs the FP8 model inside ``fp8_autocast`` and the reference (a
float32 / bfloat16 copy, or the same model, which then runs outside the context) on the same
inputs, and reports the SQNR and relative error of the output, the loss, every input gradient
and every parameter gradient, by parameter name. ``assert_fp8_parity`` raises AssertionError
naming the tensors under the thresholds, and also when nothing ran in FP8 (the model's output
inside fp8_autocast equals its output outside: layers not converted, or skipped). Nothing here changes the
parameters or their ``.grad`` (gradients come from ``torch.autograd.grad``); under delayed
scaling the FP8 model first runs one calibrating high-precision step with its backward (every
scale, the gradients' included, set from these inputs: a first FP8 step at scale 1 flushes
small E5M2 gradients to zero, and the zeros cascade one layer per step), then ``steps`` FP8
training steps (default 2), the last one compared; its FP8 state advances as those steps'
would. A gradient that one run produces and the other does not (an FP8 path that cuts the
graph) reads -inf dB and fails; a gradient under GRAD_NOISE_FLOOR that is zero in math (a
float64 run of the reference, made then, disagrees with it: rounding noise) is measured
against that floor, and a small gradient that is real (the float64 run agrees: a LayerScale
branch's) against its own size; an output dtype the
FP8 path changed fails (where model and reference have one parameter dtype); the reference runs outside FP8 even inside a
caller's ``fp8_autocast``, and both runs record their graphs under a caller's no_grad too. Models with fuse_wgrad_accumulation or
delay_wgrad_compute, whose weight gradients bypass autograd, are refused.

Default thresholds (DEFAULT_MIN_SQNR_DB, DEFAULT_GRAD_MIN_SQNR_DB) come from measurements
against float32 copies (benchmarks/bench_parity.py, results in benchmarks/results/parity-cpu/:
HYBRID delayed scaling, 2 steps, hidden size 256, minimum over 8 seeds, commit c29695f). One
FP8 GEMM (Linear, LayerNormLinear): output 28.4 dB, gradients 23.8 dB. Two chained
(LayerNormMLP, Linear-GELU-Linear): output 25.3 dB, gradients 20.6 dB. TransformerLayer (four
GEMMs; the residual carries most of the output): output 41.3 dB, weight gradients 19.6 dB. The unit tests' bounds on
smaller layers, over many random seeds, are 23 / 19 dB (one GEMM) and 21 / 15 dB (two). The
defaults, 15 dB for outputs and losses and 10 dB for gradients, leave ~10 dB for deeper models
and still fail a wrong scale (a factor 2 is 0 dB) or a wrong operand (< 3 dB). A model much
deeper than a few layers loses more: measure it with compare_to_reference and pass your bounds.
"""
from __future__ import annotations

import copy
import math
import warnings
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch
from torch.utils import _pytree

from .quantization.autocast import fp8_autocast
from .quantization.recipe import DelayedScaling

DEFAULT_MIN_SQNR_DB = 15.0       # output and loss
DEFAULT_GRAD_MIN_SQNR_DB = 10.0  # input and parameter gradients
# A gradient whose reference norm is under this fraction of the largest of its kind (input or
# parameter gradients) may be zero in math (a key bias before a softmax, a bias before a
# batch norm): both runs then hold rounding noise. A float64 run of the reference tells: where
# it gives the same gradient (within _SAME_GRADIENT, relative), the gradient is real (a
# LayerScale branch's, gamma 1e-6) and is measured against its own size; where not, it is
# rounding noise (gone in float64, or another noise where the model computes in float32
# whatever its parameters' dtype, an upcast softmax) and is measured against this floor.
GRAD_NOISE_FLOOR = 1e-5
_SAME_GRADIENT = 0.1
_PROBE_SEED = 0x5EED  # the random grad_output of the default loss
_RUN_SEED = 0x0F8     # both runs start from this RNG state (dropout draws the same masks)


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


def _inputs_tuple(inputs) -> tuple:
    if isinstance(inputs, torch.Tensor):
        return (inputs,)
    if isinstance(inputs, (tuple, list)):
        return tuple(inputs)
    raise TypeError("inputs must be a tensor or a tuple/list of positional arguments, got "
                    f"{type(inputs).__name__}")


def _float_dtype(module: torch.nn.Module) -> Optional[torch.dtype]:
    for p in module.parameters():
        if p.is_floating_point():
            return p.dtype
    return None


def _prepared(inputs: tuple, dtype: Optional[torch.dtype]) -> tuple:
    """Fresh leaves of the floating inputs (cast to dtype if given) that require grad."""
    out = []
    for x in inputs:
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            x = x.detach().to(dtype or x.dtype, copy=True).requires_grad_(True)
        out.append(x)
    return tuple(out)


def _float_outputs(output) -> list:
    leaves, _ = _pytree.tree_flatten(output)
    tensors = [t for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not tensors:
        raise ValueError("the model's output holds no floating-point tensor to compare")
    return tensors


def _probe_loss(outputs: list) -> torch.Tensor:
    """sum(out * probe) with a fixed standard-normal probe per output: backward sees a random
    grad_output (a loss like out.sum() would give a constant one, exact in FP8)."""
    gen = torch.Generator().manual_seed(_PROBE_SEED)
    total = 0
    for out in outputs:
        probe = torch.randn(out.shape, generator=gen, dtype=torch.float32).to(out.device)
        total = total + (out.float() * probe).sum()
    return total


def _rng_trackers(*modules) -> list:
    """The RNG trackers the modules draw dropout from (Transformer Engine's
    get_rng_state_tracker), each once."""
    found = []
    for module in modules:
        for m in module.modules():
            getter = getattr(m, "get_rng_state_tracker", None)
            try:
                tracker = getter() if callable(getter) else None
            except Exception:  # noqa: BLE001 (an attribute of that name that is no getter)
                tracker = None
            if tracker is not None and hasattr(tracker, "get_states") \
                    and all(tracker is not t for t in found):
                found.append(tracker)
    return found


class _SameRandomness:
    """Every run starts from the same random state: the default generators (seeded) and the
    modules' RNG trackers (their states at the start, set again before each run, and put back
    at the end), so that dropout draws the same masks in every run."""

    def __init__(self, trackers: list, seed_devices):
        self.trackers, self.seed_devices = trackers, seed_devices
        self.states = [t.get_states() for t in trackers]

    def run(self, fn):
        with torch.random.fork_rng(devices=self.seed_devices):
            torch.manual_seed(_RUN_SEED)
            for tracker, states in zip(self.trackers, self.states):
                tracker.set_states(states)
            return fn()

    def restore(self) -> None:
        for tracker, states in zip(self.trackers, self.states):
            tracker.set_states(states)


def _one_run(module, inputs: tuple, loss_fn, dtype, randomness: _SameRandomness):
    """(output tensors, loss or None, {name: gradient}) of one forward + backward."""
    def forward():
        args = _prepared(inputs, dtype)
        return args, module(*args)
    args, output = randomness.run(forward)
    outputs = _float_outputs(output)
    loss = loss_fn(output) if loss_fn is not None else None
    if loss is not None and (not isinstance(loss, torch.Tensor) or loss.numel() != 1):
        raise ValueError("loss_fn must return a one-element tensor, got "
                         f"{type(loss).__name__}{getattr(loss, 'shape', '')}")
    objective = loss if loss is not None else _probe_loss(outputs)
    named = {f"input_grad[{i}]": x for i, x in enumerate(args)
             if isinstance(x, torch.Tensor) and x.requires_grad}
    named.update({f"grad:{n}": p for n, p in module.named_parameters() if p.requires_grad})
    if not objective.requires_grad:  # the graph was cut at the output: no gradient at all
        return [o.detach() for o in outputs], loss, {}
    grads = torch.autograd.grad(objective, list(named.values()), allow_unused=True)
    grads = {n: g for n, g in zip(named, grads) if g is not None}
    return [o.detach() for o in outputs], loss, grads


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
    inputs = _inputs_tuple(inputs)
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
    randomness = _SameRandomness(_rng_trackers(model, reference), seed_devices)
    # (autograd on, also when called under no_grad or inference_mode: training steps)
    try:
        with torch.inference_mode(False), torch.enable_grad():
            with fp8_autocast(enabled=False):  # (high precision inside a caller's context)
                ref_out, ref_loss, ref_grads = _one_run(reference, inputs, loss_fn,
                                                        _float_dtype(reference), randomness)
            if calibrate and (recipe is None or isinstance(recipe, DelayedScaling)):
                # Every delayed scale, the gradients' included, from these inputs first.
                with fp8_autocast(enabled=False, calibrating=True, fp8_recipe=recipe,
                                  fp8_group=fp8_group):
                    _one_run(model, inputs, loss_fn, None, randomness)
            for _ in range(steps):
                with fp8_autocast(enabled=True, fp8_recipe=recipe, fp8_group=fp8_group):
                    fp8_out, fp8_loss, fp8_grads = _one_run(model, inputs, loss_fn, None,
                                                            randomness)
            # The model itself outside FP8, as its FP8 steps ran (with gradients: a forward
            # may branch on grad mode): whether anything ran in FP8, and the noise of its own
            # dtype (the floor of a gradient that is zero in math).
            with fp8_autocast(enabled=False):
                plain_out, _, plain_grads = _one_run(model, inputs, loss_fn, None, randomness)
            floors = _zero_in_math_floors(reference, inputs, loss_fn, ref_grads, plain_grads,
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

    same_dtype = _float_dtype(model) == _float_dtype(reference)
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


def _norm(t) -> float:
    return torch.linalg.vector_norm(t.detach().double().cpu()).item()


def _zero_in_math_floors(reference, inputs, loss_fn, ref_grads: dict, plain_grads: dict,
                         randomness) -> dict:
    """{gradient name: the noise floor it is measured against}: the reference gradients under
    GRAD_NOISE_FLOOR times the largest of their kind that are zero in math (see
    GRAD_NOISE_FLOOR), each against the larger of that floor and ten times the noise the FP8
    model shows there in its own dtype outside FP8 (a bfloat16 model's is larger)."""
    largest = {kind: max([_norm(g) for n, g in ref_grads.items()
                          if n.startswith("input_grad") == (kind == "input_grad")
                          and g.isfinite().all()], default=0.0)
               for kind in ("input_grad", "param_grad")}
    small = {}
    for name, g in ref_grads.items():
        floor = GRAD_NOISE_FLOOR * largest["input_grad" if name.startswith("input_grad")
                                           else "param_grad"]
        if _norm(g) < floor:
            small[name] = floor
    if not small:
        return {}
    zero = _zero_in_math(reference, inputs, loss_fn, ref_grads, small, randomness)
    return {name: max(floor, 10.0 * _norm(plain_grads[name]) if name in plain_grads else 0.0)
            for name, floor in small.items() if name in zero}


def _zero_in_math(reference, inputs, loss_fn, ref_grads: dict, small: dict,
                  randomness) -> set:
    """Which of the small reference gradients are zero in math, from a float64 run of the
    reference: where it reproduces the reference's largest gradients (within 1%), a small
    gradient it does not give again (within _SAME_GRADIENT) is rounding noise; where it does
    not (the model draws other random numbers in float64, or cannot run in it), a small
    gradient it makes a thousandth as large or less. Every small one across several
    processes (a rank-local float64 run of a model with collectives could deadlock)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized() \
            and torch.distributed.get_world_size() > 1:
        return set(small)
    try:
        ref64 = copy.deepcopy(reference).double()
        with warnings.catch_warnings(), fp8_autocast(enabled=False):
            warnings.simplefilter("ignore")  # (FP8 layers warn of float64 inputs)
            _, _, grads64 = _one_run(ref64, inputs, loss_fn, torch.float64, randomness)
    except Exception:  # noqa: BLE001 (a model that cannot run in float64: all of them)
        return set(small)
    big = sorted(ref_grads, key=lambda n: _norm(ref_grads[n]))[-2:]
    faithful = all(n in grads64 and _norm(grads64[n].double().cpu()
                                          - ref_grads[n].double().cpu())
                   <= 1e-2 * _norm(ref_grads[n]) for n in big)
    zero = set()
    for name in small:
        g32 = ref_grads[name].detach().double().cpu()
        g64 = grads64.get(name)
        g64 = torch.zeros_like(g32) if g64 is None else g64.detach().double().cpu()
        if faithful:
            if not (_norm(g32) > 0.0 and _norm(g64 - g32) <= _SAME_GRADIENT * _norm(g32)):
                zero.add(name)  # (the two precisions disagree: noise)
        elif _norm(g64) <= 1e-3 * _norm(g32) or _norm(g32) == 0.0:
            zero.add(name)
    return zero


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
