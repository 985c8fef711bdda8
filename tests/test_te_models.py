"""Model code written for Transformer Engine, run after `import transformer_fp8 as te`, against
pure-torch references: the te_llama tutorial's pattern (HuggingFace Llama decoder layers
swapped for TransformerLayer, weights copied its way), a GPT of TransformerLayers, and MoE
experts on GroupedLinear; and GroupedLinear's, fuse_wgrad_accumulation's and
delay_wgrad_compute's numbers against torch."""
from __future__ import annotations

import contextlib
import pickle

import pytest
import torch
import torch.nn.functional as F

import transformer_fp8 as te
from transformer_fp8 import DelayedScaling

RECIPE = DelayedScaling(amax_history_len=4)


def sqnr_db(out, ref):
    return (10 * torch.log10(ref.float().square().sum()
                             / (out.float() - ref.float()).square().sum())).item()


# ---- the te_llama tutorial's pattern --------------------------------------------------------

class TELlamaDecoderLayer(te.TransformerLayer):
    """The tutorial's wrapper, as written for Transformer Engine (minus its .cuda())."""

    def __init__(self, config, *args, **kwargs):
        super().__init__(
            hidden_size=config.hidden_size, ffn_hidden_size=config.intermediate_size,
            num_attention_heads=config.num_attention_heads, bias=False,
            layernorm_epsilon=config.rms_norm_eps, hidden_dropout=0, attention_dropout=0,
            fuse_qkv_params=False, normalization="RMSNorm", activation="swiglu",
            attn_input_format="bshd", num_gqa_groups=config.num_key_value_heads)
        te_rope = te.RotaryPositionEmbedding(config.hidden_size // config.num_attention_heads)
        self.te_rope_emb = te_rope(max_seq_len=config.max_position_embeddings)

    def forward(self, hidden_states, *args, attention_mask, **kwargs):
        if isinstance(hidden_states, tuple):
            hidden_states = hidden_states[0]
        return super().forward(hidden_states, attention_mask=attention_mask,
                               rotary_pos_emb=self.te_rope_emb)


@contextlib.contextmanager
def replace_decoder(modeling, cls):
    original = modeling.LlamaDecoderLayer
    modeling.LlamaDecoderLayer = cls
    try:
        yield
    finally:
        modeling.LlamaDecoderLayer = original


def replace_params(hf_state_dict, te_state_dict, config, layers):
    """The tutorial's weight copy, key for key."""
    for i in range(layers):
        p = f"model.layers.{i}."
        te_state_dict[p + "self_attention.layernorm_qkv.layer_norm_weight"].data[:] = \
            hf_state_dict[p + "input_layernorm.weight"].data[:]
        for name in ("query", "key", "value"):
            te_state_dict[p + f"self_attention.layernorm_qkv.{name}_weight"].data[:] = \
                hf_state_dict[p + f"self_attn.{name[0]}_proj.weight"].data[:]
        te_state_dict[p + "self_attention.proj.weight"].data[:] = \
            hf_state_dict[p + "self_attn.o_proj.weight"].data[:]
        te_state_dict[p + "layernorm_mlp.layer_norm_weight"].data[:] = \
            hf_state_dict[p + "post_attention_layernorm.weight"].data[:]
        te_state_dict[p + "layernorm_mlp.fc1_weight"].data[:config.intermediate_size] = \
            hf_state_dict[p + "mlp.gate_proj.weight"].data
        te_state_dict[p + "layernorm_mlp.fc1_weight"].data[config.intermediate_size:] = \
            hf_state_dict[p + "mlp.up_proj.weight"].data
        te_state_dict[p + "layernorm_mlp.fc2_weight"].data[:] = \
            hf_state_dict[p + "mlp.down_proj.weight"].data[:]


def test_te_llama_tutorial_runs_unchanged_and_matches_huggingface():
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama import modeling_llama
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        rms_norm_eps=1e-5, attn_implementation="sdpa")
    hf = transformers.LlamaForCausalLM(config).eval()
    with replace_decoder(modeling_llama, TELlamaDecoderLayer):
        model = transformers.LlamaForCausalLM(config).eval()
    assert isinstance(model.model.layers[0], te.TransformerLayer)
    hf_sd = hf.state_dict()
    replace_params(hf_sd, model.state_dict(), config, config.num_hidden_layers)
    model.load_state_dict({k: v for k, v in hf_sd.items() if "layers" not in k}, strict=False)
    ids = torch.randint(0, 128, (2, 32))
    with torch.no_grad():
        ref = hf(ids, use_cache=False).logits
        out = model(ids, use_cache=False).logits
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    # FP8 training steps of the swapped model: the loss stays close to HuggingFace's.
    labels = ids.clone()
    with te.fp8_autocast(fp8_recipe=RECIPE):
        loss = model(ids, labels=labels, use_cache=False).loss
    loss.backward()
    hf_loss = hf(ids, labels=labels, use_cache=False).loss
    assert abs(loss.item() - hf_loss.item()) / hf_loss.item() < 0.02
    assert all(p.grad is not None for p in model.model.layers.parameters())


