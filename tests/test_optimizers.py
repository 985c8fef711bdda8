"""transformer_fp8.optimizers.FusedAdam (Transformer Engine's name and arguments): bit for bit
torch.optim.AdamW / Adam on float32 parameters; master weights for bfloat16 and FP8 primary
weights, bit for bit the manual master-copy pattern; moments in other dtypes; state_dict round
trips keep the masters' and moments' dtypes; errors name the argument."""
from __future__ import annotations

import pytest
import torch

import transformer_fp8 as tfp8
from conftest import assert_bitwise_equal, randn
from transformer_fp8.optimizers import FusedAdam, FusedSGD
from transformer_fp8.quantization.fp8_weight import Fp8Weight


def _model(device, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.GELU(),
                               torch.nn.Linear(24, 8)).to(device=device, dtype=dtype)


def _train(model, optimizer, gen, steps, device, dtype=torch.float32, recipe=None, first=0):
    """Steps first.. on fresh inputs whose magnitude changes; the optimizer after each."""
    losses = []
    for step in range(first, first + steps):
        x = randn(gen, 12, 16, device=device, dtype=dtype) * (1 + step)
        with tfp8.fp8_autocast(enabled=recipe is not None, fp8_recipe=recipe):
            loss = model(x).float().square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())

    return losses


def _params_equal(a, b, what):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert_bitwise_equal(p.detach(), q.detach(), f"{what}: {name}")


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("adam_w_mode", [True, False], ids=["adamw", "adam_l2"])
def test_float32_is_torch_adam_bit_for_bit(device, gen, adam_w_mode, weight_decay):
    """Float32 parameters, no master weights: torch.optim.AdamW (adam_w_mode=True) or
    torch.optim.Adam with L2 weight decay (adam_w_mode=False), single-tensor, bit for bit."""
    ours, theirs = _model(device), _model(device)
    torch_cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    opt_theirs = torch_cls(theirs.parameters(), lr=3e-2, betas=(0.8, 0.95), eps=1e-6,
                           weight_decay=weight_decay, foreach=False)
    opt_ours = FusedAdam(ours.parameters(), lr=3e-2, betas=(0.8, 0.95), eps=1e-6,
                         weight_decay=weight_decay, adam_w_mode=adam_w_mode)
    seed = int(torch.randint(0, 2**31, (1,), generator=gen))
    _train(ours, opt_ours, torch.Generator().manual_seed(seed), 6, device)
    _train(theirs, opt_theirs, torch.Generator().manual_seed(seed), 6, device)
    _params_equal(ours, theirs, "after 6 steps")
    for p, q in zip(ours.parameters(), theirs.parameters()):
        assert_bitwise_equal(opt_ours.state[p]["exp_avg"], opt_theirs.state[q]["exp_avg"])
        assert_bitwise_equal(opt_ours.state[p]["exp_avg_sq"], opt_theirs.state[q]["exp_avg_sq"])


