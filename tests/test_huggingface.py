"""A HuggingFace GPT-2 (transformers' Conv1D layers) built from a small config: converted to
FP8 with every linear layer, trained with gradient_checkpointing_enable() bit-identically to
training without it. Skipped where transformers is not installed (no weights are downloaded)."""
from __future__ import annotations

import contextlib
import copy
import json
import warnings

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


def save_bin_checkpoint(model, path, shards=1):
    """The config and the state_dict as pytorch_model.bin, or as `shards` files with a
    pytorch_model.bin.index.json, as transformers 4.x's save_pretrained(safe_serialization=
    False) wrote them (transformers 5 writes safetensors only)."""
    model.config.save_pretrained(path)
    state = model.state_dict()
    if shards == 1:
        torch.save(state, path / "pytorch_model.bin")
        return
    keys = list(state)
    weight_map = {}
    for i in range(shards):
        name = f"pytorch_model-{i + 1:05d}-of-{shards:05d}.bin"
        part = keys[i::shards]
        torch.save({k: state[k] for k in part}, path / name)
        weight_map.update(dict.fromkeys(part, name))
    (path / "pytorch_model.bin.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.mark.parametrize("safe_serialization", [True, False], ids=["safetensors", "bin"])
def test_save_pretrained_round_trip_keeps_the_fp8_state(tmp_path, safe_serialization):
    """save_pretrained writes the FP8 state; from_pretrained drops it (its fresh model has no
    FP8 layers); load_fp8_state after converting puts it back, so training resumes exactly
    where it stopped rather than from fresh scales."""
    model = tfp8.convert_to_fp8(tiny_gpt2("cpu"), recipe=RECIPE)
    train_lm(model, model, "cpu")
    if safe_serialization:
        model.save_pretrained(tmp_path)
    else:   # transformers 5's save_pretrained writes safetensors whatever it is asked
        save_bin_checkpoint(model, tmp_path)
    assert (tmp_path / ("model.safetensors" if safe_serialization
                        else "pytorch_model.bin")).exists()
    saved = {k: v.clone() for k, v in model.state_dict().items()}

    reloaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path)
    tfp8.convert_to_fp8(reloaded, recipe=RECIPE)
    fresh = reloaded.transformer.h[0].mlp.c_fc.fp8_fwd_scale
    assert torch.equal(fresh, torch.ones_like(fresh)), "from_pretrained alone drops the state"
    loaded = tfp8.load_fp8_state(reloaded, tmp_path)
    assert len(loaded) == 2 * 4 + 1
    for key, value in reloaded.state_dict().items():
        assert torch.equal(value, saved[key]), key
    # the next steps are those of the original model, bit for bit
    assert_bit_identical(train_lm(reloaded, reloaded, "cpu"), train_lm(model, model, "cpu"))


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_load_fp8_state_reads_a_sharded_checkpoint(tmp_path, fmt):
    """A checkpoint in several shards (save_pretrained's max_shard_size for safetensors; shards
    and pytorch_model.bin.index.json for bin): load_fp8_state reads the FP8 state from all of
    them, bit for bit the saved one."""
    model = tfp8.convert_to_fp8(tiny_gpt2("cpu"), recipe=RECIPE)
    train_lm(model, model, "cpu")
    if fmt == "safetensors":
        model.save_pretrained(tmp_path, max_shard_size="100KB")
    else:
        save_bin_checkpoint(model, tmp_path, shards=3)
    shards = [f for f in tmp_path.iterdir() if f.name.endswith("." + fmt)]
    assert len(shards) > 1, sorted(f.name for f in tmp_path.iterdir())
    assert any(f.name.endswith(".index.json") for f in tmp_path.iterdir())
    saved = {k: v.clone() for k, v in model.state_dict().items()}

    reloaded = tfp8.convert_to_fp8(tiny_gpt2("cpu"), recipe=RECIPE)
    loaded = tfp8.load_fp8_state(reloaded, tmp_path)
    assert len(loaded) == 2 * 4 + 1
    for key, value in reloaded.state_dict().items():
        if "fp8_" in key:
            assert torch.equal(value, saved[key]), key


