"""convert_to_fp8: turning a model's linear layers into FP8 ones, in place.

torch.nn.Linear becomes transformer_fp8.Linear, and HuggingFace transformers' Conv1D (GPT-2's
transposed linear layer) becomes transformer_fp8.Conv1D; what stays in high precision is
reported with its reason.
"""
from __future__ import annotations

import importlib
import warnings
from dataclasses import dataclass, field
from typing import Optional

import torch

from ..quantization import model_init
from ..quantization.quantizer import ALIGN
from ..quantization.history import history_len_for
from ..modules.fsdp.enable import enable_fp8_all_gather, held_outside_fp8_modules
from ..modules.linear import Linear, LinearLayer
from ..quantization.recipe import Recipe


class Conv1D(LinearLayer):
    """The FP8 form of HuggingFace transformers' Conv1D (GPT-2 and relatives): an FP8 linear
    layer whose weight Parameter is stored transposed, [in_features, out_features], so that
    checkpoints, Parameters and optimizers stay as they were. Made by convert_to_fp8 only. (nf
    and nx, Conv1D's names for out_features and in_features, are kept.) Not a torch.nn.Linear,
    as transformers' Conv1D is not: code that takes an nn.Linear's weight as [out, in] (peft's
    LoRA merge) must not take it for one. A converted layer is also an instance of its
    original class (conv1d_classes), as code dispatching on transformers' Conv1D expects."""

    _supports_tensor_parallel = False  # (the styles would shard the transposed weight)

    def __init__(self, *args, **kwargs):
        raise TypeError("transformer_fp8.Conv1D is made by convert_to_fp8 from transformers' "
                        "Conv1D; build that one, or a transformer_fp8.Linear")

    def weight_nk(self, routed: bool = False) -> torch.Tensor:
        return self.weight.t()

    def fp8_weights(self) -> list[torch.Tensor]:
        return [self.weight.t()]  # (as every module's: [out_features, in_features])

    def _high_precision(self, inp: torch.Tensor, linear=None) -> torch.Tensor:
        if linear is not None:
            return super()._high_precision(inp, linear)
        # transformers' Conv1D.forward, operation for operation.
        out_shape = inp.shape[:-1] + (self.out_features,)
        flat = inp.reshape(-1, inp.shape[-1])
        out = flat @ self.weight if self.bias is None else torch.addmm(self.bias, flat,
                                                                       self.weight)
        return out.view(out_shape)

    def reset_parameters(self) -> None:
        # transformers' Conv1D initialisation: normal(std=0.02) weight, zero bias.
        torch.nn.init.normal_(self.weight, std=0.02)
        if self.bias is not None:
            torch.nn.init.zeros_(self.bias)
        if hasattr(self, "fp8_recipe_fields"):
            self.reset_fp8_state()

    def extra_repr(self) -> str:
        return f"nf={self.out_features}, nx={self.in_features}, fp8=True"


class _Conv1DClasses:
    """Per class of converted layer (transformers' Conv1D), the FP8 Conv1D that is an instance
    of that class too: code that dispatches on transformers' class (peft's LoRA, transformers'
    _init_weights) takes it for what it is. Attributes named "<module>:<qualname>" (dots as
    "/"), made on first use, so that pickle finds them by name as it finds a class."""

    def for_class(self, original: type) -> type:
        key = f"{original.__module__}:{original.__qualname__}".replace(".", "/")
        cls = self.__dict__.get(key)
        if cls is None:
            cls = type("Conv1D", (Conv1D, original),
                       {"__module__": __name__, "__qualname__": f"conv1d_classes.{key}",
                        "__doc__": Conv1D.__doc__})
            self.__dict__[key] = cls
        return cls

    def __getattr__(self, key: str) -> type:  # (unpickling: the class of a pickled layer)
        module_name, _, qualname = key.replace("/", ".").partition(":")
        if not qualname:
            raise AttributeError(key)
        original = importlib.import_module(module_name)
        for part in qualname.split("."):
            original = getattr(original, part)
        return self.for_class(original)

    def __reduce__(self):
        return "conv1d_classes"  # (pickled by name, as a module-level object)


conv1d_classes = _Conv1DClasses()


def _is_transformers_conv1d(module: torch.nn.Module) -> bool:
    """transformers.pytorch_utils.Conv1D, recognised by shape (no import of transformers):
    y = x @ weight + bias with weight [nx, nf]."""
    weight = getattr(module, "weight", None)
    return (type(module).__name__ == "Conv1D" and isinstance(weight, torch.nn.Parameter)
            and weight.dim() == 2 and tuple(weight.shape) == (getattr(module, "nx", None),
                                                              getattr(module, "nf", None)))


