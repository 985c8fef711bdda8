"""A HuggingFace transformers Llama, trained in FP8 and in bf16, checkpointed and resumed.

The model is built from a config (random initialisation, nothing downloaded), its linear layers
converted with transformer_fp8.convert_to_fp8, and trained on the text shipped in
examples/data as a character-level language model. Halfway (--resume-at), the run saves a
checkpoint (model, optimizer, step), builds a fresh model, loads the checkpoint and carries on:
the losses are those of an uninterrupted run, bit for bit. Writes a loss plot and the losses.

    python examples/train_llama.py                 # FP8 and bf16, about a minute on a GPU
    python examples/train_llama.py --tiny          # a few seconds on a CPU
    python examples/train_llama.py --precision fp8 --resume-at 0   # no checkpoint and resume

"bf16" is the high-precision baseline: bf16 on a GPU, float32 on a CPU. Needs transformers
(pip install transformers); the library itself does not.

This example shows the integration (conversion, checkpoint and resume), not FP8's accuracy: its
loop has no warmup and no gradient clipping, and at these sizes two runs whose initial weights
differ by 1e-4 end up to 5% apart, either way (so do the FP8 and bf16 runs, in either order
from seed to seed). examples/train_gpt.py, with warmup, clipping and a validation loss, is the
one that compares FP8 with bf16.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_gpt  # noqa: E402  (its tokenizer, batches, progress bar and plot)

import transformer_fp8 as tfp8  # noqa: E402

DEFAULTS = dict(steps=200, hidden=128, layers=4, heads=4, seq_len=64, batch_size=16)
TINY = dict(steps=16, hidden=32, layers=2, heads=2, seq_len=32, batch_size=4)


def build_model(vocab_size: int, args, seed: int, dtype: torch.dtype, recipe):
    """A Llama from a config with plain nn.Linear layers; for FP8 (recipe not None) they are
    converted for the recipe (the LM head, as wide as the vocabulary, stays in high precision
    unless that is a multiple of 16: convert_to_fp8 says so in a warning)."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=vocab_size, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=max(1, args.heads // 2), max_position_embeddings=args.seq_len)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).to(device=args.device, dtype=dtype)
    if recipe is not None:
        tfp8.convert_to_fp8(model, recipe=recipe)
    return model


def train(precision: str, tokens: torch.Tensor, vocab_size: int, args) -> dict:
    dtype = torch.bfloat16 if args.device.type == "cuda" else torch.float32
    recipe = tfp8.DelayedScaling(amax_history_len=16) if precision == "fp8" else None
    model = build_model(vocab_size, args, args.seed, dtype, recipe)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    batches = train_gpt.Batches(tokens, args.seq_len, args.batch_size, seed=args.seed + 1)
    losses = []
    bar = train_gpt.progress_bar(range(args.steps), disable=args.no_progress,
                                 desc=f"{precision:>4}", unit="step")
    for step in bar:
        if step == args.resume_at and step > 0:
            model, opt = checkpoint_and_resume(model, opt, vocab_size, dtype, recipe, args,
                                               precision)
        x, y = batches.next(args.device)
        with tfp8.autocast(enabled=recipe is not None, recipe=recipe):
            logits = model(input_ids=x).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
    bar.close()
    # (no validation run here: no val_loss, rather than a NaN in the plot and the JSON)
    return {"train_losses": losses, "final_train_loss": sum(losses[-5:]) / len(losses[-5:])}


def checkpoint_and_resume(model, opt, vocab_size, dtype, recipe, args, precision):
    """Save model and optimizer, then continue with a freshly built model (other initial
    weights: everything must come from the file) and optimizer loaded from it."""
    path = args.out / f"llama_{precision}_checkpoint.pt"
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, path)
    state = torch.load(path, weights_only=True)
    resumed = build_model(vocab_size, args, args.seed + 1000, dtype, recipe)
    resumed.load_state_dict(state["model"])
    resumed_opt = torch.optim.AdamW(resumed.parameters(), lr=args.lr)
    resumed_opt.load_state_dict(state["opt"])
    return resumed, resumed_opt


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--precision", choices=["fp8", "bf16", "both"], default="both")
    p.add_argument("--tiny", action="store_true", help="a small model and few steps")
    p.add_argument("--steps", type=int, help=f"training steps ({DEFAULTS['steps']})")
    p.add_argument("--resume-at", type=int, help="step at which to checkpoint and resume "
                   "(half the steps; 0: never)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--device", default=None, help="cuda or cpu (cuda if available)")
    p.add_argument("--data", type=Path, default=train_gpt.DEFAULT_DATA)
    p.add_argument("--out", type=Path, default=train_gpt.DEFAULT_OUT)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    for key, value in (TINY if args.tiny else DEFAULTS).items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    if args.steps < 1:
        p.error(f"--steps must be >= 1, got {args.steps}")
    if args.resume_at is None:
        args.resume_at = args.steps // 2
    args.device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    text = train_gpt.load_text(args.data)
    tokenizer = train_gpt.CharTokenizer(text)
    tokens = tokenizer.encode(text)
    precisions = ["bf16", "fp8"] if args.precision == "both" else [args.precision]
    results = {name: train(name, tokens, tokenizer.vocab_size, args) for name in precisions}
    # "bf16" is float32 on a CPU (train's dtype): the title says which it was.
    train_gpt.plot(results, args.out / "llama_loss_curves.png", model_name="char-level Llama",
                   baseline="BF16" if args.device.type == "cuda" else "float32 (the 'bf16' run "
                   "on a CPU)")
    config = {k: (str(v) if isinstance(v, (Path, torch.device)) else v)
              for k, v in vars(args).items()}
    (args.out / "llama_losses.json").write_text(json.dumps({"config": config, **results}))
    for name, r in results.items():
        print(f"{name}: loss {r['train_losses'][0]:.3f} -> {r['final_train_loss']:.3f}")
    return {"config": config, "results": results}


if __name__ == "__main__":
    main()
