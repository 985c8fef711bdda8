"""Loading Transformer Engine's checkpoints: the FP8 state it keeps under ``_extra_state``.

A Transformer Engine module saves its delayed-scaling state as one ``<prefix>_extra_state``
entry: a pickled dict (scale_fwd, amax_history_fwd, scale_bwd, amax_history_bwd, recipe, ...)
stored in a uint8 tensor, or an empty tensor when it never ran in FP8. Its layout per GEMM g:
forward columns 3g (input), 3g+1 (weight), 3g+2 (output, unused here); backward columns 2g
(grad_output), 2g+1 (grad_input, unused here). Ours keeps 2g, 2g+1 forward and g backward
(quantization/state.py). Two modules placed their GEMMs' slots otherwise, depending on the
Transformer Engine version that wrote the checkpoint (_te_layouts): LayerNormMLP's
grad_outputs, and GroupedLinear before 2.3 (slots by role, not by GEMM). Version 1.x writes no
recipe (and scale_inv, which 2.x dropped); among the 2.x layouts the one whose slots hold the
recorded columns is taken (a slot no GEMM used keeps scale 1 and an empty history).

The pickle is read with an unpickler that builds tensors (through torch.load with
weights_only=True) and dicts only: any class or function it names (Transformer Engine's recipe,
a user's amax_compute_algo) becomes an inert record of its name and fields; nothing is imported
or called. Transformer Engine up to 1.5 saved its state with the last step's update still owed
(_pending_update): the module runs it at its next FP8 forward, before the first cast.
Transformer Engine need not be installed.
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

from ..quantization import adoption_undo, amax_step
from ..quantization.scaling_state import note_loaded_row
from ..quantization.recipe import MAX_MARGIN
from ..quantization.state_validation import fp8_state_error
from ..quantization.transforms import outside_inference_mode

EXTRA_STATE = "_extra_state"
PENDING_UPDATE = "pending_update"  # (not a tensor: see _pending_update)
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
        # Anything else (Transformer Engine's classes, a user's amax_compute_algo function in
        # the recipe) is an inert record of its name and arguments: nothing is imported or
        # called. Only the tensors above are taken from a payload.
        return _record_class(module, name)


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
        state = torch.load(value, weights_only=True, map_location="cpu")
    else:
        raise TypeError(f"an _extra_state entry must be a uint8 tensor, got "
                        f"{type(value).__name__}")
    if not isinstance(value, io.BytesIO):
        state = _ExtraStateUnpickler(io.BytesIO(data)).load()
    if state is None or (isinstance(state, dict) and not state):
        # (Transformer Engine 2.0-2.3 pickle None for a module that never ran in FP8)
        return None
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
    if not 0 <= margin <= MAX_MARGIN or length < 1:
        return None  # (a recipe ours cannot be: its scales load without the record)
    return [margin, fmt, length, algo]


def prepare_extra_state(module, value, where: str) -> tuple:
    """What a Transformer Engine ``_extra_state`` entry gives ``module``'s FP8 state
    (Fp8StateMixin), read before anything of the module is loaded: (tensors, None) to load
    with apply_extra_state; (None, error) for a state that maps but is corrupt (a zero,
    negative or non-finite scale, a negative amax), refused as ours are; (None, None) for an
    empty entry, or one that does not map (ignored with a warning: the module starts with a
    fresh FP8 state)."""
    try:
        state = read_extra_state(value)
    except Exception as error:  # noqa: BLE001 (a payload we cannot read is reported, not fatal)
        warnings.warn(f"{where}: Transformer Engine's FP8 state could not be read ({error}); "
                      "ignored, the module starts with a fresh FP8 state", stacklevel=4)
        return None, None
    if state is None:
        return None, None
    tensors, reason = _delayed_state_of(module, state)
    if tensors is None and _stateless_recipe(state):
        return None, None  # (nothing to load: that recipe keeps no state between steps)
    if tensors is None:
        warnings.warn(f"{where}: Transformer Engine's FP8 state ignored ({reason}); the "
                      "module starts with a fresh FP8 state", stacklevel=4)
        return None, None
    error = fp8_state_error(module, {k: v for k, v in tensors.items() if k != PENDING_UPDATE},
                            "")
    if error is not None:
        return None, f"{where}: Transformer Engine's FP8 state ({EXTRA_STATE}) read as {error}"
    return tensors, None


# Transformer Engine's recipes that keep no scaling state between steps: their modules save the
# recipe and nothing to load.
_STATELESS_RECIPES = ("Float8CurrentScaling", "Float8BlockScaling", "MXFP8BlockScaling",
                      "NVFP4BlockScaling")


def _stateless_recipe(state: dict) -> bool:
    recipe = state.get("recipe")
    return (isinstance(recipe, TeRecord) and recipe.te_class.rsplit(".", 1)[-1] in
            _STATELESS_RECIPES and not any(k in state for k in _STATE_KEYS))


def _delayed_state_of(module, state: dict) -> tuple:
    """(our FP8 state tensors by buffer name, plus "fp8_recipe_fields" where the recipe is
    known; None) or (None, why the state does not map)."""
    if not all(isinstance(state.get(k), torch.Tensor) for k in _STATE_KEYS):
        recipe = state.get("recipe")
        name = recipe.te_class.rsplit(".", 1)[-1] if isinstance(recipe, TeRecord) else "?"
        return None, f"no delayed-scaling state in it (recipe {name})"
    gemms = module._num_gemms
    scale_fwd, history_fwd = state["scale_fwd"].float(), state["amax_history_fwd"].float()
    scale_bwd, history_bwd = state["scale_bwd"].float(), state["amax_history_bwd"].float()
    if (scale_fwd.shape != (3 * gemms,) or scale_bwd.shape != (2 * gemms,)
            or history_fwd.dim() != 2 or history_fwd.shape[1] != 3 * gemms
            or history_bwd.dim() != 2 or history_bwd.shape[1] != 2 * gemms):
        return None, (f"its layout (forward scales {tuple(scale_fwd.shape)}, backward "
                      f"{tuple(scale_bwd.shape)}) is not that of {gemms} GEMM(s)")
    layouts = _te_layouts(module, gemms, te_1x="recipe" not in state)
    layout, reason = _pick_layout(layouts, scale_fwd, history_fwd, scale_bwd, history_bwd)
    if layout is None:
        return None, reason
    fwd_columns, bwd_columns = layout
    tensors = {"fp8_fwd_amax_history": history_fwd[:, fwd_columns].contiguous(),
               "fp8_bwd_amax_history": history_bwd[:, bwd_columns].contiguous(),
               "fp8_fwd_scale": scale_fwd[fwd_columns], "fp8_bwd_scale": scale_bwd[bwd_columns]}
    for role in ("fwd", "bwd"):
        tensors[f"fp8_{role}_scale_inv"] = tensors[f"fp8_{role}_scale"].reciprocal()
    fields = _recipe_fields(state.get("recipe"))
    if fields is not None:
        tensors["fp8_recipe_fields"] = torch.tensor(fields, dtype=torch.int64)
    tensors[PENDING_UPDATE] = _pending_update(state)
    return tensors, None


def _pending_update(state: dict) -> tuple:
    """The roles whose delayed-scaling update the checkpoint still owes. Transformer Engine up
    to 1.5 updated lazily: the forward state at the next forward (when the last one trained,
    its fp8_meta flag update_amax_and_scale_fwd), the backward state at the start of every
    backward. So its checkpoints hold the last step's amaxes in row 0 and scales not yet made
    from them; from 1.6 on (which has no such flag) the update runs at the end of the step."""
    extra = state.get("extra_fp8_variables")
    if not isinstance(extra, dict) or "update_amax_and_scale_fwd" not in extra:
        return ()
    return ("fwd", "bwd") if extra["update_amax_and_scale_fwd"] is True else ("bwd",)


def apply_extra_state(module, tensors: dict) -> None:
    """Load what prepare_extra_state gave into the module's FP8 state."""
    device = module.fp8_fwd_scale.device
    with torch.no_grad(), outside_inference_mode():
        for name in ("fp8_fwd_amax_history", "fp8_bwd_amax_history"):
            getattr(module, name).data = tensors[name].to(device)
        for name in ("fp8_fwd_scale", "fp8_fwd_scale_inv", "fp8_bwd_scale", "fp8_bwd_scale_inv"):
            getattr(module, name).copy_(tensors[name])
        if "fp8_recipe_fields" in tensors:
            module.fp8_recipe_fields.copy_(tensors["fp8_recipe_fields"])
        else:  # (no recipe read: Transformer Engine 1.x, or one outside ours) unknown, so
            # nothing is rescaled; not the recipe the module was built for, which the state
            # was reset to before this load
            module.fp8_recipe_fields.fill_(-1)
    module.note_saved_recipe()
    adoption_undo.forget(module)  # (a failed step leaves the loaded state, not the one before)
    module._bind_scaling_states()  # (histories of another length)
    for state in module._scaling_states:  # (as state_loading.took_loaded_state)
        amax_step.AmaxStep.leave(state)
        if state.role == "bwd":
            note_loaded_row(state)  # (see scaling_state.LOADED_ROWS)
    # The update the checkpoint owes runs at the next FP8 forward, under its recipe, before
    # anything is cast (quantization/owed_update.py), as Transformer Engine <= 1.5 did.
    module._te_pending_update = tensors.get(PENDING_UPDATE, ())
    module._recipe_code = None  # adopted again from the recipe of the next FP8 forward
    module._await_recipe()  # (or of the next fp8_autocast entered: as state_loading.py)
    module._weight_cache = [None] * module._num_gemms
    module._delayed_cast_cache = None
    module._fused_step_cache = None