# ---- a GPT of TransformerLayers -------------------------------------------------------------

class TEGPT(torch.nn.Module):
    """A GPT as a Transformer Engine user writes it."""

    def __init__(self, vocab=96, hidden=64, layers=2, heads=4):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.blocks = torch.nn.ModuleList(
            te.TransformerLayer(hidden, 4 * hidden, heads, hidden_dropout=0.0,
                                attention_dropout=0.0, self_attn_mask_type="causal",
                                layer_number=i + 1, fuse_qkv_params=True)
            for i in range(layers))
        self.norm = te.LayerNorm(hidden)
        self.head = te.Linear(hidden, vocab, bias=False)

    def forward(self, ids):
        x = self.embed(ids).transpose(0, 1)  # [s, b, h]
        mask = torch.ones(1, 1, ids.shape[1], ids.shape[1], dtype=torch.bool)  # ignored
        for block in self.blocks:
            x = block(x, attention_mask=mask)
        return self.head(self.norm(x)).transpose(0, 1)


def gpt_reference(model, ids):
    """The same GPT in torch ops (pre-LN blocks, causal SDPA, tanh-gelu MLP)."""
    x = model.embed(ids).transpose(0, 1)
    for block in model.blocks:
        att, mlp = block.self_attention, block.layernorm_mlp
        lnl = att.layernorm_qkv
        h = F.layer_norm(x, (64,), lnl.layer_norm_weight, lnl.layer_norm_bias, 1e-5)
        mixed = F.linear(h, lnl.weight, lnl.bias)  # interleaved per head: q, k, v
        s, b = mixed.shape[:2]
        q, k, v = mixed.view(s, b, 4, 3, 16).unbind(3)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
        ctx = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + F.linear(ctx.permute(2, 0, 1, 3).reshape(s, b, 64), att.proj.weight,
                         att.proj.bias)
        h = F.layer_norm(x, (64,), mlp.layer_norm_weight, mlp.layer_norm_bias, 1e-5)
        h = F.gelu(F.linear(h, mlp.fc1_weight, mlp.fc1_bias), approximate="tanh")
        x = x + F.linear(h, mlp.fc2_weight, mlp.fc2_bias)
    x = F.layer_norm(x, (64,), model.norm.weight, model.norm.bias, 1e-5)
    return F.linear(x, model.head.weight).transpose(0, 1)


