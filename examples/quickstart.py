"""transformer_fp8 quickstart: the FP8 operators, then the same MLP trained in BF16 and in FP8.

    python examples/quickstart.py                 # GPU if there is one, else CPU (< 1 minute)
    python examples/quickstart.py --steps 100 --device cpu

Part 1 quantises a random tensor to FP8 (E4M3) with a scale computed from its amax and measures
the round-trip error; part 1b compares the round-trip SQNR of per-tensor, per-block (1x128,
128x128) and row-wise scaling on a tensor with outlier channels. Part 2 trains a small MLP twice
from the same initial weights on the same
synthetic regression data: once with BF16 autocast, once with its nn.Linear layers converted to
transformer_fp8.Linear and the forward pass under fp8_autocast (delayed scaling). The two final
losses should agree to within a few percent.
"""
from __future__ import annotations

import argparse
import copy
import time
from contextlib import nullcontext

import torch
import torch.nn as nn

import transformer_fp8 as tf8
from transformer_fp8 import blockwise_ops, ops
from transformer_fp8.reference import dequantize_blockwise_reference

IN, HIDDEN, OUT = 64, 256, 16  # multiples of 16, as FP8 GEMMs need


def show_operators(device: torch.device) -> None:
    print("== 1. FP8 operators " + "=" * 52)
    g = torch.Generator(device="cpu").manual_seed(0)
    x = (torch.randn(1024, 1024, generator=g) * 3.0).to(device)
    fp8_max = 448.0  # torch.finfo(torch.float8_e4m3fn).max

    amax = ops.amax(x)                                   # max |x|, on the device
    scale = ops.compute_scale_from_amax(amax, fp8_max)   # fp8_max / amax
    x_fp8 = ops.cast_to_fp8(x, scale, torch.float8_e4m3fn)
    x_back = ops.cast_from_fp8(x_fp8, scale.reciprocal(), torch.float32)

    rel_err = ((x_back - x).norm() / x.norm()).item()
    print(f"x: {tuple(x.shape)} float32 on {device}, amax = {amax.item():.4f}")
    print(f"scale = 448 / amax = {scale.item():.4f}  ->  x * scale uses the whole E4M3 range")
    print(f"x_fp8: {x_fp8.dtype}, {x_fp8.element_size()} byte/element "
          f"({x.element_size() // x_fp8.element_size()}x smaller than float32)")
    print(f"round trip cast_from_fp8(cast_to_fp8(x)): relative error {rel_err:.3%} "
          f"(3 mantissa bits: each normal value within 2**-4 = 6.25%)")

    # The same tensor without a scale: small values fall into E4M3's subnormals or flush to 0.
    tiny = x * 1e-4
    one = torch.ones((), device=device)
    tiny_back = ops.cast_from_fp8(ops.cast_to_fp8(tiny, one, torch.float8_e4m3fn), one,
                                  torch.float32)
    tiny_scale = ops.compute_scale_from_amax(ops.amax(tiny), fp8_max)
    tiny_back_scaled = ops.cast_from_fp8(ops.cast_to_fp8(tiny, tiny_scale, torch.float8_e4m3fn),
                                         tiny_scale.reciprocal(), torch.float32)
    err = lambda y: ((y - tiny).norm() / tiny.norm()).item()  # noqa: E731
    print(f"x * 1e-4 cast with scale 1: relative error {err(tiny_back):.1%}; "
          f"with its amax scale: {err(tiny_back_scaled):.3%}")
    print()


def show_block_scaling(device: torch.device) -> dict:
    """SQNR of an E4M3 round trip per scaling recipe on activations with outlier channels."""
    print("== 1b. Per-tensor vs per-block scaling on outliers " + "=" * 21)
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(512, 1024, generator=g)
    x[:, 5:9] *= 1e5  # four outlier channels, as large-model activations have
    x = x.to(device)
    ordinary = torch.ones_like(x, dtype=torch.bool)
    ordinary[:, 5:9] = False

    def sqnr_db(back: torch.Tensor) -> float:
        ref, out = x[ordinary].double(), back[ordinary].double()
        return (20 * torch.log10(ref.norm() / (out - ref).norm())).item()

    scale = ops.compute_scale_from_amax(ops.amax(x).reshape(1), 448.0)
    results = {"per-tensor": sqnr_db(ops.cast_from_fp8(ops.cast_to_fp8(x, scale,
                                                                       torch.float8_e4m3fn),
                                                       scale.reciprocal(), torch.float32))}
    for name, blocks in {"1x128 (Float8BlockScaling inputs)": (1, 128),
                         "128x128 (Float8BlockScaling weights)": (128, 128),
                         "row-wise (Float8RowwiseScaling)": (1, x.shape[1])}.items():
        q, s, _, _ = blockwise_ops.quantize_blockwise(x, *blocks, torch.float8_e4m3fn)
        results[name] = sqnr_db(dequantize_blockwise_reference(q, s).to(device))
    print("x: [512, 1024] ~ N(0, 1), 4 channels 1e5 larger; SQNR of the other values after an "
          "E4M3 round trip:")
    for name, db in results.items():
        print(f"  {name:38s} {db:6.1f} dB")
    print("per-tensor scaling spends the E4M3 range on the outliers and flushes most other values "
          "to zero; blocks without an outlier keep their own scale")
    print()
    return results


