"""Attributes that Megatron-LM reads on Parameters (Transformer Engine's marks:
``tensor_model_parallel``, ``partition_dim``, ``partition_stride``, ``sequence_parallel``),
remembered by the module so that they survive what replaces its Parameter objects:
``to_empty()`` out of "meta", a device move that makes new Parameters, then
``reset_parameters()``. Without them a sequence-parallel norm's or row bias's gradient would
not be summed over the ranks, silently.
"""
from __future__ import annotations


def mark(module, name: str, **attributes) -> None:
    """Set ``attributes`` on the module's Parameter ``name`` and remember them."""
    param = getattr(module, name, None)
    if param is None:
        return
    for key, value in attributes.items():
        setattr(param, key, value)
    marks = module.__dict__.setdefault("_param_marks", {})
    marks.setdefault(name, {}).update(attributes)


def mark_again(module) -> None:
    """Set the remembered attributes on the module's Parameters as they are now."""
    for name, attributes in module.__dict__.get("_param_marks", {}).items():
        param = getattr(module, name, None)
        if param is not None:
            for key, value in attributes.items():
                setattr(param, key, value)
