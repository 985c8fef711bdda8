"""Loss curves of a ~1B GPT trained on natural text in bf16 and in FP8 with each recipe.

Trains bench_gpt's GPT (d_model 2048, 16 layers, 16 heads, sequence 2048; byte vocabulary, so
about 0.81B parameters) for 1,000 AdamW steps of batch 4 once per precision: bf16; and
convert_to_fp8 of the transformer blocks (the LM head stays bf16) under fp8_autocast with
DelayedScaling, Float8CurrentScaling or Float8BlockScaling. Every precision starts from the same
initial weights (seeded; a checksum of them is recorded) and sees the same token stream in the
same order (batch at step s is a function of the seed and s alone; the stream's SHA-256 is
recorded). Reported, per precision: the training loss per step, its mean over the last 50 steps
and the ratio of that to bf16's (issue 14's check: within 0.5%), the loss on held-out text at
the end, the step time.

Text (stdlib_text.py; nothing downloaded): by default the ``stdlib`` corpus, the language
reference's prose (``pydoc_data/topics.py``) followed by the standard library's own .py files
(code, docstrings and comments), byte-level tokens (vocabulary 256), every 20th page of 16,384
tokens held out for validation. With CPython 3.11.7 it is 12.55M tokens (11.92M training,
0.62M validation; 12.02M with 3.12.1, 11.93M with 3.13.0): 1,000 steps of 4 x 2,049 tokens
read 0.69 of the training tokens (0.72 with 3.12), so no batch is seen twice.
``--corpus prose`` takes the reference's prose and the standard library's docstrings only (2.27M
tokens with 3.11.7, read ~3.8 times in 1,000 steps: later steps measure memorisation). Another
Python gives another text; the summary refuses to compare runs whose streams differ.

Optimizer: AdamW with bench_gpt's settings (lr 3e-4, betas 0.9/0.95, no weight decay) on
float32 master weights with float32 moments (MasterAdamW; ``--optimizer bf16``: on the bf16
parameters, as bench_gpt runs it, where updates under half a bf16 ulp are lost), the learning
rate warmed up linearly over the first 100 steps, gradients clipped to norm 1.0 (from scratch,
so that no precision's curve is set off by an early spike that has nothing to do with its
numerics). Parameters, gradients and activations bf16, the loss in fp32.

Running in pieces. A training run writes ``<out>/gpt_loss_curves.<precision>.json`` for each
precision it runs (losses and step times so far, rewritten every ``--flush-every`` steps and at
the end, so a run killed by a time limit keeps what it did; SIGTERM writes it at once) and then
summarises ``<out>``. ``--time-limit-s`` stops cleanly before that many seconds (counted from
the script's start) have passed: it starts no step it expects not to finish with
``--reserve-s`` left for the validation loss and the writes, and starts no precision without
room for 10 steps. ``--summarize DIR1 DIR2 ...`` merges the per-precision JSONs of several runs
(the most steps wins where a precision appears twice) into ``<out>/gpt_loss_curves.json`` / .md
/ .png: the curves (moving average, raw faintly) and each FP8 curve's relative difference from
bf16's, and the table. ``--checkpoint-dir`` saves model + optimizer (the FP8 state is in the
model's state_dict) + losses every ``--checkpoint-every`` steps and when the time limit stops a
run; ``--resume`` continues each precision from its checkpoint there, bit for bit the
uninterrupted run (on the CPU; tested). A checkpoint of the ~1B model is ~11 GB (bf16
parameters, float32 masters and moments): keep it outside the folder that is brought back from
a GPU machine. Each remote call starts a fresh machine, so resuming across calls works only when
the next call finds the same machine still warm; the plan below does not rely on it.

Device plan (two calls of at most 600 s, on one H100 or H200). bench_gpt's steps on an H200
(vocabulary 32,000, bf16 AdamW): bf16 101 ms, DelayedScaling 83, Float8CurrentScaling 88,
Float8BlockScaling 146. Here the byte vocabulary saves the 32,000-wide LM head and its fp32
loss (~5-8 ms), the float32 masters and the clipping cost about as much (~32 GB of memory
traffic, ~8-11 ms): take bench_gpt's times.
  call 1 (timeout_s 600): build ~90 s; bf16 + DelayedScaling: ~185 s of steps + ~15 s of text,
          model and validation: ~290 s in all.
  call 2 (timeout_s 600): build ~90 s (skipped if the machine is still warm and holds the
          build); Float8CurrentScaling + Float8BlockScaling: ~235 s + ~15 s: ~340 s in all.
  Each fits its call at 1.5x the steps' estimated time. The command for call N (PRECISIONS
  "bf16,delayed" then "current,block"; COMMIT the commit sent); bash's SECONDS (time since the
  call began) sets the limit, so that a slow build shortens the training, not the call:

    export TRANSFORMER_FP8_COMMIT=COMMIT
    ( [ -e transformer_fp8/_C*.so ] || GPU_CHECK_SKIP_TESTS=1 GPU_CHECK_SKIP_SANITIZE=1 \
        GPU_CHECK_SKIP_BENCH=1 OUT=$OUT/callN scripts/gpu_check.sh ) && \
    timeout -k 10 $((570 - SECONDS)) python3 benchmarks/gpt_loss_curves.py \
        --precisions PRECISIONS --time-limit-s $((540 - SECONDS)) --out $OUT/callN

  then, on any machine: python3 benchmarks/gpt_loss_curves.py --summarize CALL1 CALL2 --out DIR
  (DIR: benchmarks/results/<date>-<device>-gpt-loss-curves/).

    python benchmarks/gpt_loss_curves.py [--smoke] [--out DIR] [--precisions bf16,delayed,...]
        [--steps 1000] [--time-limit-s S] [--checkpoint-dir D [--resume]]
    python benchmarks/gpt_loss_curves.py --summarize DIR1 [DIR2 ...] [--out DIR]
"""
from __future__ import annotations

