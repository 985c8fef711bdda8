"""Optimizers under Transformer Engine's names (``transformer_engine.pytorch.optimizers``)."""
from .fused_adam import FusedAdam

__all__ = ["FusedAdam"]
