"""Transformer Engine's InferenceParams: a KV cache for generation (non-paged, "bshd" cache).

    params = InferenceParams(max_batch_size, max_sequence_length, num_heads_kv, head_dim_k,
                             dtype)
    params.pre_step(OrderedDict({seq_id: step_length, ...}))   # before every forward
    out = model(tokens, ..., inference_params=params)           # [b, s, ...] or [s, b, ...]

pre_step announces the batch of this forward: row i of the inputs is the i-th sequence of
step_dict, whose first step_length tokens are real (padding at the end). A new sequence id
starts at length 0 (the prefill: its prompt), a known one grows by step_length (a decode step:
1), an id left out is finished and its cache row reused. Each DotProductAttention (keyed by its
layer_number) writes its new keys and values after the cached ones (step) and attends to the
whole sequence with a bottom-right causal diagonal: the new tokens are the last ones. Rotary
embeddings then start at each sequence's cached length. The output token of sequence i is the
row at step_length - 1 of its inputs. Under torch.no_grad() or torch.inference_mode() only.

Memory per layer: k and v caches [max_batch_size, max_sequence_length, num_heads_kv, head_dim]
in dtype, zeros at first, on the device of the first keys stepped in (or allocate_memory's).
Not supported (refused naming the argument): is_paged=True and its page options, the "thd"
format (max_ctx_len), custom_cache_manager.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Optional

import torch

_OWNER = "InferenceParams"
FORMATS = ("bshd", "sbhd")


def _positive(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{_OWNER}: {name} must be a positive integer, got {value!r}")
    return value


class InferenceParams:
    """KV caching for inference, with Transformer Engine's constructor arguments (see the
    module docstring). num_heads_kv, head_dim_k and dtype are required, as in Transformer
    Engine 2.2+; head_dim_v defaults to head_dim_k. device (keyword): where the caches live;
    None: the device of the first keys stepped in."""

    def __init__(self, max_batch_size: int, max_sequence_length: int,
                 num_heads_kv: Optional[int] = None, head_dim_k: Optional[int] = None,
                 dtype: Optional[torch.dtype] = None, head_dim_v: Optional[int] = None,
                 is_paged: bool = False, total_num_pages: Optional[int] = None,
                 page_size: Optional[int] = None, max_ctx_len: Optional[int] = None,
                 qkv_format: str = "bshd", custom_cache_manager=None, *, device=None):
        for name, value in (("is_paged", is_paged), ("total_num_pages", total_num_pages),
                            ("page_size", page_size)):
            if value not in (None, False):
                raise ValueError(f"{_OWNER}: {name}={value!r} is not supported (no paged KV "
                                 "cache: one [max_batch_size, max_sequence_length, ...] cache "
                                 "per layer); leave it at its default")
        if custom_cache_manager is not None:
            raise ValueError(f"{_OWNER}: custom_cache_manager is not supported (one built-in "
                             "non-paged cache); leave it at None")
        if qkv_format not in FORMATS or max_ctx_len is not None:
            name, value = ("max_ctx_len", max_ctx_len) if qkv_format in FORMATS \
                else ("qkv_format", qkv_format)
            raise ValueError(f"{_OWNER}: {name}={value!r} is not supported (qkv_format must be "
                             f"one of {FORMATS}; 'thd', packed sequences, and its max_ctx_len "
                             "are not)")
        for name, value in (("num_heads_kv", num_heads_kv), ("head_dim_k", head_dim_k),
                            ("dtype", dtype)):
            if value is None:
                raise ValueError(f"{_OWNER}: {name} is required (num_heads_kv, head_dim_k and "
                                 "dtype size the cache)")
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(f"{_OWNER}: dtype must be a floating-point torch.dtype, got "
                             f"{dtype!r}")
        self.max_batch_size = _positive("max_batch_size", max_batch_size)
        self.max_sequence_length = _positive("max_sequence_length", max_sequence_length)
        self.num_heads_kv = _positive("num_heads_kv", num_heads_kv)
        self.head_dim_k = _positive("head_dim_k", head_dim_k)
        self.head_dim_v = _positive("head_dim_v", head_dim_k if head_dim_v is None
                                    else head_dim_v)
        self.dtype = dtype
        self.is_paged = False
        self.input_qkv_format = qkv_format
        self.device = None if device is None else torch.device(device)
        self.cache: dict = {}  # layer_number -> (k_cache, v_cache)
        self.reset()

    def reset(self) -> None:
        """Forget every sequence (the cache memory is kept and reused)."""
        self.sequences = OrderedDict()           # seq_id -> length after this step
        self.sequences_pre_step = OrderedDict()  # seq_id -> length before it
        self.step_lengths: list = []
        self.batch_size = 0
        self._stepped: set = set()
        self._tensors: dict = {}

    def __repr__(self) -> str:
        return (f"InferenceParams(dtype={self.dtype}, is_paged=False, max_batch_size="
                f"{self.max_batch_size}, max_seqlen={self.max_sequence_length}, num_heads="
                f"{self.num_heads_kv}, head_dim_k={self.head_dim_k}, head_dim_v="
                f"{self.head_dim_v})")

    def allocate_memory(self, layer_number: int, device=None) -> None:
        """Zeroed k and v caches for layer_number, [max_batch_size, max_sequence_length,
        num_heads_kv, head_dim] on device (default: the constructor's, else the current CUDA
        device if there is one, else the CPU)."""
        device = device or self.device or (
            torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
            else torch.device("cpu"))
        shape = (self.max_batch_size, self.max_sequence_length, self.num_heads_kv)
        self.cache[layer_number] = (
            torch.zeros(*shape, self.head_dim_k, dtype=self.dtype, device=device),
            torch.zeros(*shape, self.head_dim_v, dtype=self.dtype, device=device))

    def pre_step(self, step_dict) -> OrderedDict:
        """Announce the next forward: step_dict {seq_id: new tokens} in the batch's row order.
        Returns the sequences' lengths after the step."""
        if not isinstance(step_dict, dict) or not step_dict:
            raise ValueError(f"{_OWNER}.pre_step: step_dict must be a non-empty dict "
                             "{sequence id: number of new tokens}, got "
                             f"{type(step_dict).__name__}")
        if len(step_dict) > self.max_batch_size:
            raise ValueError(f"{_OWNER}.pre_step: {len(step_dict)} sequences exceed "
                             f"max_batch_size ({self.max_batch_size})")
        lengths = OrderedDict()
        for seq_id, step in step_dict.items():
            if isinstance(step, bool) or not isinstance(step, int) or step < 1:
                raise ValueError(f"{_OWNER}.pre_step: step_dict[{seq_id!r}] must be a "
                                 f"positive int (the sequence's new tokens), got {step!r}")
            lengths[seq_id] = self.sequences.get(seq_id, 0) + step
            if lengths[seq_id] > self.max_sequence_length:
                raise ValueError(f"{_OWNER}.pre_step: sequence {seq_id!r} would hold "
                                 f"{lengths[seq_id]} tokens, more than max_sequence_length "
                                 f"({self.max_sequence_length})")
        self._reindex(list(step_dict))
        self.sequences = lengths
        self.sequences_pre_step = OrderedDict(
            (seq_id, lengths[seq_id] - step) for seq_id, step in step_dict.items())
        self.step_lengths = list(step_dict.values())
        self.batch_size = len(step_dict)
        self._stepped, self._tensors = set(), {}
        return self.sequences

    def _reindex(self, seq_ids: list) -> None:
        """Move the cache rows so that row i holds seq_ids[i] (a new sequence takes a row no
        continuing one keeps; what it holds is overwritten from position 0)."""
        old_rows = {seq_id: row for row, seq_id in enumerate(self.sequences)}
        free = iter(sorted(set(range(self.max_batch_size)) - {
            old_rows[s] for s in seq_ids if s in old_rows}))
        rows = [old_rows[s] if s in old_rows else next(free) for s in seq_ids]
        if rows == list(range(len(rows))):
            return
        for k_cache, v_cache in self.cache.values():
            index = torch.tensor(rows, device=k_cache.device)
            k_cache[:len(rows)] = k_cache.index_select(0, index)
            v_cache[:len(rows)] = v_cache.index_select(0, index)

    def _check_announced(self, owner: str) -> None:
        if self.batch_size == 0:
            raise RuntimeError(f"{owner}: no sequences announced: call "
                               "inference_params.pre_step(step_dict) before each forward")

    def start_positions(self, owner: str, batch: int) -> list:
        """Where each sequence's new tokens start (its cached length), checking that the
        input holds the batch pre_step announced."""
        self._check_announced(owner)
        if batch != self.batch_size:
            raise ValueError(f"{owner}: the input's batch ({batch}) is not the number of "
                             f"sequences inference_params.pre_step announced "
                             f"({self.batch_size}); check step_dict and the input's layout "
                             "('sbhd': [s, b, ...], 'bshd': [b, s, ...])")
        return list(self.sequences_pre_step.values())

    def get_seqlens_pre_step(self, device=None) -> torch.Tensor:
        """The cached lengths before this step, int32 [max_batch_size] (zeros past the batch):
        where each sequence's new tokens start (rotary embeddings)."""
        pre = list(self.sequences_pre_step.values())
        return self._tensor("pre", pre + [0] * (self.max_batch_size - len(pre)), device)

    def step(self, layer_number: int, new_k: torch.Tensor, new_v: torch.Tensor,
             qkv_format: str):
        """Write layer_number's new keys and values ([b, s, g, d] "bshd" or [s, b, g, d]
        "sbhd", each sequence's first step_length tokens real) into its cache. Returns
        (k, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_kv, format): k and v [b, max_seqlen_kv,
        g, d] views of the cache ("bshd"), max_seqlen_kv the longest sequence now (Transformer
        Engine returns the whole max_sequence_length), format "bshd" or "sbhd_2bshd"."""
        owner = f"{_OWNER}.step"
        if qkv_format not in FORMATS:
            raise ValueError(f"{owner}: qkv_format must be one of {FORMATS}, got "
                             f"{qkv_format!r}")
        self._check_announced(owner)
        if layer_number in self._stepped:
            raise RuntimeError(f"{owner}: layer_number {layer_number!r} was stepped twice "
                               "since the last pre_step: call pre_step before each forward, "
                               "and give every attention layer its own layer_number")
        if torch.is_grad_enabled() and (new_k.requires_grad or new_v.requires_grad):
            # The cache would chain every step's autograd graph (and keep it alive).
            raise RuntimeError(f"{owner}: the KV cache is for inference: run the forward "
                               "under torch.no_grad() or torch.inference_mode()")
        if qkv_format == "sbhd":
            new_k, new_v = new_k.transpose(0, 1), new_v.transpose(0, 1)
        self._check_new(owner, layer_number, new_k, new_v)
        if layer_number not in self.cache:
            self.allocate_memory(layer_number, new_k.device)
        k_cache, v_cache = self.cache[layer_number]
        b, pre, steps = self.batch_size, list(self.sequences_pre_step.values()), \
            self.step_lengths
        if len(set(pre)) == 1 and len(set(steps)) == 1:  # one copy for the whole batch
            k_cache[:b, pre[0]:pre[0] + steps[0]] = new_k[:, :steps[0]]
            v_cache[:b, pre[0]:pre[0] + steps[0]] = new_v[:, :steps[0]]
        else:
            for row, (start, n) in enumerate(zip(pre, steps)):
                k_cache[row, start:start + n] = new_k[row, :n]
                v_cache[row, start:start + n] = new_v[row, :n]
        self._stepped.add(layer_number)
        lengths = list(self.sequences.values())
        longest = max(lengths)
        return (k_cache[:b, :longest], v_cache[:b, :longest],
                self._cu_seqlens("cu_q", steps, new_k.device),
                self._cu_seqlens("cu_kv", lengths, new_k.device), longest,
                "bshd" if qkv_format == "bshd" else "sbhd_2bshd")

    def _check_new(self, owner, layer_number, new_k, new_v) -> None:
        """new_k, new_v in "bshd" against the announced batch and the cache."""
        for name, t, head_dim in (("new_k", new_k, self.head_dim_k),
                                  ("new_v", new_v, self.head_dim_v)):
            if not isinstance(t, torch.Tensor) or t.dim() != 4 \
                    or t.shape[0] != self.batch_size or t.shape[2:] != (self.num_heads_kv,
                                                                        head_dim):
                got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"{owner}: {name} must have batch {self.batch_size} (the "
                                 f"sequences pre_step announced), num_heads_kv "
                                 f"{self.num_heads_kv} heads of size {head_dim}; got {got} "
                                 "(as [b, s, heads, d])")
            if t.shape[1] < max(self.step_lengths):
                raise ValueError(f"{owner}: {name} holds {t.shape[1]} tokens per sequence, "
                                 f"fewer than the step's longest ({max(self.step_lengths)})")
            if t.dtype != self.dtype:
                raise TypeError(f"{owner}: {name} is {t.dtype} but the cache is {self.dtype}: "
                                "build InferenceParams with dtype= the keys' dtype")
        cached = self.cache.get(layer_number)
        device = cached[0].device if cached is not None else self.device
        if device is not None and new_k.device != _indexed(device):
            raise ValueError(f"{owner}: the keys are on {new_k.device} but layer "
                             f"{layer_number!r}'s cache is on {device}")

    def _cu_seqlens(self, key, lengths, device) -> torch.Tensor:
        cumulative = [0]
        for n in lengths:
            cumulative.append(cumulative[-1] + n)
        pad = [cumulative[-1]] * (self.max_batch_size - len(lengths))
        return self._tensor(key, cumulative + pad, device)

    def _tensor(self, key, values, device) -> torch.Tensor:
        """An int32 tensor of values on device, made once per step."""
        device = torch.device(device or self.device or "cpu")
        if (key, device) not in self._tensors:
            self._tensors[key, device] = torch.tensor(values, dtype=torch.int32, device=device)
        return self._tensors[key, device]

    def padding_masks(self, seq_q: int, seq_kv: int, device):
        """This step's (query, key/value) padding masks [b, 1, 1, s], True = padding: the
        new tokens past each step length, the cache past each sequence's length."""
        key = ("pads", seq_q, seq_kv, torch.device(device))
        if key not in self._tensors:
            b = self.batch_size
            q_len = torch.tensor(self.step_lengths).view(b, 1, 1, 1)
            kv_len = torch.tensor(list(self.sequences.values())).view(b, 1, 1, 1)
            self._tensors[key] = (torch.arange(seq_q).view(1, 1, 1, seq_q).ge(q_len).to(device),
                                  torch.arange(seq_kv).view(1, 1, 1, seq_kv).ge(kv_len)
                                  .to(device))
        return self._tensors[key]