import copy
import dataclasses
import glob
import hashlib
import json
import math
import os
import signal
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_gpt  # noqa: E402
import common  # noqa: E402
import stdlib_text  # noqa: E402
import transformer_fp8 as tf8  # noqa: E402

NAME = "gpt_loss_curves"
TITLE, WHAT = common.doc_summary(__doc__)
START = time.monotonic()  # --time-limit-s counts from here

# short name on the command line -> name in the results: common.precision_variants()'s, but for
# "calibrated" (its recipe: CALIBRATED_FIRST_STEP)
PRECISIONS = {"bf16": "bf16", "delayed": "fp8 DelayedScaling",
              "current": "fp8 Float8CurrentScaling", "block": "fp8 Float8BlockScaling",
              "calibrated": "fp8 DelayedScaling, step 1 calibrating"}
# DelayedScaling whose first step is a high-precision calibrating one
# (fp8_autocast(enabled=False, calibrating=True)): every role's scales set from its amaxes.
CALIBRATED_FIRST_STEP = {"calibrated": "fp8 DelayedScaling"}
TOLERANCE = 0.005  # issue 14: each FP8 final loss within 0.5% of bf16's
CONFIG = dataclasses.replace(bench_gpt.GPTConfig(), vocab=stdlib_text.VOCAB)
SMOKE_CONFIG = dataclasses.replace(bench_gpt.SMOKE_CONFIG, vocab=stdlib_text.VOCAB)


class Stopped(Exception):
    """SIGTERM arrived (a `timeout` running out): write what there is and stop."""


def _on_sigterm(signum, frame):
    raise Stopped("SIGTERM")


# ----------------------------------------------------------------------------- arguments

