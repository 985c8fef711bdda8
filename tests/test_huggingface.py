"""A HuggingFace GPT-2 (transformers' Conv1D layers) built from a small config: converted to
FP8 with every linear layer, trained with gradient_checkpointing_enable() bit-identically to
training without it. Skipped where transformers is not installed (no weights are downloaded)."""
from __future__ import annotations

import copy

import pytest
import torch
from conftest import (DEVICE_PARAMS, assert_bitwise_equal, assert_same_training,
                      counting_aot_eager)

import transformer_fp8 as tfp8

transformers = pytest.importorskip("transformers")


def tiny_gpt2(device):
    config = transformers.GPT2Config(vocab_size=128, n_positions=32, n_embd=64, n_layer=2,
                                     n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).to(device)


def train(model, device, steps=2):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(0)
    recipe = tfp8.DelayedScaling(amax_history_len=4)
    record = []
    for _ in range(steps):
        ids = torch.randint(0, 128, (4, 32), generator=gen).to(device)
        with tfp8.fp8_autocast(fp8_recipe=recipe):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        record.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
        opt.step()
        opt.zero_grad()
    return record


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("use_reentrant", [True, False])
def test_gpt2_converted_and_gradient_checkpointed(device, use_reentrant):
    model = tiny_gpt2(device)
    summary = tfp8.convert_to_fp8(model, return_summary=True)
    # c_attn, c_proj, c_fc, mlp.c_proj per block are Conv1D; lm_head (vocab 128) is nn.Linear.
    assert len(summary.converted) == 2 * 4 + 1 and not summary.skipped, summary
    assert all(isinstance(m, tfp8.Conv1D) for m in model.transformer.h[0].mlp.children()
               if not isinstance(m, torch.nn.Dropout) and hasattr(m, "weight"))
    checkpointed = copy.deepcopy(model)
    model.train()
    checkpointed.train()
    checkpointed.gradient_checkpointing_enable(
        gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
    expected, got = train(model, device), train(checkpointed, device)
    # The checkpointing did take place: a forward leaves replay records for the recomputation.
    ids = torch.randint(0, 128, (2, 32)).to(device)
    with tfp8.fp8_autocast(fp8_recipe=tfp8.DelayedScaling(amax_history_len=4)):
        loss = checkpointed(input_ids=ids, labels=ids).loss
    assert checkpointed.transformer.h[1].mlp.c_fc._replay_records
    loss.backward()
    assert not checkpointed.transformer.h[1].mlp.c_fc._replay_records
    assert_same_training(got, expected)
    assert model.transformer.h[0].attn.c_attn.fp8_fwd_amax_history[-2:].all()


def test_llama_compiles_fullgraph_without_recompiling():
    """A HuggingFace Llama of FP8 layers under torch.compile(fullgraph=True): one graph for
    every step (no graph break per layer, no recompilation) and the eager losses, bit for bit
    (aot_eager runs the same kernels)."""
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=4, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    eager = transformers.LlamaForCausalLM(config)
    recipe = tfp8.DelayedScaling(amax_history_len=4)
    summary = tfp8.convert_to_fp8(eager, recipe=recipe, return_summary=True)
    assert len(summary.converted) == 4 * 7 + 1 and not summary.skipped
    compiled = copy.deepcopy(eager)
    backend, graphs = counting_aot_eager()
    torch._dynamo.reset()
    compiled_fn = torch.compile(compiled, fullgraph=True, backend=backend)
    gen = torch.Generator().manual_seed(0)
    losses = {"eager": [], "compiled": []}
    for ids in [torch.randint(0, 128, (2, 32), generator=gen) for _ in range(3)]:
        for name, model, fn in (("eager", eager, eager), ("compiled", compiled, compiled_fn)):
            with tfp8.fp8_autocast(fp8_recipe=recipe):
                loss = fn(input_ids=ids, labels=ids).loss
            loss.backward()
            losses[name].append(loss.detach())
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.01 * p.grad
                    p.grad = None
    assert len(graphs) == 1, f"{len(graphs)} graphs"
    for got, expected in zip(losses["compiled"], losses["eager"]):
        assert_bitwise_equal(got, expected, "loss")


@pytest.mark.parametrize("safe_serialization", [True, False], ids=["safetensors", "bin"])
def test_save_pretrained_round_trip_keeps_the_fp8_state(tmp_path, safe_serialization):
    """save_pretrained writes the FP8 state; from_pretrained drops it (its fresh model has no
    FP8 layers); load_fp8_state after converting puts it back, so training resumes exactly
    where it stopped rather than from fresh scales."""
    model = tiny_gpt2("cpu")
    tfp8.convert_to_fp8(model, recipe=tfp8.DelayedScaling(amax_history_len=4))
    train(model, "cpu", steps=2)
    model.save_pretrained(tmp_path, safe_serialization=safe_serialization)
    saved = {k: v.clone() for k, v in model.state_dict().items()}

    reloaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path)
    tfp8.convert_to_fp8(reloaded, recipe=tfp8.DelayedScaling(amax_history_len=4))
    fresh = reloaded.transformer.h[0].mlp.c_fc.fp8_fwd_scale
    assert torch.equal(fresh, torch.ones_like(fresh)), "from_pretrained alone drops the state"
    loaded = tfp8.load_fp8_state(reloaded, tmp_path)
    assert len(loaded) == 2 * 4 + 1
    for key, value in reloaded.state_dict().items():
        assert_bitwise_equal(value, saved[key], key)
    # the next steps are those of the original model
    assert_same_training(train(reloaded, "cpu"), train(model, "cpu"))


def test_load_fp8_state_refuses_a_model_that_does_not_match(tmp_path):
    model = tiny_gpt2("cpu")
    tfp8.convert_to_fp8(model)
    model.save_pretrained(tmp_path)
    plain = transformers.GPT2LMHeadModel.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="has no FP8 layers; convert it first"):
        tfp8.load_fp8_state(plain, tmp_path)
    config = transformers.GPT2Config(vocab_size=128, n_positions=32, n_embd=64, n_layer=1,
                                     n_head=2)
    smaller = tfp8.convert_to_fp8(transformers.GPT2LMHeadModel(config))
    with pytest.raises(KeyError, match="layers the model does not have"):
        tfp8.load_fp8_state(smaller, tmp_path)
    before = smaller.transformer.h[0].mlp.c_fc.fp8_fwd_scale.clone()
    assert torch.equal(smaller.transformer.h[0].mlp.c_fc.fp8_fwd_scale, before), "untouched"
