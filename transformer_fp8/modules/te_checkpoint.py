"""Loading Transformer Engine's checkpoints: the FP8 state it keeps under ``_extra_state``.

A Transformer Engine module saves its delayed-scaling state as one ``<prefix>_extra_state``
entry: a pickled dict (scale_fwd, amax_history_fwd, scale_bwd, amax_history_bwd, recipe, ...)
stored in a uint8 tensor, or an empty tensor when it never ran in FP8. Its layout per GEMM g:
forward columns 3g (input), 3g+1 (weight), 3g+2 (output, unused here); backward columns 2g
(grad_output), 2g+1 (grad_input, unused here). Ours keeps 2g, 2g+1 forward and g backward
(quantization/state.py), so the columns map one to one.

The pickle is read with an unpickler that builds tensors (through torch.load with
weights_only=True) and dicts only: Transformer Engine's own classes (the recipe) become inert
records of their fields, and nothing else is called. Transformer Engine need not be installed.
Whatever does not map (another recipe's state, a layout with another number of GEMMs, a payload
this reader does not understand) is ignored with a warning, and the module keeps a fresh FP8
state, as after loading a high-precision checkpoint.
"""
from __future__ import annotations

import collections
import io
import pickle
import warnings
from typing import Optional

import torch

EXTRA_STATE = "_extra_state"
_STATE_KEYS = ("scale_fwd", "amax_history_fwd", "scale_bwd", "amax_history_bwd")


class TeRecord:
    """An object of a Transformer Engine class, as its pickle describes it: the class name,
    the constructor arguments and the state (fields)."""

    te_class = "?"

    def __new__(cls, *args, **kwargs):
        record = object.__new__(cls)
        record.args, record.state = args, {}
        return record

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        if isinstance(state, tuple) and len(state) == 2:  # (dict state, slots state)
            state = {**(state[0] or {}), **(state[1] or {})}
        self.state = dict(state) if isinstance(state, dict) else {"value": state}

    def field(self, name, default=None):
        return self.state.get(name, default)


_RECORD_CLASSES: dict = {}


def _record_class(module: str, name: str):
    key = f"{module}.{name}"
    if key not in _RECORD_CLASSES:
        _RECORD_CLASSES[key] = type(name, (TeRecord,), {"te_class": key})
    return _RECORD_CLASSES[key]


def _tensor_from_bytes(data: bytes):
    return torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")


class _ExtraStateUnpickler(pickle.Unpickler):
    _ALLOWED = {("torch._utils", "_rebuild_tensor_v2"): torch._utils._rebuild_tensor_v2,
                ("torch.storage", "_load_from_bytes"): _tensor_from_bytes,
                ("collections", "OrderedDict"): collections.OrderedDict}

    def find_class(self, module, name):
        if (module, name) in self._ALLOWED:
            return self._ALLOWED[(module, name)]
        if module == "transformer_engine" or module.startswith("transformer_engine."):
            return _record_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in Transformer Engine's "
                                     "extra state")