def add_arguments(parser):
    parser.add_argument("--precisions", default=",".join(PRECISIONS),
                        help=f"comma-separated, run in this order; from {list(PRECISIONS)}")
    parser.add_argument("--steps", type=int, default=None, help="default 1000 (smoke: 40)")
    parser.add_argument("--batch", type=int, default=None, help="default 4 (smoke: 2)")
    parser.add_argument("--seed", type=int, default=0, help="initial weights and batch order")
    parser.add_argument("--corpus", default="stdlib", choices=stdlib_text.CORPORA)
    parser.add_argument("--lr", type=float, default=None, help="default 3e-4 (smoke: 3e-3)")
    parser.add_argument("--lr-warmup", type=int, default=None,
                        help="steps of linear warm-up; default 100 (smoke: 4)")
    parser.add_argument("--clip", type=float, default=1.0, help="gradient norm; 0: none")
    parser.add_argument("--optimizer", default="fp32-master", choices=("fp32-master", "bf16"),
                        help="AdamW on float32 master weights (default), or on the bf16 "
                             "parameters as bench_gpt runs it")
    parser.add_argument("--tail", type=int, default=None,
                        help="steps averaged for the final loss; default 50 (smoke: 10)")
    parser.add_argument("--val-windows", type=int, default=64,
                        help="held-out sequences for the validation loss")
    parser.add_argument("--time-limit-s", type=float, default=None)
    parser.add_argument("--reserve-s", type=float, default=15.0,
                        help="seconds kept for the validation loss and the writes (more with "
                             "--checkpoint-dir: the ~1B model's checkpoint is ~11 GB)")
    parser.add_argument("--flush-every", type=int, default=10)
    parser.add_argument("--checkpoint-dir", default=None)
    parser.add_argument("--checkpoint-every", type=int, default=0,
                        help="steps between checkpoints (0: only when the time limit stops)")
    parser.add_argument("--resume", action="store_true",
                        help="continue each precision from its checkpoint in --checkpoint-dir")
    parser.add_argument("--summarize", nargs="+", metavar="DIR", default=None,
                        help="merge the per-precision JSONs in these folders; no training")


def parse(argv):
    args = common.parse_args(TITLE, argv, add_arguments)
    # default: the run; --smoke: a tiny model whose loss still moves in a few steps
    for name, full, smoke in (("steps", 1000, 40), ("batch", 4, 2), ("lr", 3e-4, 3e-3),
                              ("lr_warmup", 100, 4)):
        if getattr(args, name) is None:
            setattr(args, name, smoke if args.smoke else full)
    keys = [k.strip() for k in args.precisions.split(",") if k.strip()]
    unknown = [k for k in keys if k not in PRECISIONS]
    if unknown or not keys:
        raise ValueError(f"--precisions: unknown {unknown or 'none given'}; choose from "
                         f"{list(PRECISIONS)}")
    args.precisions = keys
    if args.resume and not args.checkpoint_dir:
        raise ValueError("--resume needs --checkpoint-dir")
    for name in ("steps", "batch", "tail", "val_windows", "flush_every"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
    return args


# ----------------------------------------------------------------------------- records

def record_path(out: str, key: str) -> str:
    return os.path.join(out, f"{NAME}.{key}.json")


def write_atomic(path: str, payload: dict) -> None:
    tmp = path + ".tmp"
    common.write_json(tmp, payload)
    os.replace(tmp, path)


def weights_checksum(model: torch.nn.Module) -> str:
    """Exact fingerprint of the parameters' bits: per tensor, integer sums of the raw 16-bit
    values, plain and position-weighted (integer arithmetic: the same on every device and
    reduction order)."""
    digest = hashlib.sha256()
    for name, p in model.named_parameters():
        bits = p.detach().contiguous().view(torch.int16).flatten().long()
        weights = torch.arange(bits.numel(), device=bits.device) % 65521 + 1
        digest.update(f"{name}:{int(bits.sum())}:{int((bits * weights).sum())};".encode())
    return digest.hexdigest()[:16]


def run_config(args, cfg) -> dict:
    """What must match for two runs' curves to be compared."""
    return {"model": dataclasses.asdict(cfg), "batch": args.batch, "seed": args.seed,
            "lr": args.lr, "lr_warmup": args.lr_warmup, "clip": args.clip,
            "optimizer": args.optimizer, "smoke": bool(args.smoke)}


# ----------------------------------------------------------------------------- training

class MasterAdamW:
    """AdamW on float32 master copies of bf16 parameters (mixed-precision training as
    Transformer Engine and Megatron run it): step() takes the bf16 gradients in float32, steps
    the masters (float32 moments) and writes them back rounded to bf16. Without it AdamW keeps
    bf16 moments and adds each update to a bf16 weight, where an update under half a unit in the
    last place is lost (lr 3e-4 never moves a LayerNorm gain of 1.0; the warm-up's small steps
    move few weights at all)."""

    def __init__(self, params, lr: float):
        self.params = [p for p in params]
        self.masters = [torch.nn.Parameter(p.detach().float().clone()) for p in self.params]
        self.inner = bench_gpt.make_optimizer(self.masters, lr=lr)
        self.param_groups = self.inner.param_groups

    @torch.no_grad()
    def step(self):
        for p, m in zip(self.params, self.masters):
            m.grad = None if p.grad is None else p.grad.float()
        self.inner.step()
        for p, m in zip(self.params, self.masters):
            p.copy_(m)  # round to nearest bf16

    def zero_grad(self, set_to_none: bool = True):
        for p in self.params + self.masters:
            p.grad = None

    def state_dict(self) -> dict:
        return {"adamw": self.inner.state_dict(), "masters": [m.detach() for m in self.masters]}

    @torch.no_grad()
    def load_state_dict(self, state: dict):
        self.inner.load_state_dict(state["adamw"])
        for m, saved in zip(self.masters, state["masters"]):
            m.copy_(saved)


def make_optimizer(args, model):
    if args.optimizer == "fp32-master":
        return MasterAdamW(model.parameters(), lr=args.lr)
    return bench_gpt.make_optimizer(model.parameters(), lr=args.lr)  # bf16 moments, updates


def lr_at(args, step: int) -> float:
    return args.lr * min(1.0, (step + 1) / args.lr_warmup) if args.lr_warmup else args.lr


@torch.no_grad()
def validation_loss(model, recipe, windows: torch.Tensor, batch: int, device) -> float:
    """Mean next-token loss (fp32) over the held-out windows, the model run as it trains."""
    total, count = 0.0, 0
    for chunk in windows.split(batch):
        tokens = chunk.to(device)
        with common.fp8_context(recipe):
            logits = model(tokens[:, :-1])
        total += torch.nn.functional.cross_entropy(
            logits.float().flatten(0, 1), tokens[:, 1:].flatten(), reduction="sum").item()
        count += tokens[:, 1:].numel()
    return total / count


def _checkpoint_path(args, key):
    return os.path.join(args.checkpoint_dir, f"{NAME}.{key}.pt")


def save_checkpoint(args, key, model, optimizer, record) -> None:
    os.makedirs(args.checkpoint_dir, exist_ok=True)
    path = _checkpoint_path(args, key)
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "record": json.dumps(record, default=str)}, path + ".tmp")  # plain types only
    os.replace(path + ".tmp", path)


