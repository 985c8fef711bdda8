"""Transformer Engine's packed sequences, qkv_format "thd": the tokens of a batch's sequences
one after another, [t, heads, d], with cu_seqlens (cumulative lengths, [b + 1]) saying where
each sequence starts and how long it is. With cu_seqlens_padded the sequences start at those
offsets instead and the tokens between them (padding inserted between sequences) take part in
nothing; their outputs are zeros.

Attention (attend) runs on the sequences laid out as a padded "bshd" batch ([b, s, heads, d], s the
longest sequence) with a padding mask from their lengths, then goes back to "thd": the same
numbers as attention per sequence. The layout is read on the host (cu_seqlens .tolist(), as
Transformer Engine does where max_seqlen is not given).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class PackedLayout:
    """Where each sequence of a "thd" tensor is: its tokens are rows offsets[i] to
    offsets[i] + lengths[i] - 1."""

    offsets: list
    lengths: list
    tokens: int  # rows of the thd tensor

    @property
    def batch(self) -> int:
        return len(self.lengths)

    @property
    def longest(self) -> int:
        return max(self.lengths, default=0)

    def indices(self, device):
        """(batch index, position, row) of every token in a sequence."""
        batch = torch.cat([torch.full((n,), i, dtype=torch.long)
                           for i, n in enumerate(self.lengths)]
                          or [torch.empty(0, dtype=torch.long)])
        position = torch.cat([torch.arange(n) for n in self.lengths]
                             or [torch.empty(0, dtype=torch.long)])
        row = torch.cat([torch.arange(o, o + n) for o, n in zip(self.offsets, self.lengths)]
                        or [torch.empty(0, dtype=torch.long)])
        return batch.to(device), position.to(device), row.to(device)

    def padding_mask(self, width: int, device) -> torch.Tensor:
        """[b, 1, 1, width], True at the positions past each sequence's length."""
        lengths = torch.tensor(self.lengths, device=device).view(-1, 1, 1, 1)
        return torch.arange(width, device=device).view(1, 1, 1, -1) >= lengths


def layout(owner: str, name: str, cu_seqlens, cu_seqlens_padded, tokens: int) -> PackedLayout:
    """The layout of a thd tensor of ``tokens`` rows from Transformer Engine's cu_seqlens
    (and cu_seqlens_padded), checked: 1-D integer tensors of b + 1 non-decreasing entries from
    0, each padded sequence at least as long as its sequence, all within the rows."""
    cu = _cumulative(owner, name, cu_seqlens)
    lengths = [b - a for a, b in zip(cu, cu[1:])]
    if cu_seqlens_padded is None:
        offsets = cu[:-1]
        end = cu[-1]
    else:
        padded = _cumulative(owner, name + "_padded", cu_seqlens_padded)
        if len(padded) != len(cu):
            raise ValueError(f"{owner}: {name}_padded must have {name}'s {len(cu)} entries, "
                             f"got {len(padded)}")
        room = [b - a for a, b in zip(padded, padded[1:])]
        if any(n > r for n, r in zip(lengths, room)):
            raise ValueError(f"{owner}: {name}_padded must leave each sequence at least its "
                             f"length ({lengths}), got room for {room}")
        offsets, end = padded[:-1], padded[-1]
    if end > tokens:
        raise ValueError(f"{owner}: {name} reaches row {end}, past the {tokens} rows of the "
                         "packed tensor")
    return PackedLayout(offsets, lengths, tokens)


def _cumulative(owner: str, name: str, value) -> list:
    if not isinstance(value, torch.Tensor) or value.dim() != 1 or value.numel() < 2 \
            or value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
        got = (f"{value.dtype} of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor)
               else type(value).__name__)
        raise ValueError(f"{owner}: {name} must be a 1-D integer tensor [batch + 1] of "
                         f"cumulative sequence lengths (qkv_format 'thd'), got {got}")
    cu = [int(v) for v in value.tolist()]
    if cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"{owner}: {name} must start at 0 and never decrease, got {cu}")
    return cu


