"""Transformer Engine's tensor parallelism on LayerNormLinear (``parallel_mode="column"``) and
LayerNormMLP (``set_parallel_mode=True``), with te_tensor_parallel.py's collectives:

* LayerNormLinear, column: weight [out / n, in], bias [out / n]; the norm (its weights whole
  on every rank) runs on the rank's input, its output goes to the GEMM as a column-parallel
  Linear's input: whole (the GEMM's input gradient all-reduced before the norm's backward,
  so the norm's weight gradients are whole on every rank), or with sequence_parallel the
  rank's part of dim 0, all-gathered before the GEMM (the gradient reduce-scattered before the
  norm's backward: each rank's norm-weight gradients cover its part of the sequence, and the
  norm weights are marked ``sequence_parallel`` for Megatron-LM's sum of such gradients).
  Row is refused: the norm needs every feature of a row, and a row-parallel input holds
  in_features / n of them (Transformer Engine builds a norm over in_features and a weight
  over in_features / n there, which cannot be multiplied).
* LayerNormMLP: the norm as above, fc1 column-parallel (fc1_weight [F' / n, hidden], F' = 2 *
  ffn_hidden_size for the gated activations: each rank holds its rows of both halves, as
  Transformer Engine's shard), the activation on the rank's columns, fc2 row-parallel
  (fc2_weight [hidden, ffn_hidden_size / n]); its partial products are all-reduced
  (reduce-scattered along dim 0 with sequence_parallel) and fc2's bias added once, after (not
  at all with return_bias, which returns it).
* return_layernorm_output returns the rank's norm output (its part of the sequence with
  sequence_parallel), return_layernorm_output_gathered=True the gathered one (with
  sequence_parallel only: without it nothing is gathered), as Transformer Engine's.

The sharded FP8 forward is the norm (NormStep's kernels, as the unsharded module's backward
uses), the collective, then Linear's FP8 GEMM function (linear.py) per GEMM with the module's
plan for it: the norm's output is written in high precision and cast by the GEMM (the
unsharded module casts it in the norm's kernel; the values cast and the scale are the same).
Scales and their agreement over the ranks: as te_tensor_parallel.py's (every amax is the whole
tensor's once reduced over fp8_autocast's fp8_group).
"""
from __future__ import annotations

import torch

from .. import _param_marks as param_marks
from . import te_tensor_parallel as tp
from .activations import activation_backward, activation_forward, activation_hp
from .linear import _Fp8LinearFunction

_NORM_LINEAR_ROW = ("LayerNormLinear: parallel_mode='row' is not supported: the norm needs "
                    "every feature of a row, and a row-parallel input holds in_features / "
                    "tp_size of them; use 'column' (or None)")


def configure_norm_linear(in_features: int, out_features: int, options: dict):
    """LayerNormLinear's tensor-parallel options out of ``options``: (local out_features,
    TensorParallelOptions or None, return_layernorm_output_gathered)."""
    if options.get("parallel_mode") == "row":
        _, _, probe = tp.configure("LayerNormLinear", in_features, out_features,
                                   dict(options, parallel_mode=None))
        if probe is not None and probe.size > 1:
            raise ValueError(_NORM_LINEAR_ROW)
        options["parallel_mode"] = None  # (one rank: nothing sharded, as in Transformer Engine)
    gathered = _pop_gathered("LayerNormLinear", options)
    _, out_features, parallel = tp.configure("LayerNormLinear", in_features, out_features,
                                             options)
    return out_features, parallel, gathered


def configure_norm_mlp(hidden_size: int, ffn_hidden_size: int, options: dict):
    """LayerNormMLP's: (local ffn_hidden_size, TensorParallelOptions or None,
    return_layernorm_output_gathered). set_parallel_mode=True shards fc1 as column and fc2 as
    row; without it more than one rank is refused (Transformer Engine shards ffn_hidden_size
    and runs no collective: each rank's output would be a partial sum)."""
    set_parallel_mode = options.pop("set_parallel_mode", False)
    if set_parallel_mode not in (False, True):
        raise TypeError(f"LayerNormMLP: set_parallel_mode must be True or False, got "
                        f"{set_parallel_mode!r}")
    gathered = _pop_gathered("LayerNormMLP", options)
    options["parallel_mode"] = "column" if set_parallel_mode else None
    _, ffn_hidden_size, parallel = tp.configure(
        "LayerNormMLP", hidden_size, ffn_hidden_size, options,
        names=("hidden_size", "ffn_hidden_size"), setting="set_parallel_mode=True")
    if not set_parallel_mode and parallel is not None and parallel.size > 1:
        raise ValueError(f"LayerNormMLP: tp_size={parallel.size} (or a tp_group of that many "
                         "ranks) needs set_parallel_mode=True (fc1 column-parallel, fc2 "
                         "row-parallel): without it Transformer Engine shards ffn_hidden_size "
                         "and runs no collective, so each rank's output would be a partial "
                         "sum")
    return ffn_hidden_size, parallel, gathered


def _pop_gathered(owner: str, options: dict) -> bool:
    gathered = options.pop("return_layernorm_output_gathered", False)
    if gathered not in (False, True):
        raise TypeError(f"{owner}: return_layernorm_output_gathered must be True or False, "
                        f"got {gathered!r}")
    return gathered


