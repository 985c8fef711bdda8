"""Transformer Engine's attention modules: DotProductAttention (dot_product.py, with its masks
in masks.py and attention sinks in sink.py), MultiheadAttention (multi_head_attention.py, with
qk_norm.py), whose projections are the package's FP8 layers, rotary embeddings (rotary.py) and
the KV cache for inference (inference.py, InferenceParams)."""
from .dot_product import DotProductAttention
from .inference import InferenceParams
from .multi_head_attention import MultiheadAttention
from .rotary import RotaryPositionEmbedding, apply_rotary_pos_emb

__all__ = ["DotProductAttention", "InferenceParams", "MultiheadAttention",
           "RotaryPositionEmbedding", "apply_rotary_pos_emb"]
