"""A HuggingFace GPT-2 (transformers' Conv1D layers) built from a small config: converted to
FP8 with every linear layer, trained with gradient_checkpointing_enable() bit-identically to
training without it. Skipped where transformers is not installed (no weights are downloaded)."""
from __future__ import annotations

import copy

import pytest
import torch
from conftest import DEVICE_PARAMS
from integration_compare import assert_bit_identical, counting_aot_eager, train

import transformer_fp8 as tfp8

transformers = pytest.importorskip("transformers")


def tiny_gpt2(device):
    config = transformers.GPT2Config(vocab_size=128, n_positions=32, n_embd=64, n_layer=2,
                                     n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).to(device)


RECIPE = tfp8.DelayedScaling(amax_history_len=4)


def token_batches(device, steps=3, batch=4, seq=32):
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, 128, (batch, seq), generator=gen).to(device) for _ in range(steps)]


def train_lm(model, run, device):
    """SGD steps of a causal LM on random tokens: a StepRecord per step."""
    return train(model, lambda ids: run(input_ids=ids, labels=ids).loss, token_batches(device),
                 RECIPE, loss_fn=lambda loss: loss)


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
    expected, got = train_lm(model, model, device), train_lm(checkpointed, checkpointed, device)
    # The checkpointing did take place: a forward leaves replay records for the recomputation.
    ids = torch.randint(0, 128, (2, 32)).to(device)
    with tfp8.fp8_autocast(fp8_recipe=RECIPE):
        loss = checkpointed(input_ids=ids, labels=ids).loss
    assert checkpointed.transformer.h[1].mlp.c_fc._replay_records
    loss.backward()
    assert not checkpointed.transformer.h[1].mlp.c_fc._replay_records
    assert_bit_identical(got, expected)
    assert model.transformer.h[0].attn.c_attn.fp8_fwd_amax_history[-3:].all()


def test_llama_compiles_fullgraph_without_recompiling():
    """A HuggingFace Llama of FP8 layers under torch.compile(fullgraph=True): one graph for
    every step (no graph break per layer, no recompilation) and the eager losses, gradients and
    FP8 state, bit for bit (aot_eager runs the same kernels)."""
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=4, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    eager = transformers.LlamaForCausalLM(config)
    summary = tfp8.convert_to_fp8(eager, recipe=RECIPE, return_summary=True)
    assert len(summary.converted) == 4 * 7 + 1 and not summary.skipped
    compiled = copy.deepcopy(eager)
    backend, graphs = counting_aot_eager()
    torch._dynamo.reset()
    compiled_fn = torch.compile(compiled, fullgraph=True, backend=backend)
    expected = train_lm(eager, eager, "cpu")
    got = train_lm(compiled, compiled_fn, "cpu")
    assert len(graphs) == 1, f"{len(graphs)} graphs"
    assert_bit_identical(got, expected)
