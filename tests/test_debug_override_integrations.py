"""transformer_fp8.debug.override(..., gemms=...) in a GroupedLinear (one expert's GEMM) and a
TransformerLayer (one GEMM of its attention projection), over steps whose delayed scales
change: the overridden GEMM's result alone differs from the plain FP8 run (every other output,
gradient and FP8 state tensor bit for bit the same), and activation checkpointing and
torch.compile (aot_eager) give bit for bit the eager run's outputs, losses, gradients and FP8
state."""
from __future__ import annotations

import copy

import pytest
import torch
from conftest import assert_bitwise_equal
from integration_compare import assert_bit_identical, step_batches, train

import transformer_fp8 as tfp8
from transformer_fp8 import debug

STEPS = 3
DELAYED = tfp8.DelayedScaling(amax_history_len=4)
SPLITS = [16, 16, 16]


class Experts(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.experts = tfp8.GroupedLinear(3, 64, 64)

    def forward(self, x):
        return self.experts(x, SPLITS)


# name: (model, the module overridden, the GEMM of it overridden ("<gemm>." or "": its one
# GEMM), input shape, the weight gradient that GEMM's wgrad gives)
CASES = {
    "grouped": (Experts, "experts", "gemm1.", (48, 64), "experts.weight1"),
    "transformer": (lambda: tfp8.TransformerLayer(64, 128, 4, hidden_dropout=0.0,
                                                  attention_dropout=0.0),
                    "self_attention.proj", "", (8, 4, 64), "self_attention.proj.weight"),
}


def build(case: str, kind: str = None):
    make, layer, gemm, shape, _ = CASES[case]
    torch.manual_seed(0)
    model = make()
    if kind is not None:
        assert debug.override(model, layer, fp8=False, gemms=[gemm + kind]) == [layer]
    return model


def run(case: str, model, fn, lr: float = 0.1) -> tuple:
    """(StepRecords, outputs) of STEPS SGD steps of ``fn`` (model, or a wrapper of it) on
    inputs whose scale changes from step to step (so do the delayed scales)."""
    batches = step_batches(torch.Generator().manual_seed(0), STEPS, *CASES[case][3])
    outputs = []
    records = train(model, fn, batches, DELAYED, lr=lr, outputs=outputs)
    return records, [out.detach() for out in outputs]


def assert_same_runs(got: tuple, expected: tuple) -> None:
    assert_bit_identical(got[0], expected[0])
    for step, (g, e) in enumerate(zip(got[1], expected[1])):
        assert_bitwise_equal(g, e, f"step {step}: output")


@pytest.mark.parametrize("case", list(CASES))
def test_a_wgrad_override_changes_that_weight_gradient_only(case):
    """lr=0 (the weights stay, the inputs' scales change): every step's loss, every other
    gradient and the whole FP8 state are the plain run's; the overridden weight gradient is
    not (it is torch's product of the unquantised operands)."""
    model, plain = build(case, "wgrad"), build(case)
    got, expected = run(case, model, model, lr=0.0), run(case, plain, plain, lr=0.0)
    changed = CASES[case][4]
    for g, e in zip(got[0], expected[0]):
        assert not torch.equal(g.grads.pop(changed), e.grads.pop(changed))
    assert_same_runs(got, expected)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
@pytest.mark.parametrize("kind", ["fprop", "dgrad", "wgrad"])
@pytest.mark.parametrize("case", list(CASES))
def test_checkpointed_override_is_bit_identical(case, kind, reentrant):
    model = build(case, kind)
    checkpointed = copy.deepcopy(model)

    def checkpointed_fn(x):
        return torch.utils.checkpoint.checkpoint(checkpointed, x, use_reentrant=reentrant)

    assert_same_runs(run(case, checkpointed, checkpointed_fn), run(case, model, model))


@pytest.mark.parametrize("kind", ["fprop", "dgrad", "wgrad"])
@pytest.mark.parametrize("case", list(CASES))
def test_compiled_override_is_bit_identical_to_eager(case, kind):
    model = build(case, kind)
    compiled = copy.deepcopy(model)
    torch._dynamo.reset()
    compiled_fn = torch.compile(compiled, backend="aot_eager")
    assert_same_runs(run(case, compiled, compiled_fn), run(case, model, model))
