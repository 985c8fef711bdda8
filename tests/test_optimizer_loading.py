"""FusedAdam's and FusedSGD's load_state_dict against torch.optim's: the caller's
load_state_dict pre-hooks (torch's way to load a state saved over another parameter order) and
the group switches the steps do not have."""
from __future__ import annotations

import pytest
import torch
from multiprocess import needs_gloo, rank_results
from optimizer_dtensor_cases import worker

from transformer_fp8.optimizers import FusedAdam, FusedSGD

OPTIMIZERS = {
    "adam": (lambda ps: torch.optim.AdamW(ps, lr=0.1, foreach=False),
             lambda ps: FusedAdam(ps, lr=0.1), ("exp_avg", "exp_avg_sq")),
    "sgd": (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, foreach=False),
            lambda ps: FusedSGD(ps, lr=0.1, momentum=0.9), ("momentum_buffer",)),
}


def _swapped(optimizer, state_dict):
    """A pre-hook: the state was saved over [a, b], the loading optimizer holds [b, a]."""
    state_dict = dict(state_dict)
    state_dict["state"] = {0: state_dict["state"][1], 1: state_dict["state"][0]}
    return state_dict


@pytest.mark.parametrize("kind", list(OPTIMIZERS))
def test_a_pre_hook_that_reorders_the_state_is_honoured(kind):
    """The states an optimizer keeps in its own dtypes were read from the dict before the
    pre-hooks ran and written over what torch loaded: every moment on the other parameter."""
    make_torch, make_ours, names = OPTIMIZERS[kind]
    loaded = {}
    for which, make in (("torch", make_torch), ("ours", make_ours)):
        a, b = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(3))
        source = make([a, b])
        a.grad, b.grad = torch.full((3,), 1.0), torch.full((3,), -5.0)
        source.step()
        target = make([b, a])
        target.register_load_state_dict_pre_hook(_swapped)
        target.load_state_dict(source.state_dict())
        loaded[which] = [target.state[p][name] for p in (a, b) for name in names]
        for p in (a, b):
            for name in names:
                assert torch.equal(target.state[p][name], source.state[p][name]), (which, name)
    for ours, theirs in zip(loaded["ours"], loaded["torch"]):
        assert torch.equal(ours, theirs)


@pytest.mark.parametrize("switch", ["maximize", "amsgrad"])
def test_fused_adam_refuses_a_group_with_a_switch_its_step_lacks(switch):
    """A torch.optim.AdamW state saved with maximize=True (or amsgrad=True), or a group added
    with it, was taken and the switch ignored (maximize: the parameters moved the wrong way)."""
    p = torch.nn.Parameter(torch.ones(2))
    theirs = torch.optim.AdamW([p], lr=0.1, **{switch: True})
    p.grad = torch.ones(2)
    theirs.step()
    ours = FusedAdam([p], lr=0.1)
    before = ours.state_dict()
    with pytest.raises(ValueError, match=f"FusedAdam: argument '{switch}' must be False"):
        ours.load_state_dict(theirs.state_dict())
    assert ours.state_dict() == before and switch not in ours.param_groups[0]
    with pytest.raises(ValueError, match=f"FusedAdam: argument '{switch}' must be False"):
        ours.add_param_group({"params": [torch.nn.Parameter(torch.ones(2))], switch: True})
    assert len(ours.param_groups) == 1


# ---- Transformer Engine's FusedAdam state dicts ---------------------------------------------

def _te_split(master: torch.Tensor):
    """Transformer Engine's store_param_remainders split of a float32 master: the bfloat16
    parameter (its high 16 bits, plus one where the low 16 bits, read as int16, are negative:
    rounded to nearest) and the int16 remainder (the low 16 bits)."""
    bits = master.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    low = bits & 0xFFFF
    high = (bits >> 16) + (low >= 0x8000).to(torch.int64)
    signed = lambda v: (v & 0xFFFF) - ((v & 0xFFFF) >= 0x8000).to(torch.int64) * 0x10000  # noqa: E731
    return (signed(high).to(torch.int16).view(torch.bfloat16),
            signed(low).to(torch.int16))


def _te_state_dict(optimizer, params, remainders: bool) -> dict:
    """What Transformer Engine's FusedAdam.state_dict() gives for the state of ``optimizer``:
    the step count in the group, float32 moments, masters whole or as int16 remainders."""
    saved = optimizer.state_dict()
    steps = {float(entry["step"]) for entry in saved["state"].values()}
    assert len(steps) == 1
    group = dict(saved["param_groups"][0], step=int(steps.pop()))
    state = {}
    for key, entry in saved["state"].items():
        entry = {k: v for k, v in entry.items() if k != "step"}
        if remainders:
            param_bits, entry["master_param"] = _te_split(entry["master_param"])
            assert torch.equal(param_bits, params[key].detach()), "the split's parameter"
        state[key] = entry
    return {"state": state, "param_groups": [group]}


