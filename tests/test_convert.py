"""convert_to_fp8: in-place replacement keeping the very same Parameters."""
from __future__ import annotations

import copy

import pytest
import torch
from conftest import sqnr

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


def test_converting_again_with_a_recipe_sizes_every_fp8_layer_for_it():
    """Layers that were FP8 already (converted before, built as FP8 modules) get the recipe's
    history length too (they kept the default 1024 rows before, so a compiled step refused
    them and a distributed checkpoint did not fit)."""
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), tfp8.LayerNormMLP(32, 64),
                                tfp8.Linear(32, 32))
    tfp8.convert_to_fp8(model)
    model.append(torch.nn.Linear(32, 32))
    tfp8.convert_to_fp8(model, recipe=tfp8.DelayedScaling(amax_history_len=16))
    for layer in (model[0], model[1], model[2], model[3]):
        assert layer.fp8_fwd_amax_history.shape[0] == 16, layer
        assert layer.fp8_bwd_amax_history.shape[0] == 16, layer


def test_converted_model_trains_under_fp8_autocast():
    """30 SGD steps of the converted model track the same steps of the original in float32."""
    torch.manual_seed(0)
    original = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(),
                                   torch.nn.Linear(32, 16))
    model = tfp8.convert_to_fp8(copy.deepcopy(original))
    x = torch.randn(64, 32)
    y = x @ torch.randn(32, 16) * 0.2  # a target the model can learn
    curves = []
    for net, fp8 in ((model, True), (original, False)):
        opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
        losses = []
        for _ in range(30):
            with tfp8.fp8_autocast(enabled=fp8,
                                   fp8_recipe=tfp8.DelayedScaling(amax_history_len=4)):
                loss = torch.nn.functional.mse_loss(net(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        curves.append(losses)
    fp8_losses, float32_losses = curves
    assert fp8_losses[-1] < 0.3 * fp8_losses[0], fp8_losses
    for step in (9, 19, 29):
        assert abs(fp8_losses[step] - float32_losses[step]) <= 0.05 * float32_losses[step], \
            (step, fp8_losses[step], float32_losses[step])


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


class Conv1D(torch.nn.Module):
    """transformers.pytorch_utils.Conv1D as GPT-2 uses it (transformers is not a dependency):
    y = x @ weight + bias, weight [nx, nf]."""

    def __init__(self, nf, nx):
        super().__init__()
        self.nf, self.nx = nf, nx
        self.weight = torch.nn.Parameter(torch.empty(nx, nf))
        self.bias = torch.nn.Parameter(torch.zeros(nf))
        torch.nn.init.normal_(self.weight, std=0.02)

    def forward(self, x):
        size_out = x.size()[:-1] + (self.nf,)
        x = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
        return x.view(size_out)


def test_transformers_conv1d_is_converted_and_trains_in_fp8():
    torch.manual_seed(0)
    model = torch.nn.Sequential(Conv1D(96, 32), torch.nn.GELU(), Conv1D(32, 96))
    reference = copy.deepcopy(model)
    weight = model[0].weight
    x = torch.randn(2, 8, 32)
    summary = tfp8.convert_to_fp8(model, return_summary=True)
    assert summary.converted == ["0", "2"] and not summary.skipped
    assert isinstance(model[0], tfp8.Conv1D) and isinstance(model[0], Conv1D)
    assert model[0].weight is weight
    assert model[0].weight.shape == (32, 96), "the Parameter keeps transformers' layout"
    assert model.state_dict().keys() >= reference.state_dict().keys()
    assert torch.equal(model(x), reference(x)), "outside fp8_autocast: Conv1D's own forward"
    with tfp8.fp8_autocast(fp8_recipe=tfp8.DelayedScaling()):
        out = model(x)
    out.square().sum().backward()
    reference(x).square().sum().backward()
    assert sqnr(reference(x), out) > 20
    for p, q in zip(model.parameters(), reference.parameters()):
        assert p.grad.shape == q.grad.shape and sqnr(q.grad, p.grad) > 15
    assert model[0].fp8_fwd_amax_history[-1].all(), "the layer ran in FP8 and recorded amaxes"


@pytest.mark.parametrize("nf,nx", [(64, 64), (96, 32)], ids=["square", "wide"])
def test_conv1d_with_is_first_microbatch_caches_its_weight_as_a_gemm_operand(nf, nx):
    """The weight cast kept by is_first_microbatch=True (and reused by False) is the GEMM's
    [out, in] operand, not the Parameter's transposed [in, out] storage: over accumulation
    steps a Conv1D gives the outputs and every gradient of a Linear holding the transposed
    weight, bit for bit (a square Conv1D computed with W^T and a wide one failed)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(Conv1D(nf, nx))
    tfp8.convert_to_fp8(model)
    conv = model[0]
    linear = tfp8.Linear(nx, nf)
    with torch.no_grad():
        linear.weight.copy_(conv.weight.t())
        linear.bias.copy_(conv.bias)
    recipe = tfp8.DelayedScaling(amax_history_len=4)
    for step, first in enumerate((True, False, False, True, None)):
        x = torch.randn(2, 8, nx) * (step + 1)
        with tfp8.fp8_autocast(fp8_recipe=recipe):
            out = conv(x, is_first_microbatch=first)
            expected = linear(x, is_first_microbatch=first)
        out.square().sum().backward()
        expected.square().sum().backward()
        assert torch.equal(out, expected), step
        assert torch.equal(conv.weight.grad, linear.weight.grad.t()), step
        assert torch.equal(conv.bias.grad, linear.bias.grad), step
    assert torch.equal(conv.fp8_fwd_scale, linear.fp8_fwd_scale)
    assert sqnr(x @ conv.weight + conv.bias, out) > 15  # (delayed scales trail growing inputs)


def test_conv1d_weights_are_refused_by_fp8_all_gather():
    """Conv1D stores its weight transposed: enable_fp8_all_gather names it in its error."""
    model = torch.nn.Sequential(Conv1D(64, 32))
    tfp8.convert_to_fp8(model)
    with pytest.raises(ValueError, match=r"stored transposed.*\['0'\]"):
        tfp8.enable_fp8_all_gather(model)


class _TiedLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(64, 32)
        self.body = torch.nn.Linear(32, 32)
        self.head = torch.nn.Linear(32, 64, bias=False)
        self.head.weight = self.embed.weight  # (tied, as a language model's lm_head)

    def forward(self, tokens):
        return self.head(self.body(self.embed(tokens)))


def test_fp8_all_gather_leaves_a_weight_tied_to_an_embedding_in_high_precision():
    """An lm_head tied to the embedding: its weight stays a plain Parameter (with a warning),
    both with convert_to_fp8(fp8_all_gather=True) and enable_fp8_all_gather(model); FSDP2 may
    name the embedding as the weight's owner, which crashed the FP8 gather (and an embedding
    given an FP8-gathered weight would look up dequantised rows). The tie is kept, the other
    weights become ShardedWeights, and a gather for a module that is no FP8 layer is in high
    precision."""
    from transformer_fp8.modules.fsdp.all_gather import HIGH_PRECISION, _forward_form
    from transformer_fp8.modules.fsdp.weight import ShardedWeight
    for how in ("convert", "enable"):
        model = _TiedLM()
        with pytest.warns(UserWarning, match="tied"):
            if how == "convert":
                tfp8.convert_to_fp8(model, fp8_all_gather=True)
            else:
                tfp8.convert_to_fp8(model)
                tfp8.enable_fp8_all_gather(model)
        assert model.head.weight is model.embed.weight
        assert type(model.head.weight) is torch.nn.Parameter
        assert isinstance(model.body.weight, ShardedWeight)
    with tfp8.fp8_autocast():
        assert _forward_form(model.embed) is HIGH_PRECISION


def test_bad_flags_and_filter_results_are_refused():
    """return_summary must be a bool (a truthy "no" returned the summary); filter_fn must
    return a bool (a truthy "no" converted the layer), a numpy bool is taken."""
    import numpy as np
    with pytest.raises(TypeError, match="return_summary must be True or False"):
        tfp8.convert_to_fp8(torch.nn.Sequential(torch.nn.Linear(32, 32)), return_summary="no")
    model = torch.nn.Sequential(torch.nn.Linear(32, 32))
    with pytest.raises(TypeError, match=r"filter_fn must return True or False, got 'no'"):
        tfp8.convert_to_fp8(model, filter_fn=lambda layer, name: "no")
    assert type(model[0]) is torch.nn.Linear
    tfp8.convert_to_fp8(model, filter_fn=lambda layer, name: np.bool_(False))
    assert type(model[0]) is torch.nn.Linear


def test_skipped_layers_are_reported_with_reasons():
    model = torch.nn.Sequential(Block(), Conv1D(10, 64), torch.nn.MultiheadAttention(32, 2))
    with pytest.warns(UserWarning) as record:
        summary = tfp8.convert_to_fp8(model, return_summary=True)
    message = str(record[0].message)
    assert "converted 2 of 5 linear layers" in message
    assert set(summary.skipped) == {"0.head", "1", "2.out_proj"}
    assert "in_features 64 and out_features 10 must be multiples of 16" in summary.skipped["0.head"]
    assert "subclass of torch.nn.Linear" in summary.skipped["2.out_proj"]
    assert type(model[1]) is Conv1D and not hasattr(model[1], "in_features"), "left as it was"
    with pytest.warns(UserWarning, match="converted 0 of 1"):
        tfp8.convert_to_fp8(torch.nn.Linear(8, 8))


class FusedExperts(torch.nn.Module):
    """transformers 5's fused MoE experts (MixtralExperts): 3-D weights, no nn.Linear."""

    def __init__(self):
        super().__init__()
        self.gate_up_proj = torch.nn.Parameter(torch.randn(4, 64, 32))
        self.down_proj = torch.nn.Parameter(torch.randn(4, 32, 32))
        self.stacked_4d = torch.nn.Parameter(torch.randn(4, 2, 8, 8))  # (reported too)


def test_fused_moe_experts_are_reported_as_left_in_high_precision():
    """Their matrix products are no nn.Linear layers, so nothing converts them: the warning
    names them (a summary of "converted 2 of 2" hid most of a MoE model's GEMMs); a
    convolution's weights, 4-D, and a ViT's embeddings are not reported."""
    embeddings = torch.nn.Module()  # (a ViT's: cls_token [1, 1, d], positions [1, n, d])
    embeddings.cls_token = torch.nn.Parameter(torch.zeros(1, 1, 32))
    embeddings.position_embeddings = torch.nn.Parameter(torch.zeros(1, 5, 32))
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), FusedExperts(), torch.nn.Conv2d(3, 8, 3),
                                torch.nn.Linear(32, 32), embeddings)
    with pytest.warns(UserWarning) as record:
        summary = tfp8.convert_to_fp8(model, return_summary=True)
    message = str(record[0].message)
    assert "converted 2 of 2 linear layers" in message
    assert list(summary.not_linear) == ["1"] and not summary.skipped
    assert ("not converted 1: FusedExperts holds gate_up_proj [4, 64, 32], down_proj [4, 32, "
            "32], stacked_4d [4, 2, 8, 8]: its matrix products are not torch.nn.Linear "
            "layers") in message
    assert "GroupedLinear" in message


