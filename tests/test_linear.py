"""transformer_fp8.Linear: drop-in behaviour, FP8 numerics (SQNR), shapes, weight caching."""
from __future__ import annotations

import warnings

import pytest
import torch
from conftest import assert_bitwise_equal, randn, sqnr

import transformer_fp8 as tfp8
from transformer_fp8 import DelayedScaling, Float8CurrentScaling, Format, fp8_autocast
from transformer_fp8.modules import linear_fused_step

RECIPE = DelayedScaling(amax_history_len=16)


@pytest.fixture(autouse=True, params=["cpp_step", "python_path"])
def linear_step_path(request, monkeypatch):
    """Every test runs twice: with the C++ Linear step under DelayedScaling (the default,
    modules/linear_fused_step.py) and with the Python autograd function it replaces."""
    if request.param == "python_path":
        monkeypatch.setattr(linear_fused_step, "ENABLED", False)
    return request.param


def make_pair(gen, in_features, out_features, device, dtype=torch.float32, bias=True):
    """A transformer_fp8.Linear and a torch.nn.Linear with the same weights."""
    layer = tfp8.Linear(in_features, out_features, bias=bias, params_dtype=dtype, device=device)
    with torch.no_grad():
        layer.weight.copy_(randn(gen, out_features, in_features, device=device) / in_features**0.5)
        if bias:
            layer.bias.copy_(randn(gen, out_features, device=device))
    ref = torch.nn.Linear(in_features, out_features, bias=bias, device=device, dtype=dtype)
    ref.load_state_dict(tfp8.strip_fp8_state(layer.state_dict()))
    return layer, ref


def fp8_step(layer, x, grad, recipe=RECIPE):
    """One forward in fp8_autocast and backward outside it; returns (out, d_input, d_weight)."""
    x = x.detach().requires_grad_(True)
    layer.zero_grad()
    with fp8_autocast(fp8_recipe=recipe):
        out = layer(x)
    out.backward(grad)
    return out.detach(), x.grad, layer.weight.grad.clone()


def test_same_parameters_init_and_keys_as_nn_linear():
    torch.manual_seed(7)
    layer = tfp8.Linear(48, 32)
    torch.manual_seed(7)
    ref = torch.nn.Linear(48, 32)
    assert torch.equal(layer.weight, ref.weight) and torch.equal(layer.bias, ref.bias)
    assert isinstance(layer, torch.nn.Linear)
    assert set(ref.state_dict()) <= set(layer.state_dict())
    assert tfp8.Linear(16, 16, bias=False).bias is None


@pytest.mark.parametrize("enabled", [None, False])
def test_high_precision_outside_fp8(gen, device, enabled):
    layer, ref = make_pair(gen, 64, 32, device)
    x = randn(gen, 5, 3, 64, device=device)
    if enabled is None:
        out = layer(x)
    else:
        with fp8_autocast(enabled=False):
            out = layer(x)
    assert torch.equal(out, ref(x))
    assert not layer.fp8_fwd_amax_history.any(), "no amax is recorded outside FP8"


@pytest.mark.parametrize("recipe", [RECIPE, DelayedScaling(amax_history_len=16,
                                                           fp8_format=Format.E4M3),
                                    Float8CurrentScaling()], ids=["hybrid", "e4m3", "current"])
def test_fp8_sqnr_against_float32(gen, device, recipe):
    layer, ref = make_pair(gen, 128, 64, device)
    x = randn(gen, 96, 128, device=device)
    grad = randn(gen, 96, 64, device=device)
    fp8_step(layer, x, grad, recipe)  # warm-up: sets the delayed scales
    out, d_x, d_w = fp8_step(layer, x, grad, recipe)

    x_ref = x.clone().requires_grad_(True)
    out_ref = ref(x_ref)
    out_ref.backward(grad)
    assert sqnr(out_ref, out) >= 23
    assert sqnr(x_ref.grad, d_x) >= 19
    assert sqnr(ref.weight.grad, d_w) >= 19
    assert torch.allclose(layer.bias.grad, ref.bias.grad, rtol=1e-5, atol=1e-5)

    # For scale: bfloat16 nn.Linear on the same weights is more precise than FP8, but FP8 is
    # within its documented distance.
    ref_bf16 = torch.nn.Linear(128, 64, device=device, dtype=torch.bfloat16)
    ref_bf16.load_state_dict(tfp8.strip_fp8_state(layer.state_dict()))
    out_bf16 = ref_bf16(x.bfloat16())
    assert sqnr(out_ref, out_bf16) > sqnr(out_ref, out) >= 23