def test_without_bias_correction_the_moments_are_used_as_they_are():
    """bias_correction=False: p -= lr * m / (sqrt(v) + eps), checked in float64 over 3 steps."""
    p = torch.nn.Parameter(torch.tensor([1.0, -2.0, 0.5]))
    opt = FusedAdam([p], lr=0.1, betas=(0.5, 0.75), eps=1e-3, bias_correction=False)
    ref, m, v = p.detach().double().clone(), torch.zeros(3, dtype=torch.float64), 0
    for grad in ([1.0, 2.0, -4.0], [0.5, -1.0, 0.0], [-3.0, 0.25, 8.0]):
        p.grad = torch.tensor(grad)
        opt.step()
        g = torch.tensor(grad, dtype=torch.float64)
        m = 0.5 * m + 0.5 * g
        v = 0.75 * v + 0.25 * g * g
        ref -= 0.1 * m / (v.sqrt() + 1e-3)
    torch.testing.assert_close(p.detach().double(), ref, rtol=1e-6, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_master_weights_are_float32_adamw_rounded_into_the_parameters(device, gen, dtype):
    """bfloat16 / float16 parameters with master_weights=True: the masters are, bit for bit,
    float32 AdamW run on float32 copies fed the same (low-precision) gradients; each parameter
    is its master rounded to its dtype after every step."""
    model = _model(device, dtype)
    masters = [torch.nn.Parameter(p.detach().float().clone()) for p in model.parameters()]
    opt = FusedAdam(model.parameters(), lr=1e-2, weight_decay=0.01, master_weights=True)
    opt_masters = torch.optim.AdamW(masters, lr=1e-2, weight_decay=0.01, foreach=False)
    for step in range(4):
        x = randn(gen, 12, 16, device=device, dtype=dtype) * (1 + step)
        model(x).float().square().mean().backward()
        for master, p in zip(masters, model.parameters()):
            master.grad = p.grad.float()
        opt.step()
        opt.zero_grad()
        opt_masters.step()
        for master, p in zip(masters, model.parameters()):
            assert_bitwise_equal(opt.state[p]["master_param"], master.detach(), "master")
            assert_bitwise_equal(p.detach(), master.detach().to(dtype), "the rounded master")
            assert opt.state[p]["exp_avg"].dtype == torch.float32


@pytest.mark.parametrize("recipe", [tfp8.DelayedScaling(amax_history_len=4),
                                    tfp8.Float8CurrentScaling()], ids=["delayed", "current"])
def test_fp8_primary_weights_with_master_weights_are_the_manual_pattern(gen, recipe):
    """FP8 primary weights (quantized_model_init) with master_weights=True: losses, weights and
    FP8 state bit for bit those of the README's manual pattern (fp32 masters seeded from
    get_high_precision_init_val, torch AdamW, param.copy_(master))."""
    def build():
        torch.manual_seed(0)
        with tfp8.quantized_model_init(recipe=recipe, preserve_high_precision_init_val=True):
            return torch.nn.Sequential(tfp8.Linear(16, 32), torch.nn.GELU(), tfp8.Linear(32, 16))

    ours, manual = build(), build()
    assert any(isinstance(p, Fp8Weight) for p in ours.parameters())
    opt = FusedAdam(ours.parameters(), lr=1e-2, weight_decay=0.01, master_weights=True)
    masters = [torch.nn.Parameter((p.get_high_precision_init_val() if isinstance(p, Fp8Weight)
                                   else p.detach()).float().clone()) for p in manual.parameters()]
    opt_masters = torch.optim.AdamW(masters, lr=1e-2, weight_decay=0.01, foreach=False)

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

    seed = int(torch.randint(0, 2**31, (1,), generator=gen))
    losses = _train(ours, opt, torch.Generator().manual_seed(seed), 5, "cpu", recipe=recipe)
    state = {name: buf.clone() for name, buf in ours.named_buffers()}
    expected = _train(manual, ManualStep(), torch.Generator().manual_seed(seed), 5, "cpu",
                      recipe=recipe)
    for got, want in zip(losses, expected):
        assert_bitwise_equal(got, want, "loss")
    assert losses[-1] != losses[0]
    for (name, p), q in zip(ours.named_parameters(), manual.parameters()):
        if isinstance(p, Fp8Weight):
            assert_bitwise_equal(p.fp8_data, q.fp8_data, f"{name}: FP8 data")
            assert_bitwise_equal(p.fp8_scale_inv, q.fp8_scale_inv, f"{name}: scale_inv")
        assert_bitwise_equal(p.detach(), q.detach(), name)
    for (name, buf), other in zip(state.items(), manual.buffers()):
        assert_bitwise_equal(buf, other, f"FP8 state {name}")


def test_fp8_weight_without_masters_is_updated_once_from_its_dequantised_value():
    """Without master weights an FP8 weight's step runs in float32 from its dequantised value
    and is written (quantised) once: the same as AdamW on that value, then copy_."""
    recipe = tfp8.Float8CurrentScaling()
    with tfp8.quantized_model_init(recipe=recipe):
        layer = tfp8.Linear(16, 8, bias=False)
    weight = layer.weight
    start = weight.dequantize().float().clone()
    grad = torch.randn(8, 16)
    weight.grad = grad.clone()
    FusedAdam([weight], lr=0.05, weight_decay=0.01).step()
    expected = torch.nn.Parameter(start.clone())
    expected.grad = grad.clone()
    torch.optim.AdamW([expected], lr=0.05, weight_decay=0.01, foreach=False).step()
    with tfp8.quantized_model_init(recipe=recipe):
        reference = tfp8.Linear(16, 8, bias=False)
    with torch.no_grad():
        reference.weight.copy_(expected)
    assert_bitwise_equal(weight.fp8_data, reference.weight.fp8_data, "FP8 data")
    assert not torch.equal(weight.dequantize(), start), "the step moved the weight"


@pytest.mark.parametrize("moment_dtype", [torch.bfloat16])
def test_low_precision_moments_are_stored_rounded(gen, moment_dtype):
    """exp_avg / exp_avg_sq in bfloat16: each step computes in float32 from the stored moments
    and stores them rounded; the first step's update is the float32 one. (float16 moments are
    refused: without a scale of their own, small second moments flush to zero.)"""
    ours, fp32 = _model("cpu"), _model("cpu")
    opt = FusedAdam(ours.parameters(), lr=1e-2, exp_avg_dtype=moment_dtype,
                    exp_avg_sq_dtype=moment_dtype)
    opt_fp32 = FusedAdam(fp32.parameters(), lr=1e-2)
    seed = int(torch.randint(0, 2**31, (1,), generator=gen))
    _train(ours, opt, torch.Generator().manual_seed(seed), 1, "cpu")
    _train(fp32, opt_fp32, torch.Generator().manual_seed(seed), 1, "cpu")
    _params_equal(ours, fp32, "after one step")
    for p, q in zip(ours.parameters(), fp32.parameters()):
        for name in ("exp_avg", "exp_avg_sq"):
            assert opt.state[p][name].dtype == moment_dtype
            assert_bitwise_equal(opt.state[p][name], opt_fp32.state[q][name].to(moment_dtype),
                                 name)


def test_state_dict_round_trip_keeps_dtypes_and_continues_bit_for_bit(gen):
    """bfloat16 parameters with float32 masters and moments: torch.optim's load casts floating
    states to the parameter's dtype; FusedAdam's keeps float32, so a resumed run continues bit
    for bit as the uninterrupted one."""
    seed = int(torch.randint(0, 2**31, (1,), generator=gen))

    def fresh():
        model = _model("cpu", torch.bfloat16)
        return model, FusedAdam(model.parameters(), lr=1e-2, master_weights=True)

    whole, opt_whole = fresh()
    _train(whole, opt_whole, torch.Generator().manual_seed(seed), 5, "cpu", torch.bfloat16)
    first, opt_first = fresh()
    g = torch.Generator().manual_seed(seed)
    _train(first, opt_first, g, 3, "cpu", torch.bfloat16)
    resumed, opt_resumed = fresh()
    resumed.load_state_dict(first.state_dict())
    opt_resumed.load_state_dict(opt_first.state_dict())
    for p in resumed.parameters():
        state = opt_resumed.state[p]
        assert [state[n].dtype for n in ("exp_avg", "exp_avg_sq", "master_param")] == \
            [torch.float32] * 3
    _train(resumed, opt_resumed, g, 2, "cpu", torch.bfloat16, first=3)
    _params_equal(resumed, whole, "resumed against uninterrupted")
    for p, q in zip(resumed.parameters(), whole.parameters()):
        assert_bitwise_equal(opt_resumed.state[p]["master_param"],
                             opt_whole.state[q]["master_param"], "master")


def test_decoupled_grad_and_parameters_without_gradients():
    a, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))
    opt = FusedAdam([a, b], lr=0.1, use_decoupled_grad=True)
    a.decoupled_grad = torch.full((3,), 2.0)
    a.grad = torch.full((3,), -100.0)  # not read
    opt.step()
    expected = torch.nn.Parameter(torch.ones(3))
    expected.grad = torch.full((3,), 2.0)
    torch.optim.AdamW([expected], lr=0.1, weight_decay=0.0, foreach=False).step()
    assert_bitwise_equal(a.detach(), expected.detach(), "a step with decoupled_grad")
    assert torch.equal(b.detach(), torch.ones(3)) and not opt.state[b], "b has no gradient"
    opt.zero_grad()
    assert a.decoupled_grad is None
    a.decoupled_grad = torch.ones(3)
    opt.zero_grad(set_to_none=False)
    assert torch.equal(a.decoupled_grad, torch.zeros(3))


