"""Transformer Engine's DotProductAttention, in high precision.

DotProductAttention is softmax(q k^T * scale + mask) v on torch's scaled_dot_product_attention:
no FP8 (attention is not a GEMM with weights; FP8 attention is out of scope). Its conventions
are Transformer Engine's:
  * layouts "sbhd" (query [s, b, h, d], key/value [s_kv, b, g, d]) and "bshd"; output
    [s, b, h * d] (or [b, s, h * d]);
  * GQA: g = num_gqa_groups key/value heads, query head i reads group i // (h / g);
  * attention_mask is boolean with True = masked out (masks.py): the "padding"
    types take [b, 1, 1, s] per side, "arbitrary" anything broadcastable to [b, h, s_q, s_kv];
    with "no_mask" or a causal type without "padding" a mask is ignored, as in Transformer
    Engine's fused backends (its unfused float32 path ORs it into the causal mask);
  * causal masks: "causal" / "padding_causal" top-left (query i sees keys 0..i),
    "causal_bottom_right" / "padding_causal_bottom_right" bottom-right (query i sees keys
    0..i + s_kv - s_q); bottom_right_diagonal aligns the sliding window of the other types;
  * query rows that may attend to nothing (padded queries) give zeros, not NaN;
  * inference_params (an InferenceParams, inference.py): the keys and values join its KV cache
    and the queries attend to the whole cached sequence (bottom-right causal).
RotaryPositionEmbedding and apply_rotary_pos_emb live in rotary.py (imported here too).
"""
from __future__ import annotations

import math
from typing import Optional, Union

import torch
import torch.nn.functional as F

import torch.distributed as dist

from ... import distributed
from ...quantization.replay import checkpoint
from .. import te_checkpoint, te_tensor_parallel
from ..te_args import check_positive, check_te_options as check_unsupported
from ..torchscript import refuse_torchscript
from . import packed
from .inference import kv_cache_step
from .masks import allowed_mask, check_window_size, resolve_bottom_right, resolve_window
from .rotary import RotaryPositionEmbedding, apply_rotary_pos_emb, check_qkv_format  # noqa: F401
from .sink import check_softmax_type, with_sink

MASK_TYPES = ("no_mask", "causal", "padding", "padding_causal", "causal_bottom_right",
              "padding_causal_bottom_right", "arbitrary")

# SDPA grew enable_gqa in torch 2.5; before that the key/value heads are repeated.
_SDPA_HAS_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)


def check_mask_type(owner: str, name: str, value) -> str:
    if value not in MASK_TYPES:
        raise ValueError(f"{owner}: {name} must be one of {MASK_TYPES}, got {value!r}")
    return value


# ---- dot-product attention -----------------------------------------------------------------

_FORWARD_DEFAULTS = {"cu_seqlens_q": None, "cu_seqlens_kv": None, "cu_seqlens_q_padded": None,
                     "cu_seqlens_kv_padded": None, "max_seqlen_q": None, "max_seqlen_kv": None,
                     "core_attention_bias_type": "no_bias", "core_attention_bias": None,
                     "alibi_slopes": None, "inference_params": None, "fast_zero_fill": True,
                     "bottom_right_diagonal": None,
                     "pad_between_seqs": None, "fp8_output": False, "bf16_backward": False,
                     "num_splits": 1, "score_mod": None, "score_mod_bprop": None,
                     "score_mod_tensors": None, "score_mod_bprop_tensors": None,
                     "qkv_layer": None, "kv_layer": None, "qkv_interleave_dim": -3}

# Forward arguments whose value changes nothing for "sbhd" / "bshd" (the formats served here):
# fast_zero_fill (how the padding of packed sequences is zeroed) and pad_between_seqs=False.
_NO_EFFECT_WITHOUT_THD = {"fast_zero_fill": (True, False), "pad_between_seqs": (False,)}


