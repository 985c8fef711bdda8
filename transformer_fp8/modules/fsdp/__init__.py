"""FP8 weight all-gather under FSDP2 (all_gather.py explains how); enable_fp8_all_gather
(enable.py) turns it on for a model."""
from .enable import enable_fp8_all_gather

__all__ = ["enable_fp8_all_gather"]
