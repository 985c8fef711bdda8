"""fp8_all_gather in one process (no FSDP2): the weights it turns into ShardedWeight compute,
train and checkpoint exactly as plain Parameters; the FP8 operand of a gathered weight is bit
for bit the cast of the weight and of its transpose; bad arguments are refused before anything
changes. (Under FSDP2: tests/test_fsdp_fp8_all_gather.py.)"""
from __future__ import annotations

import io

import pytest
import torch
from integration_compare import assert_bit_identical, step_batches, train

import transformer_fp8 as tfp8
from transformer_fp8 import ops
from transformer_fp8.modules.fsdp.gathered_weight import GatheredFp8Weight
from transformer_fp8.modules.fsdp.weight import ShardedWeight

RECIPE = tfp8.DelayedScaling(amax_history_len=8, amax_compute_algo="most_recent")


def _model(fp8_all_gather: bool):
    torch.manual_seed(0)
    model = torch.nn.Sequential(tfp8.Linear(32, 48, recipe=RECIPE, fp8_all_gather=fp8_all_gather),
                                torch.nn.ReLU(), tfp8.LayerNormMLP(48, 64, recipe=RECIPE))
    if fp8_all_gather:
        tfp8.enable_fp8_all_gather(model)
    return model


def test_sharded_weights_train_exactly_as_plain_parameters():
    batches = step_batches(torch.Generator().manual_seed(1), 4, 16, 32)
    plain, wrapped = _model(False), _model(True)
    assert isinstance(wrapped[0].weight, ShardedWeight)
    assert isinstance(wrapped[0].weight, torch.nn.Parameter)
    assert isinstance(wrapped[2].fc2_weight, ShardedWeight)
    assert_bit_identical(train(wrapped, wrapped, batches, RECIPE),
                         train(plain, plain, batches, RECIPE))
    x = batches[0]
    assert torch.equal(wrapped(x), plain(x)), "outside fp8_autocast"
    assert isinstance(wrapped[0].weight, ShardedWeight), "the optimizer keeps the type"


def test_state_dict_holds_plain_weights_and_loads_back():
    wrapped = _model(True)
    state = wrapped.state_dict()
    assert list(state) == list(_model(False).state_dict())
    assert all(type(v) is torch.Tensor for v in state.values())
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    other = _model(True)
    with torch.no_grad():
        other[0].weight.mul_(2)
    other.load_state_dict(loaded)
    assert isinstance(other[0].weight, ShardedWeight)
    for key, value in other.state_dict().items():
        assert torch.equal(value, state[key]), key


def test_gathered_operand_is_the_cast_of_the_weight_and_its_transpose():
    torch.manual_seed(2)
    weight = torch.randn(48, 32)
    scale = torch.tensor([37.5])
    data, data_t = ops.cast_transpose_to_fp8(weight, scale, torch.float8_e4m3fn)
    gathered = GatheredFp8Weight(data, scale, scale.reciprocal(), torch.float32)
    operand = gathered.fp8_operand(torch.float8_e4m3fn, with_transpose=True)
    assert torch.equal(operand.data.view(torch.uint8), data.view(torch.uint8))
    assert torch.equal(operand.data_t.view(torch.uint8), data_t.view(torch.uint8))
    assert gathered.fp8_operand(torch.float8_e5m2, with_transpose=False) is None
    # Any other use sees the dequantised weight; writing into it is refused.
    expected = ops.cast_from_fp8(data, scale.reciprocal(), torch.float32)
    x = torch.randn(4, 32)
    assert torch.equal(torch.nn.functional.linear(x, gathered), x @ expected.t())
    with pytest.raises(RuntimeError, match="read-only"):
        gathered.add_(1.0)


def test_gathered_weight_with_its_high_precision_value_is_cast_from_that():
    # A checkpoint's recomputation whose gathered weight is not its forward's operand gives it
    # its high-precision value (fsdp.high_precision.replay_operands): the quantizer casts that one,
    # bit for bit the cast of the weight, instead of taking the FP8 data.
    torch.manual_seed(3)
    weight = torch.randn(48, 32)
    scale, other_scale = torch.tensor([37.5]), torch.tensor([3.0])
    data, _ = ops.cast_transpose_to_fp8(weight, other_scale, torch.float8_e4m3fn)
    gathered = GatheredFp8Weight(data, other_scale, other_scale.reciprocal(), torch.float32)
    gathered._full_high_precision = weight
    assert gathered.fp8_operand(torch.float8_e4m3fn, with_transpose=True) is None
    amax, expected_amax = torch.zeros(1), torch.zeros(1)
    got = ops.cast_transpose_to_fp8(gathered, scale, torch.float8_e4m3fn, amax)
    expected = ops.cast_transpose_to_fp8(weight, scale, torch.float8_e4m3fn, expected_amax)
    for g, e in zip(got, expected):
        assert torch.equal(g.view(torch.uint8), e.view(torch.uint8))
    assert torch.equal(amax, expected_amax) and amax.item() > 0
    with pytest.raises(RuntimeError, match="read-only"):
        gathered.add_(1.0)
    # Without it, a cast of the dequantised FP8 weight (a second rounding) is refused.
    gathered._full_high_precision = None
    with pytest.raises(RuntimeError, match="read-only"):
        ops.cast_transpose_to_fp8(gathered, scale, torch.float8_e4m3fn, amax)


