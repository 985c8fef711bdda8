"""Transformer Engine's TransformerLayer (encoder / decoder-only block) and its self-attention.

    TransformerLayer
      self_attention: MultiheadAttention
        layernorm_qkv:  LayerNormLinear   norm -> fused QKV projection, (h + 2g) * d outputs
        core_attention: DotProductAttention (high precision)
        proj:           Linear            attention output projection
      layernorm_mlp:    LayerNormMLP      norm -> fc1 -> activation -> fc2

Pre-norm residuals, as Transformer Engine: x + drop(proj(attn(ln(x)))), then the same with the
MLP; with apply_residual_connection_post_layernorm the residual is the norm's output instead.
Inside fp8_autocast the four GEMMs run in FP8 through the submodules, each with its own scales;
outside it the layer computes exactly the high-precision composition of their torch forms.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

from .attention import (DotProductAttention, apply_rotary_pos_emb, check_mask_type,
                        check_qkv_format)
from .layernorm_linear import LayerNormLinear
from .layernorm_mlp import LayerNormMLP
from .linear import Linear
from .norm_first import check_positive, check_unsupported, te_default_init
from .recipe import Recipe


def _check_dropout(owner: str, name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise ValueError(f"{owner}: {name} must be in [0, 1), got {value!r}")
    return float(value)


def _one_dtype(owner: str, dtype, params_dtype):
    if dtype is not None and params_dtype is not None and dtype != params_dtype:
        raise ValueError(f"{owner}: 'dtype' ({dtype}) and 'params_dtype' ({params_dtype}) "
                         "name the same thing and must agree; pass one")
    return dtype if dtype is not None else params_dtype


def _refuse_unless(owner: str, options: dict, name: str, allowed: tuple, why: str) -> None:
    """Pop a Transformer Engine option that is accepted only at the values ``allowed``."""
    if name in options:
        value = options.pop(name)
        if value not in allowed:
            raise ValueError(f"{owner}: {name}={value!r} is not supported ({why}); leave it at "
                             f"{allowed[0]!r}")


class MultiheadAttention(torch.nn.Module):
    """Transformer Engine's MultiheadAttention for self-attention with an input norm:
    layernorm_qkv (LayerNormLinear, hidden -> (h + 2g) * d), core_attention
    (DotProductAttention), proj (Linear, h * d -> hidden).

    QKV layout of layernorm_qkv's weight rows: with fuse_qkv_params and qkv_weight_interleaved
    (Transformer Engine's fused layout) per key/value group g: its h/g query heads, its key,
    its value; otherwise [all queries | all keys | all values] (Transformer Engine's layout
    without fuse_qkv_params, whose three parameters are here one: weight, and bias).
    forward(hidden_states, attention_mask=None, attn_mask_type=None, rotary_pos_emb=None,
    is_first_microbatch=None, checkpoint_core_attention=False) -> [s, b, hidden] (or
    (out, norm output) with return_layernorm_output).
    """

    def __init__(self, hidden_size: int, num_attention_heads: int,
                 kv_channels: Optional[int] = None, attention_dropout: float = 0.1,
                 layernorm_epsilon: float = 1e-5, init_method: Optional[Callable] = None,
                 output_layer_init_method: Optional[Callable] = None,
                 layer_number: Optional[int] = None, attn_mask_type: str = "causal",
                 num_gqa_groups: Optional[int] = None, return_layernorm_output: bool = False,
                 input_layernorm: bool = True, attention_type: str = "self",
                 fuse_qkv_params: bool = False, qkv_weight_interleaved: bool = True,
                 zero_centered_gamma: bool = False, normalization: str = "LayerNorm",
                 bias: bool = True, params_dtype: Optional[torch.dtype] = None, device=None,
                 qkv_format: str = "sbhd", softmax_scale: Optional[float] = None, *,
                 dtype: Optional[torch.dtype] = None, recipe: Optional[Recipe] = None,
                 **te_options):
        super().__init__()
        owner = "MultiheadAttention"
        if attention_type != "self":
            raise ValueError(f"{owner}: attention_type={attention_type!r} is not supported "
                             "(no cross-attention); leave it at 'self'")
        if not input_layernorm:
            raise ValueError(f"{owner}: input_layernorm=False is not supported (the QKV "
                             "projection is always a LayerNormLinear); leave it at True")
        _refuse_unless(owner, te_options, "return_bias", (False,), "the projection's bias is "
                       "always added")
        _refuse_unless(owner, te_options, "window_size", (None, (-1, -1), (-1, 0)),
                       "no sliding-window attention")
        check_unsupported(owner, te_options)
        dtype = _one_dtype(owner, dtype, params_dtype)
        self.hidden_size = check_positive(owner, "hidden_size", hidden_size)
        heads = check_positive(owner, "num_attention_heads", num_attention_heads)
        if kv_channels is None:
            if hidden_size % heads:
                raise ValueError(f"{owner}: hidden_size ({hidden_size}) must be a multiple of "
                                 f"num_attention_heads ({heads}) when kv_channels is not given")
            kv_channels = hidden_size // heads
        core_attention = DotProductAttention(
            heads, kv_channels, num_gqa_groups=num_gqa_groups,
            attention_dropout=attention_dropout, qkv_format=qkv_format,
            attn_mask_type=attn_mask_type, layer_number=layer_number,
            softmax_scale=softmax_scale)
        self.num_attention_heads, self.kv_channels = heads, kv_channels
        self.num_gqa_groups = core_attention.num_gqa_groups
        self.qkv_format = core_attention.qkv_format
        self.qkv_weight_interleaved = bool(fuse_qkv_params and qkv_weight_interleaved)
        self.return_layernorm_output = bool(return_layernorm_output)
        factory = dict(params_dtype=dtype, device=device, recipe=recipe)
        qkv_out = (heads + 2 * self.num_gqa_groups) * kv_channels
        self.layernorm_qkv = LayerNormLinear(
            hidden_size, qkv_out, eps=layernorm_epsilon, init_method=init_method, bias=bias,
            normalization=normalization, return_layernorm_output=return_layernorm_output,
            zero_centered_gamma=zero_centered_gamma, **factory)
        self.core_attention = core_attention
        self.proj = Linear(heads * kv_channels, hidden_size, bias=bias, **factory)
        self.output_layer_init_method = output_layer_init_method or te_default_init
        self._reset_proj()

    def _reset_proj(self) -> None:
        if self.proj.weight.is_meta:
            return
        self.output_layer_init_method(self.proj.weight)
        if self.proj.bias is not None:
            with torch.no_grad():
                self.proj.bias.zero_()

    def split_qkv(self, mixed: torch.Tensor):
        """The QKV projection's output [..., (h + 2g) * d] as q [..., h, d], k and v
        [..., g, d] (views where the layout allows)."""
        h, g, d = self.num_attention_heads, self.num_gqa_groups, self.kv_channels
        lead = mixed.shape[:-1]
        if self.qkv_weight_interleaved:
            per_group = mixed.view(*lead, g, h // g + 2, d)
            q, k, v = per_group.split([h // g, 1, 1], dim=-2)
            return q.reshape(*lead, h, d), k.reshape(*lead, g, d), v.reshape(*lead, g, d)
        q, k, v = mixed.split([h * d, g * d, g * d], dim=-1)
        return q.view(*lead, h, d), k.view(*lead, g, d), v.view(*lead, g, d)

    def forward(self, hidden_states: torch.Tensor, attention_mask=None,
                attn_mask_type: Optional[str] = None,
                rotary_pos_emb: Optional[torch.Tensor] = None,
                is_first_microbatch: Optional[bool] = None,
                checkpoint_core_attention: bool = False, **attention_options):
        out = self.layernorm_qkv(hidden_states, is_first_microbatch=is_first_microbatch)
        mixed, ln_out = out if self.return_layernorm_output else (out, None)
        q, k, v = self.split_qkv(mixed)
        if rotary_pos_emb is not None:
            # One tensor for both, or (query angles, key angles) as Transformer Engine takes.
            q_freqs, k_freqs = (rotary_pos_emb if isinstance(rotary_pos_emb, (tuple, list))
                                else (rotary_pos_emb, rotary_pos_emb))
            q = apply_rotary_pos_emb(q, q_freqs, self.qkv_format)
            k = apply_rotary_pos_emb(k, k_freqs, self.qkv_format)
        context = self.core_attention(q, k, v, attention_mask=attention_mask,
                                      attn_mask_type=attn_mask_type,
                                      checkpoint_core_attention=checkpoint_core_attention,
                                      **attention_options)
        out = self.proj(context, is_first_microbatch=is_first_microbatch)
        return (out, ln_out) if self.return_layernorm_output else out


# Transformer Engine's TransformerLayer options accepted only at these values (first = default).
_LAYER_OPTIONS = {
    "drop_path_rate": ((0.0, 0), "no stochastic depth"),
    "parallel_attention_mlp": ((False,), "attention and MLP run one after the other"),
    "window_size": ((None, (-1, -1), (-1, 0)), "no sliding-window attention"),
    "enc_dec_window_size": ((None,), "no cross-attention"),
    "rotary_pos_interleaved": ((False,), "rotary embeddings rotate halves, not pairs"),
}
# Sizes Transformer Engine uses for sequence parallelism only: accepted, unused.
_LAYER_HINTS = ("seq_length", "micro_batch_size", "enc_dec_attn_mask_type")
_FORWARD_UNUSED = ("encoder_output", "enc_dec_attn_mask", "enc_dec_attn_mask_type",
                   "enc_dec_window_size")


class TransformerLayer(torch.nn.Module):
    """Transformer Engine's TransformerLayer ("encoder": self-attention then MLP, the block of
    GPT/Llama-style models), built from LayerNormLinear, DotProductAttention, Linear and
    LayerNormMLP; inside fp8_autocast every GEMM runs in FP8.

    hidden_states: [s, b, hidden] with attn_input_format "sbhd" (the default), [b, s, hidden]
    with "bshd" (qkv_format is accepted as another name for it). forward(hidden_states,
    attention_mask=None, self_attn_mask_type=None, rotary_pos_emb=None,
    is_first_microbatch=None, checkpoint_core_attention=False): attention_mask and the mask
    types as DotProductAttention's (True = masked out); rotary_pos_emb the [s, 1, 1, d] angles
    of RotaryPositionEmbedding.
    Weights are initialised as Transformer Engine does: init_method for the QKV projection and
    fc1, output_layer_init_method for proj and fc2 (both default normal(0, 0.023)), biases
    zero. params_dtype (or dtype), device and recipe reach every submodule.
    Not supported (refused with a ValueError): layer_type="decoder" (cross-attention),
    output_layernorm=True (post-norm), and tensor/sequence/context parallelism.
    """

    def __init__(self, hidden_size: int, ffn_hidden_size: int, num_attention_heads: int,
                 num_gqa_groups: Optional[int] = None, layernorm_epsilon: float = 1e-5,
                 hidden_dropout: float = 0.1, attention_dropout: float = 0.1,
                 init_method: Optional[Callable] = None,
                 output_layer_init_method: Optional[Callable] = None,
                 layer_number: Optional[int] = None, kv_channels: Optional[int] = None,
                 self_attn_mask_type: str = "causal",
                 apply_residual_connection_post_layernorm: bool = False,
                 output_layernorm: bool = False, layer_type: str = "encoder",
                 zero_centered_gamma: bool = False, normalization: str = "LayerNorm",
                 activation: str = "gelu", bias: bool = True, fuse_qkv_params: bool = False,
                 params_dtype: Optional[torch.dtype] = None, device=None,
                 qkv_format: Optional[str] = None, attn_input_format: Optional[str] = None,
                 dtype: Optional[torch.dtype] = None, recipe: Optional[Recipe] = None,
                 qkv_weight_interleaved: bool = True, softmax_scale: Optional[float] = None,
                 **te_options):
        super().__init__()
        owner = "TransformerLayer"
        if layer_type != "encoder":
            raise ValueError(f"{owner}: layer_type={layer_type!r} is not supported (no "
                             "cross-attention: a decoder-only model's blocks are 'encoder' "
                             "layers with a causal mask); leave it at 'encoder'")
        if output_layernorm:
            raise ValueError(f"{owner}: output_layernorm=True is not supported (post-norm "
                             "layers); leave it at False")
        for name, (allowed, why) in _LAYER_OPTIONS.items():
            _refuse_unless(owner, te_options, name, allowed, why)
        for name in _LAYER_HINTS:
            te_options.pop(name, None)
        check_unsupported(owner, te_options)
        if qkv_format is not None and attn_input_format is not None \
                and qkv_format != attn_input_format:
            raise ValueError(f"{owner}: 'qkv_format' ({qkv_format!r}) and 'attn_input_format' "
                             f"({attn_input_format!r}) name the same thing and must agree; "
                             "pass one")
        fmt = check_qkv_format(owner, "attn_input_format",
                               attn_input_format or qkv_format or "sbhd")
        dtype = _one_dtype(owner, dtype, params_dtype)
        self.hidden_size = check_positive(owner, "hidden_size", hidden_size)
        self.ffn_hidden_size = check_positive(owner, "ffn_hidden_size", ffn_hidden_size)
        self.hidden_dropout = _check_dropout(owner, "hidden_dropout", hidden_dropout)
        self.self_attn_mask_type = check_mask_type(owner, "self_attn_mask_type",
                                                   self_attn_mask_type)
        self.apply_residual_connection_post_layernorm = bool(
            apply_residual_connection_post_layernorm)
        self.attn_input_format = fmt
        self.layer_number = layer_number
        init_method = init_method or te_default_init
        output_layer_init_method = output_layer_init_method or te_default_init
        common = dict(params_dtype=dtype, device=device, recipe=recipe, bias=bias,
                      normalization=normalization, zero_centered_gamma=zero_centered_gamma,
                      init_method=init_method, output_layer_init_method=output_layer_init_method,
                      return_layernorm_output=self.apply_residual_connection_post_layernorm)
        self.self_attention = MultiheadAttention(
            hidden_size, num_attention_heads, kv_channels=kv_channels,
            attention_dropout=_check_dropout(owner, "attention_dropout", attention_dropout),
            layernorm_epsilon=layernorm_epsilon, layer_number=layer_number,
            attn_mask_type=self.self_attn_mask_type, num_gqa_groups=num_gqa_groups,
            fuse_qkv_params=fuse_qkv_params, qkv_weight_interleaved=qkv_weight_interleaved,
            qkv_format=fmt, softmax_scale=softmax_scale, **common)
        self.layernorm_mlp = LayerNormMLP(hidden_size, ffn_hidden_size, eps=layernorm_epsilon,
                                          activation=activation, **common)

    def forward(self, hidden_states: torch.Tensor, attention_mask=None,
                self_attn_mask_type: Optional[str] = None,
                rotary_pos_emb: Optional[torch.Tensor] = None,
                is_first_microbatch: Optional[bool] = None,
                checkpoint_core_attention: bool = False, **options) -> torch.Tensor:
        owner = "TransformerLayer"
        for name in _FORWARD_UNUSED:
            if options.pop(name, None) not in (None, "no_mask"):
                raise ValueError(f"{owner}.forward: {name} is not supported (no "
                                 "cross-attention); leave it at None")
        if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() != 3 \
                or hidden_states.shape[-1] != self.hidden_size:
            lead = "s, b" if self.attn_input_format == "sbhd" else "b, s"
            got = (tuple(hidden_states.shape) if isinstance(hidden_states, torch.Tensor)
                   else type(hidden_states).__name__)
            raise ValueError(f"{owner}: hidden_states must have shape [{lead}, "
                             f"{self.hidden_size}] (attn_input_format "
                             f"{self.attn_input_format!r}), got {got}")
        post_ln = self.apply_residual_connection_post_layernorm
        attn = self.self_attention(hidden_states, attention_mask=attention_mask,
                                   attn_mask_type=self_attn_mask_type,
                                   rotary_pos_emb=rotary_pos_emb,
                                   is_first_microbatch=is_first_microbatch,
                                   checkpoint_core_attention=checkpoint_core_attention,
                                   **options)
        attn, residual = attn if post_ln else (attn, hidden_states)
        hidden = residual + self._dropout(attn)
        mlp = self.layernorm_mlp(hidden, is_first_microbatch=is_first_microbatch)
        mlp, residual = mlp if post_ln else (mlp, hidden)
        return residual + self._dropout(mlp)

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        if self.hidden_dropout == 0.0 or not self.training:
            return x
        return F.dropout(x, self.hidden_dropout, training=True)

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, ffn_hidden_size={self.ffn_hidden_size}, "
                f"attn_input_format={self.attn_input_format}, "
                f"hidden_dropout={self.hidden_dropout}")