def read_extra_state(value) -> Optional[dict]:
    """The dict a Transformer Engine ``_extra_state`` entry holds; None for an empty one."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        if value.numel() == 0:
            return None
        data = value.detach().cpu().contiguous().numpy().tobytes()
    elif isinstance(value, io.BytesIO):  # Transformer Engine's early format: torch.save bytes
        value.seek(0)
        return torch.load(value, weights_only=True, map_location="cpu")
    else:
        raise TypeError(f"an _extra_state entry must be a uint8 tensor, got "
                        f"{type(value).__name__}")
    state = _ExtraStateUnpickler(io.BytesIO(data)).load()
    if not isinstance(state, dict):
        raise TypeError(f"the _extra_state holds a {type(state).__name__}, not a dict")
    return state


def _format_code(fmt) -> Optional[int]:
    """Our recipe-field code of a Transformer Engine Format record (E4M3 0, E5M2 1,
    HYBRID 2), from its (max_fwd, max_bwd) value."""
    helper = fmt.args[0] if isinstance(fmt, TeRecord) and fmt.args else None
    maxima = tuple(helper.args) if isinstance(helper, TeRecord) else None
    return {(448, 448): 0, (57344, 57344): 1, (448, 57344): 2}.get(maxima)


def _recipe_fields(recipe) -> Optional[list]:
    """[margin, format, amax_history_len, algo] of a Transformer Engine DelayedScaling record
    (algo -1 when not one of the named ones), or None."""
    if not isinstance(recipe, TeRecord) or not recipe.te_class.endswith(".DelayedScaling"):
        return None
    fmt = _format_code(recipe.field("fp8_format"))
    algo = {"max": 0, "most_recent": 1}.get(recipe.field("amax_compute_algo", "max"), 2)
    margin, length = recipe.field("margin", 0), recipe.field("amax_history_len", 1024)
    if fmt is None or not isinstance(margin, int) or not isinstance(length, int):
        return None
    return [margin, fmt, length, algo]


def load_extra_state(module, value, where: str) -> None:
    """Load a Transformer Engine ``_extra_state`` into ``module``'s FP8 state (Fp8StateMixin)
    where it maps; warn and leave the fresh state where it does not."""
    try:
        state = read_extra_state(value)
    except Exception as error:  # noqa: BLE001 (a payload we cannot read is reported, not fatal)
        warnings.warn(f"{where}: Transformer Engine's FP8 state could not be read ({error}); "
                      "ignored, the module starts with a fresh FP8 state", stacklevel=4)
        return
    if state is None:
        return
    reason = _load_delayed_state(module, state)
    if reason:
        warnings.warn(f"{where}: Transformer Engine's FP8 state ignored ({reason}); the "
                      "module starts with a fresh FP8 state", stacklevel=4)


def _load_delayed_state(module, state: dict) -> Optional[str]:
    """Copies the state into the module; returns why it could not, or None."""
    if not all(isinstance(state.get(k), torch.Tensor) for k in _STATE_KEYS):
        recipe = state.get("recipe")
        name = recipe.te_class.rsplit(".", 1)[-1] if isinstance(recipe, TeRecord) else "?"
        return f"no delayed-scaling state in it (recipe {name})"
    gemms = module._num_gemms
    scale_fwd, history_fwd = state["scale_fwd"].float(), state["amax_history_fwd"].float()
    scale_bwd, history_bwd = state["scale_bwd"].float(), state["amax_history_bwd"].float()
    if (scale_fwd.shape != (3 * gemms,) or scale_bwd.shape != (2 * gemms,)
            or history_fwd.dim() != 2 or history_fwd.shape[1] != 3 * gemms
            or history_bwd.dim() != 2 or history_bwd.shape[1] != 2 * gemms):
        return (f"its layout (forward scales {tuple(scale_fwd.shape)}, backward "
                f"{tuple(scale_bwd.shape)}) is not that of {gemms} GEMM(s)")
    fwd_columns = [c for g in range(gemms) for c in (3 * g, 3 * g + 1)]
    bwd_columns = [2 * g for g in range(gemms)]
    device = module.fp8_fwd_scale.device
    with torch.no_grad():
        for name, history in (("fp8_fwd_amax_history", history_fwd[:, fwd_columns]),
                              ("fp8_bwd_amax_history", history_bwd[:, bwd_columns])):
            getattr(module, name).data = history.to(device).contiguous()
        for prefix, scale in (("fp8_fwd", scale_fwd[fwd_columns]),
                              ("fp8_bwd", scale_bwd[bwd_columns])):
            getattr(module, prefix + "_scale").copy_(scale)
            getattr(module, prefix + "_scale_inv").copy_(scale.reciprocal())
        fields = _recipe_fields(state.get("recipe"))
        if fields is not None:
            module.fp8_recipe_fields.copy_(torch.tensor(fields, dtype=torch.int64))
    module._recipe_code = None  # adopted again from the recipe of the next FP8 forward
    module._weight_cache = [None] * gemms
    module._delayed_cast_cache = None
    module._fused_step_cache = None
    return None


def drop_extra_state(state_dict, prefix: str, unexpected_keys: list, where: str,
                     nested: tuple = ()) -> None:
    """For a module with no FP8 state (attention, norms): accept Transformer Engine's
    ``_extra_state`` entries (its own and those of the submodules named in ``nested``, such as
    an older checkpoint's fused_attention) and ignore them, with a warning if one is not
    empty (FP8 attention metadata: attention runs in high precision here)."""
    for key in [prefix + EXTRA_STATE] + [f"{prefix}{n}.{EXTRA_STATE}" for n in nested]:
        if key not in state_dict:
            continue
        if key in unexpected_keys:
            unexpected_keys.remove(key)
        value = state_dict[key]
        if isinstance(value, torch.Tensor) and value.numel() == 0 or value is None:
            continue
        warnings.warn(f"{where}: Transformer Engine's extra state '{key}' ignored (this module "
                      "runs in high precision and keeps no FP8 state)", stacklevel=4)