def test_a_converted_conv1d_is_no_torch_nn_linear():
    """Its weight is [in, out], as transformers' Conv1D's (which is no nn.Linear either): code
    written for nn.Linear takes the weight as [out, in] (peft merged LoRA deltas untransposed
    into it: wrong logits on square layers, a shape error on the others)."""
    model = torch.nn.Sequential(Conv1D(96, 32))
    tfp8.convert_to_fp8(model)
    assert isinstance(model[0], tfp8.modules.linear.LinearLayer)
    assert not isinstance(model[0], torch.nn.Linear)
    assert tfp8.convert_to_fp8(model, return_summary=True).converted == ["0"]  # (converted before)
    with pytest.raises(TypeError, match="made by convert_to_fp8"):
        tfp8.Conv1D(32, 96)


@pytest.mark.parametrize("order", ["lora_first", "converted_first"])
@pytest.mark.parametrize("target", ["attn.c_proj", "attn.c_attn"])
def test_peft_lora_on_gpt2_merges_into_fp8_conv1d(target, order):
    """peft's LoRA on GPT-2 (where peft is installed), applied before or after convert_to_fp8:
    merge_and_unload computes what the adapted model computes. (tfp8.Conv1D was an nn.Linear
    to peft, which merged the delta untransposed: 0.74 off on the square c_proj, a shape error
    on c_attn; it is transformers' Conv1D to it now.)"""
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=128, n_positions=32, n_embd=64, n_layer=1,
                                     n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    lora = peft.LoraConfig(r=4, target_modules=[target], init_lora_weights=False,
                           fan_in_fan_out=True)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    if order == "converted_first":
        tfp8.convert_to_fp8(model)
    torch.manual_seed(1)
    adapted = peft.get_peft_model(model, lora)
    if order == "lora_first":
        tfp8.convert_to_fp8(adapted)
    layer = adapted.base_model.model.transformer.h[0].get_submodule(target)
    assert isinstance(layer.base_layer, tfp8.Conv1D)
    ids = torch.randint(0, 128, (2, 16))
    with torch.no_grad():
        before = adapted(input_ids=ids).logits
        merged = adapted.merge_and_unload()
        after = merged(input_ids=ids).logits
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)


