"""Transformer Engine's TransformerLayer (encoder / decoder-only block) and its self-attention.

    TransformerLayer
      self_attention: MultiheadAttention
        layernorm_qkv:  LayerNormLinear   norm -> fused QKV projection, (h + 2g) * d outputs
        core_attention: DotProductAttention (high precision)
        proj:           Linear            attention output projection
      layernorm_mlp:    LayerNormMLP      norm -> fc1 -> activation -> fc2

Pre-norm residuals, as Transformer Engine: x + drop(proj(attn(ln(x)))), then the same with the
MLP; with apply_residual_connection_post_layernorm the residual is the norm's output instead.
layer_type="decoder" adds cross-attention (inter_attention) between the two: x + drop(
cross_attn(ln(x), encoder_output)). Transformer Engine's variants: parallel_attention_mlp (x +
drop(attn(ln(x)) + mlp(ln(x))), as
GPT-J / Falcon), output_layernorm (no norm before the attention; a norm over the output, as
BERT's post-norm layers: layernorm), drop_path_rate (stochastic depth: DropPath on each
branch after its dropout).
Inside fp8_autocast the four GEMMs run in FP8 through the submodules, each with its own scales;
outside it the layer computes exactly the high-precision composition of their torch forms.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

from .attention.dot_product import check_mask_type, check_qkv_format
from .layernorm_mlp import LayerNormMLP
from .normalization import LayerNorm, RMSNorm
from .attention.multi_head_attention import MultiheadAttention, check_tensor_parallel
from ..quantization.recipe import Recipe
from .te_args import (check_positive, check_te_options, one_dtype, te_default_init,
                      te_only_arguments)
from ..quantization.torch_autocast import autocast_dtype
from .torchscript import refuse_torchscript


def _check_dropout(owner: str, name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise ValueError(f"{owner}: {name} must be in [0, 1), got {value!r}")
    return float(value)


class DropPath(torch.nn.Module):
    """Transformer Engine's DropPath (stochastic depth) while training: the branch zeroed with
    probability drop_prob, else scaled by 1 / (1 - drop_prob), one draw per index of dim 0 (the
    batch with "bshd", the sequence position with "sbhd", as Transformer Engine draws it), from
    the default generator in the branch's dtype."""

    def __init__(self, drop_prob: float = 0.0):
        super().__init__()
        self.drop_prob = _check_dropout("DropPath", "drop_prob", drop_prob)

    def forward(self, hidden_state: torch.Tensor) -> torch.Tensor:
        if self.drop_prob == 0.0 or not self.training:
            return hidden_state
        keep = 1.0 - self.drop_prob
        shape = (hidden_state.shape[0],) + (1,) * (hidden_state.dim() - 1)
        kept = (keep + torch.rand(shape, dtype=hidden_state.dtype,
                                  device=hidden_state.device)).floor_()  # 1 kept, 0 dropped
        return hidden_state.div(keep) * kept

    def extra_repr(self) -> str:
        return f"drop_prob={self.drop_prob}"


# The communication-overlap switches only count with ub_tp_comm_overlap=True (several default
# to True in TransformerLayer's signature).
_UB_SWITCHES = ("ub_overlap_ag", "ub_overlap_rs", "ub_overlap_rs_dgrad", "ub_bulk_dgrad",
                "ub_bulk_wgrad")


