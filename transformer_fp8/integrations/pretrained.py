"""The FP8 state of a HuggingFace model across save_pretrained / from_pretrained.

``model.save_pretrained(path)`` of a converted model writes the FP8 state with the weights (its
buffers are plain tensors). ``from_pretrained(path)`` builds the model with torch.nn.Linear
layers, which have no FP8 state: it reports every ``fp8_*`` key as unexpected and drops it.
After converting the loaded model, ``load_fp8_state(model, path)`` puts the saved FP8 state
back, so a resumed run continues with the scales it had rather than fresh ones:

    model.save_pretrained(path)                       # weights + FP8 state
    model = AutoModelForCausalLM.from_pretrained(path)
    tfp8.convert_to_fp8(model, recipe=recipe)
    tfp8.load_fp8_state(model, path)                   # histories and scales as saved
"""
from __future__ import annotations

import json
import os
from typing import Optional, Union

import torch

from ..quantization.state import Fp8State
from ..quantization.state_layout import FP8_STATE_KEYS
from ..quantization.state_validation import fp8_state_error


def _is_fp8_key(key: str) -> bool:
    return key.rsplit(".", 1)[-1] in FP8_STATE_KEYS


def _safetensors_files(path: str) -> list:
    """The safetensors files from_pretrained reads in ``path``: those its index names
    (model.safetensors.index.json), else model.safetensors; else the one *.safetensors file
    there. Other files beside them (another model's, as accelerate's save_state writes) are not
    read; several with no index or model.safetensors are refused."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            return sorted(set(json.load(f)["weight_map"].values()))
    if os.path.exists(os.path.join(path, "model.safetensors")):
        return ["model.safetensors"]
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if len(files) > 1:
        raise ValueError(f"load_fp8_state: {path!r} holds several safetensors files {files} "
                         "and neither model.safetensors nor model.safetensors.index.json: "
                         "which one is the model's is not known; pass its state_dict")
    return files


def _read_checkpoint_dir(path: str) -> dict:
    """The FP8 tensors of a save_pretrained directory (safetensors, sharded or not, or
    pytorch_model.bin): from the files from_pretrained reads."""
    files = _safetensors_files(path)
    if files:
        from safetensors import safe_open

        state = {}
        for name in files:
            with safe_open(os.path.join(path, name), framework="pt") as f:
                state.update({k: f.get_tensor(k) for k in f.keys() if _is_fp8_key(k)})
        return state
    index = os.path.join(path, "pytorch_model.bin.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.exists(os.path.join(path, "pytorch_model.bin")):
        files = ["pytorch_model.bin"]
    else:
        raise FileNotFoundError(f"load_fp8_state: {path!r} holds no *.safetensors or "
                                "pytorch_model.bin checkpoint")
    state = {}
    for name in files:
        shard = torch.load(os.path.join(path, name), map_location="cpu", weights_only=True)
        state.update({k: v for k, v in shard.items() if _is_fp8_key(k)})
    return state


def load_fp8_state(model: torch.nn.Module, checkpoint: Union[str, os.PathLike, dict]) -> list:
    """Load the FP8 state saved with ``model`` (a save_pretrained directory or a state_dict)
    into its FP8 layers, which must already be converted. Every FP8 layer of the model must
    find its state in the checkpoint, and every FP8 key of the checkpoint must belong to an FP8
    layer of the model (the layer names of a HuggingFace model, with or without its base-model
    prefix); the state is validated as load_state_dict validates it. Returns the names of the
    layers loaded."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"load_fp8_state: model must be a torch.nn.Module, got "
                        f"{type(model).__name__}")
    if isinstance(checkpoint, (str, os.PathLike)):
        state = _read_checkpoint_dir(os.fspath(checkpoint))
    elif isinstance(checkpoint, dict):
        state = {k: v for k, v in checkpoint.items() if _is_fp8_key(k)}
    else:
        raise TypeError("load_fp8_state: 'checkpoint' must be a directory path or a state_dict, "
                        f"got {type(checkpoint).__name__}")
    # (Every name of a layer the model holds at several places: its state_dict has each.)
    layers = {name: m for name, m in model.named_modules(remove_duplicate=False)
              if isinstance(m, Fp8State)}
    if not layers:
        raise ValueError("load_fp8_state: the model has no FP8 layers; convert it first "
                         "(transformer_fp8.convert_to_fp8(model, recipe=...))")
    prefixes = ["", getattr(model, "base_model_prefix", "") or ""]
    found = {}  # layer name -> its FP8 state_dict keys in the checkpoint
    for name, layer in layers.items():
        for prefix in prefixes:
            # (the model itself may be the FP8 layer: its name is "")
            keys = {k: ".".join(part for part in (prefix, name, k) if part)
                    for k in FP8_STATE_KEYS}
            if all(full in state for full in keys.values()):
                found[name] = keys
                break
        else:
            raise KeyError(f"load_fp8_state: no FP8 state for layer {name!r} in the checkpoint "
                           f"(looked for {name}.fp8_fwd_scale and the other FP8 keys)")
    unused = sorted(set(state) - {full for keys in found.values() for full in keys.values()})
    if unused:
        raise KeyError(f"load_fp8_state: the checkpoint has FP8 state for layers the model does "
                       f"not have: {unused[:5]}{' ...' if len(unused) > 5 else ''}")
    for name, keys in found.items():  # every layer's state checked before any is loaded
        error = _state_error(layers[name], {full: state[full] for full in keys.values()},
                             keys["fp8_fwd_scale"][:-len("fp8_fwd_scale")])
        if error is not None:
            raise RuntimeError(f"load_fp8_state: {error}; no layer was loaded")
    for name, keys in found.items():
        # Only FP8 keys are given: the layer's parameters stay as they are (strict=False).
        layers[name].load_state_dict({k: state[full] for k, full in keys.items()}, strict=False)
    return list(found)


def _state_error(layer, state: dict, prefix: str) -> Optional[str]:
    """Why ``layer`` would refuse its FP8 state (the keys of ``state`` start with ``prefix``):
    a shape it cannot take (a history may have another length), or a value load_state_dict
    refuses; None when it loads."""
    for key in FP8_STATE_KEYS:
        value, own = state[prefix + key], getattr(layer, key)
        if not isinstance(value, torch.Tensor):
            return f"{prefix}{key} is a {type(value).__name__}, not a tensor"
        shape_ok = (value.dim() == 2 and value.shape[1] == own.shape[1]
                    if key.endswith("amax_history") else value.shape == own.shape)
        if not shape_ok:
            return (f"{prefix}{key} has shape {list(value.shape)}, the layer's is "
                    f"{list(own.shape)}")
    return fp8_state_error(layer, state, prefix)