def to_padded(t: torch.Tensor, packed: PackedLayout, width: Optional[int] = None):
    """thd [t, ...] -> bshd [b, width, ...] (zeros past each sequence), differentiable."""
    width = packed.longest if width is None else width
    batch, position, row = packed.indices(t.device)
    out = t.new_zeros(packed.batch, width, *t.shape[1:])
    return out.index_put((batch, position), t[row])


def to_packed(t: torch.Tensor, packed: PackedLayout) -> torch.Tensor:
    """bshd [b, s, ...] -> thd [tokens, ...]: each sequence's positions at its rows, zeros in
    the rows between sequences, differentiable."""
    batch, position, row = packed.indices(t.device)
    out = t.new_zeros(packed.tokens, *t.shape[2:])
    return out.index_put((row,), t[batch, position])


def positions(packed: PackedLayout, device) -> torch.Tensor:
    """Each row's position in its sequence ([tokens], 0 for rows between sequences)."""
    _, position, row = packed.indices(device)
    out = torch.zeros(packed.tokens, dtype=torch.long, device=device)
    return out.index_put((row,), position)


def attend(attention, q, k, v, attention_mask, mask_type: str, window_size,
           bottom_right_diagonal, checkpoint_core_attention, named: dict, others: dict):
    """DotProductAttention.forward with qkv_format "thd": the sequences laid out as a padded
    "bshd" batch with padding masks from their lengths, attention, back to [t_q, h * d_v].
    mask_type: the checked attn_mask_type; named: the cu_seqlens / max_seqlen arguments;
    others: the forward's remaining keyword arguments."""
    owner = "DotProductAttention"
    if "padding" not in mask_type:
        raise ValueError(f"{owner}: qkv_format 'thd' needs a 'padding' mask type "
                         "('padding', 'padding_causal', 'padding_causal_bottom_right'), as "
                         f"in Transformer Engine; got {mask_type!r}")
    if attention_mask is not None:
        raise ValueError(f"{owner}: with qkv_format 'thd' the sequences come from "
                         "cu_seqlens_q / cu_seqlens_kv; leave attention_mask at None")
    if others.get("inference_params") is not None:
        raise ValueError(f"{owner}: inference_params with qkv_format 'thd' is not supported")
    others = {k_: v_ for k_, v_ in others.items() if k_ != "pad_between_seqs"}
    for name, t in (("query_layer", q), ("key_layer", k), ("value_layer", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{owner}: {name} must be 3-D [t, heads, head size] with "
                             f"qkv_format 'thd', got {got}")
    for name in ("max_seqlen_q", "max_seqlen_kv"):  # (a hint there; read from cu_seqlens)
        value = named[name]
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise ValueError(f"{owner}: {name} must be an int or None, got {value!r}")
    if named["cu_seqlens_q"] is None or named["cu_seqlens_kv"] is None:
        raise ValueError(f"{owner}: qkv_format 'thd' needs cu_seqlens_q and cu_seqlens_kv "
                         "(the cumulative sequence lengths)")
    lay_q = layout(owner, "cu_seqlens_q", named["cu_seqlens_q"], named["cu_seqlens_q_padded"],
                   q.shape[0])
    lay_kv = layout(owner, "cu_seqlens_kv", named["cu_seqlens_kv"],
                    named["cu_seqlens_kv_padded"], k.shape[0])
    if lay_q.batch != lay_kv.batch or v.shape[0] != k.shape[0]:
        raise ValueError(f"{owner}: cu_seqlens_q and cu_seqlens_kv must describe as many "
                         f"sequences ({lay_q.batch}, {lay_kv.batch}), and key_layer and "
                         "value_layer have as many rows")
    width_q, width_kv = lay_q.longest, lay_kv.longest
    if attention.attention_type == "self":  # (one padded length for both sides)
        width_q = width_kv = max(width_q, width_kv)
    out = attention.forward(
        to_padded(q, lay_q, width_q), to_padded(k, lay_kv, width_kv),
        to_padded(v, lay_kv, width_kv),
        attention_mask=(lay_q.padding_mask(width_q, q.device),
                        lay_kv.padding_mask(width_kv, q.device)),
        qkv_format="bshd", attn_mask_type=mask_type, window_size=window_size,
        bottom_right_diagonal=bottom_right_diagonal,
        checkpoint_core_attention=checkpoint_core_attention, **others)
    return to_packed(out, lay_q)