# peft's LoRA adapters (lora_A / lora_B hold an nn.Linear per adapter): small, trained from
# zero (lora_B), they stay in high precision over their FP8 base layer.
_ADAPTER_CONTAINERS = frozenset({"lora_A", "lora_B"})


def _is_adapter(name: str) -> bool:
    return not _ADAPTER_CONTAINERS.isdisjoint(name.split("."))


def default_filter(module: torch.nn.Linear, name: str) -> bool:
    """convert_to_fp8's choice without a filter_fn: sizes that are multiples of 16, not a
    LoRA adapter. A filter_fn of one's own replaces it; compose with it to keep its rules."""
    return (module.in_features % ALIGN == 0 and module.out_features % ALIGN == 0
            and not _is_adapter(name))


@dataclass
class ConversionSummary:
    """What convert_to_fp8 did: the qualified names converted, and those skipped with why."""

    converted: list
    skipped: dict  # name -> reason
    # Modules whose matrix products are not torch.nn.Linear layers (transformers' fused MoE
    # experts, 3-D weights): name -> what they hold. They stay in high precision.
    not_linear: dict = field(default_factory=dict)

    def __str__(self) -> str:
        total = len(self.converted) + len(self.skipped)
        lines = [f"convert_to_fp8: converted {len(self.converted)} of {total} linear layers"]
        lines += [f"  skipped {name or '(the module itself)'}: {reason}"
                  for name, reason in self.skipped.items()]
        lines += [f"  not converted {name or '(the module itself)'}: {what}"
                  for name, what in self.not_linear.items()]
        return "\n".join(lines)


