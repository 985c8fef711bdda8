"""Weights computed from other parameters (torch.nn.utils.parametrize and its weight_norm /
spectral_norm, the older weight_norm hook, prune): a module whose weight is such a tensor
computes what the same module with that tensor as its plain weight computes, bit for bit, and
the gradient reaches the underlying parameters through the parametrization (nn.Linear takes
them all; the modules read the weight from ``_parameters`` and raised KeyError)."""
from __future__ import annotations

import copy

import pytest
import torch
from conftest import assert_bitwise_equal, randn
from torch.nn.utils import parametrizations, prune

import transformer_fp8 as te

MODULES = {  # kind -> (build, name of the weight to parametrize, extra forward arguments)
    "linear": (lambda: te.Linear(32, 48), "weight", ()),
    "layernorm_linear": (lambda: te.LayerNormLinear(32, 48), "weight", ()),
    "mlp_fc1": (lambda: te.LayerNormMLP(32, 48), "fc1_weight", ()),
    "mlp_fc2": (lambda: te.LayerNormMLP(32, 48), "fc2_weight", ()),
    "grouped": (lambda: te.GroupedLinear(2, 32, 48), "weight1", ([6, 10],)),
}
PARAMETRIZE = {
    "weight_norm": lambda m, name: parametrizations.weight_norm(m, name=name),
    "weight_norm_hook": lambda m, name: torch.nn.utils.weight_norm(m, name=name),
    "prune": lambda m, name: prune.l1_unstructured(m, name, 0.3),
}
RECIPES = [pytest.param(lambda: te.DelayedScaling(amax_history_len=2), id="delayed"),
           pytest.param(te.Float8CurrentScaling, id="current"),
           pytest.param(te.Float8BlockScaling, id="block")]


@pytest.mark.filterwarnings("ignore:.*weight_norm.*is deprecated:FutureWarning")
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("how", PARAMETRIZE)
@pytest.mark.parametrize("kind", MODULES)
def test_a_parametrized_weight_trains_as_the_plain_weight_it_computes(gen, kind, how, recipe):
    build, name, extra = MODULES[kind]
    torch.manual_seed(0)
    module = build()
    plain = copy.deepcopy(module)  # the same module, its weight a Parameter
    PARAMETRIZE[how](module, name)
    plain_params = dict(plain.named_parameters())
    underlying = [(n, p) for n, p in module.named_parameters() if n not in plain_params]
    assert underlying, "the parametrization keeps the weight's parameters elsewhere"
    opt = torch.optim.SGD(module.parameters(), lr=0.5)
    fp8_recipe = recipe()

    def weight():  # the parametrized weight, computed from the parameters as they are now
        if how == "weight_norm_hook":  # (these two set the attribute in a pre-forward hook)
            return torch._weight_norm(module.get_parameter(name + "_v"),
                                      module.get_parameter(name + "_g"), 0)
        if how == "prune":
            return module.get_parameter(name + "_orig") * module.get_buffer(name + "_mask")
        return getattr(module, name)

    for step in range(3):  # the delayed scales change from step to step
        with torch.no_grad():  # the plain module's weight: what the parametrization computes
            for n, p in plain.named_parameters():
                p.copy_(weight() if n == name else module.get_parameter(n))
        x = randn(gen, 16, 32, scale=1.0 + step)
        xs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
        with te.fp8_autocast(fp8_recipe=fp8_recipe):
            ys = [m(xi, *extra) for m, xi in zip((module, plain), xs)]
        assert_bitwise_equal(ys[0], ys[1], f"output, step {step}")
        for y in ys:
            y.square().sum().backward()
        assert_bitwise_equal(xs[0].grad, xs[1].grad, f"input gradient, step {step}")
        for n, p in plain.named_parameters():
            if n != name:
                assert_bitwise_equal(module.get_parameter(n).grad, p.grad, f"{n}, step {step}")
        # the weight's gradient, carried back through the parametrization
        expected = torch.autograd.grad(weight(), [p for _, p in underlying],
                                       plain_params[name].grad, allow_unused=True)
        for (n, p), e in zip(underlying, expected):
            if e is None:
                assert p.grad is None, n
            else:
                assert_bitwise_equal(p.grad, e, f"{n}, step {step}")
        opt.step()
        opt.zero_grad()
        plain.zero_grad()