def load_checkpoint(args, key, model, optimizer, record) -> dict:
    """The checkpoint's record (losses so far) after loading its model and optimizer; the
    fresh ``record`` when there is none. Refuses one of another run."""
    path = _checkpoint_path(args, key)
    if not os.path.exists(path):
        print(f"{key}: no checkpoint at {path}; starting from step 0")
        return record
    state = torch.load(path, map_location=args.device, weights_only=True)
    saved = json.loads(state["record"])
    for field in ("config", "data", "init_checksum", "precision"):
        if saved[field] != record[field]:
            raise ValueError(f"--resume: {path} is of another run ({field}: {saved[field]} "
                             f"there, {record[field]} here)")
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    print(f"{key}: resumed at step {len(saved['losses'])} from {path}")
    return {**record, "losses": saved["losses"], "step_s": saved["step_s"],
            "resumed_at": saved.get("resumed_at", []) + [len(saved["losses"])]}


_deadline = math.inf  # START + --time-limit-s


def _time_left() -> float:
    return _deadline - time.monotonic()


def train_precision(args, key, cfg, initial, batches, val, base_record) -> dict:
    name = PRECISIONS[key]
    recipe = common.precision_variants()[CALIBRATED_FIRST_STEP.get(key, name)]
    model = copy.deepcopy(initial)
    if recipe is not None:
        tf8.convert_to_fp8(model.blocks, recipe=recipe)  # the LM head stays in bf16
    optimizer = make_optimizer(args, model)
    record = {**base_record, "precision": name, "key": key, "losses": [], "step_s": [],
              "fp8_layers": sum(isinstance(m, tf8.Linear) for m in model.modules()),
              "complete": False, "stopped": None, "val_loss": None}
    if args.resume:
        record = load_checkpoint(args, key, model, optimizer, record)
    path = record_path(args.out, key)
    clip = args.clip or None
    write_atomic(path, record)
    out_of_time = False
    try:
        for step in range(len(record["losses"]), args.steps):
            recent = record["step_s"][-5:]
            if _time_left() < (1.5 * max(recent) if recent else 0.0) + args.reserve_s:
                record["stopped"] = f"time limit, before step {step + 1}"
                out_of_time = True
                break
            for group in optimizer.param_groups:
                group["lr"] = lr_at(args, step)
            start = time.perf_counter()
            calibrating = step == 0 and key in CALIBRATED_FIRST_STEP
            loss = bench_gpt.train_step(model, recipe, batches.batch_at(step).to(args.device),
                                        optimizer, clip=clip,
                                        calibrating=calibrating).item()  # (synchronises)
            record["step_s"].append(time.perf_counter() - start)
            record["losses"].append(loss)
            if not math.isfinite(loss):
                record["stopped"] = f"non-finite loss at step {step + 1}"
                break
            if (step + 1) % args.flush_every == 0:
                write_atomic(path, record)
            if args.checkpoint_dir and args.checkpoint_every and \
                    (step + 1) % args.checkpoint_every == 0:
                save_checkpoint(args, key, model, optimizer, record)
        record["complete"] = len(record["losses"]) == args.steps
        if args.checkpoint_dir and out_of_time:
            save_checkpoint(args, key, model, optimizer, record)
        record["val_loss"] = validation_loss(model, recipe, val, args.batch, args.device)
        record["val_at_step"] = len(record["losses"])
    except Stopped:
        record["stopped"] = f"SIGTERM after step {len(record['losses'])}"
        raise
    finally:
        write_atomic(path, record)
    return record


