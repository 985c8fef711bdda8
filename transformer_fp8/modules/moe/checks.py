"""Argument checks of the MoE permutation functions (moe/permutation.py, moe/chunk_sort.py):
errors that name the function, the argument, what was expected and what was given."""
from __future__ import annotations

import operator

import torch

from ...quantization.fp8_weight import Fp8Weight
from ..fsdp.gathered_weight import GatheredFp8Weight

MAP_TYPES = ("mask", "index")


def _fail(fn: str, message: str, error=ValueError):
    raise error(f"{fn}: {message}")


def _described(t) -> str:
    if isinstance(t, torch.Tensor):
        return f"a {t.dtype} tensor of shape {list(t.shape)} on {t.device}"
    return f"{type(t).__name__} {t!r}"


def _check_activation(fn: str, name: str, t, device=None) -> None:
    """A 2-D high-precision floating tensor (not FP8), on ``device`` when given."""
    if not isinstance(t, torch.Tensor):
        _fail(fn, f"{name} must be a torch.Tensor, got {_described(t)}", TypeError)
    if isinstance(t, (Fp8Weight, GatheredFp8Weight)) or t.dtype in (torch.float8_e4m3fn,
                                                                     torch.float8_e5m2):
        _fail(fn, f"{name} must be a high-precision tensor, got {type(t).__name__} holding "
              f"{getattr(t, '_fp8', t).dtype} data: this library has no FP8 activation tensor "
              "type (Transformer Engine's takes its Float8Tensor); permute the high-precision "
              "tensor, the FP8 GEMMs after it cast it", TypeError)
    if not t.is_floating_point():
        _fail(fn, f"{name} must be a floating-point tensor, got {_described(t)}", TypeError)
    if t.dim() != 2:
        _fail(fn, f"{name} must be 2-D [num_tokens, hidden_size], got {_described(t)}")
    if device is not None and t.device != device:
        _fail(fn, f"{name} must be on {device} (the input's device), got {_described(t)}")


def _check_int_tensor(fn: str, name: str, t, dims: int, device=None,
                      allow_bool: bool = False, shape_text: str = "") -> None:
    if not isinstance(t, torch.Tensor):
        _fail(fn, f"{name} must be a torch.Tensor, got {_described(t)}", TypeError)
    ok = t.dtype == torch.bool if allow_bool else False
    if not ok and (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool):
        kind = "a bool or integer" if allow_bool else "an integer"
        _fail(fn, f"{name} must be {kind} tensor, got {_described(t)}", TypeError)
    if t.dim() != dims:
        _fail(fn, f"{name} must be {dims}-D{shape_text}, got {_described(t)}")
    if device is not None and t.device != device:
        _fail(fn, f"{name} must be on {device} (the input's device), got {_described(t)}")


def _as_int(fn: str, name: str, value) -> int:
    if isinstance(value, bool):
        _fail(fn, f"{name} must be an int, got {value!r}", TypeError)
    try:
        return operator.index(value)
    except TypeError:
        _fail(fn, f"{name} must be an int, got {_described(value)}", TypeError)


def _check_values(fn: str, *checks) -> None:
    """Checks of tensor values, each ``(ok, message, cpu_message)``: ok a 0-d bool tensor, true
    when the values are fine; message what they must be; cpu_message a function saying it with
    what was given (it reads the values). Eager on the CPU, reading ok is free: a ValueError
    with cpu_message(). On a device, or while compiling, reading it would wait for the device:
    one torch._assert_async of them all instead, with the messages, which fails at the device's
    next synchronisation (on CUDA a device-side assert, as an index out of range in torch's own
    gathers) rather than letting the values through."""
    if checks[0][0].device.type == "cpu" and not torch.compiler.is_compiling():
        for ok, _, cpu_message in checks:
            if not bool(ok):
                _fail(fn, cpu_message())
        return
    ok = checks[0][0]
    for more, _, _ in checks[1:]:
        ok = ok & more
    torch._assert_async(ok, f"{fn}: " + "; ".join(message for _, message, _ in checks))


def _check_map_type(fn: str, map_type) -> None:
    if map_type not in MAP_TYPES:
        _fail(fn, f"map_type must be 'mask' or 'index', got {map_type!r}")


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for 16-bit inputs, their own dtype for float32 and float64."""
    return torch.promote_types(dtype, torch.float32)


# ---- values of the routing (read on the host only where a failed check is reported) ----

def _negative_ids(routing_map: torch.Tensor) -> str:
    bad = (routing_map < 0).nonzero()
    t, k = bad[0].tolist()
    return (f"{len(bad)} negative id(s), the first {routing_map[t, k].item()} at [{t}, {k}] "
            f"(token {t}, column {k})")


def _first_at(row_id_map: torch.Tensor, where: torch.Tensor) -> str:
    t, s = where.nonzero()[0].tolist()
    return f"{row_id_map[t, s].item()} at [{t}, {s}]"


def _shared_row(row_id_map: torch.Tensor) -> str:
    flat = row_id_map.reshape(-1)
    counts = torch.bincount(flat[flat >= 0].long())
    row = int(counts.argmax())
    slots = [divmod(i, row_id_map.shape[1]) for i in (flat == row).nonzero()[:, 0].tolist()]
    return f"row {row} named by slots {', '.join(f'[{t}, {s}]' for t, s in slots)}"


def _check_row_id_map(fn: str, row_id_map: torch.Tensor, inp: torch.Tensor, pos) -> None:
    """row_id_map's values: -1 or a row of inp, each row named once (as moe_permute makes it).
    Otherwise the slots naming rows past inp's end or values below -1, and the second slot
    naming a row, would be dropped without a word. pos: _rows_of's (a row named twice has one
    pos)."""
    lo, hi = torch.aminmax(row_id_map)
    rows = inp.shape[0]
    named = (row_id_map >= 0).sum()
    negative = "row_id_map must hold -1 (a slot not routed) or permuted row numbers >= 0"
    twice = "row_id_map must name each permuted row at most once (as moe_permute's does)"
    _check_values(
        fn,
        (lo >= -1, negative,
         lambda: f"{negative}, got {_first_at(row_id_map, row_id_map < -1)}"),
        (hi < rows, "inp must have at least max(row_id_map) + 1 rows",
         lambda: f"inp must have at least {hi.item() + 1} rows (row_id_map places copies up to "
                 f"row {hi.item()}), got {_described(inp)}"),
        (named == (pos < row_id_map.numel()).sum(), twice,
         lambda: f"{twice}, got {_shared_row(row_id_map)}"))