def attach(module, options, sharded: dict, row_bias=None) -> None:
    """Give the built module its options (te_tensor_parallel.attach's, for a norm module).
    ``sharded``: Parameter name -> the dim it is sharded along; ``row_bias``: the bias added
    after the reduction (marked ``sequence_parallel``). The norm weights are marked
    ``sequence_parallel`` as Transformer Engine marks them."""
    if options is None:
        return
    module._te_parallel = options
    for name in ("layer_norm_weight", "layer_norm_bias"):
        param_marks.mark(module, name, sequence_parallel=options.sequence_parallel)
    if not options.communicates:
        return
    module._te_tp = options
    module._fused_step = None  # (the Python path runs the GEMMs between the collectives)
    for logical, dim in sharded.items():
        for name in module._parts.get(logical, [logical]):  # (each part of a split one)
            tp.mark_sharded(module, name, dim)
    if row_bias is not None:
        param_marks.mark(module, row_bias, sequence_parallel=options.sequence_parallel)


def norm_linear(module, inp, norm, linear):
    """LayerNormLinear's sharded forward: ``norm`` on the rank's input, the collective,
    ``linear`` (the local GEMM). Returns out, or (out, ln_out) with return_layernorm_output."""
    ln_out = norm(inp)
    ln_total = tp.to_gemm_input(ln_out, module._te_tp)
    out = linear(ln_total)
    if module.return_layernorm_output:
        return out, _returned_ln_out(module, ln_out, ln_total)
    return out


def norm_mlp(module, inp, norm, fc1, act, fc2):
    """LayerNormMLP's: norm, collective, fc1 (column), act, fc2 (row, no bias), reduction,
    then fc2's bias once (unless returned)."""
    options = module._te_tp
    ln_out = norm(inp)
    ln_total = tp.to_gemm_input(ln_out, options)
    out = tp.reduce_output(fc2(act(fc1(ln_total))), options)
    bias = None if module.return_bias else module._param("fc2_bias")
    if bias is not None:  # once, after the sum of the ranks' partial products
        out = out + bias.to(out.dtype)
    if module.return_layernorm_output:
        return out, _returned_ln_out(module, ln_out, ln_total)
    return out


def _returned_ln_out(module, ln_out, ln_total):
    """return_layernorm_output's tensor: the gathered norm output where asked for and
    sequence_parallel gathers it (its gradient then summed over the ranks, reduce-scattered),
    else the rank's (its gradient added to the rank's after the collective's backward), as
    Transformer Engine's."""
    gathered = module._ln_out_gathered and module._te_tp.sequence_parallel
    return ln_total if gathered else ln_out


def norm_linear_hp(module, inp, linear):
    return norm_linear(module, inp, module._norm_hp,
                       lambda x: linear(x, module._param("weight"), module._gemm_bias()))


def norm_linear_fp8(module, inp, plan):
    return norm_linear(module, inp, _fp8_norm(module), lambda x: _Fp8LinearFunction.apply(
        x, module._param("weight"), module._gemm_bias(), plan, True,
        module._weight_held("weight")))


def norm_mlp_hp(module, inp, linear):
    return norm_mlp(module, inp, module._norm_hp,
                    lambda x: linear(x, module._param("fc1_weight"), module._param("fc1_bias")),
                    lambda x: activation_hp(x, module._activation),
                    lambda x: linear(x, module._param("fc2_weight"), None))


def norm_mlp_fp8(module, inp, plans):
    fc1_plan, fc2_plan = plans
    return norm_mlp(
        module, inp, _fp8_norm(module),
        lambda x: _Fp8LinearFunction.apply(x, module._param("fc1_weight"),
                                           module._param("fc1_bias"), fc1_plan),
        lambda x: _Activation.apply(x, module._activation),
        lambda x: _Fp8LinearFunction.apply(x, module._param("fc2_weight"), None, fc2_plan))


def _fp8_norm(module):
    def norm(x):
        return _Norm.apply(x, module.layer_norm_weight, module.layer_norm_bias,
                           module._norm_step)
    return norm


class _Norm(torch.autograd.Function):
    """The module's norm (NormStep's forward and backward kernels, the unsharded FP8 module's)
    on the rank's rows."""

    @staticmethod
    def forward(ctx, inp, weight, bias, norm):
        x = inp.reshape(-1, inp.shape[-1])
        y, stats = norm.hp(x, weight, bias)
        ctx.save_for_backward(x, weight, *stats)
        ctx.norm, ctx.shape = norm, inp.shape
        return y.reshape(inp.shape)

    @staticmethod
    def backward(ctx, grad):
        x, weight, *stats = ctx.saved_tensors
        grad_x, grad_weight, grad_bias = ctx.norm.backward(
            grad.reshape(x.shape).contiguous(), x, stats, weight)
        return (grad_x.reshape(ctx.shape), grad_weight,
                grad_bias if ctx.needs_input_grad[2] else None, None)


class _Activation(torch.autograd.Function):
    """LayerNormMLP's activation (its fused kernels, forward and backward) on fc1's local
    output."""

    @staticmethod
    def forward(ctx, x, activation):
        ctx.save_for_backward(x)
        ctx.activation = activation
        shape = x.shape
        y = activation_forward(x.reshape(-1, shape[-1]), activation)
        return y.reshape(*shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        x2 = x.reshape(-1, x.shape[-1])
        grad_x = activation_backward(grad.reshape(x2.shape[0], -1).contiguous(), x2,
                                     ctx.activation)
        return grad_x.reshape(x.shape), None

