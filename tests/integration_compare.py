"""One comparison for every integration test (torch.compile backends, activation checkpointing,
CUDA graphs, make_graphed_callables, DDP / FSDP2 / distributed checkpoint, HuggingFace models):
a few training steps through the integration against the same steps in eager mode, compared
step by step on the loss, every parameter gradient, the input gradient and every FP8 state
tensor (histories, scales, scale_invs, as ``state_dict()`` gives them).

* ``train(model, run, batches, recipe)`` runs the steps (SGD, so that a wrong gradient factor
  changes the next step's weights, which Adam would hide) and returns one ``StepRecord`` per
  step; ``record_step`` makes one from a step run some other way.
* ``step_batches`` draws inputs whose magnitude changes from step to step (x1, x8, x1/4, ...):
  the amaxes, hence the delayed scales, differ at every step, so a scale taken from the wrong
  step shows.
* ``assert_bit_identical(got, expected)`` where the integration's contract is bit for bit
  (aot_eager, checkpointing, CUDA graphs); ``assert_close(got, expected, min_sqnr_db)`` where it
  is not (inductor fuses the surrounding ops differently, DDP sums in another order): every
  tensor, separately, within an SQNR bound. 30 dB is a relative error of 3%: a gradient off by
  a factor of 1.25 is 12 dB, a scale from the wrong fp8_max far less.
Both refuse runs of fewer than ``MIN_STEPS`` steps and runs whose loss does not change.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional

import pytest
import torch

MIN_STEPS = 3
# Input magnitude per step: every step's amax differs from the last one's.
STEP_SCALES = (1.0, 8.0, 0.25, 2.0, 0.5, 4.0)

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass
class StepRecord:
    """What one training step produced, as CPU copies, by name: ``grads`` holds every
    parameter's gradient (None where it got none) and "input" for the input's; ``fp8_state``
    every FP8 state tensor of the model's state_dict."""

    loss: torch.Tensor  # (or the output, for steps that backpropagate a given gradient)
    grads: dict = field(default_factory=dict)
    fp8_state: dict = field(default_factory=dict)


def fp8_state(model: torch.nn.Module) -> dict:
    """The model's FP8 state tensors by state_dict key (state_dict() first runs a backward
    update that a compiled backward or a reentrant checkpoint holds back)."""
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items() if "fp8_" in k}


