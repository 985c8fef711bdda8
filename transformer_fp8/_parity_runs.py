"""The runs behind transformer_fp8.testing's parity checks: the inputs each run gets, the same
randomness for every run, one forward + backward, and which small gradients are zero in math.
"""
from __future__ import annotations

import copy
import warnings
from typing import Optional

import torch
from torch.utils import _pytree

from .quantization.autocast import fp8_autocast

# A gradient whose reference norm is under this fraction of the largest of its kind (input or
# parameter gradients) may be zero in math (a key bias before a softmax, a bias before a
# batch norm): both runs then hold rounding noise. A float64 run of the reference tells: where
# it gives the same gradient (within _SAME_GRADIENT, relative), the gradient is real (a
# LayerScale branch's, gamma 1e-6) and is measured against its own size; where not, it is
# rounding noise (gone in float64, or another noise where the model computes in float32
# whatever its parameters' dtype, an upcast softmax) and is measured against this floor.
GRAD_NOISE_FLOOR = 1e-5
_SAME_GRADIENT = 0.1
_PROBE_SEED = 0x5EED  # the random grad_output of the default loss
_RUN_SEED = 0x0F8     # both runs start from this RNG state (dropout draws the same masks)


def inputs_tuple(inputs) -> tuple:
    if isinstance(inputs, torch.Tensor):
        return (inputs,)
    if isinstance(inputs, (tuple, list)):
        return tuple(inputs)
    raise TypeError("inputs must be a tensor or a tuple/list of positional arguments, got "
                    f"{type(inputs).__name__}")


def float_dtype(module: torch.nn.Module) -> Optional[torch.dtype]:
    for p in module.parameters():
        if p.is_floating_point():
            return p.dtype
    return None


def _prepared(inputs: tuple, dtype: Optional[torch.dtype]) -> tuple:
    """Fresh leaves of the floating inputs (cast to dtype if given) that require grad."""
    out = []
    for x in inputs:
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            x = x.detach().to(dtype or x.dtype, copy=True).requires_grad_(True)
        out.append(x)
    return tuple(out)