def test_bad_arguments_are_refused_before_anything_changes():
    with pytest.raises(TypeError, match="fp8_all_gather must be True or False"):
        tfp8.Linear(32, 32, fp8_all_gather=1)
    with pytest.raises(TypeError, match="fp8_all_gather must be True or False"):
        tfp8.convert_to_fp8(torch.nn.Linear(32, 32), fp8_all_gather="yes")
    for options in ({"parameters_split": ["a", "b"]}, {"fuse_wgrad_accumulation": True},
                    {"delay_wgrad_compute": True}):
        with pytest.raises(ValueError, match=f"fp8_all_gather=True cannot be combined with "
                                             f"\\['{next(iter(options))}'\\]"):
            tfp8.Linear(32, 32, fp8_all_gather=True, **options)
    model = torch.nn.Sequential(tfp8.Linear(32, 32),
                                tfp8.Linear(32, 32, parameters_split=["a", "b"]))
    with pytest.raises(ValueError, match=r"cannot be all-gathered in FP8 .*\['1'\]"):
        tfp8.enable_fp8_all_gather(model)
    assert type(model[0].weight) is torch.nn.Parameter, "nothing changed"


class Conv1D(torch.nn.Module):
    """transformers' Conv1D layout (weight [in, out]), recognised by convert_to_fp8."""

    def __init__(self, nf, nx):
        super().__init__()
        self.nf, self.nx = nf, nx
        self.weight = torch.nn.Parameter(torch.randn(nx, nf) * 0.02)
        self.bias = torch.nn.Parameter(torch.zeros(nf))


def test_convert_gathers_a_transposed_weight_in_high_precision_with_a_warning():
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), Conv1D(32, 32))
    with pytest.warns(UserWarning, match=r"weight of 1 \(Conv1D\) is all-gathered in high"):
        tfp8.convert_to_fp8(model, recipe=RECIPE, fp8_all_gather=True)
    assert isinstance(model[0].weight, ShardedWeight)
    assert isinstance(model[1], tfp8.Conv1D) and type(model[1].weight) is torch.nn.Parameter


def test_block_gathered_operand_is_the_block_cast_of_the_weight_and_its_transpose():
    from transformer_fp8.modules.fsdp.gathered_weight import block_scales_laid_out
    from transformer_fp8.quantization.blockwise import BlockQuantizer
    from transformer_fp8.reference import dequantize_blockwise_reference
    torch.manual_seed(3)
    weight = torch.randn(256, 320) * torch.linspace(0.01, 10, 320)  # partial column blocks
    quantizer = BlockQuantizer(2, torch.float8_e4m3fn, power_2_scale=True)
    want = quantizer.cast(weight, with_transpose=True)
    # What the all-gather delivers: the data, and the block scales as plain [2, 3] values.
    scales = block_scales_laid_out(want.scale_inv.contiguous())
    gathered = GatheredFp8Weight(want.data, None, scales, torch.float32, block=quantizer)
    assert gathered.fp8_cache_key == quantizer.cache_key
    operand = gathered.fp8_operand(torch.float8_e4m3fn, with_transpose=True)
    assert torch.equal(operand.data.view(torch.uint8), want.data.view(torch.uint8))
    assert torch.equal(operand.data_t.view(torch.uint8), want.data_t.view(torch.uint8))
    for got, expected in ((operand.scale_inv, want.scale_inv),
                          (operand.scale_inv_t, want.scale_inv_t)):
        assert torch.equal(got, expected) and got.stride() == expected.stride()
    assert operand.scale is None
    assert gathered.fp8_operand(torch.float8_e5m2, with_transpose=False) is None
    # Any other use: the dequantised weight (power-of-two scales: exact in float32).
    expected = dequantize_blockwise_reference(want.data, want.scale_inv).float()
    assert torch.equal(gathered.dequantize(), expected)
    assert torch.equal(gathered.detach().dequantize(), expected)