def test_gpt_of_transformer_layers_against_torch_and_in_fp8():
    torch.manual_seed(0)
    model = TEGPT()
    ids = torch.randint(0, 96, (2, 32))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), gpt_reference(model, ids), rtol=1e-5, atol=1e-5)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(4):
        with te.fp8_autocast(fp8_recipe=RECIPE):
            logits = model(ids)
        loss = F.cross_entropy(logits.reshape(-1, 96), ids.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    with torch.no_grad():
        ref = gpt_reference(model, ids)
        with te.fp8_autocast(fp8_recipe=RECIPE):
            assert sqnr_db(model(ids), ref) > 20
    assert losses[-1] < losses[0]


# ---- MoE experts on GroupedLinear -----------------------------------------------------------

class MoE(torch.nn.Module):
    """Top-1 MoE MLP as written for Transformer Engine: tokens sorted by expert, then two
    GroupedLinear layers (fc1, fc2) with m_splits = tokens per expert."""

    def __init__(self, hidden=32, ffn=64, experts=4):
        super().__init__()
        self.router = torch.nn.Linear(hidden, experts, bias=False)
        self.fc1 = te.GroupedLinear(experts, hidden, ffn)
        self.fc2 = te.GroupedLinear(experts, ffn, hidden)
        self.experts = experts

    def route(self, x):
        expert = self.router(x).argmax(-1)
        order = torch.argsort(expert, stable=True)
        return order, torch.bincount(expert, minlength=self.experts).tolist()

    def forward(self, x):
        order, splits = self.route(x)
        h = F.gelu(self.fc1(x[order], splits), approximate="tanh")
        out = torch.empty_like(x)
        out[order] = self.fc2(h, splits)
        return out


def moe_reference(moe, x, linear=F.linear):
    order, splits = moe.route(x)
    outs = []
    for i, block in enumerate(x[order].split(splits)):
        h = F.gelu(linear(block, getattr(moe.fc1, f"weight{i}"), getattr(moe.fc1, f"bias{i}")),
                   approximate="tanh")
        outs.append(linear(h, getattr(moe.fc2, f"weight{i}"), getattr(moe.fc2, f"bias{i}")))
    out = torch.empty_like(x)
    out[order] = torch.cat(outs)
    return out


def test_moe_experts_on_grouped_linear_against_torch():
    torch.manual_seed(0)
    moe = MoE()
    x = torch.randn(64, 32)
    assert torch.equal(moe(x), moe_reference(moe, x))
    with te.fp8_autocast(fp8_recipe=RECIPE):
        for _ in range(2):  # the second step casts with scales from the first
            out = moe(x)
    # Two E4M3 GEMMs in a row: 24.7 dB measured (seed 0); a wrong scale gives a few dB.
    assert sqnr_db(out, moe_reference(moe, x)) > 20


def test_grouped_linear_in_fp8_is_one_fp8_linear_per_expert():
    """Same weights and fresh state: GroupedLinear's outputs, gradients and FP8 state equal
    those of G separate FP8 Linear layers, bit for bit, an expert with no rows included."""
    torch.manual_seed(0)
    grouped = te.GroupedLinear(3, 32, 48, recipe=RECIPE)
    experts = [te.Linear(32, 48, recipe=RECIPE) for _ in range(3)]
    with torch.no_grad():
        for i, e in enumerate(experts):
            e.weight.copy_(getattr(grouped, f"weight{i}"))
            e.bias.normal_()
            getattr(grouped, f"bias{i}").copy_(e.bias)
    splits = [20, 0, 28]
    for step in range(3):
        x = torch.randn(48, 32) * (step + 1)
        xg, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
        with te.fp8_autocast(fp8_recipe=RECIPE):
            out_g = grouped(xg, splits)
            out_e = torch.cat([e(b) for e, b in zip(experts, xe.split(splits))])
        grad = torch.randn_like(out_g)
        out_g.backward(grad)
        out_e.backward(grad)
        assert torch.equal(out_g, out_e) and torch.equal(xg.grad, xe.grad), step
    for i, e in enumerate(experts):
        assert torch.equal(getattr(grouped, f"weight{i}").grad, e.weight.grad)
        assert torch.equal(getattr(grouped, f"bias{i}").grad, e.bias.grad)
        assert torch.equal(grouped.fp8_fwd_scale[2 * i:2 * i + 2], e.fp8_fwd_scale)
        assert torch.equal(grouped.fp8_fwd_amax_history[:, 2 * i:2 * i + 2],
                           e.fp8_fwd_amax_history)
        assert torch.equal(grouped.fp8_bwd_scale[i:i + 1], e.fp8_bwd_scale)


def test_an_expert_given_no_rows_keeps_its_history():
    """DelayedScaling: an expert with no rows records amax 0, which is also what a layer that
    did not run gives the reduction, so its columns neither roll nor rescale (documented in
    Good to know; Transformer Engine rolls a 0 in, so with 'max' its window ages)."""
    recipe = DelayedScaling(amax_history_len=2)
    g = te.GroupedLinear(2, 32, 16, recipe=recipe)
    x = torch.randn(8, 32)
    x[4:] *= 100  # expert 1's rows
    with te.fp8_autocast(fp8_recipe=recipe):
        g(x, [4, 4]).sum().backward()
    history, scale = g.fp8_fwd_amax_history.clone(), g.fp8_fwd_scale.clone()
    for _ in range(3):  # more steps than the history is long, expert 1 idle
        with te.fp8_autocast(fp8_recipe=recipe):
            g(torch.randn(8, 32), [8, 0]).sum().backward()
    assert torch.equal(g.fp8_fwd_amax_history[:, 2], history[:, 2]), "expert 1's input column"
    assert torch.equal(g.fp8_fwd_scale[2], scale[2])
    assert g.fp8_fwd_amax_history[1, 2] == x[4:].abs().max(), "its old amax still in the window"
    assert not torch.equal(g.fp8_fwd_amax_history[:, 0], history[:, 0]), "expert 0 rolled"


def test_grouped_linear_errors_name_the_argument():
    g = te.GroupedLinear(2, 32, 16)
    with pytest.raises(ValueError, match="m_splits must hold 2 non-negative integers"):
        g(torch.randn(8, 32), [8])
    with pytest.raises(ValueError, match=r"m_splits must add up to the input's 8 rows"):
        g(torch.randn(8, 32), [3, 4])
    with pytest.raises(ValueError, match="m_splits must hold 2 non-negative integers"):
        g(torch.randn(8, 32), [True, 7])
    with pytest.raises(ValueError, match="m_splits must hold 2 non-negative integers"):
        g(torch.randn(8, 32), [4.0, 4.0])
    for splits in ([torch.tensor(True), 7], [torch.tensor([1]), 7]):  # (operator.index took them)
        with pytest.raises(ValueError, match="m_splits must hold 2 non-negative integers"):
            g(torch.randn(8, 32), splits)
    with pytest.raises(TypeError, match="inp must be a tensor, got list"):
        g([[0.0] * 32] * 8, [4, 4])
    # 0-dim integer tensors are integers
    x8 = torch.randn(8, 32)
    assert torch.equal(g(x8, [torch.tensor(1), torch.tensor(7)]), g(x8, [1, 7]))
    # numpy integers are integers (as Transformer Engine takes them): the same output
    np = pytest.importorskip("numpy")
    x = torch.randn(8, 32)
    expected = g(x, [3, 5])
    assert torch.equal(g(x, np.array([3, 5])), expected)
    assert torch.equal(g(x, [np.int64(3), np.int32(5)]), expected)
    with pytest.raises(ValueError, match=r"input must have shape \[\.\.\., 32\]"):
        g(torch.randn(8, 16), [4, 4])
    with pytest.raises(ValueError, match="num_gemms must be a positive integer"):
        te.GroupedLinear(0, 32, 16)
    with pytest.raises(ValueError, match="single_grouped_weight=True is not supported"):
        te.GroupedLinear(2, 32, 16, single_grouped_weight=True)
    assert {n for n, _ in g.named_parameters()} == {"weight0", "weight1", "bias0", "bias1"}


# ---- fuse_wgrad_accumulation and delay_wgrad_compute ----------------------------------------

def _modules(kind, **options):
    torch.manual_seed(0)
    build = {"linear": lambda **o: te.Linear(32, 48, **o),
             "layernorm_linear": lambda **o: te.LayerNormLinear(32, 48, **o),
             "mlp": lambda **o: te.LayerNormMLP(32, 48, **o),
             "grouped": lambda **o: te.GroupedLinear(2, 32, 48, **o)}[kind]
    module, ref = build(**options), build()
    ref.load_state_dict(module.state_dict())
    call = (lambda m, x, **kw: m(x, [6, 10], **kw)) if kind == "grouped" else \
        (lambda m, x, **kw: m(x, **kw))
    weights = [n for n, p in module.named_parameters()
               if n.endswith("weight") and "layer_norm" not in n or n.startswith("weight")]
    return module, ref, call, weights


KINDS = ["linear", "layernorm_linear", "mlp", "grouped"]


WGRAD_RECIPES = [pytest.param(RECIPE, id="delayed"),
                 pytest.param(te.Float8BlockScaling(), id="block")]


@pytest.mark.parametrize("recipe", WGRAD_RECIPES)
@pytest.mark.parametrize("fp8", [False, True], ids=["hp", "fp8"])
@pytest.mark.parametrize("kind", KINDS)
def test_fuse_wgrad_accumulation_adds_to_main_grad(kind, fp8, recipe):
    module, ref, call, weights = _modules(kind, fuse_wgrad_accumulation=True)
    params = dict(module.named_parameters())
    for n in weights:
        params[n].main_grad = torch.full_like(params[n], 5.0, dtype=torch.float32)
    params[weights[0]].grad_added_to_main_grad = False
    xs = [torch.randn(16, 32) for _ in range(3)]
    for step, x in enumerate(xs):
        first = step == 0  # is_first_microbatch=True writes over main_grad
        with te.fp8_autocast(enabled=fp8, fp8_recipe=recipe):
            call(module, x, is_first_microbatch=first).square().sum().backward()
            call(ref, x, is_first_microbatch=first).square().sum().backward()
    ref_params = dict(ref.named_parameters())
    for n, p in params.items():
        if n in weights:
            assert torch.equal(p.main_grad, ref_params[n].grad), n
            expected_grad = torch.zeros_like(p) if n == weights[0] else None
            assert (p.grad is None) if expected_grad is None else torch.equal(p.grad,
                                                                              expected_grad)
        else:
            assert torch.equal(p.grad, ref_params[n].grad), n  # biases, norms: as usual
    assert params[weights[0]].grad_added_to_main_grad is True
    with pytest.raises(RuntimeError, match="needs every weight to have a 'main_grad'"):
        fresh, _, call_fresh, _ = _modules(kind, fuse_wgrad_accumulation=True)
        call_fresh(fresh, xs[0]).sum().backward()


@pytest.mark.parametrize("recipe", WGRAD_RECIPES)
@pytest.mark.parametrize("fp8", [False, True], ids=["hp", "fp8"])
@pytest.mark.parametrize("kind", KINDS)
def test_delay_wgrad_compute_hands_gradients_over_in_backward_dw(kind, fp8, recipe):
    module, ref, call, weights = _modules(kind, delay_wgrad_compute=True)
    x = torch.randn(16, 32)
    xm, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    with te.fp8_autocast(enabled=fp8, fp8_recipe=recipe):
        call(module, xm).square().sum().backward()
        call(ref, xr).square().sum().backward()
    assert torch.equal(xm.grad, xr.grad)
    params, ref_params = dict(module.named_parameters()), dict(ref.named_parameters())
    delayed = [n for n in params if "layer_norm" not in n]
    assert all(params[n].grad is None for n in delayed)
    assert all(torch.equal(params[n].grad, ref_params[n].grad) for n in params
               if n not in delayed)
    assert module.need_backward_dw()
    module.backward_dw()
    for n, p in params.items():
        assert torch.equal(p.grad, ref_params[n].grad), n
    with pytest.raises(RuntimeError, match="called more often than backward"):
        module.backward_dw()  # nothing left (Transformer Engine raises too): no change
    assert all(torch.equal(p.grad, ref_params[n].grad) for n, p in params.items())


@pytest.mark.parametrize("kind", KINDS)
def test_backward_dw_calls_the_wgrad_reduce_hooks_after_handing_over(kind):
    """register_wgrad_accumulation_and_reduce_hooks (Megatron-LM's reduction after the
    delayed wgrad): each hook runs once per backward_dw(), in order, once the gradients are in
    place; not in backward, not for a module without delay_wgrad_compute."""
    module, ref, call, weights = _modules(kind, delay_wgrad_compute=True)
    seen = []
    params = dict(module.named_parameters())
    module.register_wgrad_accumulation_and_reduce_hooks(
        lambda: seen.append(("a", params[weights[0]].grad is not None)))
    module.register_wgrad_accumulation_and_reduce_hooks(lambda: seen.append(("b", None)))
    for _ in range(2):
        call(module, torch.randn(16, 32)).square().sum().backward()
    assert seen == []
    module.backward_dw()
    assert seen == [("a", True), ("b", None)]
    module.backward_dw()
    assert seen == [("a", True), ("b", None)] * 2
    with pytest.raises(TypeError, match="hook must be callable, got int"):
        module.register_wgrad_accumulation_and_reduce_hooks(3)
    plain, _, call_plain, _ = _modules(kind)
    plain.register_wgrad_accumulation_and_reduce_hooks(lambda: seen.append("plain"))
    call_plain(plain, torch.randn(16, 32)).sum().backward()
    plain.backward_dw()  # no delay_wgrad_compute: nothing to do, no hook
    assert "plain" not in seen


@pytest.mark.parametrize("kind", KINDS)
def test_backward_dw_of_a_frozen_module_is_a_no_op(kind):
    """No parameter requires a gradient: backward leaves nothing, backward_dw() does
    nothing (the input still gets its gradient in backward)."""
    module, ref, call, _ = _modules(kind, delay_wgrad_compute=True)
    module.requires_grad_(False)
    ref.requires_grad_(False)
    x = torch.randn(16, 32)
    xm, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    call(module, xm).square().sum().backward()
    call(ref, xr).square().sum().backward()
    module.backward_dw()
    assert torch.equal(xm.grad, xr.grad)
    assert all(p.grad is None for p in module.parameters())


@pytest.mark.parametrize("kind", KINDS)
def test_a_failed_backward_dw_hands_nothing_over_and_can_be_retried(kind):
    """fuse + delay with a weight lacking main_grad: backward_dw() raises before handing
    anything over and keeps the entry, so the call after main_grad is set hands everything
    (the entry was popped and half applied before: main_grad stayed 0, biases lost)."""
    module, ref, call, weights = _modules(kind, fuse_wgrad_accumulation=True,
                                         delay_wgrad_compute=True)
    x = torch.randn(16, 32)
    call(module, x).square().sum().backward()
    call(ref, x).square().sum().backward()
    params, ref_params = dict(module.named_parameters()), dict(ref.named_parameters())
    with pytest.raises(RuntimeError, match="needs every weight to have a 'main_grad'"):
        module.backward_dw()
    assert all(p.grad is None for n, p in params.items() if "layer_norm" not in n)
    for n in weights:
        params[n].main_grad = torch.zeros_like(params[n])
    module.backward_dw()
    for n, p in params.items():
        if n in weights:
            assert torch.equal(p.main_grad, ref_params[n].grad), n
        else:
            assert torch.equal(p.grad, ref_params[n].grad), n
    assert not module._wgrad.pending  # the entry handed over once


@pytest.mark.parametrize("checkpointed", [None, "reentrant", "non_reentrant"])
@pytest.mark.parametrize("how", ["is_first_microbatch", "overwrite_main_grad"])
@pytest.mark.parametrize("delay", [False, True], ids=["fuse", "fuse_and_delay"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_module_run_twice_writes_the_sum_of_both_gradients_over_main_grad(kind, delay, how,
                                                                           checkpointed):
    """A module run twice in one forward, its main_grad written over (is_first_microbatch=True
    or overwrite_main_grad): main_grad ends as the sum of both calls' gradients (the second
    call's gradient wrote over the first's: half the gradient lost, no error), also with each
    call in its own checkpointed region (a reentrant one backpropagates in a pass of its own,
    and its recomputation runs the forward again)."""
    module, ref, call, weights = _modules(kind, fuse_wgrad_accumulation=True,
                                         delay_wgrad_compute=delay)
    params, ref_params = dict(module.named_parameters()), dict(ref.named_parameters())
    for n in weights:
        params[n].main_grad = torch.full_like(params[n], 5.0)
        if how == "overwrite_main_grad":
            params[n].overwrite_main_grad = True
    first = True if how == "is_first_microbatch" else None
    x1, x2 = torch.randn(16, 32, requires_grad=True), torch.randn(16, 32, requires_grad=True)

    def run(x):
        if checkpointed is None:
            return call(module, x, is_first_microbatch=first)
        return torch.utils.checkpoint.checkpoint(
            lambda t: call(module, t, is_first_microbatch=first), x,
            use_reentrant=checkpointed == "reentrant")

    (run(x1) + run(x2)).square().sum().backward()
    (call(ref, x1) + call(ref, x2)).square().sum().backward()
    while delay and module._wgrad.pending:  # (one entry per reentrant region's pass)
        module.backward_dw()
    for n in weights:
        torch.testing.assert_close(params[n].main_grad, ref_params[n].grad, rtol=1e-6,
                                   atol=1e-6, msg=n)


@pytest.mark.parametrize("fullgraph", [False, True])
def test_fuse_wgrad_accumulation_under_torch_compile_follows_is_first_microbatch(fullgraph):
    """A compiled Linear (aot_eager) over three microbatches, is_first_microbatch True, False,
    then True again: main_grad written over, added to, written over, as eagerly (the eager
    forward's bookkeeping walks the stack, which a trace cannot: fullgraph=True raised)."""
    torch._dynamo.reset()
    module, ref, call, _ = _modules("linear", fuse_wgrad_accumulation=True)
    module.weight.main_grad = torch.full_like(module.weight, 5.0)
    compiled = torch.compile(module, backend="aot_eager", fullgraph=fullgraph)
    x = torch.randn(16, 32)
    ref(x).square().sum().backward()
    expected = ref.weight.grad
    for first, factor in ((True, 1), (False, 2), (True, 1)):
        compiled(x, is_first_microbatch=first).square().sum().backward()
        torch.testing.assert_close(module.weight.main_grad, factor * expected, rtol=1e-6,
                                   atol=1e-6)


@pytest.mark.parametrize("kind", KINDS)
def test_wgrad_options_are_fixed_at_construction(kind):
    """Assigning fuse_wgrad_accumulation / delay_wgrad_compute after construction changed
    nothing (main_grad never written, silently); now a change is refused by name, the same
    value accepted, and a module pickled whole keeps its options."""
    module, _, _, _ = _modules(kind)
    with pytest.raises(AttributeError, match="fuse_wgrad_accumulation is fixed at construction"):
        module.fuse_wgrad_accumulation = True
    with pytest.raises(AttributeError, match="delay_wgrad_compute is fixed at construction"):
        module.delay_wgrad_compute = True
    module.fuse_wgrad_accumulation = False
    fused, _, _, _ = _modules(kind, fuse_wgrad_accumulation=True)
    copy = pickle.loads(pickle.dumps(fused))
    assert copy.fuse_wgrad_accumulation and not copy.delay_wgrad_compute


@pytest.mark.parametrize("kind", KINDS)
def test_a_module_called_twice_hands_one_backward_pass_over_at_once(kind):
    """delay_wgrad_compute on a module run twice in one forward (weights shared by two calls):
    one backward pass leaves one set of gradients, their sum, and one backward_dw() hands it
    over (it left two sets, half the gradient at a time); a second backward pass leaves a set
    of its own."""
    module, ref, call, _ = _modules(kind, delay_wgrad_compute=True)
    x = torch.randn(16, 32)

    def twice(m):
        return (call(m, x) + call(m, x * 0.5)).square().sum()

    for _ in range(2):
        twice(module).backward()
        twice(ref).backward()
    assert len(module._wgrad.pending) == 2
    module.backward_dw()
    module.backward_dw()
    for (n, p), q in zip(module.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-6, msg=n)


def test_backward_dw_with_frozen_gemm_weights_and_a_trainable_norm_is_a_no_op():
    """Only the norm trains (its gradient is never delayed): backward leaves nothing for
    backward_dw(), which does nothing (it raised 'called more often than backward')."""
    module = te.LayerNormLinear(32, 48, delay_wgrad_compute=True)
    module.weight.requires_grad_(False)
    module.bias.requires_grad_(False)
    module(torch.randn(16, 32)).square().sum().backward()
    module.backward_dw()
    assert module.layer_norm_weight.grad is not None and module.weight.grad is None
