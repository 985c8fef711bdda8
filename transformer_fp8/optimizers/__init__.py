"""Optimizers under Transformer Engine's names (``transformer_engine.pytorch.optimizers``)."""
from .fused_adam import FusedAdam
from .fused_sgd import FusedSGD

__all__ = ["FusedAdam", "FusedSGD"]
