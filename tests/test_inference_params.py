"""KV-cache generation with InferenceParams: a small language model of TransformerLayers
(rotary embeddings, GQA) decoded greedily with the cache (prefill, then one token per forward)
against recomputing the whole causal forward at every step; in high precision and inside
fp8_autocast; sequences of different lengths in one batch, finished sequences leaving the
batch; the errors."""
from __future__ import annotations

import copy
from collections import OrderedDict

import pytest
import torch
from conftest import randn, sqnr

import transformer_fp8 as tfp8
from transformer_fp8 import DelayedScaling, InferenceParams, fp8_autocast
from transformer_fp8.modules.attention import apply_rotary_pos_emb

VOCAB, HIDDEN, HEADS, GROUPS, LAYERS, MAX_LEN = 96, 64, 4, 2, 3, 24


class TinyLM(torch.nn.Module):
    """Embedding -> TransformerLayers (each its own layer_number) -> Linear, rotary angles for
    MAX_LEN positions; tokens [b, s] -> logits [b, s, VOCAB] in either layout."""

    def __init__(self, fmt, device, window_size=None):
        super().__init__()
        self.fmt = fmt
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN, device=device)
        self.layers = torch.nn.ModuleList(
            tfp8.TransformerLayer(HIDDEN, 2 * HIDDEN, HEADS, num_gqa_groups=GROUPS,
                                  hidden_dropout=0.0, attention_dropout=0.0,
                                  layer_number=i + 1, attn_input_format=fmt,
                                  window_size=window_size, device=device)
            for i in range(LAYERS))
        self.head = tfp8.Linear(HIDDEN, VOCAB, device=device)
        self.rope = tfp8.RotaryPositionEmbedding(HIDDEN // HEADS).to(device)

    def forward(self, tokens, inference_params=None):
        x = self.embed(tokens)
        x = x.transpose(0, 1) if self.fmt == "sbhd" else x
        freqs = self.rope(MAX_LEN)
        for layer in self.layers:
            # "padding_causal" is what a Transformer Engine model passes with a cache;
            # "causal" is the training mask.
            x = layer(x, self_attn_mask_type="causal" if inference_params is None
                      else "padding_causal", rotary_pos_emb=freqs,
                      inference_params=inference_params)
        logits = self.head(x)
        return logits.transpose(0, 1) if self.fmt == "sbhd" else logits


def new_params(batch, device, dtype=torch.float32):
    return InferenceParams(batch, MAX_LEN, GROUPS, HIDDEN // HEADS, dtype, device=device)


def build(gen, fmt, device, **kwargs):
    torch.manual_seed(int(torch.randint(2**31, (1,), generator=gen)))
    return TinyLM(fmt, device, **kwargs).eval()


def decode_with_cache(model, prompts, steps, params, ids=None):
    """Greedy decoding of prompts (a list of 1-D token tensors): prefill, then one token per
    forward. Returns (tokens [b, steps], logits [b, steps, VOCAB]) of the generated tokens."""
    ids = list(range(len(prompts))) if ids is None else ids
    lengths = [len(p) for p in prompts]
    batch = torch.nn.utils.rnn.pad_sequence(prompts, batch_first=True)  # padding at the end
    params.pre_step(OrderedDict(zip(ids, lengths)))
    logits = model(batch, inference_params=params)
    last = logits[torch.arange(len(prompts)), torch.tensor(lengths) - 1]
    tokens, all_logits = [], []
    for _ in range(steps):
        nxt = last.argmax(dim=-1)
        tokens.append(nxt)
        all_logits.append(last)
        params.pre_step(OrderedDict((i, 1) for i in ids))
        last = model(nxt.view(-1, 1), inference_params=params)[:, 0]
    return torch.stack(tokens, dim=1), torch.stack(all_logits, dim=1)


def decode_recomputing(model, prompt, steps):
    """The same greedy decoding of one prompt, the whole causal forward at every step."""
    seq, tokens, all_logits = prompt.view(1, -1), [], []
    for _ in range(steps):
        last = model(seq)[0, -1]
        tokens.append(last.argmax())
        all_logits.append(last)
        seq = torch.cat((seq, tokens[-1].view(1, 1)), dim=1)
    return torch.stack(tokens), torch.stack(all_logits)


def prompts_of(gen, lengths, device):
    return [torch.randint(VOCAB, (n,), generator=gen).to(device) for n in lengths]


# ---- high precision --------------------------------------------------------------------------

# The cached and recomputed forwards reduce in other orders (GEMMs of 1 row against s rows,
# attention of one query against a causal block): equal up to float32 rounding, not bitwise.
TOL = dict(rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("fmt", ["bshd", "sbhd"])
@pytest.mark.parametrize("window", [None, (4, 0)], ids=["", "window"])
def test_greedy_decoding_with_the_cache_is_recomputation(gen, device, fmt, window):
    model = build(gen, fmt, device, window_size=window)
    lengths, steps = [7, 3, 5], 8
    prompts = prompts_of(gen, lengths, device)
    with torch.no_grad():
        tokens, logits = decode_with_cache(model, prompts, steps, new_params(3, device))
        for b, prompt in enumerate(prompts):
            ref_tokens, ref_logits = decode_recomputing(model, prompt, steps)
            torch.testing.assert_close(logits[b], ref_logits, **TOL)
            assert tokens[b].tolist() == ref_tokens.tolist(), f"sequence {b}"


def test_sequences_finish_and_join(gen, device):
    """A sequence left out of step_dict is finished (its row reused); a new id starts at 0;
    the rows follow step_dict's order (the cache's rows move with them)."""
    model = build(gen, "bshd", device)
    a, b, c = prompts_of(gen, [4, 6, 5], device)
    params = new_params(2, device)
    with torch.no_grad():
        decode_with_cache(model, [a, b], 3, params, ids=["a", "b"])
        # "a" finishes; "b" (row 1 so far) goes on in row 0, "c" joins in row 1.
        params.pre_step(OrderedDict([("b", 1), ("c", len(c))]))
        nxt_b = torch.tensor([7], device=device)
        batch = torch.stack((torch.cat((nxt_b, c.new_zeros(len(c) - 1))), c))
        out = model(batch, inference_params=params)
        assert dict(params.sequences) == {"b": 6 + 3 + 1, "c": 5}
        b_tokens = decode_recomputing(model, b, 3)[0]
        ref_b = model(torch.cat((b, b_tokens, nxt_b)).view(1, -1))[0, -1]
        ref_c = model(c.view(1, -1))[0, -1]
    torch.testing.assert_close(out[0, 0], ref_b, **TOL)
    torch.testing.assert_close(out[1, len(c) - 1], ref_c, **TOL)


def test_chunked_prefill_equals_one_prefill(gen, device):
    """A known sequence may grow by more than one token (Transformer Engine's non-paged cache
    takes one): a prompt in two chunks gives the logits of one forward."""
    model = build(gen, "sbhd", device)
    prompt = prompts_of(gen, [9], device)[0]
    params = new_params(1, device)
    with torch.no_grad():
        params.pre_step({0: 5})
        first = model(prompt[:5].view(1, -1), inference_params=params)
        params.pre_step({0: 4})
        second = model(prompt[5:].view(1, -1), inference_params=params)
        ref = model(prompt.view(1, -1))
    torch.testing.assert_close(torch.cat((first, second), dim=1), ref, **TOL)


@pytest.mark.parametrize("fmt", ["bshd", "sbhd"])
def test_a_mixed_step_near_the_end_of_the_cache(gen, device, fmt):
    """One sequence decodes its token MAX_LEN - 1 while another joins with a 5-token prompt:
    every real token fits the rotary table (MAX_LEN positions), though the padded batch's
    rows reach past it (the first sequence's padding). Runs (Transformer Engine's fused
    kernel runs it; this refused it) and gives each sequence's logits of one forward."""
    model = build(gen, fmt, device)
    a, b = prompts_of(gen, [MAX_LEN, 5], device)
    params = new_params(2, device)
    with torch.no_grad():
        params.pre_step(OrderedDict(a=MAX_LEN - 1))
        model(a[:-1].view(1, -1), inference_params=params)
        params.pre_step(OrderedDict(a=1, b=5))
        batch = torch.stack((torch.cat((a[-1:], a.new_zeros(4))), b))
        mixed = model(batch, inference_params=params)
        ref_a, ref_b = model(a.view(1, -1))[0, -1], model(b.view(1, -1))[0]
    assert params.sequences == OrderedDict(a=MAX_LEN, b=5)
    torch.testing.assert_close(mixed[0, 0], ref_a, **TOL)
    torch.testing.assert_close(mixed[1], ref_b, **TOL)


def test_a_step_past_the_rotary_table_is_refused(gen, device):
    """A real token past the rotary table's positions is refused, not rotated by another
    position's angles."""
    model = build(gen, "bshd", device)
    params = InferenceParams(1, MAX_LEN + 4, GROUPS, HIDDEN // HEADS, torch.float32,
                             device=device)
    with torch.no_grad():
        params.pre_step(OrderedDict(a=MAX_LEN))
        model(prompts_of(gen, [MAX_LEN], device)[0].view(1, -1), inference_params=params)
        params.pre_step(OrderedDict(a=1))
        with pytest.raises(ValueError, match="rotary_pos_emb must have shape"):
            model(prompts_of(gen, [1], device)[0].view(1, -1), inference_params=params)


# ---- FP8 -------------------------------------------------------------------------------------

def test_fp8_decoding_with_the_cache_matches_the_fp8_forward(gen, device):
    """Inside fp8_autocast, teacher-forced: the cached logits against one no-cache FP8 forward
    of the whole sequences. Not bitwise: delayed scaling quantises each forward with scales from
    the amax history of the forwards before it, and these differ between one forward of the
    whole sequences and a prefill followed by one-token forwards (the GEMMs' shapes differ
    too). Both are FP8 quantisations of the same computation: compared by SQNR."""
    recipe = DelayedScaling(amax_history_len=16)
    model = build(gen, "bshd", device)
    lengths, steps = [6, 4], 6
    prompts = prompts_of(gen, lengths, device)
    with torch.no_grad():
        # The continuations from the high-precision model: the same tokens for both runs.
        hp_tokens, _ = decode_with_cache(model, prompts, steps, new_params(2, device))
        full = [torch.cat((p, t)) for p, t in zip(prompts, hp_tokens)]
        with fp8_autocast(fp8_recipe=recipe):  # calibrate the scales once, on the whole data
            model(torch.nn.utils.rnn.pad_sequence(full, batch_first=True))
        cached_model, plain_model = model, copy.deepcopy(model)
        params = new_params(2, device)
        cached = []
        with fp8_autocast(fp8_recipe=recipe):
            params.pre_step(OrderedDict(enumerate(lengths)))
            out = cached_model(torch.nn.utils.rnn.pad_sequence(prompts, batch_first=True),
                               inference_params=params)
            cached.append(out[torch.arange(2), torch.tensor(lengths) - 1])
            for j in range(steps - 1):
                params.pre_step({0: 1, 1: 1})
                cached.append(cached_model(hp_tokens[:, j:j + 1], inference_params=params)[:, 0])
        cached = torch.stack(cached, dim=1)  # [b, steps, VOCAB]
        for b, seq in enumerate(full):
            with fp8_autocast(fp8_recipe=recipe):
                ref = plain_model(seq.view(1, -1))[0, lengths[b] - 1:-1]
            hp_ref = model(seq.view(1, -1))[0, lengths[b] - 1:-1]
            fp8_vs_fp8, fp8_vs_hp = sqnr(ref, cached[b]), sqnr(hp_ref, ref)
            assert fp8_vs_fp8 >= 25, (b, fp8_vs_fp8)
            # The cache adds no more error than FP8 itself has against high precision.
            assert fp8_vs_fp8 >= fp8_vs_hp - 3, (b, fp8_vs_fp8, fp8_vs_hp)


# ---- rotary start positions ------------------------------------------------------------------

def test_rotary_start_positions_take_each_sequences_angles(gen, device):
    freqs = tfp8.RotaryPositionEmbedding(16)(12).to(device)
    t = randn(gen, 3, 2, 4, 16, device=device)  # sbhd
    out = apply_rotary_pos_emb(t, freqs, "sbhd", start_positions=torch.tensor([2, 7]))
    for b, start in enumerate([2, 7]):
        ref = apply_rotary_pos_emb(t[:, b:b + 1], freqs[start:], "sbhd")
        torch.testing.assert_close(out[:, b:b + 1], ref, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"s2 >= 13 \(the sequence length plus the largest"):
        apply_rotary_pos_emb(t, freqs, "sbhd", start_positions=[0, 10])
    with pytest.raises(ValueError, match="start_positions must hold 2 ints"):
        apply_rotary_pos_emb(t, freqs, "sbhd", start_positions=[0])


# ---- errors ----------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,match", [
    (dict(is_paged=True), "is_paged=True is not supported"),
    (dict(page_size=16), "page_size=16 is not supported"),
    (dict(total_num_pages=8), "total_num_pages=8 is not supported"),
    (dict(custom_cache_manager=object()), "custom_cache_manager is not supported"),
    (dict(qkv_format="thd"), "qkv_format='thd' is not supported"),
    (dict(max_ctx_len=8), "max_ctx_len=8 is not supported"),
    (dict(num_heads_kv=None), "num_heads_kv is required"),
    (dict(dtype=torch.int32), "dtype must be a floating-point torch.dtype"),
    (dict(max_batch_size=0), "max_batch_size must be a positive integer"),
    (dict(head_dim_v=-1), "head_dim_v must be a positive integer"),
])
def test_unsupported_constructor_arguments_are_refused(kwargs, match):
    args = dict(max_batch_size=2, max_sequence_length=8, num_heads_kv=2, head_dim_k=16,
                dtype=torch.float32)
    with pytest.raises(ValueError, match=match):
        InferenceParams(**{**args, **kwargs})


def test_pre_step_refuses_batches_and_lengths_past_the_cache():
    params = InferenceParams(2, 8, 2, 16, torch.float32)
    with pytest.raises(ValueError, match=r"3 sequences exceed max_batch_size \(2\)"):
        params.pre_step({0: 1, 1: 1, 2: 1})
    with pytest.raises(ValueError, match=r"sequence 1 would hold 9 tokens, more than "
                                         r"max_sequence_length \(8\)"):
        params.pre_step({0: 3, 1: 9})
    params.pre_step({0: 8})
    with pytest.raises(ValueError, match=r"sequence 0 would hold 9 tokens, more than "
                                         "max_sequence_length"):
        params.pre_step({0: 1})  # a decode step past the end
    with pytest.raises(ValueError, match=r"step_dict\[0\] must be a positive int"):
        params.pre_step({0: 0})
    with pytest.raises(ValueError, match="step_dict must be a non-empty dict"):
        params.pre_step([(0, 1)])


def test_step_refuses_inputs_that_do_not_fit(gen, device):
    model = build(gen, "sbhd", device)
    params = new_params(2, device)
    tokens = torch.randint(VOCAB, (3, 5), generator=gen).to(device)
    params.pre_step({0: 5, 1: 5})
    with pytest.raises(RuntimeError, match=r"the KV cache is for inference: run the forward "
                                           r"under torch.no_grad\(\)"):
        model(tokens[:2], inference_params=params)
    params.reset()
    with torch.no_grad():
        with pytest.raises(RuntimeError, match=r"call inference_params.pre_step\(step_dict\)"):
            model(tokens, inference_params=params)
        params.pre_step({0: 5, 1: 5})
        # [b, s] tokens of batch 3 against 2 announced sequences
        with pytest.raises(ValueError, match=r"MultiheadAttention: the input's batch \(3\) is "
                                             r"not the number of sequences inference_params."
                                             r"pre_step announced \(2\)"):
            model(tokens, inference_params=params)
        # a TransformerLayer built for "sbhd" given [b, s, hidden]: the wrong layout (without
        # rotary embeddings: the cache's step finds it)
        hidden = randn(gen, 2, 5, HIDDEN, device=device)
        with pytest.raises(ValueError, match=r"InferenceParams.step: new_k must have batch 2 "
                                             r"\(the sequences pre_step announced\)"):
            model.layers[0](hidden, self_attn_mask_type="padding_causal",
                            inference_params=params)
        with pytest.raises(ValueError, match=r"new_k holds 3 tokens per sequence, fewer than "
                                             r"the step's longest \(5\)"):
            model(tokens[:2, :3], inference_params=params)
        bf16 = new_params(2, device, dtype=torch.bfloat16)
        bf16.pre_step({0: 5, 1: 5})
        with pytest.raises(TypeError, match="the cache is torch.bfloat16: build "
                                            "InferenceParams with dtype="):
            model(tokens[:2], inference_params=bf16)
        params.pre_step({0: 1, 1: 1})  # (a fresh step)
        shared = copy.deepcopy(model)
        for layer in shared.layers:
            layer.self_attention.core_attention.layer_number = 1
        with pytest.raises(RuntimeError, match="layer_number 1 was stepped twice since the "
                                               "last pre_step"):
            shared(tokens[:2, :1], inference_params=params)


def test_attention_with_a_cache_needs_its_layer_number_and_a_mask_from_lengths():
    attn = tfp8.DotProductAttention(2, 16, qkv_format="bshd")
    params = InferenceParams(1, 8, 2, 16, torch.float32)
    params.pre_step({0: 4})
    q = torch.randn(1, 4, 2, 16)
    with pytest.raises(ValueError, match=r"inference_params needs a layer_number"):
        attn(q, q, q, inference_params=params)
    attn = tfp8.DotProductAttention(2, 16, qkv_format="bshd", layer_number=3)
    with pytest.raises(ValueError, match="'arbitrary' is not supported with inference_params"):
        attn(q, q, q, attn_mask_type="arbitrary", attention_mask=torch.zeros(1, 1, 4, 4,
                                                                             dtype=torch.bool),
             inference_params=params)
    with pytest.raises(TypeError, match="inference_params must be a transformer_fp8."
                                        "InferenceParams"):
        attn(q, q, q, inference_params={"max_batch_size": 1})
    with pytest.raises(ValueError, match="qkv_format must be one of"):
        params.step(3, q, q, "thd")
    # One sequence, no padding: the bottom-right causal attention of the prefill is causal.
    out = attn(q, q, q, inference_params=params)
    ref = attn(q, q, q, attn_mask_type="causal")
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    k_cache, _ = params.cache[3]  # [max_batch_size, max_sequence_length, g, d], zeros first
    assert torch.equal(k_cache[0, :4], q[0]) and not k_cache[0, 4:].any()


def test_a_device_named_without_index_is_the_current_one(monkeypatch):
    """InferenceParams(device="cuda") must accept keys on cuda:0 when that is the current
    device (torch.device("cuda") != torch.device("cuda", 0); every CUDA decoding step failed so
    on an H100); the rule is checked here without a GPU through a stand-in current device."""
    from transformer_fp8.modules.attention import inference
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert inference._indexed(torch.device("cuda")) == torch.device("cuda", 3)
    assert inference._indexed(torch.device("cuda", 1)) == torch.device("cuda", 1)
    assert inference._indexed(torch.device("cpu")) == torch.device("cpu")
    assert inference._indexed(torch.device("meta")) == torch.device("meta")
