"""Views of an FP8 primary weight (w[0], w[:2], w.t(), w.view(-1), w.chunk(2), w.data[...]):
they read as the dequantised values and a write into one reaches the weight, bit for bit what
writing the whole value, changed the same way, gives (a write into such a view was silently
lost: the view was a dequantised copy)."""
from __future__ import annotations

import copy
import io

import numpy as np
import pytest
import torch

import transformer_fp8 as tfp8
from conftest import assert_bitwise_equal
from transformer_fp8.quantization.fp8_weight import Fp8Weight
from transformer_fp8.quantization.fp8_weight_view import Fp8WeightView

RECIPES = {"delayed": tfp8.DelayedScaling(amax_history_len=4),
           "current": tfp8.Float8CurrentScaling()}

# name -> the write, as a function of a tensor standing for the weight
WRITES = {
    "setitem_row": lambda w: w.__setitem__(0, 0.125),
    "slice_zero_": lambda w: w[:2].zero_(),
    "transpose_mul_": lambda w: w.t().mul_(2),
    "flat_setitem": lambda w: w.view(-1).__setitem__(3, 0.5),
    "data_setitem": lambda w: w.data.__setitem__(1, -0.25),
    "chunk_fill_": lambda w: w.chunk(2)[1].fill_(0.0625),
    "column_from_row": lambda w: w[:16, 1].copy_(w[2, :16]),
    "view_of_view_add_": lambda w: w[1:5][:, 2:6].add_(1.0),
}


def pair(recipe):
    """A layer with FP8 weights, trained a step so that its delayed weight scale is made, and
    an identical copy of it."""
    torch.manual_seed(0)
    with tfp8.quantized_model_init(recipe=recipe):
        layer = tfp8.Linear(16, 32)
    with tfp8.fp8_autocast(fp8_recipe=recipe):
        layer(torch.randn(8, 16)).sum().backward()
    return layer, copy.deepcopy(layer)


@pytest.mark.parametrize("recipe", RECIPES.values(), ids=RECIPES.keys())
@pytest.mark.parametrize("write", WRITES, ids=WRITES.keys())
def test_a_write_through_a_view_reaches_the_weight(recipe, write):
    through_view, whole = pair(recipe)
    value = whole.weight.dequantize().clone()
    with torch.no_grad():
        WRITES[write](value)  # the same write into the plain high-precision value
        whole.weight.copy_(value)  # written whole
        WRITES[write](through_view.weight)
    assert isinstance(through_view.weight, Fp8Weight)
    assert_bitwise_equal(through_view.weight.fp8_data, whole.weight.fp8_data, "FP8 data")
    assert_bitwise_equal(through_view.weight.fp8_scale_inv, whole.weight.fp8_scale_inv,
                         "scale_inv")
    for name in ("fp8_fwd_amax_history", "fp8_fwd_scale", "fp8_fwd_scale_inv"):
        assert_bitwise_equal(getattr(through_view, name), getattr(whole, name), name)
    # (the write is there: the weight moved from its value before)
    before, _ = pair(recipe)
    assert not torch.equal(through_view.weight.dequantize(), before.weight.dequantize())


@pytest.mark.parametrize("recipe", RECIPES.values(), ids=RECIPES.keys())
def test_views_read_the_weights_values_as_they_are_now(recipe):
    layer, _ = pair(recipe)
    weight = layer.weight
    with torch.no_grad():  # (with gradients on, a view of it is a dequantised copy)
        row, transposed, halves = weight[3], weight.t(), weight.chunk(2)
    assert isinstance(row, Fp8WeightView) and row.shape == (16,)
    assert_bitwise_equal(row + 0, weight.dequantize()[3], "w[3]")
    assert_bitwise_equal(transposed.clone(), weight.dequantize().t(), "w.t()")
    assert_bitwise_equal(torch.cat(halves), weight.dequantize(), "w.chunk(2)")
    assert row.stride() == weight.dequantize()[3].stride()
    with torch.no_grad():
        weight.copy_(torch.randn(32, 16))  # a write into the weight: its views see it
        assert_bitwise_equal(row + 0, weight.dequantize()[3], "w[3] after a write")
        assert_bitwise_equal(transposed.clone(), weight.dequantize().t(), "w.t() after a write")


def test_a_view_in_a_computation_and_its_gradient():
    """A view taken under autograd: the values of the dequantised weight's view and the
    gradient into the weight as a plain tensor of its nominal dtype."""
    layer, _ = pair(RECIPES["current"])
    weight = layer.weight
    weight.grad = None  # (pair's training step left one)
    plain = weight.dequantize().clone().requires_grad_()
    x = torch.randn(5, 32)
    out = x @ weight.t().t()[:, :12]
    ref = x @ plain[:, :12]
    assert_bitwise_equal(out, ref, "output")
    out.square().sum().backward()
    ref.square().sum().backward()
    assert type(weight.grad) is torch.Tensor
    assert_bitwise_equal(weight.grad, plain.grad, "weight gradient")


def test_a_write_through_a_view_under_autograd_is_refused_as_for_any_leaf():
    layer, _ = pair(RECIPES["current"])
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        layer.weight[0].zero_()


