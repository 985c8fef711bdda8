"""bench_gpt's models: the GPT from plain torch layers, the same GPT with
transformer_fp8.TransformerLayer blocks (weights copied from the torch one), and the CUDA graphs
of their blocks.

Every variant keeps the embeddings, the final LayerNorm and the LM head as torch bf16 modules;
only ``model.blocks`` differ. A block takes and returns [batch, seq, d_model] bf16 activations.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

import transformer_fp8 as tf8


@dataclass(frozen=True)
class GPTConfig:
    d_model: int = 2048
    layers: int = 16
    heads: int = 16
    seq: int = 2048
    vocab: int = 32000

    def describe(self) -> str:
        return f"d{self.d_model} L{self.layers} H{self.heads} T{self.seq} V{self.vocab}"


SMOKE_CONFIG = GPTConfig(d_model=32, layers=2, heads=2, seq=16, vocab=128)


class Block(nn.Module):
    """Pre-LayerNorm attention + GELU MLP, every projection a plain nn.Linear."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        d = cfg.d_model
        self.heads = cfg.heads
        self.ln_attn, self.ln_mlp = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln_attn(x)).view(b, t, 3, self.heads, d // self.heads) \
            .permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln_mlp(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.tok_emb = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, tokens):
        x = self.tok_emb(tokens) + self.pos_emb(torch.arange(tokens.shape[1],
                                                             device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def initial_model(cfg: GPTConfig, device, seed: int = 0) -> GPT:
    """The bf16 model every precision starts from: seeded, initialised on ``device`` (~1B
    parameters are slow to draw on a CPU)."""
    torch.manual_seed(seed)
    with torch.device(device):
        return GPT(cfg).to(torch.bfloat16)


# ----------------------------------------------------------------------------- TransformerLayer

# TransformerLayer parameter -> Block parameter. The fused QKV weight without interleaving
# (fuse_qkv_params=True, qkv_weight_interleaved=False) is laid out [all queries | all keys |
# all values], each head-major: Block's qkv layout, so the rows copy as they are.
TE_NAMES = {
    "self_attention.layernorm_qkv.layer_norm_weight": "ln_attn.weight",
    "self_attention.layernorm_qkv.layer_norm_bias": "ln_attn.bias",
    "self_attention.layernorm_qkv.weight": "qkv.weight",
    "self_attention.layernorm_qkv.bias": "qkv.bias",
    "self_attention.proj.weight": "proj.weight",
    "self_attention.proj.bias": "proj.bias",
    "layernorm_mlp.layer_norm_weight": "ln_mlp.weight",
    "layernorm_mlp.layer_norm_bias": "ln_mlp.bias",
    "layernorm_mlp.fc1_weight": "fc1.weight",
    "layernorm_mlp.fc1_bias": "fc1.bias",
    "layernorm_mlp.fc2_weight": "fc2.weight",
    "layernorm_mlp.fc2_bias": "fc2.bias",
}


def te_block(cfg: GPTConfig, device) -> tf8.TransformerLayer:
    """Block's architecture as a TransformerLayer: pre-LayerNorm (eps 1e-5), causal
    self-attention over ``heads`` heads, tanh-GELU MLP of 4 d_model, biases, no dropout, bf16
    parameters, [batch, seq, d_model] activations ("bshd")."""
    return tf8.TransformerLayer(
        cfg.d_model, 4 * cfg.d_model, cfg.heads, hidden_dropout=0.0, attention_dropout=0.0,
        self_attn_mask_type="causal", params_dtype=torch.bfloat16, device=device,
        fuse_qkv_params=True, qkv_weight_interleaved=False, bias=True, activation="gelu",
        normalization="LayerNorm", layernorm_epsilon=1e-5, attn_input_format="bshd")


def te_model(model: GPT, cfg: GPTConfig) -> GPT:
    """A copy of ``model`` whose blocks are TransformerLayers holding the same weights
    (TE_NAMES); embeddings, final norm and LM head copied as they are."""
    copied = copy.deepcopy(model)
    device = model.tok_emb.weight.device
    copied.blocks = nn.ModuleList(te_block(cfg, device) for _ in model.blocks)
    for source, target in zip(model.blocks, copied.blocks):
        source_params = dict(source.named_parameters())
        target_params = dict(target.named_parameters())
        if set(target_params) != set(TE_NAMES) or set(source_params) != set(TE_NAMES.values()):
            raise RuntimeError("te_model: TE_NAMES does not map every parameter: "
                               f"TransformerLayer has {sorted(target_params)}, Block has "
                               f"{sorted(source_params)}")
        with torch.no_grad():
            for te_name, name in TE_NAMES.items():
                if target_params[te_name].shape != source_params[name].shape:
                    raise RuntimeError(f"te_model: {te_name} {tuple(target_params[te_name].shape)}"
                                       f" != {name} {tuple(source_params[name].shape)}")
                target_params[te_name].copy_(source_params[name])
    return copied


# ----------------------------------------------------------------------------- CUDA graphs

def graph_blocks(model: GPT, recipe, batch: int, cfg: GPTConfig) -> None:
    """CUDA-graph the forward and the backward of every block of ``model`` (CUDA only), in one
    call so that the graphs share one memory pool and are captured in the order they run
    (forwards first to last, backwards last to first). recipe None: torch's
    make_graphed_callables (bf16 blocks); else transformer_fp8's, each block's graphs holding
    its own fp8_autocast(recipe) and scale updates (so the step needs none around the blocks).
    Sample input per block: a bf16 [batch, seq, d_model] tensor that requires grad (the block's
    input comes from the embeddings, which train)."""
    device = model.tok_emb.weight.device
    if device.type != "cuda":
        raise ValueError(f"graph_blocks: CUDA graphs need a CUDA model, got {device}")
    blocks = tuple(model.blocks)  # (torch wants a tuple for several callables)
    samples = tuple((torch.randn(batch, cfg.seq, cfg.d_model, device=device,
                                 dtype=torch.bfloat16, requires_grad=True),) for _ in blocks)
    if recipe is None:
        torch.cuda.make_graphed_callables(blocks, samples)
    else:
        tf8.make_graphed_callables(blocks, samples, fp8_enabled=True, fp8_recipe=recipe)