def kv_cache_step(params, layer_number, key_layer, value_layer, fmt, mask_type, bottom_right,
                  seq_q):
    """DotProductAttention's side of the cache: step layer_number's keys and values in; returns
    (k, v [b, s_kv, g, d] "bshd", attention_mask, mask_type, bottom_right) for the attention
    of the seq_q new queries over the whole sequences."""
    owner = "DotProductAttention"
    if not isinstance(params, InferenceParams):
        raise TypeError(f"{owner}: inference_params must be a transformer_fp8.InferenceParams, "
                        f"got {type(params).__name__}")
    if layer_number is None:
        raise ValueError(f"{owner}: inference_params needs a layer_number (the key of this "
                         "layer's KV cache): build DotProductAttention(layer_number=...)")
    if mask_type == "arbitrary":
        raise ValueError(f"{owner}: attn_mask_type 'arbitrary' is not supported with "
                         "inference_params (the mask comes from the sequences' lengths); use "
                         "'padding_causal'")
    if "causal" in mask_type:  # the new queries are the last tokens of their sequences
        mask_type, bottom_right = "padding_causal_bottom_right", True
    else:
        mask_type = "padding"
    k, v = params.step(layer_number, key_layer, value_layer, fmt)[:2]
    seq_kv = k.shape[1]
    if all(n == seq_q for n in params.step_lengths) and \
            all(n == seq_kv for n in params.sequences.values()):
        # No padding anywhere (the batch's sequences are as long as each other).
        return k, v, None, mask_type.replace("padding_", "").replace("padding", "no_mask"), \
            bottom_right
    return k, v, params.padding_masks(seq_q, seq_kv, k.device), mask_type, bottom_right


def _indexed(device: torch.device) -> torch.device:
    """device with its index: "cuda" names the current CUDA device, as it does when torch
    allocates there (a tensor's device always has its index, so "cuda" != "cuda:0")."""
    if device.index is None and device.type not in ("cpu", "meta"):
        module = getattr(torch, device.type, None)
        if module is not None and hasattr(module, "current_device"):
            return torch.device(device.type, module.current_device())
    return device