def test_load_fp8_state_reads_the_files_from_pretrained_reads(tmp_path):
    """Another model's safetensors file beside model.safetensors (accelerate's save_state
    writes model.safetensors and model_1.safetensors for a model and its EMA copy): the FP8
    state comes from model.safetensors, as from_pretrained's weights do (the later file
    overwrote it); several files with neither model.safetensors nor an index are refused."""
    from safetensors.torch import load_file, save_file
    first = tfp8.convert_to_fp8(tiny_gpt2("cpu"), recipe=RECIPE)
    train_lm(first, first, "cpu")
    first.save_pretrained(tmp_path)
    other = tfp8.convert_to_fp8(tiny_gpt2("cpu"), recipe=RECIPE)
    train_lm(other, other, "cpu")
    train_lm(other, other, "cpu")
    save_file({k: v.contiguous() for k, v in other.state_dict().items()
               if k != "lm_head.weight"}, str(tmp_path / "model_1.safetensors"))
    reloaded = tfp8.convert_to_fp8(tiny_gpt2("cpu"), recipe=RECIPE)
    tfp8.load_fp8_state(reloaded, tmp_path)
    expected = first.state_dict()
    for key, value in reloaded.state_dict().items():
        if "fp8_" in key:
            assert torch.equal(value, expected[key]), key
    (tmp_path / "model.safetensors").rename(tmp_path / "model_0.safetensors")
    with pytest.raises(ValueError, match="several safetensors files"):
        tfp8.load_fp8_state(reloaded, tmp_path)
    assert load_file(str(tmp_path / "model_1.safetensors"))  # (both files still there)


def test_load_fp8_state_refuses_a_model_that_does_not_match(tmp_path):
    model = tfp8.convert_to_fp8(tiny_gpt2("cpu"))
    model.save_pretrained(tmp_path)
    plain = transformers.GPT2LMHeadModel.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="has no FP8 layers; convert it first"):
        tfp8.load_fp8_state(plain, tmp_path)
    config = transformers.GPT2Config(vocab_size=128, n_positions=32, n_embd=64, n_layer=1,
                                     n_head=2)
    smaller = tfp8.convert_to_fp8(transformers.GPT2LMHeadModel(config))
    before = {k: v.clone() for k, v in smaller.state_dict().items()}
    with pytest.raises(KeyError, match="layers the model does not have"):
        tfp8.load_fp8_state(smaller, tmp_path)
    for key, value in smaller.state_dict().items():
        assert torch.equal(value, before[key]), f"{key} changed by a refused load"


@pytest.mark.parametrize("bad", ["nan_scale", "wrong_shape"])
def test_load_fp8_state_of_a_corrupt_layer_loads_no_layer(tmp_path, bad):
    """Every layer's FP8 state is checked before any is loaded: a corrupt scale (or a scale of
    another shape) in the last layer's state leaves the earlier layers as they were, and the
    error names the key."""
    model = tfp8.convert_to_fp8(tiny_gpt2("cpu"), recipe=RECIPE)
    train_lm(model, model, "cpu")
    state = dict(model.state_dict())
    key = "lm_head.fp8_fwd_scale" if "lm_head.fp8_fwd_scale" in state else sorted(
        k for k in state if k.endswith("fp8_fwd_scale"))[-1]
    state[key] = (torch.tensor([float("nan"), 1.0]) if bad == "nan_scale"
                  else torch.ones(3))
    target = tfp8.convert_to_fp8(tiny_gpt2("cpu"), recipe=RECIPE)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    match = "finite and positive" if bad == "nan_scale" else "has shape \\[3\\]"
    with pytest.raises(RuntimeError, match=f"{key}.*{match}.*no layer was loaded"):
        tfp8.load_fp8_state(target, state)
    for name, value in target.state_dict().items():
        assert torch.equal(value, before[name]), f"{name} changed by a refused load"


