"""transformer_fp8.optimizers.FusedSGD (Transformer Engine's name and arguments): bit for bit
torch.optim.SGD(foreach=False) on float32 parameters across momentum / dampening / weight
decay / Nesterov; Transformer Engine's wd_after_momentum order against a float64 reference;
master weights for bfloat16, float16 and FP8 primary weights; state_dict round trips (its own
and torch.optim.SGD's); errors name the argument."""
from __future__ import annotations

import copy
import inspect
import math

import pytest
import torch

import transformer_fp8 as tfp8
from conftest import assert_bitwise_equal, randn
from test_optimizers import _model, _params_equal, _train
from transformer_fp8.optimizers import FusedSGD
from transformer_fp8.quantization.fp8_weight import Fp8Weight

COMBINATIONS = [
    dict(),
    dict(weight_decay=0.05),
    dict(momentum=0.9),
    dict(momentum=0.9, dampening=0.25, weight_decay=0.01),
    dict(momentum=0.9, nesterov=True, weight_decay=0.01),
    dict(momentum=0.5, nesterov=True),
]
IDS = ["plain", "wd", "momentum", "momentum_dampening_wd", "nesterov_wd", "nesterov"]


def _seed(gen) -> int:
    return int(torch.randint(0, 2**31, (1,), generator=gen))


def _buffers_equal(opt_a, model_a, opt_b, model_b, what):
    for p, q in zip(model_a.parameters(), model_b.parameters()):
        assert set(opt_a.state[p]) == set(opt_b.state[q]), f"{what}: state names"
        if "momentum_buffer" in opt_b.state[q]:
            assert_bitwise_equal(opt_a.state[p]["momentum_buffer"],
                                 opt_b.state[q]["momentum_buffer"], f"{what}: momentum_buffer")


@pytest.mark.parametrize("kwargs", COMBINATIONS, ids=IDS)
def test_float32_is_torch_sgd_bit_for_bit(device, gen, kwargs):
    """Float32 parameters: parameters and momentum buffers bit for bit those of
    torch.optim.SGD(foreach=False) with the same arguments, over 6 steps (no state at all
    without momentum, as torch.optim.SGD keeps none)."""
    ours, theirs = _model(device), _model(device)
    opt_ours = FusedSGD(ours.parameters(), lr=0.05, **kwargs)
    opt_theirs = torch.optim.SGD(theirs.parameters(), lr=0.05, foreach=False, **kwargs)
    seed = _seed(gen)
    _train(ours, opt_ours, torch.Generator().manual_seed(seed), 6, device)
    _train(theirs, opt_theirs, torch.Generator().manual_seed(seed), 6, device)
    _params_equal(ours, theirs, "after 6 steps")
    _buffers_equal(opt_ours, ours, opt_theirs, theirs, "after 6 steps")
    assert not any(p.equal(q) for p, q in zip(ours.parameters(), _model(device).parameters()))


def test_param_groups_and_an_lr_scheduler_are_torch_sgd_bit_for_bit(device, gen):
    """Two groups with their own hyperparameters, lr changed by a StepLR between steps."""
    ours, theirs = _model(device), _model(device)

    def groups(model):
        return [dict(params=model[0].parameters(), momentum=0.9, nesterov=True),
                dict(params=model[2].parameters(), lr=0.02, momentum=0.8, dampening=0.5,
                     weight_decay=0.1)]

    opt_ours = FusedSGD(groups(ours), lr=0.1, weight_decay=0.01)
    opt_theirs = torch.optim.SGD(groups(theirs), lr=0.1, weight_decay=0.01, foreach=False)
    sched_ours = torch.optim.lr_scheduler.StepLR(opt_ours, step_size=2, gamma=0.3)
    sched_theirs = torch.optim.lr_scheduler.StepLR(opt_theirs, step_size=2, gamma=0.3)
    seed = _seed(gen)
    g_ours, g_theirs = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
    for step in range(5):
        _train(ours, opt_ours, g_ours, 1, device, first=step)
        _train(theirs, opt_theirs, g_theirs, 1, device, first=step)
        sched_ours.step()
        sched_theirs.step()
    assert opt_ours.param_groups[1]["lr"] == opt_theirs.param_groups[1]["lr"] != 0.02
    _params_equal(ours, theirs, "after 5 steps")
    _buffers_equal(opt_ours, ours, opt_theirs, theirs, "after 5 steps")


@pytest.mark.parametrize("momentum, dampening, nesterov",
                         [(0.9, 0.0, False), (0.9, 0.0, True), (0.7, 0.3, False)],
                         ids=["momentum", "nesterov", "dampening"])
