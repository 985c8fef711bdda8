"""Training throughput and loss of a ~1B-parameter GPT in FP8 and in bf16.

Measures a GPT-style decoder (d_model 2048, 16 layers, 16 heads, sequence 2048, vocabulary
32000: about 0.94B parameters) trained for a few dozen AdamW steps on synthetic token sequences,
once per precision from the same initial weights and the same batches. Its blocks (pre-LayerNorm
causal self-attention, tanh-GELU MLP of 4 d_model, biases, no dropout) are, with ``--blocks
linear`` (the default), plain torch.nn.Linear layers, converted with transformer_fp8.convert_to_fp8
for the FP8 rows; with ``--blocks te``, transformer_fp8.TransformerLayer in the FP8 rows (the
weights copied from the torch model's), and one more row runs those TransformerLayer blocks
outside fp8_autocast. The "bf16" row is always the torch model (torch's LayerNorm, SDPA and
GELU). The embeddings, the final norm and the LM head are torch bf16 modules in every row.
FP8 rows run under fp8_autocast with DelayedScaling, Float8CurrentScaling or Float8BlockScaling.
``--graphed`` (CUDA only) adds, after the eager rows, each row again with the forward and the
backward of every block captured in CUDA graphs (torch.cuda.make_graphed_callables for bf16,
transformer_fp8.make_graphed_callables with the row's recipe for FP8; the embeddings, head,
loss and optimizer eager; no fp8_autocast around the model: each FP8 block's graphs hold their
own); a capture that fails gives an n/a row and its reason (Float8BlockScaling's always: that
function graphs DelayedScaling and Float8CurrentScaling only). Parameters and
activations are bf16, the loss is computed in fp32. Reported: time per step (synchronised wall
clock, median over the steps after the warm-up ones), tokens/s, model TFLOP/s (6 N + 12 layers
seq d_model FLOPs per token, N = parameters of the Linear layers), speedup over the bf16 row
run the same way (eager or graphed), the mean loss of the last steps and its change from step
1; the plot shows the loss curves. The loss columns are not a convergence check: from this
initialisation a few dozen steps stay near the uniform predictor's ln V (10.37 at V = 32000;
the loss starts above it, the logits' variance shrinking first), far from the data's floor of
~1.4 nats, so they show that no precision diverges or turns NaN, not that FP8 trains as well as
bf16 (that takes hundreds of steps).

    python benchmarks/bench_gpt.py [--smoke] [--out DIR] [--steps 30] [--batch 4]
        [--blocks linear|te] [--graphed]
"""
from __future__ import annotations

import copy
import gc
import math
import os
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import transformer_fp8 as tf8  # noqa: E402
# (re-exported: gpt_loss_curves and the tests take the model from here)
from gpt_models import (GPT, SMOKE_CONFIG, Block, GPTConfig, graph_blocks,  # noqa: E402,F401
                        initial_model, te_model)

NAME = "bench_gpt"
TITLE, WHAT = common.doc_summary(__doc__)

COLUMNS = [
    ["precision", "precision", "{}"],
    ["blocks", "blocks", "{}"],
    ["config", "model", "{}"],
    ["time_ms", "step (ms)", "{:.1f}"],
    ["tokens_per_s", "tokens/s", "{:,.0f}"],
    ["tflops", "model TFLOP/s", "{:.1f}"],
    ["speedup", "speedup vs bf16 (run the same way)", "{:.2f}x"],
    ["final_loss", "loss, last steps (not a convergence check)", "{:.3f}"],
    ["loss_change", "loss change from step 1", "{:+.3f}"],
]
TE_BF16 = "bf16, TransformerLayer outside fp8_autocast"
GRAPHED = ", graphed"  # suffix of the graphed rows' names


def synthetic_batches(cfg: GPTConfig, batch: int, count: int, device) -> list[torch.Tensor]:
    """Learnable token streams: each next token follows a fixed random permutation of the
    vocabulary 90% of the time and is uniform otherwise (the best achievable loss is ~1.4 nats
    at V=32000; the benchmark's few dozen steps come nowhere near it)."""
    gen = torch.Generator().manual_seed(0)
    successor = torch.randperm(cfg.vocab, generator=gen)
    tokens = torch.empty(count * batch, cfg.seq + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(cfg.vocab, (count * batch,), generator=gen)
    noise = torch.randint(cfg.vocab, tokens.shape, generator=gen)
    keep = torch.rand(tokens.shape, generator=gen) < 0.9
    for t in range(1, cfg.seq + 1):
        tokens[:, t] = torch.where(keep[:, t], successor[tokens[:, t - 1]], noise[:, t])
    return [chunk.to(device) for chunk in tokens.split(batch)]


def make_optimizer(params, lr: float = 3e-4) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)


