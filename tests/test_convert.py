"""convert_to_fp8: in-place replacement keeping the very same Parameters."""
from __future__ import annotations

import torch

import transformer_fp8 as tfp8


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = torch.nn.Linear(64, 192)
        self.proj = torch.nn.Linear(64, 64, bias=False)
        self.head = torch.nn.Linear(64, 10)  # 10 is not a multiple of 16
        self.norm = torch.nn.LayerNorm(64)


def test_replaces_linears_and_keeps_parameters():
    model = torch.nn.Sequential(Block(), torch.nn.Sequential(torch.nn.Linear(64, 32)))
    params_before = {name: p for name, p in model.named_parameters()}
    x = torch.randn(4, 64)
    ref = model[1](x)
    assert tfp8.convert_to_fp8(model) is model
    assert type(model[0].attn) is tfp8.Linear and type(model[0].proj) is tfp8.Linear
    assert type(model[1][0]) is tfp8.Linear
    assert type(model[0].head) is torch.nn.Linear, "default filter keeps unaligned layers"
    assert model[0].proj.bias is None
    for name, p in model.named_parameters():
        assert p is params_before[name]
    assert torch.equal(model[1](x), ref), "outside fp8_autocast nothing changes"


def test_filter_fn_gets_qualified_names():
    model = torch.nn.Sequential(Block())
    seen = []

    def only_attn(linear, name):
        seen.append(name)
        return name.endswith("attn")

    tfp8.convert_to_fp8(model, filter_fn=only_attn)
    assert sorted(seen) == ["0.attn", "0.head", "0.proj"]
    assert type(model[0].attn) is tfp8.Linear and type(model[0].proj) is torch.nn.Linear


def test_converting_a_linear_itself_and_twice():
    linear = torch.nn.Linear(32, 32, dtype=torch.bfloat16)
    converted = tfp8.convert_to_fp8(linear)
    assert type(converted) is tfp8.Linear and converted.weight is linear.weight
    assert converted.weight.dtype == torch.bfloat16
    assert tfp8.convert_to_fp8(converted) is converted


def test_converted_model_trains_under_fp8_autocast():
    torch.manual_seed(0)
    model = tfp8.convert_to_fp8(torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(),
                                                    torch.nn.Linear(32, 16)))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x = torch.randn(64, 32)
    y = x @ torch.randn(32, 16) * 0.2  # a target the model can learn
    losses = []
    for _ in range(30):
        with tfp8.fp8_autocast(fp8_recipe=tfp8.DelayedScaling(amax_history_len=4)):
            loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.3 * losses[0]


def test_shared_layer_hooks_and_attributes_are_kept():
    shared = torch.nn.Linear(32, 32)
    shared.note = "kept"
    calls = []
    shared.register_forward_hook(lambda module, args, out: calls.append(1))
    model = torch.nn.Sequential(shared, torch.nn.ReLU(), shared)
    tfp8.convert_to_fp8(model)
    assert model[0] is model[2] is shared and type(shared) is tfp8.Linear
    assert shared.note == "kept"
    model(torch.randn(4, 32))
    assert calls == [1, 1]


def test_subclasses_are_left_alone():
    class MyLinear(torch.nn.Linear):
        pass

    model = torch.nn.Sequential(MyLinear(32, 32))
    tfp8.convert_to_fp8(model)
    assert type(model[0]) is MyLinear