def convert_to_fp8(module: torch.nn.Module, filter_fn=None,
                   recipe: Optional[Recipe] = None, return_summary: bool = False,
                   fp8_all_gather: bool = False):
    """Turn, in place, every torch.nn.Linear in ``module`` into a transformer_fp8.Linear, and
    every HuggingFace transformers Conv1D (GPT-2's transposed linear layer) into a
    transformer_fp8.Conv1D.

    The layers stay the same objects (their class changes and they gain the FP8 state), so
    Parameters, hooks, attributes and shared uses are all kept, and optimizers and DDP see no
    change. Subclasses of nn.Linear and of Conv1D are left alone (they may use their weight
    their own way, as nn.MultiheadAttention's out_proj does). filter_fn(layer, name) ->
    bool chooses which layers; by default (default_filter) those whose in_features and
    out_features are multiples of 16, except peft's LoRA adapters (lora_A / lora_B: high
    precision over their converted base layer). A filter_fn replaces those rules: `lambda
    layer, name: name != "lm_head" and default_filter(layer, name)` keeps them. recipe: the
    recipe the layers will train with, so that their FP8 state has its final shapes from the
    start (see Linear); the module's FP8 layers that were FP8 already
    (converted before, Transformer Engine's modules) are sized for it too. fp8_all_gather:
    under FSDP2's fully_shard the converted Linear layers' weights are all-gathered in FP8
    (modules/fsdp/all_gather.py; their weight Parameters become ShardedWeight, the same
    objects); call it before fully_shard. Conv1D weights, stored transposed, and weights a
    module that is not an FP8 layer holds too (an lm_head tied to the embedding) stay plain
    Parameters, gathered in high precision (with a warning).

    Returns ``module``, or with return_summary=True a ConversionSummary. Layers left in high
    precision are reported in one warning, with the reason for each.
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"convert_to_fp8: module must be a torch.nn.Module, got "
                        f"{type(module).__name__}")
    if filter_fn is not None and not callable(filter_fn):
        raise TypeError(f"convert_to_fp8: filter_fn must be None or a callable (layer, name) -> "
                        f"bool, got {type(filter_fn).__name__}")
    for flag, value in (("fp8_all_gather", fp8_all_gather), ("return_summary", return_summary)):
        if not isinstance(value, bool):
            raise TypeError(f"convert_to_fp8: {flag} must be True or False, got {value!r}")
    filter_fn = filter_fn or default_filter
    if recipe is None:
        recipe = model_init.init_recipe()  # from quantized_model_init, if any
    history_len = history_len_for(recipe)
    summary = ConversionSummary([], {})
    for name, child in module.named_modules():
        if hasattr(child, "prepare_fp8_recipe"):
            # An FP8 layer already (converted before, or built as one): sized for the recipe too
            if recipe is not None:
                child.prepare_fp8_recipe(recipe)
            if isinstance(child, LinearLayer):
                summary.converted.append(name)  # converted before
            continue
        if _is_transformers_conv1d(child):
            if type(child).__bases__ != (torch.nn.Module,):
                # transformers' Conv1D derives from nn.Module alone; a subclass may override
                # forward, which the FP8 Conv1D's would replace.
                summary.skipped[name] = (f"{type(child).__qualname__} derives from "
                                         f"{type(child).__bases__[0].__qualname__}, not "
                                         "torch.nn.Module alone as transformers' Conv1D does: a "
                                         "subclass may compute its own way")
                continue
            child.in_features, child.out_features = child.nx, child.nf  # as Linear names them
            new_class = conv1d_classes.for_class(type(child))
        elif type(child) is torch.nn.Linear:
            new_class = Linear
        else:
            if isinstance(child, torch.nn.Linear) and _is_fully_sharded(child):
                summary.skipped[name] = ("sharded by fully_shard already: convert the model "
                                         "before fully_shard")
            elif isinstance(child, torch.nn.Linear):
                summary.skipped[name] = (f"{type(child).__name__} is a subclass of "
                                         "torch.nn.Linear, which may use its weight its own way")
            else:
                stacked = _stacked_weights(child)
                if stacked:
                    summary.not_linear[name] = stacked
            continue
        chosen = filter_fn(child, name)
        if type(chosen).__module__ == "numpy" and getattr(chosen, "dtype", None) is not None \
                and chosen.dtype.kind == "b":  # (a numpy bool)
            chosen = bool(chosen)
        if not isinstance(chosen, bool):  # (a truthy "no" converted the layer)
            raise TypeError(f"convert_to_fp8: filter_fn must return True or False, got "
                            f"{chosen!r} for {name!r}")
        if not chosen:
            summary.skipped[name] = _skip_reason(child, filter_fn, name)
            if issubclass(new_class, Conv1D):
                del child.in_features, child.out_features  # leave it as it was
            continue
        child.__class__ = new_class
        child._register_fp8_state(child.weight.device, history_len)
        child._init_converted()
        if recipe is not None:
            child.prepare_fp8_recipe(recipe)
        summary.converted.append(name)
    if fp8_all_gather:
        tied = held_outside_fp8_modules(module)
        for name in summary.converted:
            layer = module.get_submodule(name)
            if type(layer) is Linear and id(layer.weight) in tied:
                warnings.warn(f"convert_to_fp8: the weight of {name} is tied to "
                              f"{tied[id(layer.weight)]}'s: all-gathered in high precision",
                              stacklevel=2)
            elif type(layer) is Linear:
                enable_fp8_all_gather(layer)
            else:
                warnings.warn(f"convert_to_fp8: the weight of {name or '(the module itself)'} "
                              f"({type(layer).__name__}) is all-gathered in high precision",
                              stacklevel=2)
    if summary.skipped or summary.not_linear or not summary.converted:
        warnings.warn(str(summary), stacklevel=2)
    return summary if return_summary else module


def _stacked_weights(module: torch.nn.Module) -> Optional[str]:
    """What a module that multiplies by weights stacked in 3-D Parameters of its own holds
    (transformers' fused MoE experts, MixtralExperts' gate_up_proj [experts, 2 * ffn, hidden]),
    or None. A stack of several matrices: more than one along the first dimension, each more
    than a row or a column (a ViT's cls_token [1, 1, d] and position embeddings [1, n, d] are
    no such stack). Convolutions, whose weights are 3-D and more too, are not matrix products
    of this kind and are not reported."""
    if isinstance(module, torch.nn.modules.conv._ConvNd):
        return None
    stacked = [f"{n} {list(p.shape)}" for n, p in module.named_parameters(recurse=False)
               if p.dim() >= 3 and p.shape[0] > 1 and min(p.shape[-2:]) > 1
               and p.is_floating_point()]
    if not stacked:
        return None
    return (f"{type(module).__name__} holds {', '.join(stacked)}: its matrix products are not "
            "torch.nn.Linear layers (fused MoE experts) and stay in high precision; "
            "transformer_fp8.GroupedLinear runs experts in FP8")


def _is_fully_sharded(layer) -> bool:
    """Whether FSDP2's fully_shard made ``layer``'s class (an FSDP<class> subclass)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # (a torch without torch.distributed)
        return False
    return isinstance(layer, FSDPModule)


def _skip_reason(layer, filter_fn, name: str) -> str:
    if filter_fn is default_filter and _is_adapter(name):
        return "a LoRA adapter (peft's lora_A / lora_B): trained in high precision"
    if filter_fn is default_filter:
        return (f"in_features {layer.in_features} and out_features {layer.out_features} must be "
                f"multiples of {ALIGN} for FP8 GEMMs")
    return "filter_fn returned False"
