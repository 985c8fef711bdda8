"""A checkpoint saved under one fp8_format, loaded into a HuggingFace model and resumed under
another (quantization/recipe_switch.py): however the FP8 state gets into the model, its scales
are rescaled to the new format at the first step, as after load_state_dict. from_pretrained
into a class whose FP8 layers exist at construction materialises the state by assignment from
"meta" (no load_state_dict): a HYBRID checkpoint resumed under E4M3 kept grad_output's E5M2
scales there and the first backward saturated (gradients ~0.98 off), silently. Skipped where
transformers is not installed (no weights are downloaded)."""
from __future__ import annotations

import pytest
import torch
from integration_compare import assert_bit_identical, train

import transformer_fp8 as tfp8
from transformer_fp8 import DelayedScaling, Format

transformers = pytest.importorskip("transformers")

# (the default history length: a class built for no recipe has its shapes, which
# from_pretrained requires)
HYBRID = DelayedScaling(fp8_format=Format.HYBRID)
E4M3 = DelayedScaling(fp8_format=Format.E4M3)


def tiny_llama_config():
    return transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                    num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, max_position_embeddings=64)


def fp8_llama(recipe):
    """A Llama class whose linear layers are FP8 when it is built, for ``recipe`` (None: for
    none, the next delayed recipe it runs under)."""
    class FP8Llama(transformers.LlamaForCausalLM):
        def __init__(self, config):
            super().__init__(config)
            tfp8.convert_to_fp8(self, recipe=recipe)

    return FP8Llama


def train_llama(model, recipe, steps, seed=0):
    gen = torch.Generator().manual_seed(seed)
    batches = [torch.randint(0, 128, (4, 32), generator=gen) for _ in range(steps)]
    return train(model, lambda ids: model(input_ids=ids, labels=ids).loss, batches, recipe,
                 loss_fn=lambda loss: loss)


@pytest.fixture
def hybrid_checkpoint(tmp_path):
    """A model trained 3 steps under HYBRID (its grad_output scales made for E5M2), saved."""
    torch.manual_seed(0)
    model = fp8_llama(HYBRID)(tiny_llama_config())
    train_llama(model, HYBRID, 3)
    model.save_pretrained(tmp_path)
    return tmp_path, {k: v.clone() for k, v in model.state_dict().items()}


def loaded_by_load_state_dict(built_for, state):
    torch.manual_seed(1)
    model = fp8_llama(built_for)(tiny_llama_config())
    model.load_state_dict(state)
    return model


def assert_rescaled_for_e4m3(model, state) -> None:
    """After the first E4M3 step's adoption: every layer's grad_output scale is the saved E5M2
    one times 448 / 57344 (checked on a layer before that step's update, through its bits)."""
    layer = model.model.layers[0].mlp.down_proj
    key = "model.layers.0.mlp.down_proj.fp8_bwd_scale"
    with tfp8.fp8_autocast(fp8_recipe=E4M3):
        model(input_ids=torch.zeros(1, 8, dtype=torch.long))
        assert torch.equal(layer.fp8_bwd_scale, state[key] * 2.0 ** -7)


@pytest.mark.parametrize("built_for", [E4M3, None], ids=["built_for_e4m3", "built_for_none"])
def test_from_pretrained_of_a_hybrid_checkpoint_resumed_under_e4m3(hybrid_checkpoint,
                                                                   built_for):
    """from_pretrained into FP8 layers made at construction (the state assigned from "meta"):
    the first E4M3 steps are those of the same model loaded with load_state_dict, bit for bit
    (its scales rescaled from E5M2 to E4M3), whatever recipe the class was built for."""
    path, state = hybrid_checkpoint
    model = fp8_llama(built_for).from_pretrained(path)
    for key, value in state.items():
        assert torch.equal(model.state_dict()[key], value), key
    expected_model = loaded_by_load_state_dict(built_for, state)
    assert_bit_identical(train_llama(model, E4M3, 3, seed=1),
                         train_llama(expected_model, E4M3, 3, seed=1))


def test_from_pretrained_state_is_rescaled_at_the_first_e4m3_step(hybrid_checkpoint):
    """The scales themselves: grad_output's, made for E5M2, multiplied by 2**-7."""
    path, state = hybrid_checkpoint
    assert_rescaled_for_e4m3(fp8_llama(E4M3).from_pretrained(path), state)


def test_load_fp8_state_of_a_hybrid_checkpoint_resumed_under_e4m3(hybrid_checkpoint):
    """from_pretrained of the plain class, converted for E4M3, then load_fp8_state: rescaled,
    and trains as the model loaded with load_state_dict."""
    path, state = hybrid_checkpoint
    model = transformers.LlamaForCausalLM.from_pretrained(path)
    tfp8.convert_to_fp8(model, recipe=E4M3)
    tfp8.load_fp8_state(model, path)
    assert_rescaled_for_e4m3(model, state)
    model = transformers.LlamaForCausalLM.from_pretrained(path)
    tfp8.convert_to_fp8(model, recipe=E4M3)
    tfp8.load_fp8_state(model, path)
    assert_bit_identical(train_llama(model, E4M3, 3, seed=1),
                         train_llama(loaded_by_load_state_dict(E4M3, state), E4M3, 3, seed=1))