def test_wd_after_momentum_is_transformer_engines_order(momentum, dampening, nesterov):
    """wd_after_momentum=True: the buffer takes the gradient only and the weight decay is added
    to the update after momentum (Transformer Engine's kernel), checked against float64 over 4
    steps; the result differs from torch's order (weight decay in the gradient)."""
    start = torch.tensor([1.5, -2.0, 0.75, 3.0])
    grads = [[1.0, 2.0, -4.0, 0.5], [0.5, -1.0, 0.0, 2.0], [-3.0, 0.25, 8.0, -1.0],
             [2.0, 2.0, 2.0, -2.0]]
    lr, wd = 0.1, 0.2
    p = torch.nn.Parameter(start.clone())
    opt = FusedSGD([p], lr=lr, momentum=momentum, dampening=dampening, weight_decay=wd,
                   nesterov=nesterov, wd_after_momentum=True)
    before = torch.nn.Parameter(start.clone())
    opt_before = FusedSGD([before], lr=lr, momentum=momentum, dampening=dampening,
                          weight_decay=wd, nesterov=nesterov)
    ref, buf = start.double(), None
    for grad in grads:
        p.grad, before.grad = torch.tensor(grad), torch.tensor(grad)
        opt.step()
        opt_before.step()
        g = torch.tensor(grad, dtype=torch.float64)
        buf = g.clone() if buf is None else momentum * buf + (1 - dampening) * g
        d = g + momentum * buf if nesterov else buf
        ref = ref - lr * (d + wd * ref)
        torch.testing.assert_close(p.detach().double(), ref, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(opt.state[p]["momentum_buffer"].double(), buf, rtol=1e-6,
                                   atol=1e-6)
    assert (p.detach() - before.detach()).abs().max() > 1e-2, "a different order"


def test_wd_after_momentum_without_momentum_is_torch_sgd(gen):
    """Without momentum both orders are the same operations: bit for bit torch.optim.SGD."""
    ours, theirs = _model("cpu"), _model("cpu")
    opt_ours = FusedSGD(ours.parameters(), lr=0.05, weight_decay=0.1, wd_after_momentum=True)
    opt_theirs = torch.optim.SGD(theirs.parameters(), lr=0.05, weight_decay=0.1, foreach=False)
    seed = _seed(gen)
    _train(ours, opt_ours, torch.Generator().manual_seed(seed), 3, "cpu")
    _train(theirs, opt_theirs, torch.Generator().manual_seed(seed), 3, "cpu")
    _params_equal(ours, theirs, "after 3 steps")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_master_weights_are_float32_sgd_rounded_into_the_parameters(device, gen, dtype):
    """bfloat16 / float16 parameters with master_weights=True: masters and momentum buffers
    are, bit for bit, float32 torch.optim.SGD run on float32 copies fed the same
    (low-precision) gradients; each parameter is its master rounded to its dtype."""
    kwargs = dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01)
    model = _model(device, dtype)
    masters = [torch.nn.Parameter(p.detach().float().clone()) for p in model.parameters()]
    opt = FusedSGD(model.parameters(), master_weights=True, **kwargs)
    opt_masters = torch.optim.SGD(masters, foreach=False, **kwargs)
    for step in range(4):
        x = randn(gen, 12, 16, device=device, dtype=dtype) * (1 + step)
        model(x).float().square().mean().backward()
        for master, p in zip(masters, model.parameters()):
            master.grad = p.grad.float()
        opt.step()
        opt.zero_grad()
        opt_masters.step()
        for master, p in zip(masters, model.parameters()):
            state = opt.state[p]
            assert_bitwise_equal(state["master_param"], master.detach(), "master")
            assert_bitwise_equal(state["momentum_buffer"],
                                 opt_masters.state[master]["momentum_buffer"], "buffer")
            assert_bitwise_equal(p.detach(), master.detach().to(dtype), "the rounded master")


def test_low_precision_parameters_without_masters_step_in_float32_and_are_written_once(gen):
    """Without master weights a bfloat16 parameter's step is float32 SGD from its value,
    rounded once into it; its momentum buffer is float32."""
    p = torch.nn.Parameter(randn(gen, 8, 16).to(torch.bfloat16))
    ref = torch.nn.Parameter(p.detach().float().clone())
    opt = FusedSGD([p], lr=0.1, momentum=0.9, weight_decay=0.01)
    opt_ref = torch.optim.SGD([ref], lr=0.1, momentum=0.9, weight_decay=0.01, foreach=False)
    for _ in range(3):
        grad = randn(gen, 8, 16).to(torch.bfloat16)
        p.grad, ref.grad = grad, grad.float()
        opt.step()
        opt_ref.step()
        assert_bitwise_equal(opt.state[p]["momentum_buffer"],
                             opt_ref.state[ref]["momentum_buffer"], "float32 buffer")
        assert_bitwise_equal(p.detach(), ref.detach().to(torch.bfloat16), "rounded once")
        with torch.no_grad():  # the next step starts from the rounded value
            ref.copy_(p.float())