def float32_reference_step(layer, x, grad):
    """(out, d_input, d_weight) of torch.nn.Linear in float32 on the layer's weights."""
    ref = torch.nn.Linear(layer.in_features, layer.out_features, device=layer.weight.device)
    ref.load_state_dict({k: v.float() for k, v in
                         tfp8.strip_fp8_state(layer.state_dict()).items()})
    x32 = x.detach().float().requires_grad_(True)
    out = ref(x32)
    out.backward(grad.float())
    return out.detach(), x32.grad, ref.weight.grad


LOW_PRECISION_RECIPES = [RECIPE, Float8CurrentScaling(), tfp8.Float8BlockScaling(),
                         tfp8.Float8RowwiseScaling()]


@pytest.mark.parametrize("recipe", LOW_PRECISION_RECIPES,
                         ids=["delayed", "current", "block", "rowwise"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_params_and_input(gen, device, dtype, recipe):
    """Output and gradients in the parameters' dtype, each within FP8 distance of float32 (a
    factor of 1.25 anywhere is 12 dB off)."""
    layer, _ = make_pair(gen, 128, 48, device, dtype=dtype)
    x = randn(gen, 32, 128, dtype=dtype, device=device)
    grad = randn(gen, 32, 48, dtype=dtype, device=device)
    fp8_step(layer, x, grad, recipe)
    out, d_x, d_w = fp8_step(layer, x, grad, recipe)
    assert out.dtype == d_x.dtype == d_w.dtype == layer.bias.grad.dtype == dtype
    out32, d_x32, d_w32 = float32_reference_step(layer, x, grad)
    assert sqnr(out32, out) >= 23
    assert sqnr(d_x32, d_x) >= 19 and sqnr(d_w32, d_w) >= 19
    assert sqnr(grad.float().sum(0), layer.bias.grad) >= 40


@pytest.mark.parametrize("shape", [(2, 3, 64), (10, 64), (1, 64), (17, 5, 64)])
def test_any_leading_dims_and_row_counts(gen, device, shape):
    layer, ref = make_pair(gen, 64, 32, device)
    x = randn(gen, *shape, device=device)
    grad = randn(gen, *shape[:-1], 32, device=device)
    fp8_step(layer, x, grad)
    out, d_x, d_w = fp8_step(layer, x, grad)
    assert out.shape == (*shape[:-1], 32) and d_x.shape == x.shape
    x_ref = x.clone().requires_grad_(True)
    out_ref = ref(x_ref)
    out_ref.backward(grad)
    assert sqnr(out_ref, out) >= 23
    assert sqnr(x_ref.grad, d_x) >= 19 and sqnr(ref.weight.grad, d_w) >= 19


def test_unaligned_features_run_in_high_precision_with_one_warning(gen, device):
    layer, ref = make_pair(gen, 20, 30, device)
    x = randn(gen, 8, 20, device=device)
    with pytest.warns(UserWarning, match="multiples of 16"):
        with fp8_autocast(fp8_recipe=RECIPE):
            out = layer(x)
    assert torch.equal(out, ref(x))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with fp8_autocast(fp8_recipe=RECIPE):
            layer(x)


def test_saves_fp8_input_not_high_precision(gen, device):
    layer, _ = make_pair(gen, 64, 32, device)
    x = randn(gen, 32, 64, device=device, ).requires_grad_(True)
    saved = []

    def pack(t):
        saved.append((t.dtype, t.numel()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with fp8_autocast(fp8_recipe=RECIPE):
            layer(x)
    large = [dtype for dtype, numel in saved if numel > 1]
    assert large and all(dtype == torch.float8_e4m3fn for dtype in large), saved


def test_is_first_microbatch_caches_the_weight(gen, device):
    layer, _ = make_pair(gen, 64, 32, device)
    x1, x2 = randn(gen, 16, 64, device=device), randn(gen, 16, 64, device=device)
    with fp8_autocast(fp8_recipe=RECIPE):
        layer(x1)  # warm-up
    with fp8_autocast(fp8_recipe=RECIPE):
        first = layer(x1, is_first_microbatch=True)
        with torch.no_grad():
            layer.weight.mul_(0.5)  # the cached FP8 weight must not see this
        again = layer(x1, is_first_microbatch=False)
        cached_x2 = layer(x2, is_first_microbatch=False)
        recast_x2 = layer(x2, is_first_microbatch=None)
    assert torch.equal(first, again), "False reuses the weight cast by True"
    bias = layer.bias.detach()
    # None casts the halved weight (with the old scale: no clipping): the product halves.
    assert sqnr(0.5 * (cached_x2 - bias), recast_x2 - bias) >= 23
    assert not torch.equal(cached_x2, recast_x2)


def test_e5m2_format_is_refused(gen):
    layer, _ = make_pair(gen, 32, 32, "cpu")
    with pytest.raises(ValueError, match="E5M2"):
        with fp8_autocast(fp8_recipe=DelayedScaling(fp8_format=Format.E5M2)):
            layer(torch.randn(4, 32))


def test_wrong_input_width_is_refused(gen):
    layer, _ = make_pair(gen, 32, 16, "cpu")
    with pytest.raises(ValueError, match=r"\[\.\.\., 32\]"):
        layer(torch.randn(4, 31))


def test_delayed_scaling_state_with_constant_inputs(gen, device):
    """History and scales follow the rule of update_delayed_scaling, step by step."""
    L = 4
    recipe = DelayedScaling(amax_history_len=L, margin=1)
    layer, _ = make_pair(gen, 32, 16, device)
    x = randn(gen, 16, 32, device=device)
    grad = randn(gen, 16, 16, device=device)
    x_amax, w_amax, g_amax = (t.abs().max().item() for t in (x, layer.weight, grad))
    for step in range(1, L + 2):
        fp8_step(layer, x, grad, recipe)
        hist = layer.fp8_fwd_amax_history.cpu()
        filled = min(step, L - 1)
        assert torch.all(hist[0] == 0)
        assert torch.allclose(hist[L - filled:, 0], torch.full((filled,), x_amax))
        assert torch.allclose(hist[L - filled:, 1], torch.full((filled,), w_amax))
        assert torch.all(hist[1:L - filled] == 0)
        expected = torch.tensor([448 / x_amax / 2, 448 / w_amax / 2])
        assert torch.allclose(layer.fp8_fwd_scale.cpu(), expected, rtol=1e-6)
        assert torch.allclose(layer.fp8_fwd_scale_inv.cpu(), 1 / expected, rtol=1e-6)
        bwd = layer.fp8_bwd_amax_history.cpu()
        assert torch.allclose(bwd[L - filled:, 0], torch.full((filled,), g_amax))
        assert torch.allclose(layer.fp8_bwd_scale.cpu(), torch.tensor([57344 / g_amax / 2]),
                              rtol=1e-6)


def test_mlp_trains_like_bfloat16(device):
    """200 SGD steps of a small MLP: FP8 (HYBRID, delayed) ends within a few percent of bf16
    (SGD: a gradient off by a constant factor changes the curve, which Adam would hide)."""
    def make_mlp():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(),
                                   torch.nn.Linear(64, 64), torch.nn.GELU(),
                                   torch.nn.Linear(64, 16)).to(device)

    torch.manual_seed(1)
    teacher = torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.Tanh()).to(device)
    data = [torch.randn(64, 32, device=device) for _ in range(8)]
    targets = [teacher(x).detach() for x in data]

    def train(model, fp8: bool) -> float:
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        losses = []
        for step in range(200):
            x, y = data[step % 8], targets[step % 8]
            if fp8:
                with fp8_autocast(fp8_recipe=RECIPE):
                    out = model(x)
            else:
                with torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16):
                    out = model(x)
            loss = torch.nn.functional.mse_loss(out.float(), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return sum(losses[-20:]) / 20

    loss_bf16 = train(make_mlp(), fp8=False)
    loss_fp8 = train(tfp8.convert_to_fp8(make_mlp()), fp8=True)
    assert loss_fp8 < 0.2 * train_start_loss(targets)
    assert abs(loss_fp8 - loss_bf16) <= 0.05 * loss_bf16 + 1e-3, (loss_fp8, loss_bf16)


def train_start_loss(targets) -> float:
    return sum(float((y**2).mean()) for y in targets) / len(targets)


@pytest.mark.parametrize("frozen", ["weight", "input", "no_grad"])
def test_partial_gradients(gen, device, frozen):
    """Transposed FP8 copies are only made for the gradients asked for; results still match."""
    layer, ref = make_pair(gen, 64, 32, device)
    x = randn(gen, 16, 64, device=device)
    grad = randn(gen, 16, 32, device=device)
    fp8_step(layer, x, grad)  # warm-up
    layer.weight.requires_grad_(frozen != "weight")
    x_in = x.clone().requires_grad_(frozen != "input")
    layer.zero_grad()
    if frozen == "no_grad":
        with torch.no_grad(), fp8_autocast(fp8_recipe=RECIPE):
            out = layer(x_in)
        assert out.grad_fn is None and sqnr(ref(x), out) >= 23
        return
    with fp8_autocast(fp8_recipe=RECIPE):
        out = layer(x_in)
    out.backward(grad)
    x_ref = x.clone().requires_grad_(True)
    ref(x_ref).backward(grad)
    if frozen == "weight":
        assert layer.weight.grad is None and sqnr(x_ref.grad, x_in.grad) >= 19
    else:
        assert x_in.grad is None and sqnr(ref.weight.grad, layer.weight.grad) >= 19


def test_backward_uses_the_scale_of_its_forward(gen, device):
    """The update at context exit rewrites scale_inv in place; backward must dequantise the
    saved FP8 input with the scale_inv its forward used. most_recent makes the scale jump."""
    recipe = DelayedScaling(amax_history_len=4, amax_compute_algo="most_recent")
    layer, ref = make_pair(gen, 64, 32, device)
    x, grad = randn(gen, 32, 64, device=device), randn(gen, 32, 32, device=device)
    fp8_step(layer, x, grad, recipe)
    scale_before = layer.fp8_fwd_scale.clone()
    out, d_x, d_w = fp8_step(layer, x / 8, grad, recipe)
    assert not torch.equal(layer.fp8_fwd_scale, scale_before), "the input scale changed"
    x_ref = (x / 8).requires_grad_(True)
    ref(x_ref).backward(grad)
    assert sqnr(ref.weight.grad, d_w) >= 19
    assert sqnr(x_ref.grad, d_x) >= 19


@pytest.mark.parametrize("cast", ["half", "bfloat16"])
def test_dtype_casts_keep_fp8_state_float32(gen, cast):
    """.half() / .to(bfloat16) keep the FP8 state float32 and its values; the cast layer keeps
    training in FP8 with float32 accuracy bounds."""
    layer, _ = make_pair(gen, 64, 32, "cpu")
    fp8_step(layer, randn(gen, 16, 64), randn(gen, 16, 32))
    state = {name: getattr(layer, name).clone() for name in tfp8.quantization.state.FP8_FLOAT_STATE}
    layer = layer.half() if cast == "half" else layer.to(torch.bfloat16)
    dtype = layer.weight.dtype
    for name, before in state.items():
        assert_bitwise_equal(getattr(layer, name), before, name)
    x, grad = randn(gen, 16, 64, dtype=dtype), randn(gen, 16, 32, dtype=dtype)
    out, d_x, d_w = fp8_step(layer, x, grad)
    assert out.dtype == d_x.dtype == d_w.dtype == dtype
    out32, d_x32, d_w32 = float32_reference_step(layer, x, grad)
    assert sqnr(out32, out) >= 23
    assert sqnr(d_x32, d_x) >= 19 and sqnr(d_w32, d_w) >= 19


def test_meta_device_init_then_reset_gives_fresh_state(gen):
    layer = tfp8.Linear(32, 16, device="meta").to_empty(device="cpu")
    layer.reset_parameters()
    assert torch.equal(layer.fp8_fwd_scale, torch.ones(2))
    assert not layer.fp8_fwd_amax_history.any()


@pytest.mark.parametrize("build", ["tfp8_linear", "convert_to_fp8"])
def test_meta_device_init_without_reset_gives_valid_state(gen, device, build):
    """The FSDP2 / large-model pattern: build on "meta", to_empty(), initialise the weights by
    hand (no reset_parameters()). The FP8 state must be fresh, not uninitialised memory."""
    if build == "tfp8_linear":
        model = torch.nn.Sequential(tfp8.Linear(64, 32, device="meta"))
    else:
        model = tfp8.convert_to_fp8(torch.nn.Sequential(torch.nn.Linear(64, 32, device="meta")))
    model.to_empty(device=device)
    layer = model[0]
    with torch.no_grad():
        layer.weight.copy_(randn(gen, 32, 64, device=device) / 8)
        layer.bias.copy_(randn(gen, 32, device=device))
    assert torch.equal(layer.fp8_fwd_scale.cpu(), torch.ones(2))
    assert torch.equal(layer.fp8_bwd_scale_inv.cpu(), torch.ones(1))
    assert not layer.fp8_fwd_amax_history.any() and not layer.fp8_bwd_amax_history.any()
    assert torch.equal(layer.fp8_recipe_fields.cpu(), torch.full((4,), -1))
    x = randn(gen, 16, 64, device=device)
    with fp8_autocast(fp8_recipe=RECIPE):
        out = model(x)
    ref = torch.nn.functional.linear(x, layer.weight, layer.bias)
    assert sqnr(ref, out) > 20


def test_double_backward_is_refused(gen):
    layer, _ = make_pair(gen, 32, 16, "cpu")
    x = randn(gen, 8, 32).requires_grad_(True)
    with fp8_autocast(fp8_recipe=RECIPE):
        out = layer(x)
    (g,) = torch.autograd.grad(out.square().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        g.sum().backward()


_PENALTY_MODULES = {
    "Linear": (lambda: tfp8.Linear(32, 16), ()),
    "LayerNormLinear": (lambda: tfp8.LayerNormLinear(32, 16), ()),
    "LayerNormMLP": (lambda: tfp8.LayerNormMLP(32, 64), ()),
    "GroupedLinear": (lambda: tfp8.GroupedLinear(2, 32, 16), ([8, 8],)),
}


@pytest.mark.parametrize("recipe", [tfp8.DelayedScaling(), tfp8.Float8CurrentScaling(),
                                    tfp8.Float8BlockScaling()], ids=["delayed", "current", "block"])
@pytest.mark.parametrize("name", list(_PENALTY_MODULES))
def test_gradient_penalty_through_an_fp8_layer_is_refused(gen, name, recipe):
    """A gradient penalty (autograd.grad(y.sum(), x, create_graph=True)) has a constant
    grad_output, yet its gradient depends on the weights: differentiating it raises (it came
    back as a constant, and the penalty's share of the weight gradients was silently lost).
    Under create_graph=True without differentiating an FP8 gradient again, nothing changes."""
    make, extra = _PENALTY_MODULES[name]
    torch.manual_seed(0)
    layer = make()
    x = randn(gen, 16, 32).requires_grad_(True)
    with fp8_autocast(fp8_recipe=recipe):
        y = layer(x, *extra)
    (gx,) = torch.autograd.grad(y.sum(), x, create_graph=True)
    assert gx.requires_grad
    with pytest.raises(RuntimeError, match="differentiate twice the FP8 .*once_differentiable"):
        (y.square().mean() + 0.1 * gx.square().sum()).backward()

    # create_graph=True where no FP8 gradient is differentiated again: the plain gradients
    grads = []
    for create_graph in (True, False):
        torch.manual_seed(0)
        module = make()
        with fp8_autocast(fp8_recipe=recipe):
            out = module(x, *extra)
        out.square().mean().backward(create_graph=create_graph)
        grads.append([p.grad.detach().clone() for p in module.parameters()])
    for got, expected in zip(*grads):
        assert_bitwise_equal(got, expected, "create_graph=True changes no gradient")


@pytest.mark.parametrize("shape", [(0, 32), (32,)], ids=["zero_rows", "1d"])
def test_zero_rows_and_1d_input(gen, shape):
    layer, ref = make_pair(gen, 32, 16, "cpu")
    x = randn(gen, *shape)
    grad = randn(gen, *shape[:-1], 16)
    fp8_step(layer, randn(gen, 8, 32), randn(gen, 8, 16))
    out, d_x, _ = fp8_step(layer, x, grad)
    assert out.shape == (*shape[:-1], 16) and d_x.shape == x.shape
    if x.numel():
        # 16 output values make a noisy SQNR (median 31.5 dB, minimum 16.7 over 600 seeds): a
        # loose bound for the values, and the exact property: a 1-d input is one row.
        assert sqnr(ref(x), out) >= 12
        with fp8_autocast(fp8_recipe=RECIPE):
            as_vector, as_rows = layer(x), layer(x.reshape(-1, 32))
        assert torch.equal(as_vector, as_rows.reshape(as_vector.shape))


def test_float64_input_runs_in_high_precision(gen):
    layer, ref = make_pair(gen, 32, 16, "cpu", dtype=torch.float64)
    x = randn(gen, 4, 32, dtype=torch.float64)
    with pytest.warns(UserWarning, match="high precision"):
        with fp8_autocast(fp8_recipe=RECIPE):
            out = layer(x)
    assert torch.equal(out, ref(x))


@pytest.mark.parametrize("replace", ["assign_buffer", "load_state_dict_assign", "to_device"])
def test_replaced_fp8_state_is_the_one_used(gen, device, replace):
    """The delayed-scaling casts are built once per layer from views of its state; a state
    tensor replaced afterwards (attribute assignment, load_state_dict(assign=True), a move) must
    be the one the next forward reads and records into."""
    recipe = DelayedScaling(amax_history_len=4)
    layer, _ = make_pair(gen, 32, 16, device)
    x = randn(gen, 16, 32, device=device)
    grad = randn(gen, 16, 16, device=device)
    fp8_step(layer, x, grad, recipe)  # builds the casts
    new_history = torch.zeros(4, 2, device=device)
    if replace == "assign_buffer":
        layer.fp8_fwd_amax_history = new_history
    elif replace == "load_state_dict_assign":
        sd = {k: v.clone() for k, v in layer.state_dict().items()}
        sd["fp8_fwd_amax_history"] = new_history
        layer.load_state_dict(sd, assign=True)
    else:
        layer.to("meta").to_empty(device=device)
        with torch.no_grad():
            layer.weight.copy_(randn(gen, 16, 32, device=device))
            layer.bias.zero_()
        layer.reset_fp8_state()
        new_history = layer.fp8_fwd_amax_history
    with fp8_autocast(fp8_recipe=recipe):
        layer(x)
    # The exit update rolled this step's amaxes into the last row of the new history.
    assert layer.fp8_fwd_amax_history is new_history
    assert torch.equal(new_history[-1].cpu(),
                       torch.stack([x.abs().max(), layer.weight.abs().max()]).float().cpu())


def test_dtype_and_params_dtype_arguments():
    """nn.Linear's signature (in, out, bias, device, dtype) and Transformer Engine's params_dtype
    both work; conflicting or misplaced arguments are refused with the argument named."""
    assert tfp8.Linear(32, 16, dtype=torch.bfloat16).weight.dtype == torch.bfloat16
    assert tfp8.Linear(32, 16, params_dtype=torch.bfloat16).weight.dtype == torch.bfloat16
    assert tfp8.Linear(32, 16, True, "cpu", torch.float16).weight.dtype == torch.float16
    assert tfp8.Linear(32, 16, dtype=torch.half, params_dtype=torch.half).bias.dtype == torch.half
    with pytest.raises(ValueError, match="'dtype' .* and 'params_dtype' .* must agree"):
        tfp8.Linear(32, 16, dtype=torch.bfloat16, params_dtype=torch.float16)
    with pytest.raises(TypeError, match="argument 'device' must be a device"):
        tfp8.Linear(32, 16, True, torch.bfloat16)
    # Transformer Engine's positional order (in, out, sequence_parallel, fuse_wgrad_accumulation)
    with pytest.raises(TypeError, match="pass Transformer Engine's options by keyword"):
        tfp8.Linear(32, 16, False, True)
    # The FP8 state stays float32 whatever the parameters' dtype.
    assert tfp8.Linear(32, 16, dtype=torch.bfloat16).fp8_fwd_scale.dtype == torch.float32


def test_dtype_mismatch_is_refused_as_nn_linear_does(gen):
    """bf16 input, float32 weight, no torch.autocast: nn.Linear raises, and so must the FP8
    path (it must not silently cast). Under torch.autocast the mismatch is fine."""
    layer, ref = make_pair(gen, 32, 16, "cpu")
    x = randn(gen, 8, 32, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError):
        ref(x)
    layer.prepare_fp8_recipe(RECIPE)  # (fp8_autocast's entry sizes the history for RECIPE)
    history = layer.fp8_fwd_amax_history.clone()
    with pytest.raises(RuntimeError, match="input dtype torch.bfloat16 differs from the weight"):
        with fp8_autocast(fp8_recipe=RECIPE):
            layer(x)
    assert torch.equal(layer.fp8_fwd_amax_history, history), "a refused call records nothing"
    with torch.autocast("cpu", dtype=torch.bfloat16), fp8_autocast(fp8_recipe=RECIPE):
        assert layer(x).dtype == torch.bfloat16


@pytest.mark.parametrize("build", ["linear", "convert_to_fp8"])
def test_layers_built_for_a_recipe_have_its_state_shapes(build):
    """A layer built for a recipe has its final FP8 state shapes and recipe record at once, so
    a checkpoint of trained layers loads into freshly built ones (torch.distributed.checkpoint
    needs equal shapes; see test_dcp.py)."""
    recipe = DelayedScaling(amax_history_len=16, margin=2)
    if build == "linear":
        layer = tfp8.Linear(32, 16, recipe=recipe)
    else:
        layer = tfp8.convert_to_fp8(torch.nn.Sequential(torch.nn.Linear(32, 16)),
                                    recipe=recipe)[0]
    assert layer.fp8_fwd_amax_history.shape == (16, 2)
    assert layer.fp8_bwd_amax_history.shape == (16, 1)
    assert layer.fp8_recipe_fields.tolist()[:3] == [2, 2, 16]  # margin, HYBRID, length
    trained = tfp8.Linear(32, 16)
    x = torch.randn(8, 32, requires_grad=True)
    with fp8_autocast(fp8_recipe=recipe):
        trained(x).sum().backward()
    assert {k: v.shape for k, v in trained.state_dict().items()} == \
        {k: v.shape for k, v in layer.state_dict().items()}
    with pytest.raises(TypeError, match="recipe must be None, a DelayedScaling"):
        tfp8.Linear(32, 16, recipe="delayed")
