"""Transformer Engine's softmax_type for DotProductAttention: attention sinks.

For scores s_j = q k_j * scale of one query row of head h (masked keys left out):
  "vanilla"     p_j = exp(s_j) / sum_k exp(s_k)
  "off-by-one"  p_j = exp(s_j) / (1 + sum_k exp(s_k))
  "learnable"   p_j = exp(s_j) / (exp(alpha_h) + sum_k exp(s_k)), alpha the Parameter
                softmax_offset [h] (zeros at first, float32; "off-by-one" is alpha = 0, held
                in no Parameter, as Transformer Engine holds it)
The sink takes the probability mass 1 - sum_j p_j and carries no value: a query that may
attend no key gets zeros. It runs on SDPA as one more key (with_sink).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

SOFTMAX_TYPES = ("vanilla", "off-by-one", "learnable")


def check_softmax_type(owner: str, value) -> str:
    if value not in SOFTMAX_TYPES:
        raise ValueError(f"{owner}: softmax_type must be one of {SOFTMAX_TYPES}, got {value!r}")
    return value


def with_sink(q, k, v, allowed, is_causal, alpha, scale):
    """q [b, h, s_q, d], k, v [b, g, s_kv, d] and SDPA's mask (True = may attend) extended by
    the sink: one more key with score alpha_h for every query of head h and a zero value, so
    that SDPA's softmax has exp(alpha_h) in its denominator only. Returns (q', k', v',
    allowed', is_causal, rows): keep SDPA's output [:, :, rows:, :d].

    The head dimension grows by 8 (a multiple of 8 still, as the fused kernels want it; the
    values' 8 are zeros; v's head size may differ from q's and k's): the queries carry alpha_h /
    scale in
    three components of q's dtype, each the remainder of the ones before (the sink's score,
    accumulated in float32, keeps float32 accuracy with bfloat16 inputs), the sink key ones
    there, every other key zeros. Causal (top-left): the sink goes first and one zero query in
    front, so that query i + 1 sees the sink and keys 0..i with SDPA's own causal kernels."""
    b, h, s_q, d = q.shape
    g = k.shape[1]
    # (in float32, or float64 for float64 inputs: the parts' sum keeps q's accuracy)
    work = torch.promote_types(q.dtype, torch.float32)
    target = (alpha.to(work) / scale).view(1, h, 1, 1).expand(b, h, s_q, 1)
    parts, rest = [], target
    for _ in range(3):  # (the gradient reaches alpha through the first part only, once)
        parts.append(rest.to(q.dtype))
        rest = rest - parts[-1].to(work)
    q = torch.cat((q, *parts, q.new_zeros(b, h, s_q, 5)), dim=-1)
    k, v = (torch.cat((t, t.new_zeros(b, g, t.shape[2], 8)), dim=-1) for t in (k, v))
    sink_key = k.new_zeros(b, g, 1, d + 8)
    sink_key[..., d:d + 3] = 1.0
    sink_value = v.new_zeros(b, g, 1, v.shape[-1])  # (v's head size may differ from q's)
    if is_causal:
        q = torch.cat((q.new_zeros(b, h, 1, d + 8), q), dim=2)
        return (q, torch.cat((sink_key, k), dim=2), torch.cat((sink_value, v), dim=2), None,
                True, 1)
    if allowed is not None:
        allowed = F.pad(allowed.expand(*allowed.shape[:-1], k.shape[2]), (0, 1), value=True)
    return (q, torch.cat((k, sink_key), dim=2), torch.cat((v, sink_value), dim=2), allowed,
            False, 0)
