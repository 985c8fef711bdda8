"""Train a small GPT-style character-level language model in FP8 (and/or BF16).

The model is written with plain nn.Linear layers (attention qkv / output projection, MLP);
with --precision fp8 transformer_fp8.convert_to_fp8 swaps them for transformer_fp8.Linear and
the forward pass runs under fp8_autocast (delayed scaling, HYBRID format: E4M3 forward, E5M2
gradients). The embeddings, LayerNorms, attention (softmax(QK^T)V) and the LM head stay in
higher precision under BF16 autocast, as in usual FP8 recipes.
With --te-layers the blocks are transformer_fp8.TransformerLayer instead (Transformer Engine's
layer: fused LayerNorm + QKV projection, attention, output projection, LayerNorm + MLP); its
GEMMs run in FP8 under fp8_autocast without any conversion.

    python examples/train_gpt.py --precision both            # a few minutes on a CPU
    python examples/train_gpt.py --tiny --precision both     # ~10 s smoke run
    python examples/train_gpt.py --tiny --te-layers          # blocks are tfp8.TransformerLayer
    python examples/train_gpt.py --precision both --device cuda --d-model 512 --layers 8 \\
        --seq-len 256 --batch-size 64 --steps 2000

Writes <out>/losses.json (config, per-step losses, final and validation losses of each run) and
<out>/loss_curves.png (the loss curves of the runs).
The text is examples/data/*.txt (an original corpus of short fables, see
examples/data/generate_corpus.py), tokenised character by character.
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import time
from contextlib import ExitStack
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import transformer_fp8 as tf8
from transformer_fp8.modules.transformer_layer import TransformerLayer

HERE = Path(__file__).resolve().parent
DEFAULT_DATA = HERE / "data"
DEFAULT_OUT = HERE / "out"

# ----------------------------------------------------------------------------------------------
# Data: character-level tokenizer over the repo's text files.

class CharTokenizer:
    def __init__(self, text: str):
        self.chars = sorted(set(text))
        self.stoi = {c: i for i, c in enumerate(self.chars)}

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        return torch.tensor([self.stoi[c] for c in text], dtype=torch.long)

    def decode(self, ids) -> str:
        return "".join(self.chars[int(i)] for i in ids)


def load_text(data: Path) -> str:
    files = sorted(data.glob("*.txt")) if data.is_dir() else [data]
    if not files:
        raise FileNotFoundError(f"no .txt files in {data}")
    return "\n".join(f.read_text(encoding="utf-8") for f in files)


class Batches:
    """Random windows of seq_len + 1 tokens, from a seeded generator (identical across runs)."""

    def __init__(self, tokens: torch.Tensor, seq_len: int, batch_size: int, seed: int):
        self.tokens, self.seq_len, self.batch_size = tokens, seq_len, batch_size
        self.gen = torch.Generator(device="cpu").manual_seed(seed)

    def next(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(0, len(self.tokens) - self.seq_len - 1, (self.batch_size,),
                               generator=self.gen)
        offsets = torch.arange(self.seq_len + 1)
        chunk = self.tokens[starts[:, None] + offsets]
        return chunk[:, :-1].to(device), chunk[:, 1:].to(device)


# ----------------------------------------------------------------------------------------------
# Model: a pre-LayerNorm GPT with plain nn.Linear layers.

class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, d_model: int):
        super().__init__()
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.proj = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, d_model: int, heads: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, heads)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = MLP(d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def te_block(d_model: int, heads: int, layers: int) -> nn.Module:
    """The same block as Block, as a transformer_fp8.TransformerLayer: pre-LayerNorm, causal
    self-attention, 4x GELU (tanh) MLP, no dropout, batch-first input; GPT-2's initialisation
    (std 0.02, residual outputs scaled by 1 / sqrt(2 * layers))."""

    def init(std):
        return lambda weight: nn.init.normal_(weight, std=std)

    return TransformerLayer(d_model, 4 * d_model, heads, hidden_dropout=0.0,
                                attention_dropout=0.0, self_attn_mask_type="causal",
                                attn_input_format="bshd", init_method=init(0.02),
                                output_layer_init_method=init(0.02 / math.sqrt(2 * layers)))


class GPT(nn.Module):
    def __init__(self, vocab_size: int, d_model: int, layers: int, heads: int, seq_len: int,
                 te_layers: bool = False):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(te_block(d_model, heads, layers) if te_layers
                                    else Block(d_model, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        self.apply(self._init)
        for name, p in self.named_parameters():  # GPT-2: scaled init of the residual outputs
            if name.endswith("proj.weight"):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * layers))

    @staticmethod
    def _init(m: nn.Module) -> None:
        # (In a TransformerLayer only proj is an nn.Linear: re-initialised here as in Block.)
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


# ----------------------------------------------------------------------------------------------
# Training.

class _NoBar:
    """What the loop needs of a tqdm bar, for runs without one."""

    def __init__(self, iterable):
        self.iterable = iterable

    def __iter__(self):
        return iter(self.iterable)

    def set_postfix(self, **kwargs):
        pass

    def close(self):
        pass


def progress_bar(iterable, disable: bool, **kwargs):
    """A tqdm bar, or a silent stand-in when disabled or tqdm is not installed (it is imported
    only here, so that the module imports without it)."""
    if disable:
        return _NoBar(iterable)
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoBar(iterable)
    return tqdm(iterable, **kwargs)


def lr_at(step: int, args) -> float:
    warmup = max(1, args.steps // 20)
    if step < warmup:
        return args.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, args.steps - warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def forward_ctx(precision: str, device: torch.device, recipe) -> ExitStack:
    """BF16 autocast around the whole forward; FP8 runs add fp8_autocast (forward only)."""
    stack = ExitStack()
    stack.enter_context(torch.autocast(device.type, dtype=torch.bfloat16))
    if precision == "fp8":
        stack.enter_context(tf8.fp8_autocast(enabled=True, fp8_recipe=recipe))
    return stack


@torch.no_grad()
def evaluate(model, batches: list, precision: str, device: torch.device, recipe) -> float:
    model.eval()
    total = 0.0
    for x, y in batches:
        with forward_ctx(precision, device, recipe):
            logits = model(x)
        total += F.cross_entropy(logits.float().flatten(0, 1), y.flatten()).item()
    model.train()
    return total / len(batches)


def train_one(precision: str, base: GPT, train_tokens, val_batches, args,
              device: torch.device) -> dict:
    model = copy.deepcopy(base)
    converted = []
    if precision == "fp8":
        # Every nn.Linear except the LM head (which stays in BF16, as usual in FP8 recipes).
        tf8.convert_to_fp8(model, filter_fn=lambda linear, name: name != "lm_head")
        fp8_modules = (tf8.Linear, tf8.LayerNormLinear, tf8.LayerNormMLP)
        converted = [n for n, m in model.named_modules() if isinstance(m, fp8_modules)]
        print(f"[fp8] convert_to_fp8: {len(converted)} FP8 modules "
              f"({', '.join(converted[:4])}{', ...' if len(converted) > 4 else ''})")
    recipe = tf8.DelayedScaling(margin=0, fp8_format=tf8.Format.HYBRID,
                                amax_history_len=args.amax_history_len, amax_compute_algo="max")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    batches = Batches(train_tokens, args.seq_len, args.batch_size, seed=args.seed + 1)

    losses = []
    t0 = time.perf_counter()
    bar = progress_bar(range(args.steps), disable=args.no_progress, desc=f"{precision:>4}",
                       unit="step", dynamic_ncols=True)
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args)
        x, y = batches.next(device)
        with forward_ctx(precision, device, recipe):
            logits = model(x)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()  # outside fp8_autocast, as with Transformer Engine
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if step % 10 == 0 or step == args.steps - 1:
            bar.set_postfix(loss=f"{losses[-1]:.4f}")
    bar.close()
    seconds = time.perf_counter() - t0
    val_loss = evaluate(model, val_batches, precision, device, recipe)
    tail = losses[-max(1, args.steps // 10):]
    tokens = args.steps * args.batch_size * args.seq_len
    return {"precision": precision, "train_losses": losses,
            "final_train_loss": sum(tail) / len(tail), "val_loss": val_loss,
            "seconds": seconds, "tokens_per_second": tokens / seconds,
            "fp8_layers": converted, "model": model}


def plot(results: dict, path: Path, model_name: str = "char-level GPT",
         baseline: str = "BF16") -> None:
    """Loss curves; a result's val_loss is named in its legend where it has one (not None).
    ``baseline`` names the high-precision run in the title."""
    from matplotlib.figure import Figure  # no pyplot: no GUI backend, no global state

    fig = Figure(figsize=(7, 4.2), dpi=120)
    ax = fig.add_subplot()
    colors = {"bf16": "tab:blue", "fp8": "tab:orange"}
    for name, r in results.items():
        losses = r["train_losses"]
        ax.plot(losses, color=colors[name], alpha=0.25, linewidth=0.8)
        half = max(1, len(losses) // 60)  # centred running mean: no lag on the steep start
        smooth = []
        for i in range(len(losses)):
            window = losses[max(0, i - half):i + half + 1]
            smooth.append(sum(window) / len(window))
        val = r.get("val_loss")
        ax.plot(smooth, color=colors[name], linewidth=1.8,
                label=f"{name}: final {r['final_train_loss']:.3f}"
                      + (f", val {val:.3f}" if val is not None else ""))
    ax.set_xlabel("step")
    ax.set_ylabel("train loss (cross-entropy, nats/char)")
    ax.set_title(f"{model_name}: FP8 vs {baseline}" if len(results) > 1 else
                 f"{model_name}: {next(iter(results))}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


DEFAULTS = dict(steps=300, d_model=64, layers=4, heads=4, seq_len=64, batch_size=16,
                sample=200)
TINY = dict(steps=40, d_model=64, layers=2, heads=4, seq_len=64, batch_size=8, sample=0)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--precision", choices=["fp8", "bf16", "both"], default="both",
                   help="both: BF16 then FP8, from the same initial weights (both)")
    p.add_argument("--tiny", action="store_true",
                   help="a ~10 s smoke run; its sizes (" + ", ".join(
                       f"{k}={v}" for k, v in TINY.items()) + ") replace the defaults, flags "
                   "given explicitly still win")
    # Sizes: None means "the default" (DEFAULTS, or TINY with --tiny).
    p.add_argument("--steps", type=int, help=f"training steps per run ({DEFAULTS['steps']})")
    p.add_argument("--d-model", type=int, help=f"model width ({DEFAULTS['d_model']})")
    p.add_argument("--layers", type=int, help=f"transformer blocks ({DEFAULTS['layers']})")
    p.add_argument("--heads", type=int, help=f"attention heads ({DEFAULTS['heads']})")
    p.add_argument("--seq-len", type=int, help=f"context length ({DEFAULTS['seq_len']})")
    p.add_argument("--batch-size", type=int, help=f"sequences per step ({DEFAULTS['batch_size']})")
    p.add_argument("--sample", type=int, help="characters to generate from each trained model, "
                   f"0 for none ({DEFAULTS['sample']})")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (3e-3)")
    p.add_argument("--amax-history-len", type=int, default=16,
                   help="DelayedScaling amax history length (16)")
    p.add_argument("--device", default=None, help="cuda or cpu (cuda if available)")
    p.add_argument("--data", type=Path, default=DEFAULT_DATA,
                   help="a .txt file or a folder of them (examples/data)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT,
                   help="where losses.json and loss_curves.png go (examples/out)")
    p.add_argument("--seed", type=int, default=0, help="model init and batch order (0)")
    p.add_argument("--no-progress", action="store_true", help="no tqdm bar")
    p.add_argument("--te-layers", action="store_true",
                   help="build the blocks from transformer_fp8.TransformerLayer "
                   "(Transformer Engine's layer) instead of nn.Linear-based ones")
    args = p.parse_args(argv)
    for key, value in (TINY if args.tiny else DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.d_model % 16 or args.d_model % args.heads:
        p.error("--d-model must be a multiple of 16 (FP8 GEMMs) and of --heads")
    if args.steps < 1 or args.batch_size < 1 or args.seq_len < 2:
        p.error("--steps and --batch-size must be >= 1, --seq-len >= 2")
    return args


@torch.no_grad()
def sample(model: GPT, tok: CharTokenizer, prompt: str, n: int, seq_len: int,
           device: torch.device) -> str:
    """Sampling runs in float32 for both models (outside fp8_autocast a transformer_fp8.Linear
    is an nn.Linear): precision does not matter here, and on CPU float32 is the fastest."""
    model.eval()
    idx = tok.encode(prompt)[None].to(device)
    g = torch.Generator(device="cpu").manual_seed(0)
    for _ in range(n):
        logits = model(idx[:, -seq_len:])[:, -1].float()
        probs = torch.softmax(logits / 0.8, dim=-1).cpu()
        idx = torch.cat([idx, torch.multinomial(probs, 1, generator=g).to(device)], dim=1)
    model.train()
    return tok.decode(idx[0].tolist())


def main(argv=None) -> dict:
    args = parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    text = load_text(args.data)
    tok = CharTokenizer(text)
    tokens = tok.encode(text)
    split = int(0.9 * len(tokens))
    train_tokens, val_tokens = tokens[:split], tokens[split:]
    val_src = Batches(val_tokens, args.seq_len, args.batch_size, seed=args.seed + 2)
    val_batches = [val_src.next(device) for _ in range(4 if args.tiny else 16)]

    torch.manual_seed(args.seed)
    base = GPT(tok.vocab_size, args.d_model, args.layers, args.heads, args.seq_len,
               te_layers=args.te_layers).to(device)
    n_params = sum(p.numel() for p in base.parameters())
    print(f"transformer_fp8 {tf8.__version__}, torch {torch.__version__}, device {device}")
    blocks = "TransformerLayer blocks" if args.te_layers else "layers"
    print(f"data: {len(text):,} characters, vocab {tok.vocab_size}; "
          f"model: {args.layers} {blocks}, "
          f"d_model {args.d_model}, {args.heads} heads, seq {args.seq_len}, "
          f"{n_params / 1e6:.2f}M parameters; {args.steps} steps of batch {args.batch_size}")
    if device.type == "cpu":
        print("(CPU: FP8 runs the reference kernels, for correctness, not speed)")

    precisions = ["bf16", "fp8"] if args.precision == "both" else [args.precision]
    results = {p: train_one(p, base, train_tokens, val_batches, args, device) for p in precisions}

    args.out.mkdir(parents=True, exist_ok=True)
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    config.update(device=str(device), vocab_size=tok.vocab_size, n_params=n_params)
    record = {"config": config}
    for name, r in results.items():
        record[name] = {k: v for k, v in r.items() if k != "model"}
    written = {"json": args.out / "losses.json", "png": args.out / "loss_curves.png"}
    written["json"].write_text(json.dumps(record, indent=1))
    plot(results, written["png"],
         "char-level GPT, TransformerLayer blocks" if args.te_layers else "char-level GPT")

    print()
    print(f"{'':>5} {'final train loss':>17} {'val loss':>9} {'time':>8} {'tokens/s':>10}")
    for name, r in results.items():
        print(f"{name:>5} {r['final_train_loss']:17.4f} {r['val_loss']:9.4f} "
              f"{r['seconds']:7.1f}s {r['tokens_per_second']:10,.0f}")
    if len(results) == 2:
        b, f = results["bf16"]["val_loss"], results["fp8"]["val_loss"]
        print(f"FP8 vs BF16 val loss: {(f - b) / b:+.2%}")
    if args.sample:
        for name, r in results.items():
            s = sample(r["model"], tok, "The ", args.sample, args.seq_len, device)
            print(f"--- {name} model, sample ---\n{s}")
    print(f"wrote {', '.join(str(p) for p in written.values())}")
    for r in results.values():
        r.pop("model")
    return {"results": results, "files": written, "config": config}


if __name__ == "__main__":
    main()
