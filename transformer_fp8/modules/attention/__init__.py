"""Transformer Engine's attention modules: DotProductAttention (dot_product.py, with its masks
in masks.py and attention sinks in sink.py) and MultiheadAttention (multi_head_attention.py,
with qk_norm.py), whose projections are the package's FP8 layers."""
from .dot_product import DotProductAttention, RotaryPositionEmbedding, apply_rotary_pos_emb
from .multi_head_attention import MultiheadAttention

__all__ = ["DotProductAttention", "MultiheadAttention", "RotaryPositionEmbedding",
           "apply_rotary_pos_emb"]