def test_converted_gpt2_conv1d_is_transformers_conv1d_to_its_init_and_pickles():
    """A converted Conv1D is an instance of transformers' Conv1D too: init_weights() after
    meta init, conversion and to_empty() initialises every layer (transformers' _init_weights
    dispatches on its Conv1D; tfp8.Conv1D, no nn.Linear, was skipped: uninitialised memory),
    and the whole model pickles and loads as its class."""
    import io

    from transformers.pytorch_utils import Conv1D as HFConv1D

    config = transformers.GPT2Config(vocab_size=128, n_positions=32, n_embd=64, n_layer=1,
                                     n_head=2)
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(config)
    tfp8.convert_to_fp8(model)
    model.to_empty(device="cpu")
    for m in model.modules():
        if isinstance(m, tfp8.Conv1D):
            with torch.no_grad():
                m.weight.fill_(float("nan"))
    model.init_weights()
    convs = [m for m in model.modules() if isinstance(m, tfp8.Conv1D)]
    assert len(convs) == 4 and all(isinstance(m, HFConv1D) for m in convs)
    for m in convs:
        assert torch.isfinite(m.weight).all() and 0.01 < m.weight.std() < 0.03
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert type(loaded.transformer.h[0].attn.c_attn) is type(model.transformer.h[0].attn.c_attn)
    ids = torch.randint(0, 128, (2, 16))
    model.eval(), loaded.eval()  # (no dropout)
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, model(input_ids=ids).logits)


def tiny_llama_config():
    return transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                    num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, max_position_embeddings=64)


def fp8_at_construction(recipe):
    """A Llama class whose linear layers are FP8 when it is built (convert_to_fp8 in
    __init__, as a model written with FP8 layers has them): from_pretrained builds it on
    "meta" and materialises it."""
    class FP8Llama(transformers.LlamaForCausalLM):
        def __init__(self, config):
            super().__init__(config)
            tfp8.convert_to_fp8(self, recipe=recipe)

    return FP8Llama


@contextlib.contextmanager
def uninitialised_memory_is_nan():
    """torch.empty_like (from_pretrained's placeholder for a key its checkpoint lacks) fills
    NaN, so that a state left uninitialised shows whatever the allocator hands out."""
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was)


def train_llama(model, recipe):
    return train(model, lambda ids: model(input_ids=ids, labels=ids).loss,
                 token_batches("cpu"), recipe, loss_fn=lambda loss: loss)


@pytest.mark.parametrize("recipe", [RECIPE, tfp8.Float8CurrentScaling()],
                         ids=["delayed", "current"])
@pytest.mark.parametrize("checkpoint", ["plain", "fp8"])
def test_from_pretrained_into_fp8_layers_made_at_construction(tmp_path, recipe, checkpoint):
    """from_pretrained into a class whose FP8 layers exist at construction. From a plain
    checkpoint (the pretrained model to fine-tune in FP8), the FP8 state it lacks is fresh: the
    model is the plain one converted after loading (the usual order), state for state, and
    trains as it does; its state_dict then loads (transformers had filled the missing keys with
    uninitialised memory: NaN losses under DelayedScaling, a checkpoint refused on reload
    under current scaling). From a checkpoint with FP8 state, that state is kept: training
    resumes as the saved model goes on."""
    FP8Llama = fp8_at_construction(recipe)
    torch.manual_seed(0)
    if checkpoint == "plain":
        transformers.LlamaForCausalLM(tiny_llama_config()).save_pretrained(tmp_path)
        expected_model = transformers.LlamaForCausalLM.from_pretrained(tmp_path)
        tfp8.convert_to_fp8(expected_model, recipe=recipe)
    else:
        expected_model = FP8Llama(tiny_llama_config())
        train_llama(expected_model, recipe)
        expected_model.save_pretrained(tmp_path)
    with uninitialised_memory_is_nan(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = FP8Llama.from_pretrained(tmp_path)
    assert not [w for w in caught if "FP8 state" in str(w.message)], \
        [str(w.message) for w in caught]
    expected, got = expected_model.state_dict(), model.state_dict()
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert got[key].dtype == value.dtype and torch.equal(got[key], value), key
    assert_bit_identical(train_llama(model, recipe), train_llama(expected_model, recipe))
    FP8Llama(tiny_llama_config()).load_state_dict(model.state_dict())