class DotProductAttention(torch.nn.Module):
    """Transformer Engine's DotProductAttention, in high precision (inside fp8_autocast too).

    forward(query_layer, key_layer, value_layer, attention_mask=None, qkv_format=None,
    attn_mask_type=None, window_size=None, bottom_right_diagonal=None,
    checkpoint_core_attention=False, inference_params=None) -> [s, b, h * d] ("sbhd") or
    [b, s, h * d] ("bshd"). See the module docstring for layouts, GQA and masks.
    bottom_right_diagonal (the constructor's unless forward gives one) aligns the window of
    "no_mask", "padding" and "arbitrary" (None: bottom-right, Transformer Engine's default).
    inference_params needs layer_number (the key of this layer's cache) and a mask type with
    "causal" (made bottom-right) or "padding"/"no_mask"; 'arbitrary' is refused.
    Dropout on the attention probabilities while training (attention_dropout). kv_channels:
    the head size, or (that of query and key, that of value) as in Transformer Engine; the
    output is then [..., h * value head size]. softmax_scale defaults to 1 / sqrt(kv_channels
    of query and key). window_size: a sliding window (attention/masks.py), the
    constructor's unless forward gives one. softmax_type: "vanilla", "off-by-one" or
    "learnable" (attention sinks, attention/sink.py; "learnable" has the Parameter
    softmax_offset [h], float32, on device). get_rng_state_tracker (a callable returning a
    transformer_fp8.distributed.CudaRNGStatesTracker): the dropout mask is drawn inside
    ``get_rng_state_tracker().fork()`` (the state "model-parallel-rng"), as in Transformer
    Engine; checkpoint_core_attention then restores the tracker's states for the
    recomputation. tp_size / tp_group (Transformer Engine's tensor parallelism): the
    inputs hold this rank's num_attention_heads / tp_size query heads and num_gqa_groups /
    tp_size key/value groups (MultiheadAttention's column-parallel QKV projection gives them);
    attention itself needs no communication. sequence_parallel=True: the dropout mask is drawn
    from the default generator, not inside the tracker's fork, as in Transformer Engine
    (Megatron-LM runs a sequence-parallel block inside the tracker's fork already, and a fork
    nested in it would draw the numbers the block's next dropout draws). Context-parallel
    options are accepted only at their defaults.
    """

    __prepare_scriptable__ = refuse_torchscript  # (torch.jit.script: a clear error)

    def __init__(self, num_attention_heads: int, kv_channels: int,
                 num_gqa_groups: Optional[int] = None, attention_dropout: float = 0.0,
                 qkv_format: str = "sbhd", attn_mask_type: str = "causal",
                 window_size=None, bottom_right_diagonal=None, sequence_parallel: bool = False,
                 tp_size: int = 1, get_rng_state_tracker=None, tp_group=None,
                 layer_number: Optional[int] = None, attention_type: str = "self",
                 cp_group=None, cp_global_ranks=None, cp_stream=None, cp_comm_type: str = "p2p",
                 softmax_scale: Optional[float] = None, softmax_type: str = "vanilla",
                 return_max_logit: bool = False, name=None, *, device=None):
        super().__init__()
        owner = "DotProductAttention"
        for option, value in (("cp_group", cp_group), ("cp_global_ranks", cp_global_ranks),
                              ("cp_stream", cp_stream)):
            if value is not None:
                raise ValueError(f"{owner}: {option}={value!r} is not supported (no context "
                                 "parallelism); leave it at None")
        if cp_comm_type != "p2p":
            raise ValueError(f"{owner}: cp_comm_type={cp_comm_type!r} is not supported (no "
                             "context parallelism); leave it at 'p2p'")
        if return_max_logit:
            raise ValueError(f"{owner}: return_max_logit=True is not supported; leave it at "
                             "False")
        check_unsupported(owner, dict(name=name))
        # (options kept with their group, which deepcopy shares and pickling drops)
        _, _, self._te_parallel = te_tensor_parallel.configure(
            owner, 1, 1, dict(tp_group=tp_group, tp_size=tp_size,
                              sequence_parallel=sequence_parallel))
        ranks = self.tp_size
        # (the flag as given, whatever the ranks: Transformer Engine's test for the fork)
        self._dropout_outside_fork = bool(sequence_parallel)
        # Attention dropout runs inside get_rng_state_tracker().fork() (the getter is called at
        # each forward, so a model copy shares the caller's tracker).
        self.get_rng_state_tracker = distributed.check_rng_state_tracker(owner,
                                                                         get_rng_state_tracker)
        self.num_attention_heads = check_positive(owner, "num_attention_heads",
                                                  num_attention_heads)
        if isinstance(kv_channels, (tuple, list)) and len(kv_channels) == 2:
            # (head size of query and key, head size of value), as in Transformer Engine
            head_k = check_positive(owner, "kv_channels[0]", kv_channels[0])
            head_v = check_positive(owner, "kv_channels[1]", kv_channels[1])
            self.kv_channels = (head_k, head_v)
        else:
            head_k = head_v = self.kv_channels = check_positive(owner, "kv_channels",
                                                                kv_channels)
        self.hidden_size_per_attention_head_k = head_k  # (Transformer Engine's names)
        self.hidden_size_per_attention_head_v = head_v
        groups = num_attention_heads if num_gqa_groups is None else num_gqa_groups
        check_positive(owner, "num_gqa_groups", groups)
        if num_attention_heads % groups:
            raise ValueError(f"{owner}: num_gqa_groups must divide num_attention_heads "
                             f"({num_attention_heads}), got {groups}")
        self.num_gqa_groups = groups
        for name, count in (("num_attention_heads", num_attention_heads),
                            ("num_gqa_groups", groups)):
            if count % ranks:
                raise ValueError(f"{owner}: {name} ({count}) must be divisible by the {ranks} "
                                 "tensor-parallel ranks (each holds its share of the heads)")
        # This rank's heads (all of them without tensor parallelism), as Transformer Engine's
        # per-partition counts.
        self.num_attention_heads_per_partition = num_attention_heads // ranks
        self.num_gqa_groups_per_partition = groups // ranks
        if isinstance(attention_dropout, bool) or not isinstance(attention_dropout, (int, float)) \
                or not 0 <= attention_dropout < 1:
            raise ValueError(f"{owner}: attention_dropout must be in [0, 1), got "
                             f"{attention_dropout!r}")
        self.attention_dropout = float(attention_dropout)
        self.qkv_format = check_qkv_format(owner, "qkv_format", qkv_format, packed=True)
        self.attn_mask_type = check_mask_type(owner, "attn_mask_type", attn_mask_type)
        if attention_type not in ("self", "cross"):
            raise ValueError(f"{owner}: attention_type must be 'self' or 'cross', got "
                             f"{attention_type!r}")
        self.attention_type = attention_type
        self.layer_number = layer_number
        if softmax_scale is None:
            softmax_scale = 1.0 / math.sqrt(head_k)
        elif isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)) \
                or not softmax_scale > 0:
            raise ValueError(f"{owner}: softmax_scale must be a number > 0, got "
                             f"{softmax_scale!r}")
        self.softmax_scale = float(softmax_scale)
        self.window_size = check_window_size(owner, window_size)
        resolve_bottom_right(owner, "no_mask", bottom_right_diagonal)  # (checks the value)
        self.bottom_right_diagonal = bottom_right_diagonal
        self.softmax_type = check_softmax_type(owner, softmax_type)
        if softmax_type == "learnable":  # Transformer Engine's name, shape and start: zeros
            self.softmax_offset = torch.nn.Parameter(
                torch.zeros(num_attention_heads // ranks, dtype=torch.float32, device=device))

    def __setstate__(self, state: dict) -> None:
        # (a module pickled whole before tensor parallelism: one rank holding every head)
        state.setdefault("num_attention_heads_per_partition", state.get("num_attention_heads"))
        state.setdefault("num_gqa_groups_per_partition", state.get("num_gqa_groups"))
        state.setdefault("_te_parallel", None)
        state.setdefault("_dropout_outside_fork", False)
        super().__setstate__(state)

    @property
    def tp_size(self) -> int:
        return 1 if self._te_parallel is None else self._te_parallel.size

    @property
    def tp_group(self):
        return None if self._te_parallel is None else self._te_parallel.group

    def set_tensor_parallel_group(self, tp_group) -> None:
        """Transformer Engine's: the tensor-parallel group of a module built with tp_size
        alone (attention needs none of it; kept for the callers that set it on every
        module)."""
        size = 1 if tp_group is None else dist.get_world_size(tp_group)
        if size != self.tp_size:
            raise ValueError(f"DotProductAttention.set_tensor_parallel_group: tp_group has "
                             f"{size} ranks, the module was built for tp_size={self.tp_size}")
        if self._te_parallel is not None:
            self._te_parallel = self._te_parallel.with_group(tp_group)

    def reset_parameters(self) -> None:
        """The learnable sink's offset back to its start, zeros (a module materialised from
        "meta" by to_empty() holds uninitialised memory until this runs, as torch's do)."""
        if self.softmax_type == "learnable":
            with torch.no_grad():
                self.softmax_offset.zero_()

    def forward(self, query_layer: torch.Tensor, key_layer: torch.Tensor,
                value_layer: torch.Tensor,
                attention_mask: Union[torch.Tensor, tuple, None] = None,
                qkv_format: Optional[str] = None, cu_seqlens_q=None, cu_seqlens_kv=None,
                cu_seqlens_q_padded=None, cu_seqlens_kv_padded=None, max_seqlen_q=None,
                max_seqlen_kv=None, attn_mask_type: Optional[str] = None, window_size=None,
                bottom_right_diagonal=None, checkpoint_core_attention: bool = False,
                **unsupported) -> torch.Tensor:
        owner = "DotProductAttention"
        named = dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_kv=cu_seqlens_kv,
                     cu_seqlens_q_padded=cu_seqlens_q_padded,
                     cu_seqlens_kv_padded=cu_seqlens_kv_padded, max_seqlen_q=max_seqlen_q,
                     max_seqlen_kv=max_seqlen_kv)
        if (self.qkv_format if qkv_format is None else qkv_format) == "thd":
            mask_type = check_mask_type(owner, "attn_mask_type", self.attn_mask_type
                                        if attn_mask_type is None else attn_mask_type)
            return packed.attend(self, query_layer, key_layer, value_layer, attention_mask,
                                 mask_type, window_size, bottom_right_diagonal,
                                 checkpoint_core_attention, named, unsupported)
        inference_params = unsupported.pop("inference_params", None)
        for name, value in {**named, **unsupported}.items():
            if name not in _FORWARD_DEFAULTS:
                raise TypeError(f"{owner}.forward() got an unexpected keyword argument {name!r}")
            if name == "qkv_interleave_dim" and unsupported.get("qkv_layer") is None:
                continue  # only read with a packed qkv_layer
            if name in _NO_EFFECT_WITHOUT_THD and value in _NO_EFFECT_WITHOUT_THD[name]:
                continue  # (Transformer Engine reads them for packed "thd" sequences only)
            if value is not None and value != _FORWARD_DEFAULTS[name]:
                raise ValueError(f"{owner}.forward: {name}={value!r} is not supported; leave "
                                 f"it at {_FORWARD_DEFAULTS[name]!r}")
        fmt = check_qkv_format(owner, "qkv_format",
                               self.qkv_format if qkv_format is None else qkv_format)
        mask_type = check_mask_type(owner, "attn_mask_type",
                                    self.attn_mask_type if attn_mask_type is None
                                    else attn_mask_type)
        window = resolve_window(owner, mask_type,
                                self.window_size if window_size is None else window_size)
        bottom_right = resolve_bottom_right(owner, mask_type, self.bottom_right_diagonal
                                            if bottom_right_diagonal is None
                                            else bottom_right_diagonal)
        cached = inference_params is not None
        if cached:
            # The cache holds every earlier token: the queries are the last ones of their
            # sequences, hence the bottom-right causal diagonal (and padding by lengths).
            self._to_bhsd(query_layer, key_layer, value_layer, fmt)  # (checks the inputs)
            key_layer, value_layer, attention_mask, mask_type, bottom_right = kv_cache_step(
                inference_params, self.layer_number, key_layer, value_layer, fmt, mask_type,
                bottom_right, query_layer.shape[0 if fmt == "sbhd" else 1])
        q, k, v = self._to_bhsd(query_layer, key_layer, value_layer, fmt, cached)
        allowed, is_causal = allowed_mask(mask_type, attention_mask, q.shape[0],
                                          self.num_attention_heads_per_partition, q.shape[2],
                                          k.shape[2],
                                          q.device, window, bottom_right,
                                          cross=self.attention_type == "cross")
        dropout = self.attention_dropout if self.training else 0.0
        if checkpoint_core_attention and torch.is_grad_enabled():
            # With a tracker, its states are restored for the recomputation too: same masks.
            out = checkpoint(self._sdpa, q, k, v, allowed, is_causal, dropout,
                             get_rng_state_tracker=self.get_rng_state_tracker,
                             use_reentrant=False)
        else:
            out = self._sdpa(q, k, v, allowed, is_causal, dropout)
        b, h, s, d = out.shape
        if fmt == "sbhd":
            return out.permute(2, 0, 1, 3).reshape(s, b, h * d)
        return out.transpose(1, 2).reshape(b, s, h * d)

    # -- inputs ----------------------------------------------------------------------------

    def _to_bhsd(self, q, k, v, fmt, cached=False):
        """Checks the three inputs; returns them as [b, heads, s, d] views. cached: k and v
        come from a KV cache ("bshd", the sequences so far), q in fmt."""
        owner = "DotProductAttention"
        lead = "s, b" if fmt == "sbhd" else "b, s"
        h, g = self.num_attention_heads_per_partition, self.num_gqa_groups_per_partition
        d_k, d_v = self.hidden_size_per_attention_head_k, self.hidden_size_per_attention_head_v
        for name, t, heads, d in (("query_layer", q, h, d_k), ("key_layer", k, g, d_k),
                                  ("value_layer", v, g, d_v)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{owner}: {name} must be a torch.Tensor, got "
                                f"{type(t).__name__}")
            if t.dim() != 4 or t.shape[2] != heads or t.shape[3] != d:
                raise ValueError(f"{owner}: {name} must have shape [{lead}, {heads}, {d}] "
                                 f"(qkv_format {fmt!r}), got {tuple(t.shape)}")
            if not t.is_floating_point():
                raise TypeError(f"{owner}: {name} must be a floating-point tensor, got "
                                f"{t.dtype}")
        batch_dim, seq_dim = (1, 0) if fmt == "sbhd" else (0, 1)
        if cached:
            perm = (1, 2, 0, 3) if fmt == "sbhd" else (0, 2, 1, 3)
            return q.permute(perm), k.transpose(1, 2), v.transpose(1, 2)
        if not (q.shape[batch_dim] == k.shape[batch_dim] == v.shape[batch_dim]):
            raise ValueError(f"{owner}: query_layer, key_layer and value_layer must have the "
                             f"same batch size, got shapes {tuple(q.shape)}, {tuple(k.shape)}, "
                             f"{tuple(v.shape)}")
        if k.shape[seq_dim] != v.shape[seq_dim]:
            raise ValueError(f"{owner}: key_layer and value_layer must have the same sequence "
                             f"length, got shapes {tuple(k.shape)} and {tuple(v.shape)}")
        if self.attention_type == "self" and q.shape[seq_dim] != k.shape[seq_dim]:
            raise ValueError(f"{owner}: self-attention needs query and key/value of the same "
                             f"sequence length, got shapes {tuple(q.shape)} and "
                             f"{tuple(k.shape)}")
        if not (q.dtype == k.dtype == v.dtype) and not torch.is_autocast_enabled(
                q.device.type):
            raise TypeError(f"{owner}: query_layer, key_layer and value_layer must have one "
                            f"dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
        perm = (1, 2, 0, 3) if fmt == "sbhd" else (0, 2, 1, 3)
        return q.permute(perm), k.permute(perm), v.permute(perm)

    def _sdpa(self, q, k, v, allowed, is_causal, dropout):
        if (dropout > 0.0 and self.get_rng_state_tracker is not None
                and not self._dropout_outside_fork):
            # The dropout mask from the tracker's stream (Transformer Engine's default name);
            # the default generators are left as if nothing had been drawn.
            with self.get_rng_state_tracker().fork(distributed.DEFAULT_RNG_TRACKER_NAME):
                return self._sdpa_sink(q, k, v, allowed, is_causal, dropout)
        return self._sdpa_sink(q, k, v, allowed, is_causal, dropout)

    def _sdpa_sink(self, q, k, v, allowed, is_causal, dropout):
        if self.softmax_type != "vanilla":
            alpha = (self.softmax_offset if self.softmax_type == "learnable"
                     else q.new_zeros(self.num_attention_heads_per_partition,
                                      dtype=torch.float32))
            q, k, v, allowed, is_causal, rows = with_sink(q, k, v, allowed, is_causal, alpha,
                                                          self.softmax_scale)
            # (No query row is left without a key: the sink takes every row's mass.)
            out = self._sdpa_vanilla(q, k, v, allowed, is_causal, dropout)
            return out[:, :, rows:, :self.hidden_size_per_attention_head_v]
        return self._sdpa_vanilla(q, k, v, allowed, is_causal, dropout)

    def _sdpa_vanilla(self, q, k, v, allowed, is_causal, dropout):
        groups = self.num_attention_heads // self.num_gqa_groups
        gqa = {}
        if groups > 1:
            # SDPA's own GQA where it helps (unmasked: the flash kernel takes it); with a mask
            # the memory-efficient kernel does not, so the key/value heads are repeated.
            if _SDPA_HAS_GQA and allowed is None:
                gqa = {"enable_gqa": True}
            else:
                k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        if allowed is None:
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout,
                                                  is_causal=is_causal, scale=self.softmax_scale,
                                                  **gqa)
        # A query row that may attend to nothing (a padded query) would give NaN: let it attend
        # to everything, then zero its output. No branch on the data (no host sync).
        dead = ~allowed.any(dim=-1, keepdim=True)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed | dead,
                                             dropout_p=dropout, scale=self.softmax_scale, **gqa)
        return out.masked_fill(dead, 0.0)

    def _load_from_state_dict(self, state_dict, prefix, *args):
        super()._load_from_state_dict(state_dict, prefix, *args)
        te_checkpoint.drop_extra_state(state_dict, prefix, args[3], "DotProductAttention",
                                       nested=("fused_attention",))

    def extra_repr(self) -> str:
        return (f"num_attention_heads={self.num_attention_heads}, "
                f"kv_channels={self.kv_channels}, num_gqa_groups={self.num_gqa_groups}, "
                f"qkv_format={self.qkv_format}, attn_mask_type={self.attn_mask_type}")