class Counting(torch.nn.Module):
    """An identity parametrization that counts its computations."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, weight):
        self.calls += 1
        return weight


@pytest.mark.parametrize("fp8", [False, True], ids=["hp", "fp8"])
@pytest.mark.parametrize("kind", MODULES)
def test_a_parametrized_weight_is_computed_once_per_forward(kind, fp8):
    """As nn.Linear computes it: spectral_norm advances its power iteration at each
    computation, so two or three per forward (the FP8 checks, the GEMM) gave other numbers."""
    build, name, extra = MODULES[kind]
    module = build()
    counting = Counting()
    torch.nn.utils.parametrize.register_parametrization(module, name, counting)
    counting.calls = 0  # (registering computes it once)
    with te.fp8_autocast(enabled=fp8, fp8_recipe=te.DelayedScaling()):
        module(torch.randn(16, 32), *extra).sum().backward()
    assert counting.calls == 1


def test_spectral_norm_computes_what_it_computes_on_nn_linear(gen):
    """Outside fp8_autocast a spectral-normed Linear is nn.Linear's, bit for bit, over
    training steps (the power iteration's vectors advance once per forward on both)."""
    torch.manual_seed(0)
    plain = torch.nn.Linear(32, 48)
    layer = te.Linear(32, 48)
    layer.load_state_dict(plain.state_dict(), strict=False)
    torch.manual_seed(1)
    parametrizations.spectral_norm(plain)
    torch.manual_seed(1)
    parametrizations.spectral_norm(layer)
    for step in range(3):
        x = randn(gen, 16, 32)
        outs = [m(x) for m in (plain, layer)]
        assert_bitwise_equal(outs[1], outs[0], f"step {step}")
        for out in outs:
            out.square().sum().backward()
        for (n, p), q in zip(plain.named_parameters(), layer.parameters()):
            assert_bitwise_equal(q.grad, p.grad, f"{n}, step {step}")


@pytest.mark.parametrize("option", ["fuse_wgrad_accumulation", "delay_wgrad_compute"])
def test_gradient_routing_refuses_a_parametrized_weight(option):
    """The routing hands a Parameter's gradient over; a computed weight's was lost
    (backward_dw set .grad on a tensor nobody holds, the parameters got none)."""
    module = te.Linear(32, 48, **{option: True})
    parametrizations.weight_norm(module)
    with pytest.raises(RuntimeError, match="'weight' is computed from others"):
        module(torch.randn(16, 32))


def test_a_plain_checkpoint_of_a_parametrized_layer_starts_its_fp8_state_afresh():
    """Its own weights are under parametrizations.*: a checkpoint holding them without FP8
    state loads as into a plain layer (fresh scales), not as a checkpoint of other layers."""
    module = te.Linear(32, 48, bias=False)
    parametrizations.weight_norm(module)
    with te.fp8_autocast(fp8_recipe=te.DelayedScaling()):
        module(torch.randn(16, 32) * 4).sum().backward()
    assert not torch.all(module.fp8_fwd_scale == 1)
    module.load_state_dict(te.strip_fp8_state(module.state_dict()), strict=False)
    assert torch.all(module.fp8_fwd_scale == 1) and not module.fp8_fwd_amax_history.any()


class _Halved(torch.nn.Module):  # a custom parametrization
    def forward(self, weight):
        return weight * 0.5


COPIED_PARAMETRIZATIONS = {
    "weight_norm": lambda m: parametrizations.weight_norm(m, "weight"),
    "custom": lambda m: torch.nn.utils.parametrize.register_parametrization(m, "weight",
                                                                            _Halved()),
}


@pytest.mark.parametrize("when", ["before_a_step", "after_a_step"])
@pytest.mark.parametrize("how", COPIED_PARAMETRIZATIONS)
def test_a_copy_of_a_parametrized_layer_is_a_module_of_its_own(how, when):
    """torch parametrize gives the module's class a deepcopy of its own that copies __dict__
    as it is (unless the class defines __deepcopy__): the copy shared the original's creation
    index (trained next to it in one step, the original's delayed state stopped updating), and
    after a delayed step deepcopy raised (the step's C++ plan cannot be pickled). The original
    and its copy trained together give what two independently built layers give."""
    recipe = te.DelayedScaling(amax_history_len=4)

    def make():
        torch.manual_seed(0)
        layer = te.Linear(32, 64, recipe=recipe)
        COPIED_PARAMETRIZATIONS[how](layer)
        return layer

    torch.manual_seed(1)
    xs = [torch.randn(8, 32) for _ in range(4)]
    original, twin, twin_of_copy = make(), make(), make()
    if when == "after_a_step":
        for layer in (original, twin, twin_of_copy):
            with te.fp8_autocast(fp8_recipe=recipe):
                layer(xs[0]).sum().backward()
            layer.zero_grad(set_to_none=True)
        torch.optim.swa_utils.AveragedModel(original)  # (a deepcopy: raised too)
    copied = copy.deepcopy(original)
    assert copied._fp8_index != original._fp8_index
    for x in xs[1:]:
        losses = []
        for a, b in ((original, copied), (twin, twin_of_copy)):
            with te.fp8_autocast(fp8_recipe=recipe):
                loss = a(x).pow(2).sum() + b(2 * x).pow(2).sum()
            loss.backward()
            losses.append(loss.detach())
        assert_bitwise_equal(losses[0], losses[1])
    for got, want in ((original, twin), (copied, twin_of_copy)):
        assert torch.any(got.fp8_fwd_scale != 1)  # (the delayed state was updated)
        for (name, p), (_, q) in zip(got.named_parameters(), want.named_parameters()):
            assert_bitwise_equal(p.grad, q.grad, name)
        for (name, t), (_, u) in zip(got.state_dict().items(), want.state_dict().items()):
            assert_bitwise_equal(t, u, name)