def train_step(model: GPT, recipe, tokens: torch.Tensor, optimizer, clip: float | None = None,
               calibrating: bool = False):
    """One AdamW step on ``tokens`` [batch, seq + 1] (inputs, then the next tokens as targets):
    the forward under fp8_autocast(recipe) (recipe None: bf16; ``calibrating``: a
    high-precision calibrating step, see common.fp8_context), the loss in fp32, the backward
    outside it; the gradient norm clipped to ``clip`` if given. Returns the loss (a tensor)."""
    with common.fp8_context(recipe, calibrating):
        logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    if clip is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def train(model: GPT, recipe, batches, warmup: int, device) -> dict:
    """AdamW steps over ``batches``; per-step loss and synchronised wall time."""
    optimizer = make_optimizer(model.parameters())
    losses, times = [], []
    for tokens in batches:
        start = time.perf_counter()
        loss = train_step(model, recipe, tokens, optimizer)
        common.synchronize(device)
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    return {"losses": losses, "step_s": statistics.median(times[warmup:])}


def flops_per_token(model: GPT, cfg: GPTConfig) -> float:
    linear_params = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    return 6 * linear_params + 12 * cfg.layers * cfg.seq * cfg.d_model


def plot(ax, payload):
    styles = ["-", "--", ":", "-."]  # FP8 curves may lie on top of the bf16 one
    for i, (name, losses) in enumerate(payload["extra"]["losses"].items()):
        ax.plot(range(1, len(losses) + 1), losses, styles[i % len(styles)], label=name)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(f"GPT {payload['rows'][0]['config']}: loss per step\n(a few dozen steps: "
                 "not a convergence check)", fontsize=9)
    ax.legend(fontsize=7)


def add_arguments(parser):
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of the timing")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--blocks", choices=("linear", "te"), default="linear",
                        help="FP8 rows' blocks: nn.Linear converted with convert_to_fp8, or "
                             "TransformerLayer (adds a bf16 TransformerLayer row)")
    parser.add_argument("--graphed", action="store_true",
                        help="CUDA only: every row again with each block CUDA-graphed")


def _torch_copy(initial: GPT, cfg: GPTConfig) -> GPT:
    return copy.deepcopy(initial)


def _converted(initial: GPT, cfg: GPTConfig) -> GPT:
    model = copy.deepcopy(initial)
    tf8.convert_to_fp8(model.blocks)  # the LM head stays in bf16
    return model


def variants(blocks: str) -> list[tuple]:
    """(row name, blocks column, recipe or None, build(initial, cfg) -> model), in row order."""
    rows = [("bf16", "nn.Linear", None, _torch_copy)]
    if blocks == "te":
        rows.append((TE_BF16, "TransformerLayer", None, te_model))
        fp8_blocks, build = "TransformerLayer", te_model
    else:
        fp8_blocks, build = "convert_to_fp8(nn.Linear)", _converted
    rows += [(name, fp8_blocks, recipe, build)
             for name, recipe in common.precision_variants().items() if recipe is not None]
    return rows


def run_variant(variant, initial: GPT, cfg: GPTConfig, args, batches, graphed: bool) -> dict:
    """Builds the row's model from ``initial``, graphs its blocks if ``graphed``, trains it.
    Raises if the model's parameter count is not the torch model's."""
    name, _, recipe, build = variant
    model = build(initial, cfg)
    params = sum(p.numel() for p in model.parameters())
    expected = sum(p.numel() for p in initial.parameters())
    if params != expected:
        raise RuntimeError(f"{name}: {params:,} parameters, the torch GPT has {expected:,}")
    if graphed:
        graph_blocks(model, recipe, args.batch, cfg)
        recipe = None  # each block's graphs hold its fp8_autocast; the rest is bf16 torch
    return {**train(model, recipe, batches, args.warmup, args.device), "params": params}


def graphs_available(device: torch.device) -> bool:
    return device.type == "cuda"


def _free(device) -> None:
    gc.collect()  # (a graphed module's forward refers back to it: a reference cycle)
    if device.type == "cuda":
        try:
            torch.cuda.empty_cache()
        except RuntimeError as exc:  # (after a failed capture: the next rows say n/a)
            print(f"torch.cuda.empty_cache failed: {common.exception_chain(exc)}", flush=True)