@pytest.mark.parametrize("recipe", [tfp8.DelayedScaling(amax_history_len=4),
                                    tfp8.Float8CurrentScaling()], ids=["delayed", "current"])
def test_fp8_primary_weights_with_master_weights_are_the_manual_pattern(gen, recipe):
    """FP8 primary weights (quantized_model_init) with master_weights=True: losses, weights and
    FP8 state bit for bit those of the README's manual pattern (fp32 masters seeded from
    get_high_precision_init_val, torch.optim.SGD, param.copy_(master))."""
    kwargs = dict(lr=0.05, momentum=0.9, weight_decay=0.01)

    def build():
        torch.manual_seed(0)
        with tfp8.quantized_model_init(recipe=recipe, preserve_high_precision_init_val=True):
            return torch.nn.Sequential(tfp8.Linear(16, 32), torch.nn.GELU(), tfp8.Linear(32, 16))

    ours, manual = build(), build()
    assert any(isinstance(p, Fp8Weight) for p in ours.parameters())
    opt = FusedSGD(ours.parameters(), master_weights=True, **kwargs)
    masters = [torch.nn.Parameter((p.get_high_precision_init_val() if isinstance(p, Fp8Weight)
                                   else p.detach()).float().clone()) for p in manual.parameters()]
    opt_masters = torch.optim.SGD(masters, foreach=False, **kwargs)

    class ManualStep:
        def step(self):
            for master, p in zip(masters, manual.parameters()):
                master.grad, p.grad = p.grad.float(), None
            opt_masters.step()
            with torch.no_grad():
                for master, p in zip(masters, manual.parameters()):
                    p.copy_(master)

        def zero_grad(self):
            opt_masters.zero_grad()

    seed = _seed(gen)
    losses = _train(ours, opt, torch.Generator().manual_seed(seed), 5, "cpu", recipe=recipe)
    state = {name: buf.clone() for name, buf in ours.named_buffers()}
    expected = _train(manual, ManualStep(), torch.Generator().manual_seed(seed), 5, "cpu",
                      recipe=recipe)
    for got, want in zip(losses, expected):
        assert_bitwise_equal(got, want, "loss")
    assert losses[-1] != losses[0]
    for (name, p), q, master in zip(ours.named_parameters(), manual.parameters(), masters):
        if isinstance(p, Fp8Weight):
            assert_bitwise_equal(p.fp8_data, q.fp8_data, f"{name}: FP8 data")
            assert_bitwise_equal(p.fp8_scale_inv, q.fp8_scale_inv, f"{name}: scale_inv")
            assert_bitwise_equal(opt.state[p]["master_param"], master.detach(), "master")
        assert_bitwise_equal(p.detach(), q.detach(), name)
    for (name, buf), other in zip(state.items(), manual.buffers()):
        assert_bitwise_equal(buf, other, f"FP8 state {name}")


def test_fp8_weight_without_masters_is_updated_once_from_its_dequantised_value():
    """Without master weights an FP8 weight's step runs in float32 from its dequantised value
    and is written (quantised) once: the same as torch SGD on that value, then copy_."""
    recipe = tfp8.Float8CurrentScaling()
    with tfp8.quantized_model_init(recipe=recipe):
        layer = tfp8.Linear(16, 8, bias=False)
    weight = layer.weight
    start = weight.dequantize().float().clone()
    grad = torch.randn(8, 16)
    weight.grad = grad.clone()
    FusedSGD([weight], lr=0.05, weight_decay=0.01).step()
    expected = torch.nn.Parameter(start.clone())
    expected.grad = grad.clone()
    torch.optim.SGD([expected], lr=0.05, weight_decay=0.01, foreach=False).step()
    with tfp8.quantized_model_init(recipe=recipe):
        reference = tfp8.Linear(16, 8, bias=False)
    with torch.no_grad():
        reference.weight.copy_(expected)
    assert_bitwise_equal(weight.fp8_data, reference.weight.fp8_data, "FP8 data")
    assert not torch.equal(weight.dequantize(), start), "the step moved the weight"