def test_lora_adapters_stay_in_high_precision():
    """peft's adapters (lora_A / lora_B, nn.Linear per adapter; here a stand-in of peft's
    layout) are left in high precision by the default filter, named with the reason: with a
    rank that is a multiple of 16 they were converted, and the zero-initialised lora_B's FP8
    output stayed 0, then 7-13 dB, behind its delayed scale."""

    class LoraLinear(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.base_layer = torch.nn.Linear(32, 64)
            self.lora_A = torch.nn.ModuleDict({"default": torch.nn.Linear(32, 16, bias=False)})
            self.lora_B = torch.nn.ModuleDict({"default": torch.nn.Linear(16, 64, bias=False)})

    model = torch.nn.Sequential(LoraLinear())
    with pytest.warns(UserWarning, match="LoRA adapter"):
        summary = tfp8.convert_to_fp8(model, return_summary=True)
    assert summary.converted == ["0.base_layer"]
    assert set(summary.skipped) == {"0.lora_A.default", "0.lora_B.default"}
    assert type(model[0].lora_A["default"]) is torch.nn.Linear
    everything = tfp8.convert_to_fp8(torch.nn.Sequential(LoraLinear()), return_summary=True,
                                     filter_fn=lambda layer, name: True)
    assert len(everything.converted) == 3  # (a filter of one's own decides)
    # The README's filter: its own rule composed with the default rules (adapters stay).
    from transformer_fp8.integrations.convert import default_filter
    composed = tfp8.convert_to_fp8(
        torch.nn.Sequential(LoraLinear()), return_summary=True,
        filter_fn=lambda layer, name: name != "lm_head" and default_filter(layer, name))
    assert composed.converted == ["0.base_layer"]


@pytest.mark.parametrize("how", ["built", "converted", "layernorm_linear"])
def test_a_bias_set_after_construction_is_used(how):
    """torch.nn.Linear built without a bias uses one assigned later (layer.bias =
    nn.Parameter(...)); the FP8 layer ignored it (output off by the bias, bias.grad None)."""
    torch.manual_seed(0)
    if how == "built":
        layer = tfp8.Linear(32, 48, bias=False)
    elif how == "converted":
        layer = tfp8.convert_to_fp8(torch.nn.Sequential(torch.nn.Linear(32, 48, bias=False)))[0]
    else:
        layer = tfp8.LayerNormLinear(32, 48, bias=False)
    assert "bias=False" in repr(layer)
    layer.bias = torch.nn.Parameter(torch.randn(48))
    assert "bias=True" in repr(layer)
    x = torch.randn(16, 32)
    normed = layer._norm_hp(x) if how == "layernorm_linear" else x
    expected = torch.nn.functional.linear(normed, layer.weight, layer.bias)
    assert torch.equal(layer(x), expected)
    with tfp8.fp8_autocast(fp8_recipe=tfp8.DelayedScaling()):
        out = layer(x)
    assert sqnr(expected.detach(), out.detach()) > 20
    out.sum().backward()
    assert torch.equal(layer.bias.grad, torch.full((48,), 16.0))


def test_a_subclass_of_conv1d_is_left_alone():
    """A subclass named Conv1D that overrides forward keeps its own forward: converting it
    would replace that forward by transformers' (its output silently changed)."""
    class Conv1D(globals()["Conv1D"]):  # (the same class name, as a user's override has)
        def forward(self, x):
            return super().forward(x) * 2

    torch.manual_seed(0)
    model = torch.nn.Sequential(Conv1D(32, 32))
    x = torch.randn(4, 32)
    expected = model(x)
    with pytest.warns(UserWarning, match="converted 0 of 1"):
        summary = tfp8.convert_to_fp8(model, return_summary=True)
    assert "may compute its own way" in summary.skipped["0"]
    assert type(model[0]) is Conv1D and not hasattr(model[0], "in_features")
    assert torch.equal(model(x), expected)
