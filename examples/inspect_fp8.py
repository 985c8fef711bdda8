"""Finding the layer that makes an FP8 run drift, with transformer_fp8.debug.

A small residual MLP (4 blocks of Linear-GELU-Linear, bfloat16) learns a fixed random teacher.
Block 2 carries an outlier channel, as large models' activations have: channel 7 of its fc1
input is 1e5 times larger on one token in 16 (a "massive activation" on BOS-like tokens), and
fc1's weight column 7 is zero and frozen, so the exact output ignores the channel. Under
per-tensor FP8 scaling the outlier sets the scale of the whole tensor and the ordinary values
flush to zero, so the FP8 loss stays above bf16's; 1x128 tiles confine it to its tokens' rows.

The script trains it four ways from the same initial weights and batches: bf16; FP8 (HYBRID
delayed scaling) with statistics every 10 steps, printing the worst operands (the report names
blocks.2.fc1 and its input: about half of its non-zero values flush to zero); FP8 with that
layer overridden to high precision; FP8 with that layer overridden to 1x128 block scaling. It
prints the final losses (150 steps on the CPU, as bf16 = 1.000, commit ef35e82: FP8 1.306, high
precision there 1.052, 1x128 blocks there 1.072) and, with --out, writes the statistics (JSON lines)
and a heat
map of the fraction flushed to zero.

    python examples/inspect_fp8.py [--steps 150] [--out DIR]
"""
from __future__ import annotations

import argparse
import copy
import os

import torch

import transformer_fp8 as tfp8
from transformer_fp8 import debug

HIDDEN, ROWS, OUTLIER_CHANNEL, OUTLIER_FACTOR, OUTLIER_EVERY = 128, 64, 7, 1e5, 16
RECIPE = tfp8.DelayedScaling(fp8_format=tfp8.Format.HYBRID, amax_history_len=16)


class OutlierChannel(torch.nn.Module):
    """Multiplies one channel of one token (row) in OUTLIER_EVERY by a large factor."""

    def forward(self, x):
        scale = torch.ones(x.shape, dtype=x.dtype, device=x.device)
        scale[::OUTLIER_EVERY, OUTLIER_CHANNEL] = OUTLIER_FACTOR
        return x * scale


def _zero_outlier_column(grad):
    grad = grad.clone()
    grad[:, OUTLIER_CHANNEL] = 0
    return grad


class Block(torch.nn.Module):
    def __init__(self, outlier: bool):
        super().__init__()
        self.inject = OutlierChannel() if outlier else torch.nn.Identity()
        self.fc1 = tfp8.Linear(HIDDEN, 2 * HIDDEN)
        self.fc2 = tfp8.Linear(2 * HIDDEN, HIDDEN)
        if outlier:  # the outlier channel's weights: zero, and frozen by train()
            with torch.no_grad():
                self.fc1.weight[:, OUTLIER_CHANNEL] = 0

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.inject(x))))


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(outlier=(i == 2)) for i in range(4))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def train(model, batches, fp8: bool, stats=None) -> list:
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for block in model.blocks:  # (a tensor hook would not survive copy.deepcopy)
        if isinstance(block.inject, OutlierChannel):
            block.fc1.weight.register_hook(_zero_outlier_column)
    losses = []
    for x, y in batches:
        with tfp8.fp8_autocast(enabled=fp8, fp8_recipe=RECIPE):
            out = model(x)
        loss = torch.nn.functional.mse_loss(out.float(), y.float())
        loss.backward()
        opt.step()
        opt.zero_grad()
        if stats is not None:
            stats.step()
        losses.append(loss.item())
    return losses


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--out", default=None, help="folder for fp8_stats.jsonl and the heat map")
    args = parser.parse_args(argv)
    if args.steps < 11:  # statistics every 10 steps, step 0's left out: the first is step 10
        parser.error(f"--steps must be at least 11 (statistics are taken every 10 steps), "
                     f"got {args.steps}")
    torch.manual_seed(0)
    base = Model().to(torch.bfloat16)
    teacher = torch.nn.Linear(HIDDEN, HIDDEN).to(torch.bfloat16)
    batches = []
    for _ in range(args.steps):
        x = torch.randn(ROWS, HIDDEN, dtype=torch.bfloat16)
        with torch.no_grad():
            batches.append((x, teacher(x)))

    def final(losses):
        tail = losses[-max(1, len(losses) // 10):]
        return sum(tail) / len(tail)

    results = {"bf16": final(train(copy.deepcopy(base), batches, fp8=False))}
    model = copy.deepcopy(base)
    path = os.path.join(args.out, "fp8_stats.jsonl") if args.out else None
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        if os.path.exists(path):
            os.remove(path)
    with debug.collect_stats(model, frequency=10, path=path) as stats:
        results["fp8"] = final(train(model, batches, fp8=True, stats=stats))
    # Step 0 runs with a fresh layer's unit scales: judge the steps after it.
    steady = [r for r in stats.records if r["step"] > 0]
    print("FP8 operands with the most values flushed to zero (at their worst logged step):")
    print(debug.worst_report(steady, "underflow_frac", top=4))
    print("\nFP8 operands with the lowest SQNR of the quantised tensor:")
    print(debug.worst_report(steady, "sqnr_db", top=4))
    worst = max(steady, key=lambda r: r["underflow_frac"])
    layer = worst["layer"]
    print(f"\n-> {layer}, tensor {worst['tensor']}: {worst['underflow_frac']:.1%} of its "
          f"non-zero values flush to zero, SQNR {worst['sqnr_db']:.1f} dB\n")
    for label, kwargs in (("fp8, " + layer + " in high precision", {"fp8": False}),
                          ("fp8, " + layer + " with 1x128 blocks",
                           {"recipe": tfp8.Float8BlockScaling()})):
        model = copy.deepcopy(base)
        debug.override(model, layer, **kwargs)
        results[label] = final(train(model, batches, fp8=True))
    width = max(len(k) for k in results)
    print(f"{'run':<{width}}  final loss (mean of the last 10% of steps)")
    for name, loss in results.items():
        print(f"{name:<{width}}  {loss:.5f}  ({loss / results['bf16']:.3f}x bf16)")
    if args.out:
        try:
            debug.plot_heatmap(path, "underflow_frac", os.path.join(args.out, "underflow.png"))
            print(f"statistics in {path}, heat map in {args.out}/underflow.png")
        except ImportError:
            print(f"statistics in {path} (matplotlib is not installed: no heat map)")
    return {"worst": worst, "losses": results}


if __name__ == "__main__":
    main()
