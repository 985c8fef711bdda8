"""Transformer Engine's mixture-of-experts token permutation, in plain torch (permutation.py,
chunk_sort.py; their argument checks in checks.py)."""
from .chunk_sort import moe_sort_chunks_by_index, moe_sort_chunks_by_index_with_probs
from .permutation import moe_permute, moe_permute_with_probs, moe_unpermute

__all__ = ["moe_permute", "moe_permute_with_probs", "moe_sort_chunks_by_index",
           "moe_sort_chunks_by_index_with_probs", "moe_unpermute"]
