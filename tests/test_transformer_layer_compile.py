"""torch.compile(fullgraph=True) of a whole TransformerLayer (attention, its fused
LayerNormLinear / LayerNormMLP, residuals, rotary embedding), trained over steps whose scales
change: with aot_eager (eager's kernels) losses, every gradient (input and parameters) and
the FP8 state bit for bit eager's, in one graph for every step; with inductor within float32
rounding of eager (100 dB on the CPU, 45 dB on CUDA where inductor's elementwise ops may flip
one FP8 code; a cast with another step's scale is about 30 dB off)."""
from __future__ import annotations

import copy

import pytest
import torch
from conftest import DEVICE_PARAMS
from integration_compare import (assert_bit_identical, assert_close, counting_aot_eager,
                                 step_batches, train)

from transformer_fp8 import (DelayedScaling, Float8BlockScaling, Float8CurrentScaling,
                             Float8RowwiseScaling, RotaryPositionEmbedding, TransformerLayer)

STEPS = 3
SEQ, BATCH, HIDDEN = 16, 2, 64
RECIPES = [DelayedScaling(amax_history_len=4), Float8CurrentScaling(), Float8BlockScaling(),
           Float8RowwiseScaling()]
RECIPE_IDS = ["delayed", "current", "block", "rowwise"]
CONFIGS = {
    # causal self-attention with grouped keys, RMSNorm (zero-centred gamma), SwiGLU, rotary
    "rmsnorm-swiglu-gqa-rotary": dict(normalization="RMSNorm", activation="swiglu",
                                      num_gqa_groups=2, zero_centered_gamma=True),
    # the residual after the norm, batch-first input, GeGLU, no mask
    "post-layernorm-bshd": dict(apply_residual_connection_post_layernorm=True,
                                attn_input_format="bshd", activation="geglu",
                                self_attn_mask_type="no_mask"),
}


def _layer(config: str, recipe, device: str) -> TransformerLayer:
    torch.manual_seed(0)
    return TransformerLayer(HIDDEN, 128, 4, hidden_dropout=0.0, attention_dropout=0.0,
                            recipe=recipe, device=device, **CONFIGS[config])


def _runs(config: str, recipe, device: str, backend) -> tuple:
    eager = _layer(config, recipe, device)
    compiled_layer = copy.deepcopy(eager)
    torch._dynamo.reset()
    compiled = torch.compile(compiled_layer, fullgraph=True, backend=backend)
    shape = (BATCH, SEQ, HIDDEN) if "bshd" in config else (SEQ, BATCH, HIDDEN)
    batches = step_batches(torch.Generator().manual_seed(1), STEPS, *shape, device=device)
    if "rotary" in config:
        freqs = RotaryPositionEmbedding(HIDDEN // 4)(SEQ).to(device)
        expected = train(eager, lambda x: eager(x, rotary_pos_emb=freqs), batches, recipe)
        got = train(compiled_layer, lambda x: compiled(x, rotary_pos_emb=freqs), batches, recipe)
    else:
        expected = train(eager, eager, batches, recipe)
        got = train(compiled_layer, compiled, batches, recipe)
    fp8_layers = [m for m in compiled_layer.modules() if hasattr(m, "fp8_fwd_amax_history")]
    assert len(fp8_layers) == 3, "LayerNormLinear (qkv), Linear (proj), LayerNormMLP"
    if isinstance(recipe, DelayedScaling):  # (the compiled steps ran in FP8 and recorded)
        assert all(m.fp8_fwd_amax_history[-STEPS:].all() for m in fp8_layers)
    return got, expected


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("recipe", RECIPES, ids=RECIPE_IDS)
def test_compiled_transformer_layer_is_bit_identical_to_eager(device, config, recipe):
    backend, graphs = counting_aot_eager()
    got, expected = _runs(config, recipe, device, backend)
    assert_bit_identical(got, expected)
    assert len(graphs) == 1, f"compiled {len(graphs)} times: recompiled between steps"


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("recipe", RECIPES[:3], ids=RECIPE_IDS[:3])
def test_inductor_compiled_transformer_layer_matches_eager(device, recipe):
    got, expected = _runs("rmsnorm-swiglu-gqa-rotary", recipe, device, "inductor")
    assert_close(got, expected, min_sqnr_db=100.0 if device == "cpu" else 45.0)
