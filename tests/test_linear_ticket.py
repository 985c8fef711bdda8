"""The Linear layer's ticket (modules/linear_fused_step.py's _keep_ticket and
ticketed_linear_step): after a forward through its C++ step, the layer's next forwards under
the same context call that step again after identity checks only. Every change a ticket must
see (a parameter, a state buffer, the recipe, the input, torch.autocast, checkpointing,
is_first_microbatch, an attribute) is made between steps, on a layer and on its copy that
takes the Python path, and both are compared bit for bit (outputs, gradients, FP8 state) over
steps where the scales move; and the ticket is seen to run, or not, where it should."""
from __future__ import annotations

import copy

import pytest
import torch
from conftest import DEVICE_PARAMS, randn
from fused_step_checks import assert_same, node_name

import transformer_fp8 as tfp8
from transformer_fp8 import DelayedScaling, fp8_autocast
from transformer_fp8.modules import linear_fused_step
from transformer_fp8.quantization.autocast import isolated_fp8_autocast

RECIPE = DelayedScaling(amax_history_len=4)
CURRENT = tfp8.Float8CurrentScaling()
OTHER = DelayedScaling(amax_history_len=3, margin=1)
# Another recipe whose state is laid out as RECIPE's (the layer adopts it without any change of
# its attributes), with steps of its own.
SAME_LAYOUT = DelayedScaling(amax_history_len=4, reduce_amax=False)


def one_step(layer, x, g, recipe, checkpoint=None, autocast_bf16=False, **forward_kwargs):
    """A forward in fp8_autocast (under torch.utils.checkpoint when ``checkpoint`` is
    "reentrant" or "non_reentrant") and its backward: (output, input grad, parameter grads,
    node)."""
    x = x.detach().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast_bf16), \
            fp8_autocast(fp8_recipe=recipe):
        if checkpoint is None:
            out = layer(x, **forward_kwargs)
        else:
            out = torch.utils.checkpoint.checkpoint(
                lambda t: layer(t, **forward_kwargs), x,
                use_reentrant=checkpoint == "reentrant")
    if isinstance(out, tuple):  # return_bias
        out = out[0] + out[1]
    node = node_name(out)
    out.backward(g.to(out.dtype))
    params = [p.grad.clone() if p.grad is not None else None for p in layer.parameters()]
    layer.zero_grad(set_to_none=True)
    return out.detach(), x.grad, params, node


# The changes draw on the CPU generator and move the tensors to the layer's device.
def _new_weight(layer, gen):
    layer.weight = torch.nn.Parameter(
        randn(gen, *layer.weight.shape, scale=3.0).to(layer.weight.device))


def _weight_data(layer, gen):
    layer.weight.data = randn(gen, *layer.weight.shape, scale=0.5).to(layer.weight.device)


def _bias_removed(layer, gen):
    layer.bias = None


def _parameters_dict_write(layer, gen):  # behind the module's __setattr__, as FSDP2 does
    layer._parameters["weight"] = torch.nn.Parameter(
        randn(gen, *layer.weight.shape).to(layer.weight.device))


def _bias_in_parameters_dict(layer, gen):
    layer._parameters["bias"] = torch.nn.Parameter(
        randn(gen, *layer.bias.shape).to(layer.bias.device))


def _bias_removed_from_parameters_dict(layer, gen):
    layer._parameters["bias"] = None


def _buffers_dict_write(layer, gen):  # behind the module's __setattr__
    layer._buffers["fp8_fwd_scale"] = layer.fp8_fwd_scale.clone() * 4
    layer._buffers["fp8_fwd_scale_inv"] = 1 / layer._buffers["fp8_fwd_scale"]
    layer._buffers["fp8_bwd_amax_history"] = layer.fp8_bwd_amax_history.clone()


def _load_state_dict(layer, gen):
    other = tfp8.Linear(layer.in_features, layer.out_features, recipe=RECIPE)
    for param in other.parameters():
        param.data = randn(gen, *param.shape)
    with fp8_autocast(fp8_recipe=RECIPE):
        other(randn(gen, 16, layer.in_features, scale=9.0)).sum().backward()
    layer.load_state_dict(other.state_dict())


def _reset_fp8_state(layer, gen):
    layer.reset_fp8_state()


def _return_bias(layer, gen):
    layer.return_bias = True


CHANGES = {"new_weight": _new_weight, "weight_data": _weight_data, "bias_removed": _bias_removed,
           "parameters_dict_write": _parameters_dict_write,
           "bias_in_parameters_dict": _bias_in_parameters_dict,
           "bias_removed_from_parameters_dict": _bias_removed_from_parameters_dict,
           "buffers_dict_write": _buffers_dict_write, "load_state_dict": _load_state_dict,
           "reset_fp8_state": _reset_fp8_state, "return_bias": _return_bias}