def test_state_dict_round_trip_keeps_float32_and_resumes_bit_for_bit(gen):
    """bfloat16 parameters with float32 masters and momentum buffers: torch.optim's load casts
    floating states to the parameter's dtype; FusedSGD's keeps float32, so a resumed run
    continues bit for bit as the uninterrupted one (through torch.save / torch.load)."""
    import io
    seed = _seed(gen)

    def fresh():
        model = _model("cpu", torch.bfloat16)
        return model, FusedSGD(model.parameters(), lr=0.05, momentum=0.9, dampening=0.1,
                               weight_decay=0.01, master_weights=True)

    whole, opt_whole = fresh()
    _train(whole, opt_whole, torch.Generator().manual_seed(seed), 5, "cpu", torch.bfloat16)
    first, opt_first = fresh()
    g = torch.Generator().manual_seed(seed)
    _train(first, opt_first, g, 3, "cpu", torch.bfloat16)
    buffer = io.BytesIO()
    torch.save({"model": first.state_dict(), "optimizer": opt_first.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    resumed, opt_resumed = fresh()
    resumed.load_state_dict(saved["model"])
    opt_resumed.load_state_dict(saved["optimizer"])
    for p, q in zip(resumed.parameters(), first.parameters()):
        for name in ("momentum_buffer", "master_param"):
            assert_bitwise_equal(opt_resumed.state[p][name], opt_first.state[q][name], name)
    _train(resumed, opt_resumed, g, 2, "cpu", torch.bfloat16, first=3)
    _params_equal(resumed, whole, "resumed against uninterrupted")
    for p, q in zip(resumed.parameters(), whole.parameters()):
        for name in ("momentum_buffer", "master_param"):
            assert_bitwise_equal(opt_resumed.state[p][name], opt_whole.state[q][name], name)


def test_the_state_dict_given_to_a_load_is_not_shared(gen):
    """The loaded states are copies: stepping after a load leaves the state dict given (and
    the optimizer it came from) as it was."""
    model = _model("cpu")
    opt = FusedSGD(model.parameters(), lr=0.05, momentum=0.9)
    _train(model, opt, torch.Generator().manual_seed(_seed(gen)), 2, "cpu")
    state_dict = opt.state_dict()
    kept = copy.deepcopy(state_dict)
    other = FusedSGD(model.parameters(), lr=0.05, momentum=0.9)
    other.load_state_dict(state_dict)
    _train(model, other, torch.Generator().manual_seed(1), 1, "cpu", first=2)
    for key, entry in kept["state"].items():
        assert_bitwise_equal(state_dict["state"][key]["momentum_buffer"],
                             entry["momentum_buffer"], "the given buffer")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_torch_sgd_state_loads_and_continues_as_torch_sgd(gen, dtype):
    """A torch.optim.SGD state dict (its groups carry maximize, foreach, ...) loads: float32
    parameters continue bit for bit as torch.optim.SGD; bfloat16 parameters' buffers (bfloat16
    in torch's state) are kept as float32 of the same values."""
    seed = _seed(gen)
    kwargs = dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01)
    ours, theirs = _model("cpu", dtype), _model("cpu", dtype)
    opt_theirs = torch.optim.SGD(theirs.parameters(), foreach=False, **kwargs)
    _train(theirs, opt_theirs, torch.Generator().manual_seed(seed), 2, "cpu", dtype)
    ours.load_state_dict(theirs.state_dict())
    opt = FusedSGD(ours.parameters(), lr=1.0)
    opt.load_state_dict(opt_theirs.state_dict())
    assert opt.param_groups[0]["lr"] == 0.05 and opt.param_groups[0]["nesterov"]
    for p, q in zip(ours.parameters(), theirs.parameters()):
        buf = opt.state[p]["momentum_buffer"]
        assert buf.dtype == torch.float32
        assert_bitwise_equal(buf, opt_theirs.state[q]["momentum_buffer"].float(), "buffer")
    if dtype != torch.float32:
        return
    _train(ours, opt, torch.Generator().manual_seed(seed + 1), 2, "cpu", first=2)
    _train(theirs, opt_theirs, torch.Generator().manual_seed(seed + 1), 2, "cpu", first=2)
    _params_equal(ours, theirs, "after the load")
    _buffers_equal(opt, ours, opt_theirs, theirs, "after the load")


def test_a_torch_sgd_state_with_maximize_is_refused():
    p = torch.nn.Parameter(torch.ones(2))
    theirs = torch.optim.SGD([p], lr=0.1, maximize=True)
    opt = FusedSGD([p], lr=0.1)
    with pytest.raises(ValueError, match="'maximize'"):
        opt.load_state_dict(theirs.state_dict())
    assert "maximize" not in opt.param_groups[0]


@pytest.mark.parametrize("kwargs, argument", [
    (dict(momentum=0.0, nesterov=True), "nesterov"),
    (dict(momentum=0.9, dampening=0.1, nesterov=True), "nesterov"),
    (dict(lr=-0.1), "lr"),
    (dict(lr=float("nan")), "lr"),
    (dict(momentum=-0.5), "momentum"),
    (dict(weight_decay=-1e-4), "weight_decay"),
])
def test_refused_arguments_are_named(kwargs, argument):
    """Refused where torch.optim.SGD refuses them too (and a NaN lr, which torch lets by)."""
    kwargs = {"lr": 0.1, **kwargs}
    with pytest.raises(ValueError, match=f"argument '{argument}'"):
        FusedSGD([torch.nn.Parameter(torch.ones(2))], **kwargs)
    if not (isinstance(kwargs["lr"], float) and math.isnan(kwargs["lr"])):
        with pytest.raises(ValueError):
            torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], **kwargs)


