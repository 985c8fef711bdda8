"""Transformer Engine's MultiheadAttention (self- and cross-attention), with its arguments and
names.

    qkv (Linear) or, with input_layernorm=True, layernorm_qkv (LayerNormLinear):
        hidden -> (h + 2g) * d; Parameters query_weight, key_weight, value_weight (and
        *_bias) by default, one weight (and bias) with fuse_qkv_params=True
    attention_type="cross" instead (queries from the input, keys and values from forward's
    encoder_output, [s_kv, b, hidden]):
        query_layer (Linear) or layernorm_query (LayerNormLinear, its Parameter query_weight
        unless fuse_qkv_params): hidden -> h * d
        key_value (Linear): hidden -> 2g * d; key_weight, value_weight (one weight with
        fuse_qkv_params: per group its key then its value with qkv_weight_interleaved, else
        [all keys | all values])
    q_norm, k_norm: with qk_norm_type, norms over the head dimension (attention/qk_norm.py)
    core_attention: DotProductAttention (high precision; window_size, softmax_type)
    proj: Linear, h * d -> hidden

QKV layout of the projection's output: with fuse_qkv_params and qkv_weight_interleaved
(Transformer Engine's fused layout) per key/value group: its h/g query heads, its key, its
value; otherwise [all queries | all keys | all values], which is also how the query, key and
value Parameters are joined.

Tensor parallelism (Transformer Engine's, set_parallel_mode=True with tp_group / tp_size,
sequence_parallel): each of the n ranks holds h/n query heads and g/n key/value groups. The
QKV projection is column-parallel (a rank's query, key and value weights are its rows of each;
with fuse_qkv_params its rows of the fused weight, whole groups in the interleaved layout,
[its queries | its keys | its values] otherwise), attention runs on the rank's heads with no
communication, and proj is row-parallel (its input columns are the rank's heads; the partial
outputs are summed, or reduce-scattered along dim 0 with sequence_parallel, whose input is the
rank's part of dim 0, all-gathered before the QKV projection). te_tensor_parallel.py runs the
collectives.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from ...quantization.recipe import Recipe
from ..layernorm_linear import LayerNormLinear
from ..linear import Linear
from . import packed
from .dot_product import DotProductAttention, apply_rotary_pos_emb
from .rotary import rotate_packed
from .inference import InferenceParams
from .qk_norm import qk_norm_modules
from ..te_args import check_positive, check_te_options, one_dtype, te_default_init, \
    te_only_arguments
from ..te_tensor_parallel import configure as configure_tensor_parallel
from ..torchscript import refuse_torchscript


class MultiheadAttention(torch.nn.Module):
    """Transformer Engine's MultiheadAttention for self-attention (arguments in its order; see
    the module docstring for the submodules and Parameter names).

    input_layernorm: False (Transformer Engine's default) projects the input as it is (qkv, a
    Linear); True normalises it first (layernorm_qkv, a LayerNormLinear; return_layernorm_output
    then also returns the norm's output). return_bias returns proj's bias instead of adding it.
    forward(hidden_states, attention_mask=None, encoder_output=None, attn_mask_type=None,
    window_size=None, bottom_right_diagonal=None, is_first_microbatch=None,
    checkpoint_core_attention=False, inference_params=None, rotary_pos_emb=None, ...) returns
    out [s, b, hidden] (or [b, s, hidden] with qkv_format "bshd"), then proj's bias if
    return_bias, then the norm's output if return_layernorm_output. qk_norm_type ("RMSNorm",
    "LayerNorm", "L2Normalization") normalises each query and key head after the rotary
    embedding (before it with qk_norm_before_rope); window_size and softmax_type are
    DotProductAttention's, and so are attn_mask_type's "*_bottom_right" types and
    bottom_right_diagonal. inference_params (an InferenceParams, after its pre_step): the keys
    and values join its cache under layer_number (1 unless given), rotary embeddings start at
    each sequence's cached length, and the new tokens attend to the whole sequence.
    get_rng_state_tracker reaches DotProductAttention (attention dropout inside its fork) and
    the projections (their weights drawn inside its fork, weight_rng.py).
    attention_type="cross" (see the module docstring): forward's encoder_output is required,
    attention_mask / attn_mask_type mask the encoder's keys (a padding mask as the pair (query
    mask, key mask)), rotary_pos_emb's pair gives the keys their own angles.
    Not supported (refused): inference_params with cross-attention (no cache of the encoder's
    keys), and the options te_args lists at other values than their defaults.
    """

    __prepare_scriptable__ = refuse_torchscript  # (torch.jit.script: a clear error)

    def __init__(self, hidden_size: int, num_attention_heads: int,
                 kv_channels: Optional[int] = None, attention_dropout: float = 0.1,
                 layernorm_epsilon: float = 1e-5, init_method: Optional[Callable] = None,
                 output_layer_init_method: Optional[Callable] = None,
                 layer_number: Optional[int] = None, attn_mask_type: str = "causal",
                 window_size=None, bottom_right_diagonal=None, tp_group=None, tp_size: int = 1,
                 num_gqa_groups: Optional[int] = None, fuse_wgrad_accumulation: bool = False,
                 get_rng_state_tracker=None, sequence_parallel: bool = False,
                 params_dtype: Optional[torch.dtype] = None, return_bias: bool = False,
                 return_layernorm_output: bool = False, input_layernorm: bool = False,
                 attention_type: str = "self", set_parallel_mode: bool = False,
                 fuse_qkv_params: bool = False, zero_centered_gamma: bool = False,
                 qkv_weight_interleaved: bool = True, rotary_pos_interleaved: bool = False,
                 ub_overlap_ag: bool = False, ub_overlap_rs: bool = False,
                 ub_overlap_rs_dgrad: bool = False, ub_bulk_dgrad: bool = False,
                 ub_bulk_wgrad: bool = False, bias: bool = True,
                 normalization: str = "LayerNorm", device=None, qkv_format: str = "sbhd",
                 name=None, qk_norm_type=None, qk_norm_eps: float = 1e-6,
                 qk_norm_before_rope: bool = False, seq_length=None, micro_batch_size=None,
                 softmax_type: str = "vanilla", *, dtype: Optional[torch.dtype] = None,
                 recipe: Optional[Recipe] = None, softmax_scale: Optional[float] = None):
        owner = "MultiheadAttention"
        te_options = te_only_arguments(locals())
        te_options.pop("get_rng_state_tracker")  # (dropout and the weights in its fork)
        tp = {k: te_options.pop(k) for k in ("tp_group", "tp_size", "sequence_parallel")}
        te_options.pop("set_parallel_mode")
        check_te_options(owner, te_options)
        super().__init__()
        if attention_type not in ("self", "cross"):
            raise ValueError(f"{owner}: attention_type must be 'self' or 'cross', got "
                             f"{attention_type!r}")
        self.attention_type = attention_type
        dtype = one_dtype(owner, dtype, params_dtype)
        self.hidden_size = check_positive(owner, "hidden_size", hidden_size)
        heads = check_positive(owner, "num_attention_heads", num_attention_heads)
        if kv_channels is None:
            if hidden_size % heads:
                raise ValueError(f"{owner}: hidden_size ({hidden_size}) must be a multiple of "
                                 f"num_attention_heads ({heads}) when kv_channels is not given")
            kv_channels = hidden_size // heads
        # (one head size: a (q/k, v) pair, which DotProductAttention takes, is not
        # Transformer Engine's here either)
        kv_channels = check_positive(owner, "kv_channels", kv_channels)
        ranks = check_tensor_parallel(owner, tp, set_parallel_mode, heads,
                                      num_gqa_groups or heads)
        # layer_number keys the KV cache (inference_params): 1 unless given, as Transformer
        # Engine numbers it.
        core_attention = DotProductAttention(
            heads, kv_channels, num_gqa_groups=num_gqa_groups,
            attention_dropout=attention_dropout, qkv_format=qkv_format,
            attn_mask_type=attn_mask_type, window_size=window_size,
            bottom_right_diagonal=bottom_right_diagonal,
            layer_number=1 if layer_number is None else layer_number,
            softmax_scale=softmax_scale, softmax_type=softmax_type,
            get_rng_state_tracker=get_rng_state_tracker, device=device,
            attention_type=attention_type, **tp)
        self.q_norm, self.k_norm = qk_norm_modules(owner, qk_norm_type, qk_norm_eps, kv_channels,
                                                   dtype, device)
        self.qk_norm_before_rope = bool(qk_norm_before_rope)
        self.num_attention_heads, self.kv_channels = heads, kv_channels
        self.num_gqa_groups = groups = core_attention.num_gqa_groups
        # This rank's share of the heads (all of them on one rank), Transformer Engine's names.
        self.num_attention_heads_per_partition = heads // ranks
        self.num_gqa_groups_per_partition = groups // ranks
        self.qkv_format = core_attention.qkv_format
        self.input_layernorm = bool(input_layernorm)
        self.qkv_weight_interleaved = bool(fuse_qkv_params and qkv_weight_interleaved)
        self.return_layernorm_output = bool(return_layernorm_output and input_layernorm)
        self.return_bias = bool(return_bias)
        init_method = init_method or te_default_init
        output_layer_init_method = output_layer_init_method or te_default_init
        split = None if fuse_qkv_params else {"query": heads * kv_channels,
                                              "key": groups * kv_channels,
                                              "value": groups * kv_channels}
        common = dict(params_dtype=dtype, device=device, recipe=recipe, bias=bias,
                      fuse_wgrad_accumulation=fuse_wgrad_accumulation, parameters_split=split,
                      get_rng_state_tracker=get_rng_state_tracker,  # (weights in its fork)
                      parallel_mode="column" if set_parallel_mode else None, **tp)
        norm_options = dict(eps=layernorm_epsilon, init_method=init_method,
                            normalization=normalization,
                            return_layernorm_output=return_layernorm_output,
                            zero_centered_gamma=zero_centered_gamma)
        if attention_type == "cross":
            self._build_cross_projections(hidden_size, heads, groups, kv_channels,
                                          fuse_qkv_params, init_method, norm_options, common)
        elif self.input_layernorm:
            self.layernorm_qkv = LayerNormLinear(
                hidden_size, (heads + 2 * groups) * kv_channels, **norm_options, **common)
        else:
            self.qkv = Linear(hidden_size, (heads + 2 * groups) * kv_channels,
                              init_method=init_method, **common)
        self.core_attention = core_attention
        common["parameters_split"] = None
        common["parallel_mode"] = "row" if set_parallel_mode else None
        self.proj = Linear(heads * kv_channels, hidden_size, init_method=output_layer_init_method,
                           return_bias=return_bias, **common)
        self._share_qk_norm_gradients()

    def _build_cross_projections(self, hidden_size, heads, groups, kv_channels,
                                 fuse_qkv_params, init_method, norm_options, common) -> None:
        """Cross-attention's projections, as Transformer Engine names and splits them: the
        queries' (layernorm_query or query_layer) and the encoder output's keys and values
        (key_value)."""
        queries, keys = heads * kv_channels, groups * kv_channels
        if self.input_layernorm:
            self.layernorm_query = LayerNormLinear(
                hidden_size, queries, **norm_options,
                **dict(common, parameters_split=None if fuse_qkv_params else ("query",)))
        else:
            self.query_layer = Linear(hidden_size, queries, init_method=init_method,
                                      **dict(common, parameters_split=None))
        self.key_value = Linear(
            hidden_size, 2 * keys, init_method=init_method,
            **dict(common, parameters_split=None if fuse_qkv_params else {"key": keys,
                                                                          "value": keys}))

    def _projections(self) -> list:
        if self.attention_type == "cross":
            query = self.layernorm_query if self.input_layernorm else self.query_layer
            return [query, self.key_value, self.proj]
        return [self.layernorm_qkv if self.input_layernorm else self.qkv, self.proj]

    @property
    def tp_size(self) -> int:
        return self.core_attention.tp_size

    @property
    def tp_group(self):
        return self.core_attention.tp_group

    def set_tensor_parallel_group(self, tp_group) -> None:
        """Transformer Engine's: the tensor-parallel group, for a module built with tp_size
        and no tp_group, given to every submodule."""
        for module in (*self._projections(), self.core_attention):
            module.set_tensor_parallel_group(tp_group)
        self._share_qk_norm_gradients()

    def _share_qk_norm_gradients(self) -> None:
        """Under tensor parallelism each rank's query/key norms see its heads only: their
        weight gradients are summed over the ranks (normalization._Norm._grad_sum_over)."""
        options = self.core_attention._te_parallel
        for norm in (self.q_norm, self.k_norm):
            if norm is not None and any(True for _ in norm.parameters()):
                norm._grad_sum_over = (options if options is not None and options.size > 1
                                       else None)

    def split_qkv(self, mixed: torch.Tensor):
        """The QKV projection's output [..., (h + 2g) * d] as q [..., h, d], k and v
        [..., g, d] (views where the layout allows; h and g this rank's heads)."""
        h, g = self.num_attention_heads_per_partition, self.num_gqa_groups_per_partition
        d = self.kv_channels
        lead = mixed.shape[:-1]
        if self.qkv_weight_interleaved:
            per_group = mixed.view(*lead, g, h // g + 2, d)
            q, k, v = per_group.split([h // g, 1, 1], dim=-2)
            return q.reshape(*lead, h, d), k.reshape(*lead, g, d), v.reshape(*lead, g, d)
        q, k, v = mixed.split([h * d, g * d, g * d], dim=-1)
        return q.view(*lead, h, d), k.view(*lead, g, d), v.view(*lead, g, d)

    def split_kv(self, mixed: torch.Tensor):
        """Cross-attention's key/value projection [..., 2g * d] as k and v [..., g, d] (g
        this rank's groups)."""
        g, d = self.num_gqa_groups_per_partition, self.kv_channels
        lead = mixed.shape[:-1]
        if self.qkv_weight_interleaved:
            k, v = mixed.view(*lead, g, 2 * d).split([d, d], dim=-1)
            return k, v
        k, v = mixed.view(*lead, 2 * g, d).split([g, g], dim=-2)
        return k, v

    def __setstate__(self, state: dict) -> None:
        # (a module pickled whole before tensor parallelism: one rank holding every head;
        # before cross-attention: self-attention)
        state.setdefault("num_attention_heads_per_partition", state.get("num_attention_heads"))
        state.setdefault("num_gqa_groups_per_partition", state.get("num_gqa_groups"))
        state.setdefault("attention_type", "self")
        super().__setstate__(state)

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, encoder_output=None,
                attn_mask_type: Optional[str] = None, window_size=None,
                bottom_right_diagonal=None, is_first_microbatch: Optional[bool] = None,
                checkpoint_core_attention: bool = False, inference_params=None,
                rotary_pos_emb: Optional[torch.Tensor] = None, **attention_options):
        owner = "MultiheadAttention.forward"
        if self.attention_type == "self" and encoder_output is not None:
            raise ValueError(f"{owner}: encoder_output is for attention_type='cross'; this "
                             "module is self-attention: leave it at None")
        if self.attention_type == "cross" and not isinstance(encoder_output, torch.Tensor):
            raise ValueError(f"{owner}: attention_type='cross' needs encoder_output (the "
                             "tensor the keys and values are projected from), got "
                             f"{type(encoder_output).__name__}")
        if inference_params is not None and not isinstance(inference_params, InferenceParams):
            raise TypeError(f"{owner}: inference_params must be a "
                            "transformer_fp8.InferenceParams, got "
                            f"{type(inference_params).__name__}")
        if inference_params is not None and self.attention_type == "cross":
            raise ValueError(f"{owner}: inference_params with attention_type='cross' is not "
                             "supported (no cache of the encoder's keys and values)")
        if self.attention_type == "cross":
            q, k, v, ln_out = self._cross_projections(hidden_states, encoder_output,
                                                      is_first_microbatch)
        else:
            ln_out = None
            if self.input_layernorm:
                out = self.layernorm_qkv(hidden_states, is_first_microbatch=is_first_microbatch)
                mixed, ln_out = out if self.return_layernorm_output else (out, None)
            else:
                mixed = self.qkv(hidden_states, is_first_microbatch=is_first_microbatch)
            q, k, v = self.split_qkv(mixed)
        if self.q_norm is not None and self.qk_norm_before_rope:
            q, k = self.q_norm(q), self.k_norm(k)
        if rotary_pos_emb is not None:
            # One tensor for both, or (query angles, key angles) as Transformer Engine takes.
            q_freqs, k_freqs = (rotary_pos_emb if isinstance(rotary_pos_emb, (tuple, list))
                                else (rotary_pos_emb, rotary_pos_emb))
            # With a KV cache the new tokens start at each sequence's cached length.
            if self.qkv_format == "thd":  # packed sequences: positions restart at each one
                if inference_params is not None:
                    raise ValueError(f"{owner}: inference_params with qkv_format 'thd' is not "
                                     "supported")
                q = _rotate_packed_side(q, q_freqs, "q", attention_options)
                k = _rotate_packed_side(k, k_freqs, "kv", attention_options)
            else:
                starts = None if inference_params is None else \
                    inference_params.start_positions(
                        "MultiheadAttention", q.shape[1 if self.qkv_format == "sbhd" else 0])
                if starts is not None:
                    seq = q.shape[0 if self.qkv_format == "sbhd" else 1]
                    ends = list(inference_params.sequences.values())
                    q_freqs, k_freqs = (_covering_padding(f, max(starts) + seq, max(ends))
                                        for f in (q_freqs, k_freqs))
                q = apply_rotary_pos_emb(q, q_freqs, self.qkv_format, start_positions=starts)
                k = apply_rotary_pos_emb(k, k_freqs, self.qkv_format, start_positions=starts)
        if self.q_norm is not None and not self.qk_norm_before_rope:
            q, k = self.q_norm(q), self.k_norm(k)
        context = self.core_attention(q, k, v, attention_mask=attention_mask,
                                      attn_mask_type=attn_mask_type, window_size=window_size,
                                      bottom_right_diagonal=bottom_right_diagonal,
                                      checkpoint_core_attention=checkpoint_core_attention,
                                      inference_params=inference_params, **attention_options)
        out = self.proj(context, is_first_microbatch=is_first_microbatch)
        outputs = list(out) if self.return_bias else [out]
        if self.return_layernorm_output:
            outputs.append(ln_out)
        return outputs[0] if len(outputs) == 1 else tuple(outputs)

    def _cross_projections(self, hidden_states, encoder_output, is_first_microbatch):
        """q [..., h, d] from the input, k and v [..., g, d] from encoder_output, and the
        queries' norm output (or None)."""
        k, v = self.split_kv(self.key_value(encoder_output,
                                            is_first_microbatch=is_first_microbatch))
        ln_out = None
        if self.input_layernorm:
            out = self.layernorm_query(hidden_states, is_first_microbatch=is_first_microbatch)
            query, ln_out = out if self.return_layernorm_output else (out, None)
        else:
            query = self.query_layer(hidden_states, is_first_microbatch=is_first_microbatch)
        q = query.view(*query.shape[:-1], self.num_attention_heads_per_partition,
                       self.kv_channels)
        return q, k, v, ln_out


def _covering_padding(freqs, needed: int, real: int):
    """A KV-cache step's rotary table long enough for every row of the padded batch (``needed``
    positions): the rows past a sequence's new tokens are padding (never cached, their outputs
    masked), so the table is extended with copies of its last angles where only they fall past
    it, as Transformer Engine's fused kernel runs such a batch. ``real``: the longest sequence
    after the step; a table shorter than that is left as it is (apply_rotary_pos_emb refuses
    it)."""
    if not isinstance(freqs, torch.Tensor) or freqs.dim() != 4 or freqs.shape[0] >= needed \
            or freqs.shape[0] < real or freqs.shape[0] == 0:
        return freqs
    return torch.cat((freqs, freqs[-1:].expand(needed - freqs.shape[0], *freqs.shape[1:])))


def _rotate_packed_side(t, freqs, side: str, options: dict):
    """Rotary embeddings of packed queries or keys ("thd"): each sequence's rows (its length
    from cu_seqlens_<side>, its first row from cu_seqlens_<side>_padded where given, whatever
    pad_between_seqs says: Transformer Engine rotates at the unpadded offsets unless it is
    True) from position 0; the rows between and after the sequences unchanged."""
    owner = "MultiheadAttention"
    cu = options.get(f"cu_seqlens_{side}")
    if cu is None:
        raise ValueError(f"{owner}: qkv_format 'thd' needs cu_seqlens_q and cu_seqlens_kv (the "
                         "cumulative sequence lengths)")
    packed_layout = packed.layout(owner, f"cu_seqlens_{side}", cu,
                                  options.get(f"cu_seqlens_{side}_padded"), t.shape[0])
    return rotate_packed(owner, t, freqs, packed_layout)


def check_tensor_parallel(owner: str, tp: dict, set_parallel_mode, heads: int,
                          groups: int) -> int:
    """The tensor-parallel ranks the module is built for (tp: its tp_group, tp_size and
    sequence_parallel; checked, not consumed), after the checks: set_parallel_mode a bool,
    True where there is more than one rank (Transformer Engine shards the heads by tp_size
    whatever set_parallel_mode is, and without it runs no collective: each rank's output
    would be a partial sum), heads and groups divisible by the ranks."""
    if set_parallel_mode not in (False, True):
        raise TypeError(f"{owner}: set_parallel_mode must be True or False, got "
                        f"{set_parallel_mode!r}")
    _, _, parallel = configure_tensor_parallel(owner, 1, 1, dict(tp))
    ranks = 1 if parallel is None else parallel.size
    if ranks > 1 and not set_parallel_mode:
        raise ValueError(f"{owner}: tp_size={ranks} (or a tp_group of that many ranks) needs "
                         "set_parallel_mode=True (QKV projection column-parallel, proj "
                         "row-parallel): without it the ranks' outputs would be partial sums")
    for name, count in (("num_attention_heads", heads), ("num_gqa_groups", groups)):
        if isinstance(count, int) and count % ranks:
            raise ValueError(f"{owner}: {name} ({count}) must be divisible by the {ranks} "
                             "tensor-parallel ranks (each holds its share of the heads)")
    return ranks
