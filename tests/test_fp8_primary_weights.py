"""FP8 primary weights (quantized_model_init): modules built inside hold their GEMM weights as
Fp8Weight. What they compute (bit for bit the same module with the dequantised weight), how they
train (an fp32 master copy tracks a high-precision run; plain SGD on the FP8 weight stalls),
and their memory. Writes, checkpoints and errors: test_fp8_primary_weights_state.py."""
from __future__ import annotations

import pytest
import torch

import transformer_fp8 as tfp8
from conftest import assert_bitwise_equal, randn, sqnr
from transformer_fp8 import ops
from transformer_fp8.modules.fp8_primary_weights import SCALE_INV_SUFFIX, stored_bytes
from transformer_fp8.quantization.fp8_weight import Fp8Weight

DELAYED = tfp8.DelayedScaling(amax_history_len=4)
CURRENT = tfp8.Float8CurrentScaling()

# name -> (constructor, input feature count, forward extra arguments)
MODULES = {
    "Linear": (lambda **kw: tfp8.Linear(64, 32, **kw), 64, ()),
    "LayerNormLinear": (lambda **kw: tfp8.LayerNormLinear(64, 48, **kw), 64, ()),
    "LayerNormMLP": (lambda **kw: tfp8.LayerNormMLP(64, 96, activation="swiglu", **kw), 64, ()),
    "GroupedLinear": (lambda **kw: tfp8.GroupedLinear(2, 32, 48, **kw), 32, ([16, 16],)),
}


def build_pair(name, recipe, dtype=torch.float32, device="cpu", seed=0):
    """The module built inside quantized_model_init, and the same module built outside with
    its weights set to the dequantised FP8 weights (and the same FP8 state)."""
    make = MODULES[name][0]
    torch.manual_seed(seed)
    with tfp8.quantized_model_init(recipe=recipe):
        fp8 = make(params_dtype=dtype, device=device)
    torch.manual_seed(seed)
    ref = make(params_dtype=dtype, device=device)
    ref.load_state_dict(fp8.state_dict(), strict=True)  # the dequantised weights load
    return fp8, ref


def fp8_weights_of(module):
    return [p for p in module.parameters() if isinstance(p, Fp8Weight)]


def run(module, x, extra, recipe, grad):
    x = x.detach().clone().requires_grad_()
    if recipe is None:
        out = module(x, *extra)
    else:
        with tfp8.fp8_autocast(fp8_recipe=recipe):
            out = module(x, *extra)
    out.backward(grad)
    return out, x.grad, {n: p.grad for n, p in module.named_parameters()}