def _copy(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    if t is None:
        return None
    t = t.full_tensor() if hasattr(t, "full_tensor") else t  # FSDP2's DTensor
    return t.detach().cpu().clone()


def record_step(loss: torch.Tensor, model: torch.nn.Module, inputs: Optional[dict] = None,
                with_fp8_state: bool = True) -> StepRecord:
    """A StepRecord of a step whose backward has run: the loss, the gradients of the model's
    parameters and of ``inputs`` (name -> tensor), and the FP8 state."""
    grads = {name: _copy(p.grad) for name, p in model.named_parameters()}
    for name, t in (inputs or {}).items():
        grads[name] = _copy(t.grad)
    return StepRecord(_copy(loss), grads, fp8_state(model) if with_fp8_state else {})


def step_batches(gen: torch.Generator, steps: int, *shape, device="cpu",
                 dtype=torch.float32) -> list:
    """``steps`` standard-normal batches, the step-th scaled by STEP_SCALES[step]."""
    return [(torch.randn(shape, generator=gen) * STEP_SCALES[step % len(STEP_SCALES)])
            .to(device=device, dtype=dtype) for step in range(steps)]


def mean_square(out: torch.Tensor) -> torch.Tensor:
    return out.float().square().mean()


def train(model: torch.nn.Module, run: Callable, batches: list, recipe, *, lr: float = 0.1,
          loss_fn: Callable = mean_square, input_grad: bool = True,
          backward: Callable = torch.Tensor.backward, outputs: Optional[list] = None) -> list:
    """One SGD step per batch: ``loss_fn(run(x))`` with the forward inside fp8_autocast under
    ``recipe``, ``backward(loss)`` outside it. Returns a StepRecord per step, taken after
    backward and before the optimizer step. ``run`` is the model itself, its compiled form, a
    wrapper that checkpoints it, ...; ``input_grad``: whether x (a float batch) requires grad;
    ``outputs``: a list that keeps every step's output (and so its graph) alive."""
    import transformer_fp8 as tfp8

    opt = torch.optim.SGD(model.parameters(), lr=lr)
    records = []
    for batch in batches:
        x = batch.clone()
        if input_grad and x.is_floating_point():
            x.requires_grad_(True)
        with tfp8.fp8_autocast(fp8_recipe=recipe):
            out = run(x)
        loss = loss_fn(out)
        backward(loss)
        if outputs is not None:
            outputs.append(out)
        records.append(record_step(loss, model, {"input": x} if x.requires_grad else None))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return records


# ---- comparisons ---------------------------------------------------------------------------

def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(_INT_OF_SIZE[t.element_size()])


def assert_close_or_sqnr(what: str, got: torch.Tensor, expected: torch.Tensor,
                         high_precision: bool, min_sqnr_db: float) -> None:
    """A sharded result against the unsharded one: allclose in high precision (sums in
    another order), else at least ``min_sqnr_db``."""
    assert got is not None, f"{what}: no gradient"
    assert got.shape == expected.shape and got.dtype == expected.dtype, what
    if high_precision:
        torch.testing.assert_close(got, expected, msg=lambda m: f"{what}: {m}")
    else:
        db = sqnr_db(expected, got)
        assert db >= min_sqnr_db, f"{what}: SQNR {db:.1f} dB, below {min_sqnr_db} dB"


def assert_rank_records_match(name: str, ranks: list, high_precision: bool,
                              min_sqnr_db: float) -> None:
    """Each rank's records of the case ``name`` (``ranks[r]["cases"][name]``: per step, key ->
    (sharded, unsharded)): the FP8 state bit for bit, everything else by
    assert_close_or_sqnr."""
    for rank, result in enumerate(ranks):
        for step, record in enumerate(result["cases"][name]):
            for key, (got, expected) in record.items():
                where = f"{name} rank {rank} step {step} {key}"
                if key == "fp8_state":
                    assert got.keys() == expected.keys() and got, where
                    for k in got:
                        assert torch.equal(got[k], expected[k]), f"{where} {k}"
                else:
                    assert_close_or_sqnr(where, got, expected, high_precision, min_sqnr_db)


def sqnr_db(ref: torch.Tensor, out: torch.Tensor) -> float:
    """Signal to noise ratio of ``out`` against ``ref`` in dB, in float64: inf when equal,
    -inf when ref is zero and out is not."""
    ref64, out64 = ref.detach().cpu().double(), out.detach().cpu().double()
    noise = torch.linalg.vector_norm(out64 - ref64).item()
    if noise == 0.0:
        return math.inf
    signal = torch.linalg.vector_norm(ref64).item()
    return 20.0 * math.log10(signal / noise) if signal > 0 else -math.inf


def _pairs(got: list, expected: list):
    """(what, got tensor, expected tensor) for every tensor of every step; checks the runs'
    shape first."""
    if len(expected) < MIN_STEPS:
        pytest.fail(f"a comparison needs >= {MIN_STEPS} steps, got {len(expected)}")
    if len(got) != len(expected):
        pytest.fail(f"{len(got)} steps recorded, expected {len(expected)}")
    if all(torch.equal(r.loss, expected[0].loss) for r in expected[1:]):
        pytest.fail("the loss is the same at every step: the steps do not differ")
    for step, (g, e) in enumerate(zip(got, expected)):
        yield f"step {step}: loss", g.loss, e.loss
        for kind, g_dict, e_dict in (("gradient of", g.grads, e.grads),
                                     ("FP8 state", g.fp8_state, e.fp8_state)):
            if g_dict.keys() != e_dict.keys():
                pytest.fail(f"step {step}: {kind}: names differ: {sorted(g_dict)} vs "
                            f"{sorted(e_dict)}")
            for name in e_dict:
                what = f"step {step}: {kind} {name}"
                if (g_dict[name] is None) != (e_dict[name] is None):
                    pytest.fail(f"{what}: None in one run only")
                if e_dict[name] is not None:
                    yield what, g_dict[name], e_dict[name]


def _check_like(what: str, g: torch.Tensor, e: torch.Tensor) -> None:
    if g.dtype != e.dtype or g.shape != e.shape:
        pytest.fail(f"{what}: {g.dtype} {tuple(g.shape)} vs expected {e.dtype} {tuple(e.shape)}")


def assert_bit_identical(got: list, expected: list) -> None:
    """Every tensor of every step bit for bit the same (NaN compared by its bits)."""
    for what, g, e in _pairs(got, expected):
        _check_like(what, g, e)
        diff = _bits(g) != _bits(e)
        if diff.any():
            idx = diff.nonzero()[:3].tolist()
            samples = [(i, g[tuple(i)].item(), e[tuple(i)].item()) for i in idx]
            pytest.fail(f"{what}: {int(diff.sum())} of {diff.numel()} elements differ; "
                        f"SQNR {sqnr_db(e, g):.1f} dB; first (index, got, expected): {samples}")


def assert_close(got: list, expected: list, min_sqnr_db: float = 30.0) -> None:
    """Every tensor of every step, separately, within ``min_sqnr_db`` of the expected one (a
    zero tensor must stay zero; the integer recipe record must match exactly)."""
    for what, g, e in _pairs(got, expected):
        _check_like(what, g, e)
        if not e.is_floating_point():
            if not torch.equal(g, e):
                pytest.fail(f"{what}: {g.tolist()} vs expected {e.tolist()}")
            continue
        db = sqnr_db(e, g)
        if not db >= min_sqnr_db:
            rel = (torch.linalg.vector_norm((g - e).double())
                   / torch.linalg.vector_norm(e.double())).item()
            pytest.fail(f"{what}: SQNR {db:.1f} dB < {min_sqnr_db} dB (relative error "
                        f"{rel:.3g}; got norm {g.double().norm().item():.4g}, expected "
                        f"{e.double().norm().item():.4g})")


# ---- torch.compile -------------------------------------------------------------------------

def counting_aot_eager() -> tuple:
    """(backend, graphs): torch.compile's aot_eager backend (the same kernels as eager), and
    the list of graphs it was asked to compile (one per compilation)."""
    import torch._dynamo.backends.debugging as debugging

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return debugging.aot_eager(gm, example_inputs)

    return backend, graphs


def data_parallel_in_one_process(model: torch.nn.Module, batch: Callable, recipe, world: int,
                                 steps: int, lr: float) -> list:
    """What ``world`` data-parallel ranks compute, in one process: every rank's batch
    (``batch(rank, step)``) in a forward of its own, in one fp8_autocast, the ranks' losses
    summed, the gradients divided by the world size (DDP's and FSDP2's average; a power of two,
    so exact) before each SGD step. Delayed scaling records the MAX of the forwards' amaxes, as
    the ranks' reduction does; current scaling casts each batch with its own amax, as each
    rank does. Per rank, a StepRecord per step (its own loss, the shared gradients and FP8
    state)."""
    import transformer_fp8 as tfp8

    opt = torch.optim.SGD(model.parameters(), lr=lr)
    records = [[] for _ in range(world)]
    for step in range(steps):
        with tfp8.fp8_autocast(fp8_recipe=recipe):
            outs = [model(batch(rank, step)) for rank in range(world)]
        losses = [out.square().mean() for out in outs]
        sum(losses).backward()
        with torch.no_grad():
            for p in model.parameters():
                p.grad /= world
        for rank in range(world):
            records[rank].append(record_step(losses[rank], model))
        opt.step()
        opt.zero_grad()
    return records
