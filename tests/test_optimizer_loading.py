"""FusedAdam's and FusedSGD's load_state_dict against torch.optim's: the caller's
load_state_dict pre-hooks (torch's way to load a state saved over another parameter order) and
the group switches the steps do not have."""
from __future__ import annotations

import pytest
import torch

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