def make_data(n: int, device: torch.device, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs x ~ N(0, 1); targets from a fixed random 'teacher' network plus a little noise."""
    teacher = torch.Generator(device="cpu").manual_seed(1234)
    w1 = torch.randn(IN, 96, generator=teacher) / IN ** 0.5
    w2 = torch.randn(96, OUT, generator=teacher) / 96 ** 0.5
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(n, IN, generator=g)
    y = torch.tanh(x @ w1) @ w2 + 0.01 * torch.randn(n, OUT, generator=g)
    return x.to(device), y.to(device)


def make_mlp() -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(IN, HIDDEN), nn.GELU(),
        nn.Linear(HIDDEN, HIDDEN), nn.GELU(),
        nn.Linear(HIDDEN, OUT),
    )


def train(model: nn.Module, precision: str, data, args, device: torch.device) -> dict:
    """Adam on MSE; the forward pass under BF16 autocast, and also under fp8_autocast for FP8."""
    x_train, y_train, x_val, y_val = data
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.steps, eta_min=args.lr / 10)
    recipe = tf8.DelayedScaling(amax_history_len=16)

    def forward(xb):
        # BF16 autocast for what is not an FP8 Linear (here, the GELUs). fp8_autocast wraps the
        # forward pass only: backward runs outside it, as with Transformer Engine.
        fp8 = tf8.fp8_autocast(enabled=True, fp8_recipe=recipe) if precision == "fp8" \
            else nullcontext()
        with torch.autocast(device.type, dtype=torch.bfloat16), fp8:
            return model(xb)

    g = torch.Generator(device="cpu").manual_seed(2)  # same batches for both runs
    losses = []
    t0 = time.perf_counter()
    for step in range(args.steps):
        idx = torch.randint(0, x_train.shape[0], (args.batch_size,), generator=g).to(device)
        out = forward(x_train[idx])
        loss = nn.functional.mse_loss(out.float(), y_train[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
        if (step + 1) % max(1, args.steps // 5) == 0 or step == 0:
            print(f"  [{precision}] step {step + 1:4d}/{args.steps}  loss {losses[-1]:.5f}")
    seconds = time.perf_counter() - t0
    with torch.no_grad():
        val_loss = nn.functional.mse_loss(forward(x_val).float(), y_val).item()
    tail = losses[-max(1, args.steps // 10):]
    return {"losses": losses, "final_train_loss": sum(tail) / len(tail), "val_loss": val_loss,
            "initial_loss": losses[0], "seconds": seconds}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300, help="training steps per run (300)")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.steps < 1 or args.batch_size < 1:
        p.error(f"--steps must be >= 1 and --batch-size >= 1, got {args.steps} and "
                f"{args.batch_size}")
    return args


def default_device() -> str:
    """cuda where this build runs FP8 on the current GPU, else cpu (saying why: a build made
    without the CUDA toolkit has CPU kernels only; a GPU older than compute capability 8.9 has
    no FP8 tensor cores)."""
    if not torch.cuda.is_available():
        return "cpu"
    available, reason = tf8.is_fp8_available(return_reason=True)
    if available:
        return "cuda"
    print(f"(a GPU is present, but FP8 on it is not available: {reason}; running on the CPU)")
    return "cpu"


def main(argv=None) -> dict:
    args = parse_args(argv)
    device = torch.device(args.device or default_device())
    torch.manual_seed(args.seed)
    print(f"transformer_fp8 {tf8.__version__}, torch {torch.__version__}, device {device}"
          + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else
             " (CPU kernels: the same FP8 casts bit for bit, GEMMs dequantise to float32)"))
    print()
    show_operators(device)
    block_sqnr = show_block_scaling(device)

    print("== 2. Train an MLP in BF16 and in FP8 from the same init " + "=" * 15)
    x_train, y_train = make_data(8192, device, seed=1)
    x_val, y_val = make_data(2048, device, seed=3)
    data = (x_train, y_train, x_val, y_val)

    torch.manual_seed(args.seed)
    base = make_mlp().to(device)
    print(f"model: {IN} -> {HIDDEN} -> {HIDDEN} -> {OUT} MLP, "
          f"{sum(p.numel() for p in base.parameters()):,} parameters (float32 master weights), "
          f"{args.steps} steps of batch {args.batch_size}")

    results = {}
    bf16_model = copy.deepcopy(base)
    results["bf16"] = train(bf16_model, "bf16", data, args, device)

    fp8_model = tf8.convert_to_fp8(copy.deepcopy(base))  # nn.Linear -> transformer_fp8.Linear
    n_fp8 = sum(isinstance(m, tf8.Linear) for m in fp8_model.modules())
    print(f"  convert_to_fp8: {n_fp8} nn.Linear layers replaced by transformer_fp8.Linear")
    results["fp8"] = train(fp8_model, "fp8", data, args, device)

    bf16, fp8 = results["bf16"], results["fp8"]
    rel_train = abs(fp8["final_train_loss"] - bf16["final_train_loss"]) / bf16["final_train_loss"]
    rel_val = abs(fp8["val_loss"] - bf16["val_loss"]) / bf16["val_loss"]
    print()
    print("== Result " + "=" * 62)
    print(f"{'':>6} {'initial loss':>13} {'final train loss':>17} {'val loss':>10} {'time':>8}")
    for name in ("bf16", "fp8"):
        r = results[name]
        print(f"{name:>6} {r['initial_loss']:13.5f} {r['final_train_loss']:17.5f} "
              f"{r['val_loss']:10.5f} {r['seconds']:7.1f}s")
    print(f"relative difference FP8 vs BF16: final train loss {rel_train:.2%}, "
          f"val loss {rel_val:.2%}")
    if device.type == "cpu":
        print("(on CPU the FP8 GEMMs run reference kernels: timings say nothing about GPU speed)")
    results["rel_diff_train"] = rel_train
    results["rel_diff_val"] = rel_val
    results["block_scaling_sqnr_db"] = block_sqnr
    return results


if __name__ == "__main__":
    main()