class TransformerLayer(torch.nn.Module):
    """Transformer Engine's TransformerLayer ("encoder": self-attention then MLP, the block of
    GPT/Llama-style models), built from LayerNormLinear, DotProductAttention, Linear and
    LayerNormMLP; inside fp8_autocast every GEMM runs in FP8.

    hidden_states: [s, b, hidden] with attn_input_format "sbhd" (the default), [b, s, hidden]
    with "bshd", [t, hidden] with "thd" (packed sequences: forward's cu_seqlens_q /
    cu_seqlens_kv, and *_padded, reach the self-attention; qkv_format is accepted as another
    name for attn_input_format). forward takes Transformer
    Engine's arguments in its order (hidden_states, attention_mask, self_attn_mask_type, ...,
    is_first_microbatch, checkpoint_core_attention, inference_params, rotary_pos_emb, ...):
    attention_mask and the mask types as DotProductAttention's (True = masked out; ignored
    with "causal"); rotary_pos_emb the [s, 1, 1, d] angles of RotaryPositionEmbedding. Under
    torch.autocast the layer computes and returns the autocast dtype, as Transformer Engine.
    Constructor arguments in Transformer Engine's order (then, by keyword: qkv_format, dtype,
    recipe, softmax_scale).
    Weights are initialised as Transformer Engine does: init_method for the QKV projection and
    fc1, output_layer_init_method for proj and fc2 (both default normal(0, 0.023)), biases
    zero. params_dtype (or dtype), device and recipe reach every submodule.
    window_size, bottom_right_diagonal, softmax_type and qk_norm_type / qk_norm_eps /
    qk_norm_before_rope reach the self-attention (MultiheadAttention), as in Transformer Engine;
    so does forward's inference_params (KV-cache generation, attention/inference.py; give each
    layer of a stack its own layer_number, the key of its cache). get_rng_state_tracker
    reaches DotProductAttention and the GEMM modules: attention dropout and the weights'
    initialisation inside the tracker's fork, hidden dropout on the default generator (as in
    Transformer Engine).
    tp_group, tp_size, set_parallel_mode=True, sequence_parallel: Transformer Engine's tensor
    parallelism, given to the self-attention (MultiheadAttention: heads split over the ranks)
    and to LayerNormMLP (fc1 column-, fc2 row-parallel); with sequence_parallel,
    hidden_states and the output are the rank's part of dim 0 (the sequence, "sbhd"), and
    the residuals and hidden dropout run on that part.
    parallel_attention_mlp, output_layernorm and drop_path_rate: see the module docstring
    (output_layernorm's norm is the submodule layernorm, LayerNorm or RMSNorm as normalization
    says; the self-attention then projects its input as it is, MultiheadAttention's qkv).
    layer_type="decoder": a cross-attention (inter_attention, a MultiheadAttention with
    attention_type="cross" and its own norm) after the self-attention, on forward's
    encoder_output ([s_enc, b, hidden], required), masked by enc_dec_attn_mask /
    enc_dec_attn_mask_type (the constructor's default "no_mask"), with enc_dec_window_size and
    enc_dec_bottom_right_diagonal, and given rotary_pos_emb too, as Transformer Engine does
    (no DropPath on its branch, as there).
    Not supported (refused with a ValueError): parallel_attention_mlp with
    apply_residual_connection_post_layernorm, with output_layernorm (which Transformer Engine
    refuses too) or with layer_type="decoder", inference_params with a decoder layer (no cache
    of the encoder's keys), and context parallelism.
    """

    __prepare_scriptable__ = refuse_torchscript  # (torch.jit.script: a clear error)

    def __init__(self, hidden_size: int, ffn_hidden_size: int, num_attention_heads: int,
                 num_gqa_groups: Optional[int] = None, layernorm_epsilon: float = 1e-5,
                 hidden_dropout: float = 0.1, attention_dropout: float = 0.1,
                 init_method: Optional[Callable] = None,
                 output_layer_init_method: Optional[Callable] = None,
                 layer_number: Optional[int] = None, kv_channels: Optional[int] = None,
                 self_attn_mask_type: str = "causal", window_size=None,
                 bottom_right_diagonal=None, enc_dec_attn_mask_type: str = "no_mask",
                 enc_dec_bottom_right_diagonal=None, enc_dec_window_size=None, tp_group=None,
                 tp_size: int = 1, params_dtype: Optional[torch.dtype] = None,
                 get_rng_state_tracker=None, fuse_wgrad_accumulation: bool = False,
                 seq_length=None, micro_batch_size=None, sequence_parallel: bool = False,
                 apply_residual_connection_post_layernorm: bool = False,
                 output_layernorm: bool = False, parallel_attention_mlp: bool = False,
                 layer_type: str = "encoder", drop_path_rate: float = 0.0,
                 set_parallel_mode: bool = False, fuse_qkv_params: bool = False,
                 rotary_pos_interleaved: bool = False, zero_centered_gamma: bool = False,
                 qkv_weight_interleaved: bool = True, ub_tp_comm_overlap: bool = False,
                 ub_overlap_ag: bool = True, ub_overlap_rs: bool = True,
                 ub_overlap_rs_dgrad: bool = False, ub_bulk_dgrad: bool = True,
                 ub_bulk_wgrad: bool = True, bias: bool = True, activation: str = "gelu",
                 activation_params: Optional[dict] = None, normalization: str = "LayerNorm",
                 device=None, attn_input_format: Optional[str] = None, name=None,
                 qk_norm_type=None, qk_norm_eps: float = 1e-6,
                 qk_norm_before_rope: bool = False, softmax_type: str = "vanilla", *,
                 qkv_format: Optional[str] = None, dtype: Optional[torch.dtype] = None,
                 recipe: Optional[Recipe] = None, softmax_scale: Optional[float] = None):
        owner = "TransformerLayer"
        te_options = te_only_arguments(locals())
        if not ub_tp_comm_overlap:
            for switch in _UB_SWITCHES:
                te_options.pop(switch)
        te_options.pop("get_rng_state_tracker")  # (dropout and the weights in its fork)
        if layer_type == "decoder":  # (the cross-attention's; an encoder has none to take them)
            for name in ("enc_dec_attn_mask_type", "enc_dec_window_size",
                         "enc_dec_bottom_right_diagonal"):
                te_options.pop(name)
        tp = {k: te_options.pop(k) for k in ("tp_group", "tp_size", "sequence_parallel",
                                             "set_parallel_mode")}
        check_te_options(owner, te_options)
        super().__init__()
        if layer_type not in ("encoder", "decoder"):
            raise ValueError(f"{owner}: layer_type must be 'encoder' or 'decoder', got "
                             f"{layer_type!r}")
        self.layer_type = layer_type
        for name, value in (("output_layernorm", output_layernorm),
                            ("parallel_attention_mlp", parallel_attention_mlp)):
            if value not in (False, True):
                raise TypeError(f"{owner}: {name} must be True or False, got {value!r}")
        if parallel_attention_mlp and apply_residual_connection_post_layernorm:
            raise ValueError(f"{owner}: parallel_attention_mlp=True cannot be combined with "
                             "apply_residual_connection_post_layernorm=True (one residual, the "
                             "input, for both branches; Transformer Engine fails there too)")
        if parallel_attention_mlp and output_layernorm:
            raise ValueError(f"{owner}: parallel_attention_mlp=True cannot be combined with "
                             "output_layernorm=True (the attention would project the "
                             "un-normalised input; Transformer Engine refuses it too)")
        if parallel_attention_mlp and layer_type == "decoder":
            raise ValueError(f"{owner}: parallel_attention_mlp=True cannot be combined with "
                             "layer_type='decoder' (the cross-attention would run between two "
                             "branches that share one input)")
        self.output_layernorm = bool(output_layernorm)
        self.parallel_attention_mlp = bool(parallel_attention_mlp)
        self.drop_path = (DropPath(_check_dropout(owner, "drop_path_rate", drop_path_rate))
                          if drop_path_rate else None)
        if qkv_format is not None and attn_input_format is not None \
                and qkv_format != attn_input_format:
            raise ValueError(f"{owner}: 'qkv_format' ({qkv_format!r}) and 'attn_input_format' "
                             f"({attn_input_format!r}) name the same thing and must agree; "
                             "pass one")
        fmt = check_qkv_format(owner, "attn_input_format",
                               attn_input_format or qkv_format or "sbhd", packed=True)
        if fmt == "thd" and layer_type == "decoder":
            raise ValueError(f"{owner}: attn_input_format 'thd' (packed sequences) with "
                             "layer_type='decoder' is not supported")
        dtype = one_dtype(owner, dtype, params_dtype)
        self.hidden_size = check_positive(owner, "hidden_size", hidden_size)
        self.ffn_hidden_size = check_positive(owner, "ffn_hidden_size", ffn_hidden_size)
        self.hidden_dropout = _check_dropout(owner, "hidden_dropout", hidden_dropout)
        self.self_attn_mask_type = check_mask_type(owner, "self_attn_mask_type",
                                                   self_attn_mask_type)
        self.apply_residual_connection_post_layernorm = bool(
            apply_residual_connection_post_layernorm)
        self.attn_input_format = fmt
        self.layer_number = layer_number
        check_tensor_parallel(owner, {k: tp[k] for k in ("tp_group", "tp_size",
                                                         "sequence_parallel")},
                              tp["set_parallel_mode"], check_positive(owner, "num_attention_heads",
                                                                      num_attention_heads),
                              num_gqa_groups or num_attention_heads)
        init_method = init_method or te_default_init
        output_layer_init_method = output_layer_init_method or te_default_init
        common = dict(params_dtype=dtype, device=device, recipe=recipe, bias=bias,
                      normalization=normalization, zero_centered_gamma=zero_centered_gamma,
                      init_method=init_method, output_layer_init_method=output_layer_init_method,
                      return_layernorm_output=self.apply_residual_connection_post_layernorm,
                      fuse_wgrad_accumulation=fuse_wgrad_accumulation, **tp)
        # What the self-attention and a decoder's cross-attention share, as in Transformer
        # Engine (its common_attention_kwargs).
        attention = dict(
            kv_channels=kv_channels, layernorm_epsilon=layernorm_epsilon,
            attention_dropout=_check_dropout(owner, "attention_dropout", attention_dropout),
            layer_number=layer_number, num_gqa_groups=num_gqa_groups,
            fuse_qkv_params=fuse_qkv_params, qkv_weight_interleaved=qkv_weight_interleaved,
            qkv_format=fmt, softmax_scale=softmax_scale, softmax_type=softmax_type,
            qk_norm_type=qk_norm_type, qk_norm_eps=qk_norm_eps,
            qk_norm_before_rope=qk_norm_before_rope,
            get_rng_state_tracker=get_rng_state_tracker, **common)
        self.self_attention = MultiheadAttention(
            hidden_size, num_attention_heads, input_layernorm=not self.output_layernorm,
            attn_mask_type=self.self_attn_mask_type, window_size=window_size,
            bottom_right_diagonal=bottom_right_diagonal, **attention)
        if layer_type == "decoder":
            self.enc_dec_attn_mask_type = check_mask_type(owner, "enc_dec_attn_mask_type",
                                                          enc_dec_attn_mask_type)
            self.inter_attention = MultiheadAttention(
                hidden_size, num_attention_heads, input_layernorm=True, attention_type="cross",
                attn_mask_type=self.enc_dec_attn_mask_type, window_size=enc_dec_window_size,
                bottom_right_diagonal=enc_dec_bottom_right_diagonal, **attention)
        self.layernorm_mlp = LayerNormMLP(hidden_size, ffn_hidden_size, eps=layernorm_epsilon,
                                          activation=activation,
                                          activation_params=activation_params,
                                          get_rng_state_tracker=get_rng_state_tracker, **common)
        if self.output_layernorm:
            norm = {"LayerNorm": LayerNorm, "RMSNorm": RMSNorm}[normalization]
            self.layernorm = norm(hidden_size, eps=layernorm_epsilon,
                                  sequence_parallel=self.sequence_parallel, params_dtype=dtype,
                                  zero_centered_gamma=zero_centered_gamma, device=device)

    def __setstate__(self, state: dict) -> None:
        # (a layer pickled whole before these options: a pre-norm encoder layer)
        for name, value in (("layer_type", "encoder"), ("output_layernorm", False),
                            ("parallel_attention_mlp", False)):
            state.setdefault(name, value)
        if "drop_path" not in state.get("_modules", {}):  # (a submodule, or None, since)
            state.setdefault("drop_path", None)
        super().__setstate__(state)

    @property
    def tp_size(self) -> int:
        return self.self_attention.tp_size

    @property
    def tp_group(self):
        return self.self_attention.tp_group

    @property
    def sequence_parallel(self) -> bool:
        return self.layernorm_mlp.sequence_parallel

    def set_tensor_parallel_group(self, tp_group) -> None:
        """Transformer Engine's: the tensor-parallel group, for a layer built with tp_size and
        no tp_group, given to every submodule."""
        self.self_attention.set_tensor_parallel_group(tp_group)
        if self.layer_type == "decoder":
            self.inter_attention.set_tensor_parallel_group(tp_group)
        self.layernorm_mlp.set_tensor_parallel_group(tp_group)

    def forward(self, hidden_states: torch.Tensor, attention_mask=None,
                self_attn_mask_type: Optional[str] = None, window_size=None,
                bottom_right_diagonal=None, encoder_output=None, enc_dec_attn_mask=None,
                enc_dec_attn_mask_type: Optional[str] = None, enc_dec_window_size=None,
                enc_dec_bottom_right_diagonal=None, is_first_microbatch: Optional[bool] = None,
                checkpoint_core_attention: bool = False, inference_params=None,
                rotary_pos_emb: Optional[torch.Tensor] = None, **options) -> torch.Tensor:
        owner = "TransformerLayer"
        cross = dict(encoder_output=encoder_output, attention_mask=enc_dec_attn_mask,
                     attn_mask_type=enc_dec_attn_mask_type, window_size=enc_dec_window_size,
                     bottom_right_diagonal=enc_dec_bottom_right_diagonal)
        if self.layer_type == "encoder":
            for name, value in (("encoder_output", encoder_output),
                                ("enc_dec_attn_mask", enc_dec_attn_mask),
                                ("enc_dec_attn_mask_type", enc_dec_attn_mask_type),
                                ("enc_dec_window_size", enc_dec_window_size),
                                ("enc_dec_bottom_right_diagonal", enc_dec_bottom_right_diagonal)):
                if value not in (None, "no_mask"):
                    raise ValueError(f"{owner}.forward: {name} is for layer_type='decoder' "
                                     "(cross-attention); this layer is an encoder: leave it at "
                                     "None")
        elif inference_params is not None:
            raise ValueError(f"{owner}.forward: inference_params with layer_type='decoder' is "
                             "not supported (no cache of the encoder's keys and values)")
        options.update(window_size=window_size, bottom_right_diagonal=bottom_right_diagonal,
                       inference_params=inference_params)
        # The self-attention's keys are its queries' tokens: their sequences too, as
        # Transformer Engine passes them (whatever *_kv the caller gives).
        for kv, q in (("cu_seqlens_kv", "cu_seqlens_q"),
                      ("cu_seqlens_kv_padded", "cu_seqlens_q_padded"),
                      ("max_seqlen_kv", "max_seqlen_q")):
            if options.get(q) is not None or options.get(kv) is not None:
                options[kv] = options.get(q)
        rank = 2 if self.attn_input_format == "thd" else 3  # ([t, hidden] packed)
        if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() != rank \
                or hidden_states.shape[-1] != self.hidden_size:
            lead = {"sbhd": "s, b", "bshd": "b, s", "thd": "t"}[self.attn_input_format]
            got = (tuple(hidden_states.shape) if isinstance(hidden_states, torch.Tensor)
                   else type(hidden_states).__name__)
            raise ValueError(f"{owner}: hidden_states must have shape [{lead}, "
                             f"{self.hidden_size}] (attn_input_format "
                             f"{self.attn_input_format!r}), got {got}")
        work_dtype = autocast_dtype(hidden_states.device.type)
        if work_dtype is not None:
            # As Transformer Engine: under torch.autocast the layer works (residuals included)
            # in the autocast dtype and returns it.
            hidden_states = hidden_states.to(work_dtype)
        post_ln = self.apply_residual_connection_post_layernorm
        attn = self.self_attention(hidden_states, attention_mask=attention_mask,
                                   attn_mask_type=self_attn_mask_type,
                                   rotary_pos_emb=rotary_pos_emb,
                                   is_first_microbatch=is_first_microbatch,
                                   checkpoint_core_attention=checkpoint_core_attention,
                                   **options)
        if self.parallel_attention_mlp:  # both branches from the input, one residual
            mlp = self.layernorm_mlp(hidden_states, is_first_microbatch=is_first_microbatch)
            out = self._residual(hidden_states, attn + mlp)
        else:
            # (the attention returns its norm's output only where it has the norm)
            attn, residual = (attn if post_ln and not self.output_layernorm
                              else (attn, hidden_states))
            hidden = self._residual(residual, attn)
            if self.layer_type == "decoder":
                inter = self.inter_attention(hidden, is_first_microbatch=is_first_microbatch,
                                             checkpoint_core_attention=checkpoint_core_attention,
                                             rotary_pos_emb=rotary_pos_emb, **cross)
                inter, residual = inter if post_ln else (inter, hidden)
                hidden = self._residual(residual, inter, drop_path=False)
            mlp = self.layernorm_mlp(hidden, is_first_microbatch=is_first_microbatch)
            mlp, residual = mlp if post_ln else (mlp, hidden)
            out = self._residual(residual, mlp)
        return self.layernorm(out) if self.output_layernorm else out

    def _residual(self, residual: torch.Tensor, branch: torch.Tensor,
                  drop_path: bool = True) -> torch.Tensor:
        """residual + drop_path(dropout(branch)), as Transformer Engine's (dropout drawn
        first; the cross-attention's branch has no DropPath there)."""
        if self.hidden_dropout != 0.0 and self.training:
            branch = F.dropout(branch, self.hidden_dropout, training=True)
        if drop_path and self.drop_path is not None:
            branch = self.drop_path(branch)
        return residual + branch

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, ffn_hidden_size={self.ffn_hidden_size}, "
                f"attn_input_format={self.attn_input_format}, "
                f"hidden_dropout={self.hidden_dropout}"
                + ", parallel_attention_mlp=True" * self.parallel_attention_mlp
                + ", output_layernorm=True" * self.output_layernorm)
