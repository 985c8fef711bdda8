"""The model, data and training steps shared by the tensor-parallel tests
(test_tensor_parallel*.py): a two-layer MLP of transformer_fp8.Linear (fc1 colwise, fc2 rowwise
under tensor parallelism), run over steps whose input magnitude changes (so do the scales),
one record per step of what a step produced."""
from __future__ import annotations

import torch
from integration_compare import STEP_SCALES

import transformer_fp8 as tfp8

IN, HIDDEN, OUT = 48, 192, 80  # HIDDEN / ranks and the others: multiples of 16 on 2 and 4 ranks
LEAD = (2, 12)                 # 24 rows: not a multiple of 16 (padded in the GEMMs)
LR = 0.1


class Mlp(torch.nn.Module):
    def __init__(self, recipe, bias: bool = True):
        super().__init__()
        self.fc1 = tfp8.Linear(IN, HIDDEN, bias=bias, recipe=recipe)
        self.act = torch.nn.GELU()
        self.fc2 = tfp8.Linear(HIDDEN, OUT, bias=bias, recipe=recipe)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


def build(recipe, seed: int = 0, bias: bool = True) -> Mlp:
    torch.manual_seed(seed)  # the same weights in every process
    model = Mlp(recipe, bias)
    with torch.no_grad():  # biases large enough that a bias added twice (or never) shows
        for layer in (model.fc1, model.fc2):
            if layer.bias is not None:
                layer.bias.uniform_(-0.5, 0.5)
    return model


def parallelize(model: Mlp, mesh) -> Mlp:
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )
    return parallelize_module(model, mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})


def batch(step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(*LEAD, IN, generator=gen) * STEP_SCALES[step % len(STEP_SCALES)]


def _full(t):
    if t is None:
        return None
    t = t.full_tensor() if hasattr(t, "full_tensor") else t
    return t.detach().clone()


def train(model: Mlp, recipe, steps: int, group=None, run=None, first: int = 0) -> list:
    """SGD steps ``first``.. of ``run`` (default: the model), the forward inside
    fp8_autocast(fp8_group=group); per step a dict: loss, output, input gradient, every
    parameter's full gradient, the FP8 state (state_dict), and the full weights' amaxes before
    the step."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    run = model if run is None else run
    records = []
    for step in range(first, first + steps):
        x = batch(step).requires_grad_(True)
        weight_amax = {name: _full(layer.weight).abs().max()
                       for name, layer in (("fc1", model.fc1), ("fc2", model.fc2))}
        with tfp8.fp8_autocast(fp8_recipe=recipe, fp8_group=group):
            out = run(x)
        out = _full(out) if hasattr(out, "full_tensor") else out
        loss = out.float().square().mean()
        loss.backward()
        records.append({
            "loss": loss.detach().clone(), "output": out.detach().clone(),
            "grads": {"input": x.grad.clone(),
                      **{name: _full(p.grad) for name, p in model.named_parameters()}},
            "fp8_state": {k: v.detach().clone() for k, v in model.state_dict().items()
                          if "fp8_" in k and v.is_floating_point()},
            "weight_amax": weight_amax})
        opt.step()
        opt.zero_grad(set_to_none=True)
    return records