@pytest.mark.parametrize("kwargs, argument", [
    (dict(amsgrad=True), "amsgrad"),
    (dict(capturable=True), "capturable"),
    (dict(exp_avg_dtype=torch.uint8), "exp_avg_dtype"),
    (dict(exp_avg_sq_dtype=torch.float64), "exp_avg_sq_dtype"),
    (dict(exp_avg_sq_dtype=torch.float16), "exp_avg_sq_dtype"),
    (dict(master_weights=True, master_weight_dtype=torch.bfloat16), "master_weight_dtype"),
    (dict(master_weights=True, master_weight_dtype=torch.float16), "master_weight_dtype"),
    (dict(betas=(0.9, 1.0)), "betas[1]"),
    (dict(lr=-1.0), "lr"),
    (dict(eps=-1e-8), "eps"),
])
def test_refused_arguments_are_named(kwargs, argument):
    with pytest.raises(ValueError, match=argument.replace("[", r"\[").replace("]", r"\]")):
        FusedAdam([torch.nn.Parameter(torch.ones(2))], **kwargs)


def test_sparse_gradients_and_set_grad_none_conflicts_are_refused():
    p = torch.nn.Parameter(torch.ones(4))
    p.grad = torch.ones(4).to_sparse()
    opt = FusedAdam([p])
    with pytest.raises(ValueError, match="sparse"):
        opt.step()
    assert not opt.state[p], "nothing changed"
    with pytest.warns(DeprecationWarning, match="set_grad_none"):
        opt = FusedAdam([p], set_grad_none=False)
    with pytest.raises(ValueError, match="set_grad_none=False"):
        opt.zero_grad(set_to_none=True)


