"""Transformer Engine's RotaryPositionEmbedding and apply_rotary_pos_emb.

RotaryPositionEmbedding(dim)(max_seq_len) is the angle tensor [s, 1, 1, d];
apply_rotary_pos_emb applies it to the first d features of q or k with the non-interleaved
rotate-half convention t * cos + rotate_half(t) * sin. With start_positions (KV-cache
inference) sequence b's token t takes the angles of position start_positions[b] + t.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..te_args import check_positive
from ..torchscript import refuse_torchscript

QKV_FORMATS = ("sbhd", "bshd")


def check_qkv_format(owner: str, name: str, value, packed: bool = False) -> str:
    """sbhd or bshd; also thd (packed sequences, attention/packed.py) where ``packed``."""
    formats = QKV_FORMATS + ("thd",) if packed else QKV_FORMATS
    if value not in formats:
        extra = (" ('thd', packed sequences, is DotProductAttention's only)"
                 if value == "thd" else "")
        raise ValueError(f"{owner}: {name} must be one of {formats}, got {value!r}{extra}")
    return value

class RotaryPositionEmbedding(torch.nn.Module):
    """Transformer Engine's RotaryPositionEmbedding: forward(max_seq_len, offset=0) returns the
    float32 angles [max_seq_len, 1, 1, dim'], r = int(dim * rotary_percent) and dim' = 2 *
    ceil(r / 2) (r itself when even; as Transformer Engine), position p and feature j holding
    p * base^(-2 (j mod dim'/2) / r): the frequencies repeated, not interleaved.
    seq_len_interpolation_factor with pretrained_max_position_embeddings divides
    the positions (position interpolation): by the factor, or by max_seq_len / pretrained when
    max_seq_len exceeds pretrained * factor.
    The inverse frequencies are a buffer, inv_freq (in the state_dict, as Transformer Engine
    keeps it)."""

    __prepare_scriptable__ = refuse_torchscript  # (torch.jit.script: a clear error)

    def __init__(self, dim: int, rotary_percent: float = 1.0,
                 seq_len_interpolation_factor: Optional[int] = None,
                 pretrained_max_position_embeddings: Optional[int] = None,
                 rotary_base: float = 10000.0, interleaved: bool = False):
        super().__init__()
        check_positive("RotaryPositionEmbedding", "dim", dim)
        if isinstance(rotary_percent, bool) or not isinstance(rotary_percent, (int, float)) \
                or not 0 < rotary_percent <= 1:
            raise ValueError("RotaryPositionEmbedding: rotary_percent must be in (0, 1], got "
                             f"{rotary_percent!r}")
        if interleaved:
            raise ValueError("RotaryPositionEmbedding: interleaved=True is not supported; "
                             "only the rotate-half (non-interleaved) convention")
        if not isinstance(rotary_base, (int, float)) or not rotary_base > 0:
            raise ValueError("RotaryPositionEmbedding: rotary_base must be a number > 0, got "
                             f"{rotary_base!r}")
        rot_dim = int(dim * rotary_percent) if rotary_percent < 1 else dim
        if rot_dim < 1:
            raise ValueError("RotaryPositionEmbedding: the rotary dimension (dim * "
                             f"rotary_percent = {dim * rotary_percent}) must be >= 1")
        self.rotary_base = float(rotary_base)
        self.seq_len_interpolation_factor = seq_len_interpolation_factor
        self.pretrained_max_position_embeddings = pretrained_max_position_embeddings
        # (an odd rotary dimension r: ceil(r / 2) frequencies over r, as Transformer Engine)
        exponents = torch.arange(0, rot_dim, 2, dtype=torch.float32) / rot_dim
        self.register_buffer("inv_freq", 1.0 / (self.rotary_base ** exponents))
        self.dim = 2 * exponents.numel()  # (the angles' features)

    def forward(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
        check_positive("RotaryPositionEmbedding", "max_seq_len", max_seq_len)
        inv_freq = self.inv_freq.float()
        positions = torch.arange(max_seq_len, device=inv_freq.device,
                                 dtype=torch.float32) + offset
        factor, pretrained = (self.seq_len_interpolation_factor,
                              self.pretrained_max_position_embeddings)
        if factor is not None and pretrained is not None:
            if max_seq_len > pretrained * factor:
                positions = positions / (max_seq_len / pretrained)
            else:
                positions = positions / factor
        freqs = torch.outer(positions, inv_freq)  # [s, dim / 2]
        return torch.cat((freqs, freqs), dim=-1).reshape(max_seq_len, 1, 1, self.dim)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, rotary_base={self.rotary_base}"


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rotary_pos_emb(t: torch.Tensor, freqs: torch.Tensor, tensor_format: str = "sbhd",
                         start_positions=None, interleaved: bool = False, fused: bool = False,
                         cu_seqlens=None, cp_size: int = 1, cp_rank: int = 0) -> torch.Tensor:
    """t [s, b, h, d] (or [b, s, h, d] with "bshd") rotated by the angles freqs [s2, 1, 1, d2]
    (s2 >= s, even d2 <= d): the first d2 features become t * cos + rotate_half(t) * sin, the
    rest pass through. cos and sin are taken in float32, then cast to t's dtype.
    start_positions ([b] ints, a tensor or a list): sequence b's token j takes the angles of
    position start_positions[b] + j (s2 >= max(start_positions) + s; a tensor is read on the
    host for that check). tensor_format "thd" (packed sequences, t [tokens, h, d]) needs
    cu_seqlens ([b + 1] cumulative lengths): each sequence's positions start at 0 (at
    start_positions[b] with them); rows past cu_seqlens[-1] pass through unchanged. Transformer
    Engine's other arguments: fused (its kernel
    or not: the same numbers) is accepted and changes nothing; interleaved, cp_size and cp_rank
    (context parallelism) only at their defaults, cu_seqlens with "thd" only."""
    owner = "apply_rotary_pos_emb"
    for name, value, default in (("interleaved", interleaved, False), ("cp_size", cp_size, 1),
                                 ("cp_rank", cp_rank, 0)):
        if not (value is default or (not isinstance(value, bool) and value == default)):
            raise ValueError(f"{owner}: {name}={value!r} is not supported (rotate-half "
                             "embeddings, no context parallelism); leave it at "
                             f"{default!r}")
    check_qkv_format(owner, "tensor_format", tensor_format, packed=True)
    if tensor_format == "thd":
        return _apply_packed(owner, t, freqs, cu_seqlens, start_positions)
    if cu_seqlens is not None:
        raise ValueError(f"{owner}: cu_seqlens is for tensor_format='thd' (packed sequences); "
                         f"leave it at None with {tensor_format!r}")
    if t.dim() != 4:
        raise ValueError(f"{owner}: t must be 4-D [{', '.join(tensor_format)}], got shape "
                         f"{tuple(t.shape)}")
    if not t.is_floating_point():  # (an integer t would be rotated by angles cast to ints)
        raise TypeError(f"{owner}: t must be a floating-point tensor, got {t.dtype}")
    if isinstance(freqs, torch.Tensor):
        if freqs.is_complex() or freqs.dtype == torch.bool:  # (.float() drops the imaginary)
            raise TypeError(f"{owner}: rotary_pos_emb must hold real angles (a floating-point "
                            f"tensor), got {freqs.dtype}")
        if freqs.device != t.device:
            raise ValueError(f"{owner}: rotary_pos_emb must be on t's device {t.device}, got "
                             f"{freqs.device}")
    seq, batch = t.shape[:2] if tensor_format == "sbhd" else t.shape[1::-1]
    starts = _start_positions(owner, start_positions, batch)
    needed = seq + (max(starts) if starts else 0)
    if (not isinstance(freqs, torch.Tensor) or freqs.dim() != 4 or freqs.shape[1:3] != (1, 1)
            or freqs.shape[0] < needed or freqs.shape[3] > t.shape[3] or freqs.shape[3] % 2):
        got = tuple(freqs.shape) if isinstance(freqs, torch.Tensor) else type(freqs).__name__
        what = "the sequence length" + (" plus the largest start position" if starts else "")
        raise ValueError(f"{owner}: rotary_pos_emb must have shape [s2, 1, 1, d2] with s2 >= "
                         f"{needed} ({what}) and an even d2 <= {t.shape[3]} (the head size), "
                         f"got {got}")
    if starts is None:
        freqs = freqs[:seq].float()  # [s, 1, 1, d2]
    else:  # position start_b + j for row b: [s, b, 1, d2]
        positions = (torch.tensor(starts, device=freqs.device).view(1, batch)
                     + torch.arange(seq, device=freqs.device).view(seq, 1))
        freqs = freqs[:, 0].float()[positions]
    if tensor_format == "bshd":
        freqs = freqs.transpose(0, 1)  # [1 or b, s, 1, d2]
    cos, sin = freqs.cos().to(t.dtype), freqs.sin().to(t.dtype)
    rot_dim = freqs.shape[-1]
    rotated, passed = t[..., :rot_dim], t[..., rot_dim:]
    rotated = rotated * cos + _rotate_half(rotated) * sin
    return torch.cat((rotated, passed), dim=-1) if passed.shape[-1] else rotated


def _apply_packed(owner: str, t, freqs, cu_seqlens, start_positions) -> torch.Tensor:
    """apply_rotary_pos_emb of a "thd" tensor: row r of sequence b at position r - cu[b] (plus
    start_positions[b]); rows past cu_seqlens' last entry pass through unchanged."""
    from .packed import layout
    if cu_seqlens is None:
        raise ValueError(f"{owner}: tensor_format='thd' needs cu_seqlens (the cumulative "
                         "sequence lengths of the packed tokens)")
    if t.dim() != 3:
        raise ValueError(f"{owner}: t must be 3-D [t, h, d] with tensor_format='thd', got "
                         f"shape {tuple(t.shape)}")
    return rotate_packed(owner, t, freqs, layout(owner, "cu_seqlens", cu_seqlens, None,
                                                 t.shape[0]), start_positions)


def rotate_packed(owner: str, t, freqs, packed, start_positions=None) -> torch.Tensor:
    """The rows of the sequences of ``packed`` (attention/packed.py's PackedLayout: their
    offsets and real lengths) of the "thd" tensor t [t, h, d] rotated, each sequence from
    position 0 (start_positions[b] with them); every other row (between padded sequences,
    past the last) unchanged. The angles need cover the longest sequence only."""
    if not t.is_floating_point():
        raise TypeError(f"{owner}: t must be a floating-point tensor, got {t.dtype}")
    starts = _start_positions(owner, start_positions, packed.batch)
    batch, position, row = packed.indices(t.device)
    if starts:
        position = position + torch.tensor(starts, dtype=torch.long, device=t.device)[batch]
    needed = int(position.max()) + 1 if position.numel() else 0
    if (not isinstance(freqs, torch.Tensor) or freqs.dim() != 4 or freqs.shape[1:3] != (1, 1)
            or freqs.shape[0] < needed or freqs.shape[3] > t.shape[2] or freqs.shape[3] % 2
            or freqs.is_complex() or freqs.device != t.device):
        got = tuple(freqs.shape) if isinstance(freqs, torch.Tensor) else type(freqs).__name__
        raise ValueError(f"{owner}: rotary_pos_emb must be real angles on t's device of shape "
                         f"[s2, 1, 1, d2] with s2 >= {needed} (the longest sequence, plus its "
                         f"start position) and an even d2 <= {t.shape[2]}, got {got}")
    angles = freqs[:, 0].float()[position.to(freqs.device)]  # [rows, 1, d2]
    cos, sin = angles.cos().to(t.dtype), angles.sin().to(t.dtype)
    rot_dim = angles.shape[-1]
    rows = t[row]
    rotated = rows[..., :rot_dim] * cos + _rotate_half(rows[..., :rot_dim]) * sin
    if rot_dim < t.shape[2]:
        rotated = torch.cat((rotated, rows[..., rot_dim:]), dim=-1)
    return t.index_put((row,), rotated)


def _start_positions(owner: str, start_positions, batch: int) -> Optional[list]:
    """start_positions as a list of batch ints >= 0, or None."""
    if start_positions is None:
        return None
    if isinstance(start_positions, torch.Tensor):
        start_positions = start_positions.reshape(-1)[:batch].tolist()
    starts = list(start_positions)
    if len(starts) != batch or any(isinstance(p, bool) or not isinstance(p, int) or p < 0
                                   for p in starts):
        raise ValueError(f"{owner}: start_positions must hold {batch} ints >= 0 (one per "
                         f"sequence), got {start_positions!r}")
    return starts
