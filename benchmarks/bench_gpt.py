"""Training throughput and loss of a ~1B-parameter GPT in FP8 and in bf16.

Measures a GPT-style decoder (d_model 2048, 16 layers, 16 heads, sequence 2048, vocabulary
32000: about 0.94B parameters) built from plain torch.nn.Linear, trained for a few dozen AdamW
steps on synthetic token sequences, once per precision from the same initial weights and the
same batches: bf16; transformer_fp8.convert_to_fp8 of the transformer blocks (the LM head stays
bf16) under fp8_autocast with DelayedScaling; the same with Float8CurrentScaling, and with Float8BlockScaling. Parameters
and activations are bf16, the loss is computed in fp32. Reported: time per step (synchronised
wall clock, median over the steps after the warm-up ones), tokens/s, model TFLOP/s (6 N + 12
layers seq d_model FLOPs per token, N = parameters of the Linear layers), speedup over bf16, the
mean loss of the last steps and its change from step 1; the plot shows the loss curves. The loss
columns are not a convergence check: from this initialisation a few dozen steps stay near the
uniform predictor's ln V (10.37 at V = 32000; the loss starts above it, the logits' variance
shrinking first), far from the data's floor of ~1.4 nats, so they show that no precision
diverges or turns NaN, not that FP8 trains as well as bf16 (that takes hundreds of steps).

    python benchmarks/bench_gpt.py [--smoke] [--out DIR] [--steps 30] [--batch 4]
"""
from __future__ import annotations

import copy
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import transformer_fp8 as tf8  # noqa: E402

NAME = "bench_gpt"
TITLE, WHAT = common.doc_summary(__doc__)

COLUMNS = [
    ["precision", "precision", "{}"],
    ["config", "model", "{}"],
    ["time_ms", "step (ms)", "{:.1f}"],
    ["tokens_per_s", "tokens/s", "{:,.0f}"],
    ["tflops", "model TFLOP/s", "{:.1f}"],
    ["speedup", "speedup vs bf16", "{:.2f}x"],
    ["final_loss", "loss, last steps (not a convergence check)", "{:.3f}"],
    ["loss_change", "loss change from step 1", "{:+.3f}"],
]


@dataclass(frozen=True)
class GPTConfig:
    d_model: int = 2048
    layers: int = 16
    heads: int = 16
    seq: int = 2048
    vocab: int = 32000

    def describe(self) -> str:
        return f"d{self.d_model} L{self.layers} H{self.heads} T{self.seq} V{self.vocab}"


SMOKE_CONFIG = GPTConfig(d_model=32, layers=2, heads=2, seq=16, vocab=128)


class Block(nn.Module):
    """Pre-LayerNorm attention + GELU MLP, every projection a plain nn.Linear."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        d = cfg.d_model
        self.heads = cfg.heads
        self.ln_attn, self.ln_mlp = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln_attn(x)).view(b, t, 3, self.heads, d // self.heads) \
            .permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln_mlp(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.tok_emb = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, tokens):
        x = self.tok_emb(tokens) + self.pos_emb(torch.arange(tokens.shape[1],
                                                             device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


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


def initial_model(cfg: GPTConfig, device, seed: int = 0) -> GPT:
    """The bf16 model every precision starts from: seeded, initialised on ``device`` (~1B
    parameters are slow to draw on a CPU)."""
    torch.manual_seed(seed)
    with torch.device(device):
        return GPT(cfg).to(torch.bfloat16)


def make_optimizer(params, lr: float = 3e-4) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)


def train_step(model: GPT, recipe, tokens: torch.Tensor, optimizer, clip: float | None = None):
    """One AdamW step on ``tokens`` [batch, seq + 1] (inputs, then the next tokens as targets):
    the forward under fp8_autocast(recipe) (recipe None: bf16), the loss in fp32, the backward
    outside it; the gradient norm clipped to ``clip`` if given. Returns the loss (a tensor)."""
    with common.fp8_context(recipe):
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

    results, fp8_layers = {}, 0
    for name, recipe in common.precision_variants().items():
        model = copy.deepcopy(initial)
        if recipe is not None:
            tf8.convert_to_fp8(model.blocks)  # the LM head stays in bf16
            fp8_layers = sum(isinstance(m, tf8.Linear) for m in model.modules())
        results[name] = train(model, recipe, batches, args.warmup, args.device)
        del model
        if args.device.type == "cuda":
            torch.cuda.empty_cache()

    tail = max(1, min(5, args.steps // 4))
    config = f"{cfg.describe()}, {n_params / 1e9:.2f}B params, batch {args.batch}"
    rows = [{"precision": name, "config": config, "time_ms": r["step_s"] * 1e3,
             "tokens_per_s": tokens_per_step / r["step_s"], "tflops": flops / r["step_s"] / 1e12,
             "speedup": common.ratio(results["bf16"]["step_s"], r["step_s"]),
             "final_loss": statistics.fmean(r["losses"][-tail:]),
             "loss_change": statistics.fmean(r["losses"][-tail:]) - r["losses"][0]}
            for name, r in results.items()]
    notes = [f"{args.steps} steps per precision, the first {args.warmup} left out of the timing; "
             f"loss = mean of the last {tail} steps, change = that minus step 1's loss "
             f"(ln V = {math.log(cfg.vocab):.2f} for a uniform prediction)",
             f"not a convergence check: {args.steps} steps stay near ln V (the data's floor is "
             "~1.4 nats at V = 32000), so the loss shows only that no precision diverged or "
             "turned NaN", f"{n_params:,} parameters, {tokens_per_step} tokens per step, "
             f"{fp8_layers} of {4 * cfg.layers + 1} Linear layers in FP8 in the FP8 runs"]
    return common.report(args, NAME, TITLE, WHAT, COLUMNS, rows, plot=plot, notes=notes,
                         extra={"losses": {n: r["losses"] for n, r in results.items()},
                                "params": n_params, "tokens_per_step": tokens_per_step})


if __name__ == "__main__":
    main()