@pytest.mark.parametrize("recipe", [DELAYED, CURRENT], ids=["delayed", "current"])
@pytest.mark.parametrize("name", list(MODULES))
def test_weights_are_fp8_with_their_scale(name, recipe, device):
    fp8, _ = build_pair(name, recipe, device=device)
    weights = fp8_weights_of(fp8)
    assert len(weights) == len(fp8.fp8_weights()) >= 1
    for gemm, w in enumerate(fp8.fp8_weights()):
        assert isinstance(w, Fp8Weight) and isinstance(w, torch.nn.Parameter)
        assert w.dtype == torch.float32 and w.requires_grad
        assert w.fp8_data.dtype == torch.float8_e4m3fn and w.fp8_data.element_size() == 1
        init = w.dequantize()  # the value it stands for, and its scale: its own amax's
        amax = init.abs().max().reshape(1)
        own = ops.compute_scale_from_amax(w.fp8_data.float().abs().max().reshape(1) *
                                          w.fp8_scale_inv, 448.0)
        assert torch.allclose(w.fp8_scale_inv.reciprocal(), own, rtol=1e-6), "scale from amax"
        assert w.fp8_data.float().abs().max() == 448.0, "the largest element lands on 448"
        if recipe is DELAYED:  # the layer's weight state starts from that scale and amax
            col = 2 * gemm + 1
            assert_bitwise_equal(fp8.fp8_fwd_scale_inv[col:col + 1], w.fp8_scale_inv)
            assert torch.allclose(fp8.fp8_fwd_amax_history[0, col], amax, rtol=2 ** -3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("recipe", [DELAYED, CURRENT, tfp8.Float8BlockScaling(), None],
                         ids=["delayed", "current", "block", "outside"])
@pytest.mark.parametrize("name", list(MODULES))
def test_same_outputs_and_gradients_as_the_dequantised_weights(name, recipe, dtype, device,
                                                               gen):
    """The FP8 GEMMs take the FP8 data as it is; the module with the dequantised weight casts
    it back to the same data with the same scale: bit for bit the same outputs and gradients
    (the weight gradient in the weight's dtype). Under a block recipe and outside fp8_autocast
    both compute with the dequantised weight."""
    init_recipe = CURRENT if recipe is CURRENT else DELAYED
    fp8, ref = build_pair(name, init_recipe, dtype, device)
    _, features, extra = MODULES[name]
    x = randn(gen, 32, features, dtype=dtype, device=device)
    out_features = fp8(x, *extra).shape[-1]
    grad = randn(gen, 32, out_features, dtype=dtype, device=device)
    out, dx, grads = run(fp8, x, extra, recipe, grad)
    out_ref, dx_ref, grads_ref = run(ref, x, extra, recipe, grad)
    assert_bitwise_equal(out, out_ref, "output")
    assert_bitwise_equal(dx, dx_ref, "input gradient")
    for key, g in grads.items():
        assert type(g) is torch.Tensor and g.dtype == dtype, key
        assert_bitwise_equal(g, grads_ref[key], f"grad of {key}")
    if recipe is DELAYED:  # the same step for the state, except the weights' amaxes, which
        # the FP8 weights recorded when they were written (not at this forward)
        state, state_ref = fp8.state_dict(), ref.state_dict()
        cols = slice(0, None, 2)  # the inputs' columns
        assert_bitwise_equal(state["fp8_fwd_amax_history"][:, cols],
                             state_ref["fp8_fwd_amax_history"][:, cols], "input amaxes")
        assert_bitwise_equal(state["fp8_bwd_amax_history"], state_ref["fp8_bwd_amax_history"])


@pytest.mark.parametrize("first", [True, False])
def test_is_first_microbatch_uses_the_fp8_weight(first, gen):
    fp8, ref = build_pair("Linear", DELAYED)
    x = randn(gen, 16, 64)
    with tfp8.fp8_autocast(fp8_recipe=DELAYED):
        out = fp8(x, is_first_microbatch=True)
        again = fp8(x, is_first_microbatch=first)
        out_ref = ref(x)
    assert_bitwise_equal(out, out_ref)
    assert_bitwise_equal(again, out_ref)
    assert fp8._weight_cache == [None], "nothing kept: the weight is its own FP8 operand"


def test_activation_checkpointing_is_bit_identical(gen):
    fp8, _ = build_pair("LayerNormMLP", DELAYED)
    plain, _ = build_pair("LayerNormMLP", DELAYED)
    x = randn(gen, 32, 64)
    grad = randn(gen, 32, 64)
    results = []
    for module, checkpointed in ((fp8, True), (plain, False)):
        xi = x.clone().requires_grad_()
        with tfp8.fp8_autocast(fp8_recipe=DELAYED):
            out = (torch.utils.checkpoint.checkpoint(module, xi, use_reentrant=False)
                   if checkpointed else module(xi))
        out.backward(grad)
        results.append((out, xi.grad, module.fc1_weight.grad, module.fc2_weight.grad))
    for got, want in zip(*results):
        assert_bitwise_equal(got, want)


def _mlp():
    return torch.nn.Sequential(tfp8.Linear(64, 128), torch.nn.GELU(), tfp8.Linear(128, 32))


def _train(model, step_fn, gen_seed, steps):
    """Regression of tanh(x @ W) with fresh inputs every step; returns the losses."""
    g = torch.Generator().manual_seed(gen_seed)
    target_w = torch.randn(64, 32, generator=g) / 8
    losses = []
    for _ in range(steps):
        x = torch.randn(256, 64, generator=g)
        with tfp8.fp8_autocast(fp8_recipe=DELAYED):
            loss = torch.nn.functional.mse_loss(model(x), torch.tanh(x @ target_w))
        loss.backward()
        step_fn()
        losses.append(loss.item())
    return losses


def test_training_with_an_fp32_master_copy_tracks_high_precision(gen):
    """AdamW on fp32 master weights (seeded from get_high_precision_init_val), written back with
    param.copy_(master), against the same model with high-precision weights and the same FP8
    GEMMs. Measured (benchmarks/measure_fp8_primary_weights.py, 30 steps, seeds 0-2, commit
    7f5f94a, benchmarks/results/2026-11-27-cpu-fp8-primary-weights): losses within 0.15% of each
    other, master weights at 41.2-41.6 dB SQNR from the high-precision run's."""
    seed = int(torch.randint(0, 2**31, (1,), generator=gen))
    torch.manual_seed(seed)
    with tfp8.quantized_model_init(recipe=DELAYED, preserve_high_precision_init_val=True):
        fp8_model = _mlp()
    torch.manual_seed(seed)
    hp_model = _mlp()
    masters = []
    for p, p_hp in zip(fp8_model.parameters(), hp_model.parameters()):
        init = p.get_high_precision_init_val() if isinstance(p, Fp8Weight) else p.detach()
        assert_bitwise_equal(init, p_hp.detach(), "the kept initial value")
        masters.append(torch.nn.Parameter(init.float().clone()))
        if isinstance(p, Fp8Weight):
            p.clear_high_precision_init_val()
            assert p.get_high_precision_init_val() is None
    opt = torch.optim.AdamW(masters, lr=1e-3)
    opt_hp = torch.optim.AdamW(hp_model.parameters(), lr=1e-3)

    def master_step():
        for master, p in zip(masters, fp8_model.parameters()):
            master.grad, p.grad = p.grad.float(), None
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for master, p in zip(masters, fp8_model.parameters()):
                p.copy_(master)

    def hp_step():
        opt_hp.step()
        opt_hp.zero_grad()

    losses = _train(fp8_model, master_step, seed, 30)
    losses_hp = _train(hp_model, hp_step, seed, 30)
    assert losses[-1] < 0.7 * losses[0], "it trains"
    worst = max(abs(a - b) / b for a, b in zip(losses, losses_hp))
    assert worst < 0.01, f"losses {worst:.2%} apart"
    for master, p_hp in zip(masters, hp_model.parameters()):
        assert sqnr(p_hp.detach(), master.detach()) > 35


def test_plain_sgd_on_fp8_weights_quantises_every_update(gen):
    """torch.optim.SGD updates the FP8 weight in place: the new value is quantised with the
    layer's delayed weight scale, so every update smaller than half an FP8 step is lost.
    Measured (lr 0.3, 30 steps, seeds 0-2, benchmarks/measure_fp8_primary_weights.py, commit
    7f5f94a, as at e98e941): 96% of the first layer's FP8 codes unchanged by each step and the loss
    rises
    (0.43-0.45 -> 0.46-0.47) where high-precision weights reach 0.34-0.35."""
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    with tfp8.quantized_model_init(recipe=DELAYED):
        model = _mlp()
    w = model[0].weight
    opt = torch.optim.SGD(model.parameters(), lr=0.3)
    kept = []

    def step():
        before = w.dequantize()
        expected = before - 0.3 * w.grad  # what SGD writes, then quantised with the layer's
        scale = model[0].fp8_fwd_scale[1:2].clone()  # scale, or its own where that would clip
        amax = ops.amax(expected).reshape(1)
        if (amax * scale > 448).item():
            scale = ops.compute_scale_from_amax(amax, 448.0, DELAYED.margin)
        codes = w.fp8_data.view(torch.uint8).clone()
        opt.step()
        opt.zero_grad()
        assert_bitwise_equal(w.fp8_data, ops.cast_to_fp8(expected, scale, torch.float8_e4m3fn))
        kept.append((w.fp8_data.view(torch.uint8) == codes).float().mean().item())

    losses = _train(model, step, 1, 10)
    assert min(kept) > 0.9, kept  # most codes do not move
    assert losses[-1] > 0.9 * losses[0], losses  # and the loss hardly does


@pytest.mark.parametrize("dtype,hp_bytes", [(torch.float32, 4), (torch.bfloat16, 2)])
def test_memory_per_parameter(dtype, hp_bytes):
    """Bytes of parameters and buffers (FP8 state included), FP8 weights against the same
    module built outside quantized_model_init: 1 byte per weight element plus 8 bytes (scale,
    scale_inv) per weight."""
    torch.manual_seed(0)
    with tfp8.quantized_model_init(recipe=DELAYED):
        fp8 = tfp8.LayerNormMLP(1024, 4096, params_dtype=dtype)
    hp = tfp8.LayerNormMLP(1024, 4096, params_dtype=dtype, recipe=DELAYED)
    weight_elements = 2 * 1024 * 4096
    assert [w.stored_bytes() for w in fp8_weights_of(fp8)] == [4096 * 1024 + 8] * 2
    saved = stored_bytes(hp) - stored_bytes(fp8)
    assert saved == weight_elements * (hp_bytes - 1) - 2 * 8
    ratio = stored_bytes(fp8) / stored_bytes(hp)
    print(f"{dtype}: {stored_bytes(fp8)} / {stored_bytes(hp)} bytes = {ratio:.5f}")
    # measured 0.25064 (float32), 0.50043 (bfloat16)
    assert ratio < (0.2507 if dtype == torch.float32 else 0.5005), ratio


def test_state_dict_holds_plain_tensors():
    fp8, _ = build_pair("Linear", DELAYED)
    state = fp8.state_dict()
    assert type(state["weight"]) is torch.Tensor and state["weight"].dtype == torch.float32
    assert_bitwise_equal(state["weight"], fp8.weight.dequantize())
    assert_bitwise_equal(state["weight" + SCALE_INV_SUFFIX], fp8.weight.fp8_scale_inv)
    assert fp8.state_dict(keep_vars=True)["weight"] is fp8.weight


WRITES = {
    "optimizer_step": lambda m, w: torch.optim.SGD(m.parameters(), lr=0.5).step(),
    "copy_": lambda m, w: w.copy_(torch.randn(w.shape) * 3),
    "data": lambda m, w: setattr(w, "data", torch.randn(w.shape)),
    "load_state_dict": lambda m, w: m.load_state_dict(
        {k: (v * 2 if k == "weight" else v) for k, v in m.state_dict().items()}),
}


@pytest.mark.parametrize("write", list(WRITES))
@pytest.mark.parametrize("recipe", [DELAYED, CURRENT], ids=["delayed", "current"])
def test_writes_keep_the_fp8_tensors_addresses(recipe, write):
    """A write (optimizer step, copy_, .data =, load_state_dict) goes into the weight's FP8
    data, scale and scale_inv in place: a captured CUDA graph reads them at the addresses it
    was captured with (each write replaced them, and replays read freed memory). A backward
    after a write still uses the weight its forward cast (dgrad from the forward's operand),
    bit for bit a run without the write."""
    layers = []
    for _ in range(2):
        torch.manual_seed(0)
        with tfp8.quantized_model_init(recipe=recipe):
            layers.append(tfp8.Linear(32, 48))
    written, untouched = layers
    weight = written.weight

    def tensors():
        return (weight.fp8_data, weight._fp8.scale, weight.fp8_scale_inv)

    before = [t.data_ptr() for t in tensors()]
    x = torch.randn(16, 32)
    grads = []
    for layer, do_write in ((written, True), (untouched, False)):
        xx = x.clone().requires_grad_(True)
        with tfp8.fp8_autocast(fp8_recipe=recipe):
            out = layer(xx)
        if do_write:
            if write == "optimizer_step":
                weight.grad = torch.ones_like(weight.dequantize())
            with torch.no_grad():
                WRITES[write](layer, layer.weight)
        out.sum().backward()
        grads.append(xx.grad)
    assert [t.data_ptr() for t in tensors()] == before
    assert not torch.equal(written.weight.dequantize(), untouched.weight.dequantize())
    assert_bitwise_equal(grads[0], grads[1], "input gradient")


@pytest.mark.parametrize("convert", ["half", "to_bfloat16"])
def test_a_converted_copy_of_a_weight_is_independent_of_it(convert):
    """weight.half() / .to(torch.bfloat16) holds the same FP8 values in
    tensors of its own: writes (in place since 37b70be) into either leave the other as it was
    (the copy shared the original's tensors: an optimizer step changed an EMA copy)."""
    torch.manual_seed(0)
    with tfp8.quantized_model_init(recipe=CURRENT):
        layer = tfp8.Linear(32, 48)
    weight = layer.weight
    copy = {"half": lambda w: w.half(),
            "to_bfloat16": lambda w: w.to(torch.bfloat16)}[convert](weight)
    assert isinstance(copy, Fp8Weight)
    assert_bitwise_equal(copy.fp8_data, weight.fp8_data, "FP8 data")
    original, copied = weight.dequantize().clone(), copy.dequantize().clone()
    with torch.no_grad():
        weight.copy_(torch.randn(48, 32) * 4)
    assert_bitwise_equal(copy.dequantize(), copied, "the copy after a write to the weight")
    changed = weight.dequantize().clone()
    with torch.no_grad():
        copy.copy_(torch.randn(48, 32) * 7)
    assert_bitwise_equal(weight.dequantize(), changed, "the weight after a write to the copy")
    assert not torch.equal(original, changed)


@pytest.mark.parametrize("recipe", [tfp8.DelayedScaling(amax_history_len=4),
                                    tfp8.Float8CurrentScaling()], ids=["delayed", "current"])
@pytest.mark.parametrize("module", ["linear", "layernorm_mlp"])
def test_compiled_fp8_weights_train_as_eager(module, recipe):
    """torch.compile (aot_eager): the FP8 step of a layer with FP8 weights runs eagerly (a
    graph break), so the weights get their gradients (the trace took the weight's inner
    tensors as inputs: every weight gradient was None, no error) and training is bit for bit
    eager's, over steps whose scales change."""
    import copy

    from integration_compare import assert_bit_identical, step_batches, train

    torch.manual_seed(0)
    with tfp8.quantized_model_init(recipe=recipe):
        eager = (tfp8.Linear(64, 32) if module == "linear" else tfp8.LayerNormMLP(64, 128))
    compiled = copy.deepcopy(eager)
    torch._dynamo.reset()
    run = torch.compile(compiled, backend="aot_eager")
    batches = step_batches(torch.Generator().manual_seed(1), 3, 16, 64)
    got = train(compiled, run, batches, recipe, lr=0.01)
    expected = train(eager, eager, batches, recipe, lr=0.01)
    assert all(g is not None for step in got for name, g in step.grads.items()
               if "weight" in name), "every weight got a gradient"
    assert_bit_identical(got, expected)


@pytest.mark.parametrize("recipe", [DELAYED, tfp8.Float8CurrentScaling()],
                         ids=["delayed", "current"])
def test_a_written_value_past_the_layers_range_is_not_clipped(gen, recipe):
    """An initialisation written after construction (Hugging Face's weight.data.normal_) or a
    weight that grows goes past the range of the delayed weight scale, which the construction
    made from the initial values alone: such a value is cast with its own scale (38% of a
    normal_(0, 0.02) init were clipped to the initial max before, std 0.012 for 0.02)."""
    with tfp8.quantized_model_init(recipe=recipe):
        layer = tfp8.Linear(1024, 256)
    value = randn(gen, 256, 1024) * 0.02
    with torch.no_grad():
        layer.weight.data.copy_(value)
    own = ops.compute_scale_from_amax(ops.amax(value).reshape(1), 448.0,
                                      getattr(recipe, "margin", 0))
    expected = ops.cast_from_fp8(ops.cast_to_fp8(value, own, torch.float8_e4m3fn),
                                 own.reciprocal(), torch.float32)
    assert_bitwise_equal(layer.weight.dequantize(), expected)
    if isinstance(recipe, tfp8.DelayedScaling):  # the layer's weight scale follows
        assert_bitwise_equal(layer.fp8_fwd_scale[1:2], own)
    if isinstance(recipe, tfp8.DelayedScaling):  # an infinite value keeps the layer's scale
        scale = layer.fp8_fwd_scale[1:2].clone()
        with torch.no_grad():
            layer.weight.data.copy_(value.index_fill(0, torch.tensor([3]), float("inf")))
        assert_bitwise_equal(layer.fp8_fwd_scale[1:2], scale)
