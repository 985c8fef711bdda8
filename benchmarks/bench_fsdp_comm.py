"""FSDP2 weight all-gather volume per training step: FP8 all-gather against high precision.

One transformer block of a Llama-shaped model (q, k, v, o projections and the SwiGLU MLP's gate,
up and down projections as converted Linear layers, each fully_shard-ed) trains one step on two
gloo processes (CPU); every all_gather_into_tensor call is wrapped and its bytes counted
(forward gathers and the backward re-gathers). Runs: float32 parameters gathered in float32,
in bfloat16 (MixedPrecisionPolicy param_dtype), and in FP8 (fp8_all_gather=True, float32
parameters, DelayedScaling). The per-step figure for the whole model is the block's times the
number of layers (every block has the same shapes; embeddings and the output layer, which are
not FP8 Linear layers, are left out).

    python benchmarks/bench_fsdp_comm.py [--smoke] [--out DIR]
"""
from __future__ import annotations

import datetime
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

import transformer_fp8 as tfp8  # noqa: E402

NAME = "bench_fsdp_comm"
TITLE, WHAT = common.doc_summary(__doc__)
WORLD = 2
# (name, hidden, key/value width, MLP width, layers): Llama 3.2 1B and Llama 3 8B shapes.
MODELS = [("~1B (Llama-3.2-1B shapes)", 2048, 512, 8192, 16),
          ("8B (Llama-3-8B shapes)", 4096, 1024, 14336, 32)]
SMOKE_MODELS = [("smoke", 64, 32, 128, 2)]
RUNS = ("float32", "bfloat16", "fp8")

COLUMNS = [
    ["model", "model", "{}"],
    ["gather", "all-gather of", "{}"],
    ["gib_per_step", "all-gather GiB / step (whole model, per rank)", "{:.3f}"],
    ["ratio_fp32", "vs float32", "{:.3f}"],
    ["ratio_bf16", "vs bfloat16", "{:.3f}"],
]


class _Block(torch.nn.Module):
    """The Linear layers of one Llama block (no attention or norm: only the weights matter)."""

    def __init__(self, hidden: int, kv: int, mlp: int):
        super().__init__()
        linear = lambda i, o: torch.nn.Linear(i, o, bias=False)  # noqa: E731
        self.q, self.k, self.v, self.o = (linear(hidden, hidden), linear(hidden, kv),
                                          linear(hidden, kv), linear(hidden, hidden))
        self.gate, self.up, self.down = linear(hidden, mlp), linear(hidden, mlp), \
            linear(mlp, hidden)

    def layers(self) -> list:
        return [self.q, self.k, self.v, self.o, self.gate, self.up, self.down]

    def forward(self, x):
        attention = self.o(self.q(x)) + self.k(x).sum() + self.v(x).sum()
        return attention + self.down(torch.nn.functional.silu(self.gate(x)) * self.up(x))


def _rank(rank: int, out_dir: str, hidden: int, kv: int, mlp: int, run: str) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/pg_{run}", rank=rank,
                            world_size=WORLD, timeout=datetime.timedelta(seconds=600))
    try:
        torch.manual_seed(0)
        recipe = tfp8.DelayedScaling(amax_history_len=4)
        model = _Block(hidden, kv, mlp)
        tfp8.convert_to_fp8(model, recipe=recipe, fp8_all_gather=run == "fp8")
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if run == "bfloat16" \
            else MixedPrecisionPolicy()
        for layer in model.layers():
            fully_shard(layer, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        sent, original = [], dist.all_gather_into_tensor

        def counting(output_tensor, input_tensor, *args, **kwargs):
            sent.append(input_tensor.numel() * input_tensor.element_size())
            return original(output_tensor, input_tensor, *args, **kwargs)

        x = torch.randn(16, hidden)
        dist.all_gather_into_tensor = counting
        try:
            with tfp8.fp8_autocast(fp8_recipe=recipe):
                loss = model(x).float().square().mean()
            loss.backward()
        finally:
            dist.all_gather_into_tensor = original
        if rank == 0:
            torch.save(sent, os.path.join(out_dir, f"{run}.pt"))
    finally:
        dist.destroy_process_group()
    # The bytes are on disk: skip the interpreter's teardown, where gloo objects left to the
    # garbage collector have been seen to abort (as in tests/multiprocess.py).
    sys.stdout.flush()
    os._exit(0)


def _block_bytes(hidden: int, kv: int, mlp: int, run: str) -> int:
    """Bytes one rank sends in the all-gathers of one training step of one block."""
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_rank, args=(out_dir, hidden, kv, mlp, run), nprocs=WORLD,
                           start_method="spawn")
        return sum(torch.load(os.path.join(out_dir, f"{run}.pt")))


def main(argv=None) -> dict:
    args = common.parse_args(TITLE, argv)
    # The ranks are gloo processes on the CPU whatever --device says (the byte counts do not
    # depend on the device): the results name the CPU, not a GPU the machine may have.
    args.device = torch.device("cpu")
    rows = []
    for model, hidden, kv, mlp, layers in (SMOKE_MODELS if args.smoke else MODELS):
        step = {run: _block_bytes(hidden, kv, mlp, run) * layers for run in RUNS}
        for run in RUNS:
            rows.append({"model": model, "gather": run, "gib_per_step": step[run] / 2**30,
                         "ratio_fp32": step[run] / step["float32"],
                         "ratio_bf16": step[run] / step["bfloat16"]})
    notes = [f"{WORLD} gloo ranks on the CPU, one training step of one block (16 tokens), bytes "
             "counted at every all_gather_into_tensor (forward and backward re-gathers), times "
             "the number of layers; fp8: DelayedScaling, float32 parameters"]
    return common.report(args, NAME, TITLE, WHAT, COLUMNS, rows, plot=plot, notes=notes)


def plot(ax, payload):
    rows = payload["rows"]
    common.bar_plot(ax, [f"{r['model']}\n{r['gather']}" for r in rows],
                    [r["ratio_bf16"] for r in rows], "all-gather bytes / bfloat16's",
                    "FSDP2 weight all-gather per step", reference=1.0,
                    reference_label="bfloat16")


if __name__ == "__main__":
    main()