def main(argv=None) -> dict:
    args = common.parse_args(TITLE, argv, add_arguments)
    cfg = SMOKE_CONFIG if args.smoke else GPTConfig()
    if args.smoke:
        args.steps, args.warmup, args.batch = min(args.steps, 4), 1, 2
    initial = initial_model(cfg, args.device)
    n_params = sum(p.numel() for p in initial.parameters())
    batches = synthetic_batches(cfg, args.batch, args.steps, args.device)
    tokens_per_step = args.batch * cfg.seq
    flops = flops_per_token(initial, cfg) * tokens_per_step
    rows_to_run = [(v, False) for v in variants(args.blocks)]
    notes = []
    if args.graphed and not graphs_available(args.device):
        print(f"--graphed: skipped, CUDA graphs need a CUDA device (running on {args.device})")
        notes.append(f"--graphed skipped: no CUDA device ({args.device})")
    elif args.graphed:  # last: a failed capture may leave the device in a bad state
        rows_to_run += [(v, True) for v in variants(args.blocks)]

    results, blocks_of = {}, {}
    for variant, graphed in rows_to_run:
        name = variant[0] + (GRAPHED if graphed else "")
        blocks_of[name] = variant[1]
        try:
            results[name] = run_variant(variant, initial, cfg, args, batches, graphed)
        except Exception as exc:  # a graph that fails to capture or replay: an n/a row
            if not graphed:
                raise
            reason = common.exception_chain(exc)
            print(f"{name}: n/a, {reason}", flush=True)
            notes.append(f"{name}: n/a, {reason}")
            results[name] = None
        _free(args.device)
    te_params = [r["params"] for n, r in results.items()
                 if r and blocks_of[n] == "TransformerLayer"]
    print(f"parameters: torch GPT {n_params:,}"
          + (f", TransformerLayer GPT {te_params[0]:,}" if te_params else ""))

    tail = max(1, min(5, args.steps // 4))
    config = f"{cfg.describe()}, {n_params / 1e9:.2f}B params, batch {args.batch}"
    rows = []
    for name, r in results.items():
        row = {"precision": name, "blocks": blocks_of[name], "config": config,
               **{column[0]: None for column in COLUMNS[3:]}}  # (n/a where it failed)
        base = results.get("bf16" + (GRAPHED if name.endswith(GRAPHED) else ""))
        if r is not None:
            final = statistics.fmean(r["losses"][-tail:])
            row.update(time_ms=r["step_s"] * 1e3, tokens_per_s=tokens_per_step / r["step_s"],
                       tflops=flops / r["step_s"] / 1e12, final_loss=final,
                       loss_change=final - r["losses"][0],
                       speedup=common.ratio(base and base["step_s"], r["step_s"]))
        rows.append(row)
    fp8_gemms = ("TransformerLayer blocks: LayerNormLinear (norm + QKV), Linear (proj), "
                 "LayerNormMLP (norm + fc1 + GELU + fc2), fused QKV weight "
                 "(fuse_qkv_params, not interleaved), weights copied from the torch GPT"
                 if args.blocks == "te" else "convert_to_fp8 of the blocks' nn.Linear layers")
    notes = [f"{args.steps} steps per row, the first {args.warmup} left out of the timing; "
             f"loss = mean of the last {tail} steps, change = that minus step 1's loss "
             f"(ln V = {math.log(cfg.vocab):.2f} for a uniform prediction)",
             f"not a convergence check: {args.steps} steps stay near ln V (the data's floor is "
             "~1.4 nats at V = 32000), so the loss shows only that no precision diverged or "
             "turned NaN", f"{n_params:,} parameters in every row, {tokens_per_step} tokens "
             f"per step; FP8 rows: the {4 * cfg.layers} GEMMs of the blocks in FP8, the LM head "
             f"in bf16 ({fp8_gemms})",
             "speedup: over the eager bf16 row for eager rows, over the graphed bf16 row for "
             "graphed rows (blocks graphed, embeddings, head, loss and optimizer eager; FP8 "
             "blocks graphed with the row's recipe, no fp8_autocast around the model)"] + notes
    return common.report(args, NAME, TITLE, WHAT, COLUMNS, rows, plot=plot, notes=notes,
                         extra={"losses": {n: r["losses"] if r else [] for n, r in results.items()},
                                "params": n_params, "params_te": te_params[0] if te_params
                                else None, "tokens_per_step": tokens_per_step})


if __name__ == "__main__":
    main()