# Steps that differ from the plain step: (keyword arguments of one_step, forward keywords)
STEPS = {"other_recipe": (dict(recipe=OTHER), {}),
         "torch_autocast": (dict(autocast_bf16=True), {}),
         "checkpoint_non_reentrant": (dict(checkpoint="non_reentrant"), {}),
         "checkpoint_reentrant": (dict(checkpoint="reentrant"), {}),
         "is_first_microbatch": (None, None)}


def _sequence(layer, gen_seed, kind, recipe, device):
    """Two plain steps (the second one's forward by the ticket), the change or odd step, then
    two plain steps again; returns the results of every step."""
    gen = torch.Generator().manual_seed(gen_seed)
    shape = (2, 16, layer.in_features)

    def data(scale):
        return (randn(gen, *shape, scale=scale).to(device),
                randn(gen, 2, 16, layer.out_features, scale=scale).to(device))

    results = [one_step(layer, *data(s), recipe) for s in (1.0, 8.0)]
    if kind in CHANGES:
        CHANGES[kind](layer, gen)
        results.append(one_step(layer, *data(0.1), recipe))
    elif kind == "is_first_microbatch":
        # A forward without is_first_microbatch drops the weight kept by True, so that a later
        # False quantises the weight again.
        for first in (True, False, None, "weight changed", False):
            if first == "weight changed":
                layer.weight.data.mul_(2)
            else:
                results.append(one_step(layer, *data(2.0), recipe, is_first_microbatch=first))
    elif kind == "isolated_context":  # what make_graphed_callables captures
        x, g = data(4.0)
        x = x.requires_grad_(True)
        with isolated_fp8_autocast(True, recipe, None):
            out = layer(x)
        out.backward(g)
        results.append((out.detach(), x.grad, [p.grad.clone() for p in layer.parameters()],
                        node_name(out)))
        layer.zero_grad(set_to_none=True)
    elif kind == "other_recipe_first_microbatch":
        # The layer's state moves to the other recipe's steps on the Python path, which makes
        # no ticket: the ticket of the first recipe must not record into it afterwards.
        results.append(one_step(layer, *data(3.0), SAME_LAYOUT, is_first_microbatch=True))
    elif kind == "no_grad":
        with torch.no_grad(), fp8_autocast(fp8_recipe=recipe):
            results.append((layer(data(5.0)[0]), None, [], "none"))
    else:
        step_kwargs, _ = STEPS[kind]
        step_kwargs = {"recipe": recipe, **step_kwargs}
        results.append(one_step(layer, *data(0.2), **step_kwargs))
    results += [one_step(layer, *data(s), recipe) for s in (30.0, 0.05)]
    return results


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("kind", list(CHANGES) + list(STEPS) + [
    "other_recipe_first_microbatch", "isolated_context", "no_grad"])
@pytest.mark.parametrize("recipe", [RECIPE, CURRENT], ids=["delayed", "current"])
def test_changes_between_steps_are_seen_as_on_the_python_path(recipe, kind, device, gen,
                                                              monkeypatch):
    torch.manual_seed(0)
    layer = tfp8.Linear(32, 48, recipe=recipe if recipe is RECIPE else None).to(device)
    python_layer = copy.deepcopy(layer)
    seed = int(torch.randint(0, 2**31, (1,), generator=gen))
    fused = _sequence(layer, seed, kind, recipe, device)
    monkeypatch.setattr(linear_fused_step, "ENABLED", False)
    python = _sequence(python_layer, seed, kind, recipe, device)
    assert all("Fp8LinearStep" not in step[3] for step in python), "the Python path ran"
    assert "Fp8LinearStep" in fused[1][3]
    if kind == "no_grad":  # (no gradients to compare for that step)
        torch.testing.assert_close(fused[2][0], python[2][0], rtol=0, atol=0)
        fused, python = fused[:2] + fused[3:], python[:2] + python[3:]
    assert_same(fused, python, layer, python_layer)


@pytest.mark.parametrize("recipe", [RECIPE, CURRENT], ids=["delayed", "current"])
def test_ticket_runs_the_steady_state_steps(recipe, gen, monkeypatch):
    """From the second step on, the forward runs through the ticket: the full path (base.py's
    _dispatch) is not called."""
    layer = tfp8.Linear(32, 32)
    x, g = randn(gen, 16, 32), randn(gen, 16, 32)
    one_step(layer, x, g, recipe)
    assert layer._fused_ticket is not None
    calls = []
    dispatch = type(layer)._dispatch
    monkeypatch.setattr(type(layer), "_dispatch",
                        lambda *a: calls.append(1) or dispatch(*a))
    for _ in range(3):
        assert "Fp8LinearStep" in one_step(layer, x, g, recipe)[3]
    assert calls == []
    monkeypatch.setattr(linear_fused_step, "ENABLED", False)  # the switch stops the ticket too
    assert "Fp8LinearStep" not in one_step(layer, x, g, recipe)[3]
    assert calls == [1]


