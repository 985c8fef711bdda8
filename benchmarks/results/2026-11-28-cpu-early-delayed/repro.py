"""Mid-size CPU reproduction of gpt_loss_curves' early DelayedScaling divergence, with per-role
FP8 statistics (debug.collect_stats) of the first --stats-steps steps.

    python3 repro.py --d 512 --heads 8 --init-std 0.04 --lr 1.2e-3 --steps 20 \
        --loss-scale 0.0625 --precisions delayed,current        # diverges (~100 s each, 1 core)
    JIT=1 python3 repro.py ... --precisions delayed             # with jit_patch: tracks current
    python3 show.py /tmp/early_delayed.json delayed blocks.0    # per-step, per-role table

--loss-scale scales the loss (and the clip norm) so that the per-element gradients are as small
as the 0.81B model's (8x the tokens per batch, 16 layers): Adam and current scaling are
scale-free, delayed scaling's first cast (scale 1.0) is not. --init-std 0.04 and --lr 1.2e-3 give
the d512 blocks the d2048 model's per-layer gain (0.02 * sqrt(2048 / 512)) and its coherent
update size."""
import argparse, copy, dataclasses, json, math, os, sys, time
import torch
HERE = os.path.dirname(os.path.abspath(__file__))
WT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))  # the repository root
sys.path.insert(0, WT)
sys.path.insert(0, os.path.join(WT, "benchmarks"))
import bench_gpt, stdlib_text, gpt_loss_curves as glc
import transformer_fp8 as tf8
if os.environ.get("JIT"):
    sys.path.insert(0, HERE); import jit_patch  # noqa

p = argparse.ArgumentParser()
p.add_argument("--d", type=int, default=256); p.add_argument("--layers", type=int, default=4)
p.add_argument("--seq", type=int, default=256); p.add_argument("--batch", type=int, default=4)
p.add_argument("--steps", type=int, default=40); p.add_argument("--warmup", type=int, default=100)
p.add_argument("--lr", type=float, default=3e-4)
p.add_argument("--precisions", default="bf16,delayed,current")
p.add_argument("--stats", default="delayed")
p.add_argument("--stats-steps", type=int, default=12)
p.add_argument("--out", default="/tmp/early_delayed.json")
p.add_argument("--threads", type=int, default=1)
p.add_argument("--init-std", type=float, default=0.02)
p.add_argument("--heads", type=int, default=0)
p.add_argument("--loss-scale", type=float, default=1.0)
a = p.parse_args()
torch.set_num_threads(a.threads)
cfg = bench_gpt.GPTConfig(d_model=a.d, layers=a.layers, heads=a.heads or max(1, a.d // 64), seq=a.seq,
                          vocab=stdlib_text.VOCAB)
corpus = stdlib_text.load("stdlib")
batches = stdlib_text.Batches(corpus.train, cfg.seq, a.batch, 0)
initial = bench_gpt.initial_model(cfg, "cpu", 0)
if a.init_std != 0.02:
    torch.manual_seed(0)
    with torch.no_grad():
        for q in initial.parameters():
            if q.dim() == 2:
                q.normal_(0, a.init_std)
args = argparse.Namespace(lr=a.lr, lr_warmup=a.warmup)
recipes = {"bf16": None, "delayed": tf8.DelayedScaling(fp8_format=tf8.Format.HYBRID),
           "current": tf8.Float8CurrentScaling(fp8_format=tf8.Format.HYBRID)}
# "calibrated": DelayedScaling whose step 0 is a high-precision step under
# fp8_autocast(enabled=False, calibrating=True), which sets every role's scales (grad_output too).
recipes["calibrated"] = recipes["delayed"]
results = {}
import torch.nn.functional as F
def train_step(model, recipe, tokens, opt, ls, calibrating=False):
    """bench_gpt.train_step with the loss scaled by ls (and the clip norm with it): gradients
    ls times smaller, as a model with more tokens per batch has them; Adam is scale-free."""
    context = (tf8.fp8_autocast(enabled=False, calibrating=True, fp8_recipe=recipe)
               if calibrating else glc.common.fp8_context(recipe))
    with context:
        logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
    (loss * ls).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0 * ls)
    opt.step(); opt.zero_grad(set_to_none=True)
    return loss.item()

for key in a.precisions.split(","):
    recipe = recipes[key]
    model = copy.deepcopy(initial)
    if recipe is not None:
        tf8.convert_to_fp8(model.blocks, recipe=recipe)
    opt = glc.MasterAdamW(model.parameters(), lr=a.lr)
    stats = None
    if recipe is not None and key in a.stats.split(","):
        stats = tf8.debug.collect_stats(model, layers="blocks.*").enable()
    losses, recs = [], []
    t0 = time.time()
    for step in range(a.steps):
        for g in opt.param_groups:
            g["lr"] = glc.lr_at(args, step)
        if stats is not None and step == a.stats_steps:
            stats.disable(); stats = None
        loss = train_step(model, recipe, batches.batch_at(step), opt, a.loss_scale,
                          calibrating=key == "calibrated" and step == 0)
        losses.append(loss)
        if stats is not None:
            recs += stats.step()
    if stats is not None:
        stats.disable()
    results[key] = {"losses": losses, "stats": recs}
    print(key, f"{time.time()-t0:.0f}s", [round(x, 2) for x in losses], flush=True)
json.dump(results, open(a.out, "w"))