def _float_outputs(output) -> list:
    leaves, _ = _pytree.tree_flatten(output)
    tensors = [t for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not tensors:
        raise ValueError("the model's output holds no floating-point tensor to compare")
    return tensors


def _probe_loss(outputs: list) -> torch.Tensor:
    """sum(out * probe) with a fixed standard-normal probe per output: backward sees a random
    grad_output (a loss like out.sum() would give a constant one, exact in FP8)."""
    gen = torch.Generator().manual_seed(_PROBE_SEED)
    total = 0
    for out in outputs:
        probe = torch.randn(out.shape, generator=gen, dtype=torch.float32).to(out.device)
        total = total + (out.float() * probe).sum()
    return total


def rng_trackers(*modules) -> list:
    """The RNG trackers the modules draw dropout from (Transformer Engine's
    get_rng_state_tracker), each once."""
    found = []
    for module in modules:
        for m in module.modules():
            getter = getattr(m, "get_rng_state_tracker", None)
            try:
                tracker = getter() if callable(getter) else None
            except Exception:  # noqa: BLE001 (an attribute of that name that is no getter)
                tracker = None
            if tracker is not None and hasattr(tracker, "get_states") \
                    and all(tracker is not t for t in found):
                found.append(tracker)
    return found


class SameRandomness:
    """Every run starts from the same random state: the default generators (seeded) and the
    modules' RNG trackers (their states at the start, set again before each run, and put back
    at the end), so that dropout draws the same masks in every run."""

    def __init__(self, trackers: list, seed_devices):
        self.trackers, self.seed_devices = trackers, seed_devices
        self.states = [t.get_states() for t in trackers]

    def run(self, fn):
        with torch.random.fork_rng(devices=self.seed_devices):
            torch.manual_seed(_RUN_SEED)
            for tracker, states in zip(self.trackers, self.states):
                tracker.set_states(states)
            return fn()

    def restore(self) -> None:
        for tracker, states in zip(self.trackers, self.states):
            tracker.set_states(states)


def one_run(module, inputs: tuple, loss_fn, dtype, randomness: SameRandomness):
    """(output tensors, loss or None, {name: gradient}) of one forward + backward."""
    def forward():
        args = _prepared(inputs, dtype)
        return args, module(*args)
    args, output = randomness.run(forward)
    outputs = _float_outputs(output)
    loss = loss_fn(output) if loss_fn is not None else None
    if loss is not None and (not isinstance(loss, torch.Tensor) or loss.numel() != 1):
        raise ValueError("loss_fn must return a one-element tensor, got "
                         f"{type(loss).__name__}{getattr(loss, 'shape', '')}")
    objective = loss if loss is not None else _probe_loss(outputs)
    named = {f"input_grad[{i}]": x for i, x in enumerate(args)
             if isinstance(x, torch.Tensor) and x.requires_grad}
    named.update({f"grad:{n}": p for n, p in module.named_parameters() if p.requires_grad})
    if not objective.requires_grad:  # the graph was cut at the output: no gradient at all
        return [o.detach() for o in outputs], loss, {}
    grads = torch.autograd.grad(objective, list(named.values()), allow_unused=True)
    grads = {n: g for n, g in zip(named, grads) if g is not None}
    return [o.detach() for o in outputs], loss, grads


def _norm(t) -> float:
    return torch.linalg.vector_norm(t.detach().double().cpu()).item()


def zero_in_math_floors(reference, inputs, loss_fn, ref_grads: dict, plain_grads: dict,
                        randomness) -> dict:
    """{gradient name: the noise floor it is measured against}: the reference gradients under
    GRAD_NOISE_FLOOR times the largest of their kind that are zero in math (see
    GRAD_NOISE_FLOOR), each against the larger of that floor and ten times the noise the FP8
    model shows there in its own dtype outside FP8 (a bfloat16 model's is larger)."""
    largest = {kind: max([_norm(g) for n, g in ref_grads.items()
                          if n.startswith("input_grad") == (kind == "input_grad")
                          and g.isfinite().all()], default=0.0)
               for kind in ("input_grad", "param_grad")}
    small = {}
    for name, g in ref_grads.items():
        floor = GRAD_NOISE_FLOOR * largest["input_grad" if name.startswith("input_grad")
                                           else "param_grad"]
        if _norm(g) < floor:
            small[name] = floor
    if not small:
        return {}
    zero = _zero_in_math(reference, inputs, loss_fn, ref_grads, small, randomness)
    return {name: max(floor, 10.0 * _norm(plain_grads[name]) if name in plain_grads else 0.0)
            for name, floor in small.items() if name in zero}


def _zero_in_math(reference, inputs, loss_fn, ref_grads: dict, small: dict,
                  randomness) -> set:
    """Which of the small reference gradients are zero in math, from a float64 run of the
    reference: where it reproduces the reference's largest gradients (within 1%), a small
    gradient it does not give again (within _SAME_GRADIENT) is rounding noise; where it does
    not (the model draws other random numbers in float64, or cannot run in it), a small
    gradient it makes a thousandth as large or less. Every small one across several
    processes (a rank-local float64 run of a model with collectives could deadlock)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized() \
            and torch.distributed.get_world_size() > 1:
        return set(small)
    try:
        ref64 = copy.deepcopy(reference).double()
        with warnings.catch_warnings(), fp8_autocast(enabled=False):
            warnings.simplefilter("ignore")  # (FP8 layers warn of float64 inputs)
            _, _, grads64 = one_run(ref64, inputs, loss_fn, torch.float64, randomness)
    except Exception:  # noqa: BLE001 (a model that cannot run in float64: all of them)
        return set(small)
    big = sorted(ref_grads, key=lambda n: _norm(ref_grads[n]))[-2:]
    faithful = all(n in grads64 and _norm(grads64[n].double().cpu()
                                          - ref_grads[n].double().cpu())
                   <= 1e-2 * _norm(ref_grads[n]) for n in big)
    zero = set()
    for name in small:
        g32 = ref_grads[name].detach().double().cpu()
        g64 = grads64.get(name)
        g64 = torch.zeros_like(g32) if g64 is None else g64.detach().double().cpu()
        if faithful:
            if not (_norm(g32) > 0.0 and _norm(g64 - g32) <= _SAME_GRADIENT * _norm(g32)):
                zero.add(name)  # (the two precisions disagree: noise)
        elif _norm(g64) <= 1e-3 * _norm(g32) or _norm(g32) == 0.0:
            zero.add(name)
    return zero
