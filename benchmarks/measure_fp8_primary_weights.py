"""FP8 primary weights (quantized_model_init) in training, on the CPU: a 64-128-32 MLP of
transformer_fp8.Linear learns tanh(x @ W) for 30 steps under fp8_autocast(DelayedScaling), with
(1) AdamW on fp32 master weights written back with param.copy_(master), against the same model
with high-precision weights (same initial values, same FP8 GEMMs), and (2) plain SGD on the FP8
weights against SGD on high-precision weights. Prints one row per seed (README: FP8 primary
weights). Usage: python benchmarks/measure_fp8_primary_weights.py [--seeds N]
"""
from __future__ import annotations

import argparse

import torch

import transformer_fp8 as tfp8
from transformer_fp8.quantization.fp8_weight import Fp8Weight
from transformer_fp8.testing import sqnr

RECIPE = tfp8.DelayedScaling(amax_history_len=8)
STEPS = 30


def mlp():
    return torch.nn.Sequential(tfp8.Linear(64, 128), torch.nn.GELU(), tfp8.Linear(128, 32))


def pair(seed):
    torch.manual_seed(seed)
    with tfp8.quantized_model_init(recipe=RECIPE, preserve_high_precision_init_val=True):
        fp8_model = mlp()
    torch.manual_seed(seed)
    return fp8_model, mlp()


def train(model, step_fn, seed, watch=None):
    g = torch.Generator().manual_seed(seed + 1)
    target_w = torch.randn(64, 32, generator=g) / 8
    losses, kept = [], []
    for _ in range(STEPS):
        x = torch.randn(256, 64, generator=g)
        with tfp8.fp8_autocast(fp8_recipe=RECIPE):
            loss = torch.nn.functional.mse_loss(model(x), torch.tanh(x @ target_w))
        loss.backward()
        codes = watch.fp8_data.view(torch.uint8).clone() if watch is not None else None
        step_fn()
        if watch is not None:
            kept.append((watch.fp8_data.view(torch.uint8) == codes).float().mean().item())
        losses.append(loss.item())
    return losses, kept


def optimizer_step(opt):
    def step():
        opt.step()
        opt.zero_grad()
    return step


def master_copy(seed):
    fp8_model, hp_model = pair(seed)
    masters = [torch.nn.Parameter((p.get_high_precision_init_val() if isinstance(p, Fp8Weight)
                                   else p.detach()).float().clone())
               for p in fp8_model.parameters()]
    opt = torch.optim.AdamW(masters, lr=1e-3)

    def step():
        for master, p in zip(masters, fp8_model.parameters()):
            master.grad, p.grad = p.grad.float(), None
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for master, p in zip(masters, fp8_model.parameters()):
                p.copy_(master)

    losses, _ = train(fp8_model, step, seed)
    hp_losses, _ = train(hp_model, optimizer_step(torch.optim.AdamW(hp_model.parameters(),
                                                                    lr=1e-3)), seed)
    worst = max(abs(a - b) / b for a, b in zip(losses, hp_losses))
    weights_db = min(sqnr(m.detach(), p.detach())
                     for m, p in zip(masters, hp_model.parameters()))
    return losses[0], losses[-1], hp_losses[-1], worst, weights_db


def plain_sgd(seed, lr=0.3):
    fp8_model, hp_model = pair(seed)
    losses, kept = train(fp8_model, optimizer_step(torch.optim.SGD(fp8_model.parameters(), lr)),
                         seed, watch=fp8_model[0].weight)
    hp_losses, _ = train(hp_model, optimizer_step(torch.optim.SGD(hp_model.parameters(), lr)),
                         seed)
    return losses[0], losses[-1], hp_losses[-1], sum(kept) / len(kept)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args(argv)
    print(f"AdamW lr 1e-3 on fp32 masters vs high-precision weights, {STEPS} steps")
    print("seed | loss first | FP8 weights last | hp weights last | worst rel diff | "
          "masters vs hp weights SQNR dB")
    for seed in range(args.seeds):
        first, last, hp_last, worst, db = master_copy(seed)
        print(f"{seed} | {first:.4f} | {last:.4f} | {hp_last:.4f} | {worst:.4%} | {db:.1f}")
    print(f"\nplain SGD lr 0.3 on the FP8 weights vs on high-precision weights, {STEPS} steps")
    print("seed | loss first | FP8 weights last | hp weights last | "
          "first layer's FP8 codes unchanged per step (mean)")
    for seed in range(args.seeds):
        first, last, hp_last, kept = plain_sgd(seed)
        print(f"{seed} | {first:.4f} | {last:.4f} | {hp_last:.4f} | {kept:.1%}")


if __name__ == "__main__":
    main()