def test_ticket_refuses_what_the_full_path_refuses(gen):
    layer = tfp8.Linear(32, 32, recipe=RECIPE)
    x, g = randn(gen, 16, 32), randn(gen, 16, 32)
    one_step(layer, x, g, RECIPE)
    one_step(layer, x, g, RECIPE)
    state = [t.clone() for t in layer.fp8_state_tensors()]
    with pytest.raises(ValueError, match=r"input must have shape \[\.\.\., 32\], got \(16, 16\)"):
        with fp8_autocast(fp8_recipe=RECIPE):
            layer(x[:, :16])
    with pytest.raises(RuntimeError, match="input dtype torch.bfloat16 differs from the weight"):
        with fp8_autocast(fp8_recipe=RECIPE):
            layer(x.bfloat16())
    for before, after in zip(state, layer.fp8_state_tensors()):
        assert torch.equal(before, after), "a refused forward changes no state"


def test_ticket_compares_the_state_buffers_in_their_order():
    """_C.LinearTicket compares the layer's state buffers by name, in the order of the buffers
    it is given (roles.float_state_buffers)."""
    from transformer_fp8 import _C
    from transformer_fp8.quantization.state import FP8_FLOAT_STATE
    assert tuple(_C.LinearTicket.buffer_names) == FP8_FLOAT_STATE


def test_ticket_refuses_an_inconsistent_construction(gen):
    """The ticket's arguments are checked when it is made: delayed scaling's slices, buffers
    and backward step come together."""
    from transformer_fp8 import _C
    layer = tfp8.Linear(32, 32)
    with pytest.raises(RuntimeError, match="8 state slices or none, got 1"):
        _C.LinearTicket(layer.weight, layer.bias, [], [layer.fp8_fwd_scale], torch.float8_e4m3fn,
                        torch.float8_e5m2, torch.float32, 32, None)
    with pytest.raises(RuntimeError, match="together"):
        _C.LinearTicket(layer.weight, layer.bias, [], [], torch.float8_e4m3fn,
                        torch.float8_e5m2, torch.float32, 32, object())


def test_a_parameter_whose_class_changes_in_place_takes_the_full_path(gen):
    """torch.utils.swap_tensors changes a Parameter's class in place (the same object): a
    tensor subclass takes the Python path, as on a forward without a ticket."""
    class Subclass(torch.Tensor):
        pass
    layer = tfp8.Linear(32, 32, recipe=RECIPE)
    x, g = randn(gen, 16, 32), randn(gen, 16, 32)
    for _ in range(2):
        assert "Fp8LinearStep" in one_step(layer, x, g, RECIPE)[3]
    weight = layer.weight
    torch.utils.swap_tensors(weight, torch.nn.Parameter(Subclass(weight.detach().clone())))
    assert layer._parameters["weight"] is weight and type(weight) is not torch.nn.Parameter
    assert "Fp8LinearStep" not in one_step(layer, x, g, RECIPE)[3]


def test_a_layer_in_a_reference_cycle_through_its_ticket_is_collected(gen):
    """The ticket holds the layer's parameters where the garbage collector sees them: a layer
    whose parameter refers back to it is freed by a collection."""
    import gc
    import weakref
    layer = tfp8.Linear(32, 32, recipe=RECIPE)
    layer.weight.owner = layer  # a back-reference: a cycle through the ticket's weight
    x, g = randn(gen, 16, 32), randn(gen, 16, 32)
    for _ in range(2):
        one_step(layer, x, g, RECIPE)
    assert layer._fused_ticket is not None
    ref = weakref.ref(layer)
    del layer
    gc.collect()
    assert ref() is None


def test_current_scaling_ticket_is_taken_whatever_the_group(gen, monkeypatch):
    """Current scaling casts each rank's tensors with their own amaxes (no collective): the
    ticket holds in a group of several ranks too."""
    from transformer_fp8.quantization import update_plan
    layer = tfp8.Linear(32, 32)
    x, g = randn(gen, 16, 32), randn(gen, 16, 32)
    one_step(layer, x, g, CURRENT)
    assert layer._fused_ticket is not None
    monkeypatch.setattr(update_plan, "world_size", lambda group: 2)
    with fp8_autocast(fp8_recipe=CURRENT):
        assert linear_fused_step.ticketed_linear_step(layer, x) is not None


def test_conv1d_weight_view_makes_no_ticket(gen):
    """A weight that is not the Parameter itself (HuggingFace Conv1D's transposed view, split
    parameters) makes no ticket: it could never match."""
    layer = tfp8.Linear(32, 48, recipe=RECIPE, parameters_split=("a", "b"))
    x, g = randn(gen, 16, 32), randn(gen, 16, 48)
    for _ in range(2):
        assert "Fp8LinearStep" in one_step(layer, x, g, RECIPE)[3]
    assert layer._fused_ticket is None