def _adam_run(params, steps, seed, optimizer=None):
    optimizer = optimizer or FusedAdam(params, lr=1e-2, master_weights=True,
                                       store_param_remainders=True)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
        optimizer.step()
    return optimizer


@pytest.mark.parametrize("remainders", [True, False])
@pytest.mark.parametrize("weights_first", [True, False])
def test_fused_adam_loads_transformer_engine_state_dicts(remainders, weights_first):
    """Transformer Engine's FusedAdam keeps the step count in the group and, with
    store_param_remainders, a bfloat16 parameter's master as the int16 low 16 bits: loaded,
    training continues bit for bit as from the float32 state (the masters rebuilt exactly),
    whether the model's weights are loaded before or after the optimizer."""
    torch.manual_seed(0)
    # Masters whose bfloat16 rounding goes both ways and crosses signs, as the split defines it.
    masters = [torch.randn(33) * 3, torch.randn(4, 5) * 1e-3]
    params = [torch.nn.Parameter(_te_split(m)[0].clone()) for m in masters]
    source = _adam_run(params, 3, seed=1)
    for p, m in zip(params, masters):  # (rounded as Transformer Engine rounds them)
        with torch.no_grad():
            p.copy_(_te_split(source.state[p]["master_param"])[0])
    te_dict = _te_state_dict(source, params, remainders)
    expected = [p.detach().clone() for p in params]
    reference = FusedAdam([torch.nn.Parameter(e.clone()) for e in expected], lr=1e-2,
                          master_weights=True)
    reference.load_state_dict(source.state_dict())
    ref_params = [p for g in reference.param_groups for p in g["params"]]

    loaded = [torch.nn.Parameter(torch.zeros_like(e)) for e in expected]
    target = FusedAdam(loaded, lr=1e-2, master_weights=True, store_param_remainders=True)
    if weights_first:
        with torch.no_grad():
            for p, e in zip(loaded, expected):
                p.copy_(e)
    target.load_state_dict(te_dict)
    if not weights_first:
        with torch.no_grad():
            for p, e in zip(loaded, expected):
                p.copy_(e)
    assert "step" not in target.param_groups[0]
    _adam_run(loaded, 2, seed=2, optimizer=target)
    _adam_run(ref_params, 2, seed=2, optimizer=reference)
    for p, q in zip(loaded, ref_params):
        assert torch.equal(p, q)
        assert torch.equal(target.state[p]["master_param"], reference.state[q]["master_param"])
        assert float(target.state[p]["step"]) == 5.0


def test_fused_adam_refuses_transformer_engine_states_it_cannot_continue():
    param = torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))
    source = _adam_run([param], 1, seed=3)
    te_dict = _te_state_dict(source, [param], remainders=True)
    before = {k: v.clone() for k, v in source.state[param].items()}
    no_step = {"state": te_dict["state"],
               "param_groups": [{k: v for k, v in te_dict["param_groups"][0].items()
                                 if k != "step"}]}
    with pytest.raises(ValueError, match="the state of parameter 0 has moments but no step "
                                         "count"):
        source.load_state_dict(no_step)
    float_param = torch.nn.Parameter(torch.zeros(4))
    other = FusedAdam([float_param], master_weights=True)
    with pytest.raises(ValueError, match=r"'master_param' of parameter 0 is int16 .* belongs to "
                                         r"a torch.float32 parameter of shape \(4,\)"):
        other.load_state_dict(te_dict)
    for name, value in before.items():  # (nothing loaded by the refused calls)
        assert torch.equal(source.state[param][name], value)
    assert other.state == {} or not other.state[float_param]


def test_named_parameters_are_taken_as_torch_optim_takes_them():
    model = torch.nn.Linear(4, 3)
    for make in (lambda ps: FusedAdam(ps, lr=0.1), lambda ps: FusedSGD(ps, lr=0.1)):
        optimizer = make(model.named_parameters())
        assert optimizer.param_groups[0]["param_names"] == ["weight", "bias"]
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()
    with pytest.raises(ValueError, match="parameters must be float32, bfloat16, float16"):
        FusedAdam([("w", torch.nn.Parameter(torch.zeros(2, dtype=torch.float64)))])


@needs_gloo
def test_fused_adam_rebuilds_transformer_engine_masters_of_dtensor_parameters(tmp_path):
    """FSDP2's sharded bfloat16 parameters (2 gloo ranks): the masters are rebuilt from each
    rank's shard (a DTensor's << returned its input: masters off by up to 2.1)."""
    for result in rank_results(worker, tmp_path, world=2, timeout_s=300):
        assert torch.equal(result["master"], result["expected_master"])
        assert torch.equal(result["param"], result["expected_param"])
        assert result["step"] == 4.0