def _te_layouts(module, gemms: int, te_1x: bool) -> list:
    """The columns of Transformer Engine's state that hold ours, as (forward columns: each
    GEMM's input and weight; backward columns: each GEMM's grad_output), one pair for each
    layout the Transformer Engine versions that write this kind of state (1.x or 2.x) used."""
    # "by_gemm" unless the module names another (LayerNormMLP, GroupedLinear: _TE_STATE_LAYOUT)
    layout = getattr(module, "_TE_STATE_LAYOUT", "by_gemm")
    by_gemm = ([c for g in range(gemms) for c in (3 * g, 3 * g + 1)],
               [2 * g for g in range(gemms)])
    if layout == "layernorm_mlp":  # our GEMM 0 is fc1, GEMM 1 fc2
        # fc1's and fc2's grad_output: GRAD_OUTPUT2 and GRAD_OUTPUT1 in 1.x, GRAD_INPUT1 and
        # GRAD_OUTPUT1 in 2.0-2.3, GRAD_OUTPUT1 and GRAD_OUTPUT2 from 2.4.
        return [(by_gemm[0], [2, 0])] if te_1x else [(by_gemm[0], [1, 0]), by_gemm]
    if layout == "grouped_linear":
        # Up to 2.2, by role: every input, then every weight; grad_outputs 0..n-1. From 2.3,
        # by GEMM.
        by_role = ([c for g in range(gemms) for c in (g, gemms + g)], list(range(gemms)))
        return [by_role] if te_1x else [by_role, by_gemm]
    return [by_gemm]