def test_a_refused_gradient_leaves_every_parameter_as_it_was():
    """A sparse gradient, or a decoupled_grad of another shape, refused in the second group:
    nothing updated, no state made, in either optimizer (the parameters before it were
    updated, their step counted, so a retry updated them twice)."""
    for make in (lambda groups: FusedAdam(groups, lr=0.1),
                 lambda groups: FusedSGD(groups, lr=0.1, momentum=0.9)):
        a, b, c = (torch.nn.Parameter(torch.ones(4)) for _ in range(3))
        opt = make([{"params": [a, b]}, {"params": [c]}])
        a.grad, b.grad, c.grad = torch.ones(4), torch.ones(4), torch.ones(4).to_sparse()
        with pytest.raises(ValueError, match="sparse"):
            opt.step()
        assert all(torch.equal(p, torch.ones(4)) for p in (a, b, c))
        assert not any(opt.state[p] for p in (a, b, c))
    a, b = torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(4))
    opt = FusedAdam([a, b], lr=0.1, use_decoupled_grad=True)
    a.decoupled_grad, b.decoupled_grad = torch.ones(4), torch.ones(1)
    with pytest.raises(ValueError, match=r"a gradient of shape \(1,\) for a parameter of "
                                         r"shape \(4,\)"):
        opt.step()
    assert torch.equal(a, torch.ones(4)) and not opt.state[a]


@pytest.mark.parametrize("dtype", [torch.complex64, torch.float64])
def test_parameters_of_other_dtypes_are_refused(dtype):
    """complex (its imaginary part was dropped) and float64 (rounded to float32 at every step)
    parameters are refused, as Transformer Engine's kernels do, also when added later."""
    with pytest.raises(ValueError, match=f"got one of dtype {dtype}"):
        FusedAdam([torch.nn.Parameter(torch.ones(2, dtype=dtype))])
    opt = FusedAdam([torch.nn.Parameter(torch.ones(2))])
    with pytest.raises(ValueError, match="float32, bfloat16, float16 or FP8"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(2, dtype=dtype))]})
    assert len(opt.param_groups) == 1


def test_float32_parameters_take_no_master(gen):
    """master_weights=True updates float32 parameters in place (no master), as without it."""
    ours, plain = _model("cpu"), _model("cpu")
    opt = FusedAdam(ours.parameters(), lr=1e-2, master_weights=True)
    seed = int(torch.randint(0, 2**31, (1,), generator=gen))
    _train(ours, opt, torch.Generator().manual_seed(seed), 3, "cpu")
    _train(plain, FusedAdam(plain.parameters(), lr=1e-2), torch.Generator().manual_seed(seed),
           3, "cpu")
    _params_equal(ours, plain, "with and without master_weights")
    assert all("master_param" not in opt.state[p] for p in ours.parameters())


