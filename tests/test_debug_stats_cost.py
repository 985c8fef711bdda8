"""What a logged step of transformer_fp8.debug costs: ONE operator per operand (fp8_operand_stats,
two kernel launches; its pure-torch reference: the same number of operators for any shape, no
more than pinned here), and one device-to-host transfer per logged step, none
from host to device (counted on the CPU: every operator or method that would move data between
the host and a GPU, or wait for one, is counted)."""
from __future__ import annotations

import collections
import functools

import pytest
import torch
from conftest import randn
from torch.utils._python_dispatch import TorchDispatchMode

import transformer_fp8 as tfp8
from transformer_fp8 import debug, ops
from transformer_fp8.debug.stats import operand_stats, operand_stats_reference
from transformer_fp8.ops.blockwise import quantize_blockwise

E4M3 = torch.float8_e4m3fn
# Element-wise and reduction operators per operand of the reference (views and allocations not
# counted); before its stacked reductions it ran 36 (per tensor) and 47 (per block).
MAX_OPS_PER_TENSOR = 23
MAX_OPS_PER_BLOCKS = 25
# Data leaves the host for a device: a tensor made from Python values (torch.tensor), or an
# index made from a Python list. Data comes back: .item(), float(t), bool(t).
_HOST_DEVICE_OPS = ("aten.lift_fresh", "aten.lift_fresh_copy", "aten.index.Tensor",
                    "aten.index_put_", "aten._index_put_impl_", "aten._local_scalar_dense")
_HOST_METHODS = ("tolist", "cpu", "numpy", "item")


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


def _computing_ops(fn) -> list:
    """The operators fn dispatches that compute (neither views nor allocations)."""
    with _Ops() as log:
        fn()
    skip = {"aten.empty.memory_format", "aten.empty_strided.default",
            "aten.scalar_tensor.default"}  # scalar_tensor: a CPU scalar passed to the kernel
    return [str(f) for f in log.ops if not f.is_view and str(f) not in skip]


@pytest.mark.parametrize("shape", [(16, 64), (130, 300), (512, 1024)])
@pytest.mark.parametrize("stats, per_tensor_ops, per_block_ops", [
    (operand_stats, 1, 1), (operand_stats_reference, MAX_OPS_PER_TENSOR, MAX_OPS_PER_BLOCKS)],
    ids=["operator", "reference"])
def test_operators_per_operand_are_few_and_do_not_grow_with_the_shape(
        gen, shape, stats, per_tensor_ops, per_block_ops):
    x = randn(gen, *shape)
    scale = torch.tensor([8.0])
    q = ops.cast_to_fp8(x, scale, E4M3)
    per_tensor = _computing_ops(lambda: stats(x, q, scale, 448.0))
    assert len(per_tensor) <= per_tensor_ops, collections.Counter(per_tensor)
    for block_rows, block_cols in ((1, 128), (128, 128)):
        qb, scale_inv, _, _ = quantize_blockwise(x, block_rows, block_cols, E4M3, True)
        block_scale = scale_inv.reciprocal()
        per_block = _computing_ops(functools.partial(stats, x, qb, block_scale, 448.0,
                                                     block_rows, block_cols))
        assert len(per_block) <= per_block_ops, collections.Counter(per_block)
    assert not any(op.startswith(_HOST_DEVICE_OPS) for op in per_tensor + per_block)
    if stats is operand_stats:
        assert per_tensor == per_block == ["transformer_fp8.fp8_operand_stats.default"]


class _HostTransfers(TorchDispatchMode):
    """Counts the operators of _HOST_DEVICE_OPS and, with the methods patched, the calls of
    _HOST_METHODS (which on a CPU tensor dispatch nothing)."""

    def __init__(self, monkeypatch):
        super().__init__()
        self.counts = collections.Counter()
        for name in _HOST_METHODS:
            def counted(t, *args, _name=name, _method=getattr(torch.Tensor, name), **kwargs):
                self.counts[f"Tensor.{_name}"] += 1
                return _method(t, *args, **kwargs)
            monkeypatch.setattr(torch.Tensor, name, counted)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func).startswith(_HOST_DEVICE_OPS):
            self.counts[str(func)] += 1
        return func(*args, **(kwargs or {}))


def _microbatches(model, x, grad, recipe, n=2):
    for _ in range(n):
        x = x.clone().requires_grad_(True)
        with tfp8.fp8_autocast(fp8_recipe=recipe):
            out = model(x)
        out.backward(grad)


@pytest.mark.parametrize("recipe", [tfp8.DelayedScaling(amax_history_len=4),
                                    tfp8.Float8BlockScaling()], ids=["delayed", "block"])
def test_a_logged_step_copies_to_the_host_once(gen, recipe):
    # Two microbatches per step (each operand combined from two casts), three FP8 layers.
    model = torch.nn.Sequential(tfp8.Linear(32, 32), torch.nn.ReLU(), tfp8.LayerNormMLP(32, 64))
    x, grad = randn(gen, 8, 32), randn(gen, 8, 32)
    _microbatches(model, x, grad, recipe)  # the model's first step (recipe adopted) outside
    counts = {}
    with debug.collect_stats(model, frequency=2) as stats:
        for logged in (True, False):
            with pytest.MonkeyPatch.context() as monkeypatch:
                with _HostTransfers(monkeypatch) as log:
                    _microbatches(model, x, grad, recipe)
                    records = stats.step()
            counts[logged] = log.counts
            per_step = 9 if isinstance(recipe, tfp8.DelayedScaling) else 18  # (+ transposes)
            assert len(records) == (per_step if logged else 0)
    extra = {k: counts[True][k] - counts[False][k]
             for k in counts[True].keys() | counts[False].keys()}
    assert {k: n for k, n in extra.items() if n} == {"Tensor.tolist": 1}