def test_a_view_pickles_as_its_values():
    layer, _ = pair(RECIPES["delayed"])
    buffer = io.BytesIO()
    torch.save(layer.weight[2:4], buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    assert type(loaded) is torch.Tensor
    assert_bitwise_equal(loaded, layer.weight.dequantize()[2:4], "w[2:4] loaded")


def _iadd_row(w):
    w[1] += 0.5  # (Python: the add into the view w[1], then w[1] = that view)


def _imul_column(w):
    w[:, 1] *= 3


@pytest.mark.parametrize("recipe", RECIPES.values(), ids=RECIPES.keys())
@pytest.mark.parametrize("write", [_iadd_row, _imul_column], ids=["iadd_row", "imul_column"])
def test_an_augmented_assignment_writes_once(recipe, write, monkeypatch):
    """``w[i] += x``: one write of the weight, bit for bit the whole value changed the same
    way (Python's second step, the view written into itself, is no second write)."""
    through_view, whole = pair(recipe)
    value = whole.weight.dequantize().clone()
    writes = []
    original = Fp8Weight._write
    monkeypatch.setattr(Fp8Weight, "_write",
                        lambda self, v: (writes.append(1), original(self, v))[1])
    with torch.no_grad():
        write(value)
        write(through_view.weight)
    assert len(writes) == 1
    with torch.no_grad():
        whole.weight.copy_(value)
    assert_bitwise_equal(through_view.weight.fp8_data, whole.weight.fp8_data, "FP8 data")
    assert_bitwise_equal(through_view.weight.fp8_scale_inv, whole.weight.fp8_scale_inv,
                         "scale_inv")
    assert_bitwise_equal(through_view.fp8_fwd_amax_history, whole.fp8_fwd_amax_history,
                         "amax history")


def test_an_out_argument_into_the_weight_reads_views():
    """``out=`` an FP8 weight, views (of another weight) among the inputs."""
    layer, other = pair(RECIPES["current"])
    target, reference = layer.weight, copy.deepcopy(layer).weight
    source = other.weight
    with torch.no_grad():
        source.copy_(torch.randn(32, 16))
        torch.cat([source[:16], source[16:]], out=target)
        reference.copy_(source.dequantize())
    assert_bitwise_equal(target.fp8_data, reference.fp8_data, "FP8 data")


def test_host_reads_of_a_view():
    layer, _ = pair(RECIPES["delayed"])
    weight = layer.weight
    value = weight.dequantize()
    with torch.no_grad():
        row = weight[0]
        assert isinstance(row, Fp8WeightView)
        assert row.tolist() == value[0].tolist()
        assert (row.numpy() == value[0].numpy()).all()
        assert (np.asarray(row) == value[0].numpy()).all()
        assert f"{weight[0, 3]:.5f}" == f"{value[0, 3]:.5f}"
        assert [r.tolist() for r in weight] == value.tolist()
        assert_bitwise_equal(copy.deepcopy(row), value[0], "deepcopy")
        copy.deepcopy(row).zero_()  # (a copy of its own: neither the weight nor its views)
        row.numpy()[:] = 0
        assert_bitwise_equal(row.clone(), value[0], "w[0] after writes into its copies")
        assert_bitwise_equal(weight.dequantize(), value, "the weight after them")


def test_views_share_one_dequantisation_while_the_weight_is_unchanged(monkeypatch):
    layer, _ = pair(RECIPES["current"])
    weight = layer.weight
    calls = []
    original = Fp8Weight.dequantize
    monkeypatch.setattr(Fp8Weight, "dequantize",
                        lambda self: (calls.append(1), original(self))[1])
    with torch.no_grad():
        rows = list(weight)
        total = sum(float(r.abs().max()) for r in rows)
        assert len(calls) == 1
        weight.copy_(torch.randn(32, 16))  # (the next read sees the new values)
        calls.clear()
        assert_bitwise_equal(torch.stack([r + 0 for r in rows]), original(weight), "rows")
        assert len(calls) == 1  # (one shared dequantisation; the reference is not counted)
    assert total > 0


def test_with_gradients_on_a_view_is_a_copy_and_the_forward_dequantises_once(monkeypatch):
    """The high-precision forward (outside fp8_autocast) takes ``w.t()`` with gradients on:
    a dequantised copy, one dequantisation in the forward, as before views wrote through."""
    layer, _ = pair(RECIPES["delayed"])
    calls = []
    original = Fp8Weight.dequantize
    monkeypatch.setattr(Fp8Weight, "dequantize",
                        lambda self: (calls.append(1), original(self))[1])
    assert type(layer.weight[0]) is torch.Tensor
    calls.clear()
    out = layer(torch.randn(8, 16))
    assert len(calls) == 1
    out.sum().backward()
    assert len(calls) <= 2


@pytest.mark.parametrize("reshape", ["unsqueeze_", "t_", "squeeze_", "transpose_"])
def test_an_in_place_reshape_of_a_view_is_refused(reshape):
    layer, _ = pair(RECIPES["delayed"])
    weight = layer.weight
    before = weight.fp8_data.clone(), layer.fp8_fwd_amax_history.clone()
    args = {"unsqueeze_": (0,), "t_": (), "squeeze_": (), "transpose_": (0, 1)}[reshape]
    with torch.no_grad():
        view = weight.detach()[0:4]
        with pytest.raises(NotImplementedError, match="cannot change its own shape"):
            getattr(view, reshape)(*args)
    assert view.shape == (4, 16)
    assert_bitwise_equal(weight.fp8_data, before[0], "FP8 data")
    assert_bitwise_equal(layer.fp8_fwd_amax_history, before[1], "amax history")