def test_a_one_element_tensor_lr_is_torch_sgds(gen):
    """lr as a 1-element tensor steps as torch.optim.SGD's (its value read on the host); a
    tensor of more elements is refused, as torch.optim.SGD refuses it."""
    ours, theirs = _model("cpu"), _model("cpu")
    opt = FusedSGD(ours.parameters(), lr=torch.tensor(0.05), momentum=0.9)
    opt_theirs = torch.optim.SGD(theirs.parameters(), lr=torch.tensor(0.05), momentum=0.9,
                                 foreach=False)
    seed = _seed(gen)
    _train(ours, opt, torch.Generator().manual_seed(seed), 3, "cpu")
    _train(theirs, opt_theirs, torch.Generator().manual_seed(seed), 3, "cpu")
    _params_equal(ours, theirs, "after 3 steps")
    with pytest.raises(ValueError, match="argument 'lr'"):
        FusedSGD([torch.nn.Parameter(torch.ones(2))], lr=torch.tensor([0.1, 0.2]))


def test_missing_lr_and_bad_added_groups_are_refused():
    """lr has no default (as in Transformer Engine); a group added later is checked too and,
    when refused, not added."""
    with pytest.raises(ValueError, match="lr"):
        FusedSGD([torch.nn.Parameter(torch.ones(2))])
    opt = FusedSGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)
    with pytest.raises(ValueError, match="argument 'nesterov'"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(2))], "nesterov": True})
    with pytest.raises(ValueError, match="float32, bfloat16, float16 or FP8"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(2, dtype=torch.float64))]})
    assert len(opt.param_groups) == 1


def test_sparse_gradients_set_grad_none_and_parameters_without_gradients():
    p = torch.nn.Parameter(torch.ones(4))
    p.grad = torch.ones(4).to_sparse()
    opt = FusedSGD([p], lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match="FusedSGD: sparse"):
        opt.step()
    assert not opt.state[p] and torch.equal(p.detach(), torch.ones(4)), "nothing changed"
    with pytest.warns(DeprecationWarning, match="set_grad_none"):
        opt = FusedSGD([p], lr=0.1, set_grad_none=False)
    with pytest.raises(ValueError, match="set_grad_none=False"):
        opt.zero_grad(set_to_none=True)
    a, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))
    opt = FusedSGD([a, b], lr=0.1, momentum=0.9)
    a.grad = torch.ones(3)
    opt.step()
    assert torch.equal(b.detach(), torch.ones(3)) and not opt.state[b], "b has no gradient"
    opt.zero_grad()
    assert a.grad is None, "set_to_none by default"


def test_float32_parameters_take_no_master_and_materialize_master_grads_changes_nothing(gen):
    ours, plain = _model("cpu"), _model("cpu")
    opt = FusedSGD(ours.parameters(), lr=0.05, momentum=0.9, master_weights=True,
                   materialize_master_grads=False)
    seed = _seed(gen)
    _train(ours, opt, torch.Generator().manual_seed(seed), 3, "cpu")
    _train(plain, FusedSGD(plain.parameters(), lr=0.05, momentum=0.9),
           torch.Generator().manual_seed(seed), 3, "cpu")
    _params_equal(ours, plain, "with and without master_weights")
    assert all("master_param" not in opt.state[p] for p in ours.parameters())


def test_transformer_engines_arguments_and_import_path():
    """Transformer Engine 2.8's FusedSGD signature (master_weights added at the end)."""
    names = list(inspect.signature(FusedSGD).parameters)
    assert names == ["params", "lr", "momentum", "dampening", "weight_decay", "nesterov",
                     "wd_after_momentum", "materialize_master_grads", "set_grad_none",
                     "master_weights"]
    assert tfp8.optimizers.FusedSGD is FusedSGD