def test_a_master_missing_from_a_loaded_state_is_made_from_the_parameter(gen):
    """A state saved without masters, loaded with master_weights=True: each master is made at
    the next step from the parameter (the bfloat16 weights trained on; they stood still)."""
    model = _model("cpu", torch.bfloat16)
    opt = FusedAdam(model.parameters(), lr=1e-2)
    _train(model, opt, torch.Generator().manual_seed(0), 2, "cpu", torch.bfloat16)
    with_masters = FusedAdam(model.parameters(), lr=1e-2, master_weights=True)
    with_masters.load_state_dict(opt.state_dict())
    before = [p.detach().clone() for p in model.parameters()]
    _train(model, with_masters, torch.Generator().manual_seed(1), 1, "cpu", torch.bfloat16,
           first=2)
    for p, old in zip(model.parameters(), before):
        master = with_masters.state[p]["master_param"]
        assert master.dtype == torch.float32
        assert_bitwise_equal(p.detach(), master.to(torch.bfloat16), "the rounded master")
        assert not torch.equal(p.detach(), old), "the step moved the parameter"


def test_an_fp8_weight_written_after_construction_starts_its_master_from_that_value():
    """preserve_high_precision_init_val=True, then a checkpoint loaded into the weight: the
    master starts from the loaded (dequantised) value, not the construction-time one; with
    nothing written, from the kept initial value."""
    recipe = tfp8.DelayedScaling()
    torch.manual_seed(0)
    pretrained = tfp8.Linear(16, 16).state_dict()
    for load in (True, False):
        torch.manual_seed(1)
        with tfp8.quantized_model_init(recipe=recipe, preserve_high_precision_init_val=True):
            model = tfp8.Linear(16, 16)
        if load:
            model.load_state_dict(pretrained)
        weight = model.weight
        start = (weight.dequantize() if load else weight.get_high_precision_init_val()).float()
        opt = FusedAdam([weight], lr=1e-6, master_weights=True)
        weight.grad = torch.ones(16, 16)
        opt.step()
        master = opt.state[weight]["master_param"]
        assert (master - start).abs().max() <= 1.01e-6, "one step of lr 1e-6 from the start"


def test_a_torch_adamw_state_loads_and_continues_as_adamw(gen):
    """A torch.optim.AdamW state dict (its groups lack bias_correction) loads, and the next
    steps are AdamW's, bit for bit."""
    seed = int(torch.randint(0, 2**31, (1,), generator=gen))
    ours, theirs = _model("cpu"), _model("cpu")
    opt_theirs = torch.optim.AdamW(theirs.parameters(), lr=1e-2, foreach=False)
    g = torch.Generator().manual_seed(seed)
    _train(theirs, opt_theirs, g, 2, "cpu")
    ours.load_state_dict(theirs.state_dict())
    opt = FusedAdam(ours.parameters(), lr=1e-2, weight_decay=0.01)
    opt.load_state_dict(opt_theirs.state_dict())
    g_ours = torch.Generator().manual_seed(seed + 1)
    _train(ours, opt, g_ours, 2, "cpu", first=2)
    _train(theirs, opt_theirs, torch.Generator().manual_seed(seed + 1), 2, "cpu", first=2)
    _params_equal(ours, theirs, "after the load")


def test_importable_under_transformer_engine_path():
    assert tfp8.optimizers.FusedAdam is FusedAdam


def test_param_groups_given_as_generators_keep_their_parameters(gen):
    """A group's "params" may be a generator (model.parameters()): every parameter in it is
    stepped (the dtype check once read the generator, leaving the group empty)."""
    seed = int(torch.randint(0, 2**31, (1,), generator=gen))
    ours, theirs = _model("cpu"), _model("cpu")
    opt = FusedAdam([dict(params=ours[0].parameters()),
                     dict(params=ours[2].parameters(), lr=1e-3)], lr=1e-2)
    opt_theirs = torch.optim.AdamW([dict(params=theirs[0].parameters()),
                                    dict(params=theirs[2].parameters(), lr=1e-3)],
                                   lr=1e-2, weight_decay=0.0, foreach=False)
    assert [len(g["params"]) for g in opt.param_groups] == [2, 2]
    _train(ours, opt, torch.Generator().manual_seed(seed), 2, "cpu")
    _train(theirs, opt_theirs, torch.Generator().manual_seed(seed), 2, "cpu")
    _params_equal(ours, theirs, "after 2 steps")