def _used_columns(scale: torch.Tensor, history: torch.Tensor) -> set:
    """The columns some GEMM recorded into: a non-zero (or NaN) amax, or a scale moved from 1."""
    used = (history != 0).any(dim=0) | (scale != 1)
    return set(used.nonzero().flatten().tolist())


def _pick_layout(layouts, scale_fwd, history_fwd, scale_bwd, history_bwd):
    """(layout, None), or (None, why no layout is certain). A layout fits when every column
    that a GEMM recorded into, among those some layout reads, is one of its own; several that
    fit must read the same values."""
    if len(layouts) == 1:
        return layouts[0], None
    used_fwd, used_bwd = _used_columns(scale_fwd, history_fwd), _used_columns(scale_bwd,
                                                                              history_bwd)
    read_fwd = set().union(*(set(f) for f, _ in layouts))
    read_bwd = set().union(*(set(b) for _, b in layouts))
    fitting = [(f, b) for f, b in layouts
               if used_fwd & read_fwd <= set(f) and used_bwd & read_bwd <= set(b)]
    if not fitting:
        return None, ("its recorded slots fit no layout of this module's Transformer Engine "
                      "versions")

    def values(layout):
        f, b = layout
        return (scale_fwd[f], history_fwd[:, f], scale_bwd[b], history_bwd[:, b])

    first = values(fitting[0])
    for other in fitting[1:]:
        if not all(torch.equal(x, y) for x, y in zip(first, values(other))):
            return None, ("which Transformer Engine version wrote it cannot be told from its "
                          "recorded slots")
    return fitting[0], None


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
        try:
            state = read_extra_state(state_dict[key])
        except Exception as error:  # noqa: BLE001 (ignored either way; said why)
            warnings.warn(f"{where}: Transformer Engine's extra state '{key}' could not be read "
                          f"({error}); ignored", stacklevel=4)
            continue
        recipe = state.get("recipe") if state is not None else None
        if isinstance(recipe, TeRecord) and recipe.field("fp8_dpa") is True:
            # Attention ran in FP8 in Transformer Engine; here it runs in high precision. (A
            # state written without fp8_dpa is the FP8 metadata of a module that ran in high
            # precision there too: nothing to say.)
            warnings.warn(f"{where}: Transformer Engine's extra state '{key}' ignored: it was "
                          "saved with fp8_dpa=True (FP8 attention); attention runs in high "
                          "precision here and keeps no FP8 state", stacklevel=4)