def train_main(args) -> dict:
    global _deadline
    _deadline = math.inf if args.time_limit_s is None else START + args.time_limit_s
    cfg = SMOKE_CONFIG if args.smoke else CONFIG
    corpus = stdlib_text.load(args.corpus)
    batches = stdlib_text.Batches(corpus.train, cfg.seq, args.batch, args.seed)
    val = stdlib_text.val_windows(corpus.val, cfg.seq, args.val_windows)
    initial = bench_gpt.initial_model(cfg, args.device, args.seed)
    base = {"config": run_config(args, cfg), "steps_planned": args.steps,
            "data": {**corpus.describe(), "val_windows": len(val)},
            "epochs": batches.epochs_for(args.steps),
            "init_checksum": weights_checksum(initial),
            "params": sum(p.numel() for p in initial.parameters()),
            "info": common.device_info(args.device), "argv": sys.argv[1:]}
    print(f"{corpus.name}: {base['data']['tokens']:,} tokens "
          f"({corpus.train.numel():,} train, {corpus.val.numel():,} validation), "
          f"{args.steps} steps read {base['epochs']:.2f} of the training tokens; "
          f"{base['params']:,} parameters, initial weights {base['init_checksum']}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    step_s = 0.0  # the median step of the precision before: 10 of them to start another
    try:
        for key in args.precisions:
            if _time_left() < args.reserve_s + 10 * step_s:
                print(f"{key}: not started, {max(0.0, _time_left()):.0f} s left", flush=True)
                continue
            started = time.monotonic()
            record = train_precision(args, key, cfg, initial, batches, val, base)
            step_s = statistics.median(record["step_s"]) if record["step_s"] else step_s
            print(f"{key}: {len(record['losses'])} steps in {time.monotonic() - started:.1f} s"
                  f", last loss {record['losses'][-1] if record['losses'] else float('nan'):.4f}"
                  f", validation {record['val_loss']:.4f}"
                  + (f" (stopped: {record['stopped']})" if record["stopped"] else ""),
                  flush=True)
            if args.device.type == "cuda":
                torch.cuda.empty_cache()
    except Stopped:
        print("SIGTERM: stopped; the records hold the steps done", flush=True)
    finally:
        signal.signal(signal.SIGTERM, previous)
    return summarize([args.out], args.out, args.tail, no_plot=args.no_plot)


# ----------------------------------------------------------------------------- summary

COLUMNS = [
    ["precision", "precision", "{}"],
    ["steps", "steps done", "{}"],
    ["final_loss", "final train loss (mean of the last steps)", "{:.4f}"],
    ["ratio", "ratio to bf16", "{:.4f}"],
    ["within", "within 0.5% of bf16", "{}"],
    ["val_loss", "validation loss (end)", "{:.4f}"],
    ["val_ratio", "validation ratio to bf16", "{:.4f}"],
    ["step_ms", "median step (ms)", "{:.1f}"],
    ["run", "run (folder)", "{}"],
]


def read_records(dirs) -> dict:
    """{precision: record} from the per-precision JSONs in ``dirs`` (folders or files); where
    a precision appears more than once, the record with the most steps (the later on a tie)."""
    found = {}
    for where in dirs:
        paths = [where] if os.path.isfile(where) else \
            sorted(glob.glob(os.path.join(where, f"{NAME}.*.json")))
        for path in paths:
            with open(path) as f:
                record = json.load(f)
            record["_from"] = path
            best = found.get(record["precision"])
            if best is None or len(record["losses"]) >= len(best["losses"]):
                found[record["precision"]] = record
    if not found:
        raise ValueError(f"--summarize: no {NAME}.<precision>.json in {list(dirs)}")
    order = list(PRECISIONS.values())
    return dict(sorted(found.items(), key=lambda kv: order.index(kv[0])))


def check_comparable(records: dict) -> None:
    """Same model, batches, optimizer, text and initial weights, or a ValueError naming the
    difference."""
    first_name, first = next(iter(records.items()))
    for name, record in records.items():
        for field in ("config", "data", "init_checksum"):
            a, b = first[field], record[field]
            if field == "data":  # the validation count follows the run's --val-windows
                a, b = ({k: v for k, v in d.items() if k != "val_windows"} for d in (a, b))
            if a != b:
                raise ValueError(f"--summarize: {name} ({record['_from']}) and {first_name} "
                                 f"({first['_from']}) differ in {field}: {b} vs {a}")


def smooth(values, window: int) -> list:
    """Trailing moving average over ``window`` steps (fewer at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def summarize(dirs, out: str, tail: int | None = None, no_plot: bool = False) -> dict:
    """The summary of the records in ``dirs``; ``tail``: steps averaged for the final loss
    (default 50, 10 for smoke runs)."""
    records = read_records(dirs)
    check_comparable(records)
    first = next(iter(records.values()))
    tail = tail or (10 if first["config"]["smoke"] else 50)
    # Compare at the last step every precision reached (a run cut short lowers it for all)
    common_steps = min(len(r["losses"]) for r in records.values())
    n_tail = max(1, min(tail, common_steps))

    def final(record):
        return statistics.fmean(record["losses"][common_steps - n_tail:common_steps]) \
            if common_steps else None
    ref = records.get("bf16")
    rows = []
    for name, r in records.items():
        ratio = common.ratio(final(r), final(ref)) if ref else None
        rows.append({
            "precision": name, "steps": f"{len(r['losses'])}/{r['steps_planned']}",
            "final_loss": final(r), "ratio": ratio,
            "within": "reference" if name == "bf16" else "n/a" if ratio is None else
            "yes" if abs(ratio - 1) <= TOLERANCE else "NO",
            "val_loss": r["val_loss"],
            "val_ratio": common.ratio(r["val_loss"], ref["val_loss"])
            if ref and r.get("val_at_step") == ref.get("val_at_step") else None,
            "step_ms": statistics.median(r["step_s"]) * 1e3 if r["step_s"] else None,
            "run": os.path.basename(os.path.dirname(os.path.abspath(r["_from"]))),
            "stopped": r["stopped"]})
    data, model = first["data"], first["config"]["model"]
    notes = [
        f"final train loss: mean of steps {common_steps - n_tail + 1}-{common_steps} (the last "
        f"{n_tail} steps every precision reached); within: |ratio - 1| <= {TOLERANCE:.1%}",
        f"model d{model['d_model']} L{model['layers']} H{model['heads']} T{model['seq']} "
        f"V{model['vocab']}, {first['params']:,} parameters, batch {first['config']['batch']}, "
        f"initial weights {first['init_checksum']} (every run), seed {first['config']['seed']}",
        f"text: corpus '{data['corpus']}' of Python {data['python']}, {data['tokens']:,} byte "
        f"tokens ({data['train_tokens']:,} train, {data['val_tokens']:,} held out), sha256 "
        f"{data['sha256'][:16]}; {first['steps_planned']} steps read {first['epochs']:.2f} of the "
        f"training tokens, the same batches in the same order for every precision",
        "validation loss: after each run's last step, on "
        + ", ".join(f"{r['data']['val_windows']}" for r in records.values())
        + " held-out sequences (per precision); its ratio only where the run stopped at the "
        "step bf16's did",
    ]
    notes += [f"{name}: stopped ({r['stopped']})" for name, r in records.items() if r["stopped"]]
    devices = sorted({r["info"].get("device_name", "?") for r in records.values()})
    runs = {}
    for name, r in records.items():
        runs.setdefault(common.describe(r["info"]), []).append(name)
    notes += [f"{', '.join(names)}: {where}" for where, names in runs.items()]
    payload = {"name": NAME, "title": TITLE, "what": WHAT, "smoke": first["config"]["smoke"],
               "info": first["info"], "columns": COLUMNS, "rows": rows, "notes": notes,
               "extra": {"losses": {n: r["losses"] for n, r in records.items()},
                         "devices": devices, "sources": [r["_from"] for r in records.values()],
                         "common_steps": common_steps, "tail": n_tail}}
    text = common.payload_markdown(payload)
    print(text)
    if payload["smoke"]:
        print("(smoke run on a tiny model: the numbers above mean nothing)")
    os.makedirs(out, exist_ok=True)
    common.write_json(os.path.join(out, f"{NAME}.json"), payload)
    with open(os.path.join(out, f"{NAME}.md"), "w") as f:
        f.write(text + "\n")
    if not no_plot:
        common.save_plot(os.path.join(out, f"{NAME}.png"),
                         [(plot_curves, payload), (plot_difference, payload)],
                         title=" / ".join(devices))
    return payload


def _window(payload) -> int:
    """One moving-average window for every curve: 1/40 of the longest."""
    return max(1, max(len(c) for c in payload["extra"]["losses"].values()) // 40)


def plot_curves(ax, payload):
    styles = ["-", "--", ":", "-."]  # the FP8 curves may lie on the bf16 one
    for i, (name, losses) in enumerate(payload["extra"]["losses"].items()):
        steps = range(1, len(losses) + 1)
        line, = ax.plot(steps, smooth(losses, _window(payload)), styles[i % 4], label=name)
        ax.plot(steps, losses, color=line.get_color(), alpha=0.2, linewidth=0.6)
    ax.set_yscale("log")  # the late steps' differences stay visible
    from matplotlib.ticker import FormatStrFormatter
    ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
    ax.yaxis.set_minor_formatter(FormatStrFormatter("%g"))
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats per byte)")
    ax.set_title(f"training loss (moving average of {_window(payload)} steps; raw faint)",
                 fontsize=9)
    ax.legend(fontsize=7)


def plot_difference(ax, payload):
    curves = payload["extra"]["losses"]
    ax.axhspan(-TOLERANCE * 100, TOLERANCE * 100, color="tab:green", alpha=0.12,
               label=f"±{TOLERANCE:.1%}")
    if "bf16" in curves:
        ref = smooth(curves["bf16"], _window(payload))
        for name, losses in curves.items():
            if name == "bf16":
                continue
            mine = smooth(losses, _window(payload))
            n = min(len(ref), len(mine))
            ax.plot(range(1, n + 1), [100 * (mine[i] / ref[i] - 1) for i in range(n)],
                    label=name)
    ax.set_xlabel("step")
    ax.set_ylabel("loss relative to bf16 (%)")
    ax.set_title("FP8 loss / bf16 loss - 1 (moving averages)", fontsize=9)
    ax.legend(fontsize=7)


# ----------------------------------------------------------------------------- entry point

def main(argv=None) -> dict:
    args = parse(argv)
    if args.summarize:
        return summarize(args.summarize, args.out, args.tail, no_plot=args.no_plot)
    return train_main(args)


if __name__ == "__main__":
    main()
