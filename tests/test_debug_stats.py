"""transformer_fp8.debug statistics: every figure against a pure-torch computation on hand-made
tensors (exact fractions), per block for the block recipes, the collector end to end (records
of a Linear and a LayerNormMLP step against the tensors they cast, frequency, layer filter,
JSON lines, heat map) and its zero cost when off (the same operators dispatched)."""
from __future__ import annotations

import math

import pytest
import torch
from conftest import randn
from torch.utils._python_dispatch import TorchDispatchMode

import transformer_fp8 as tfp8
from transformer_fp8 import _fp8_hooks, debug, ops
from transformer_fp8.ops.blockwise import quantize_blockwise
from transformer_fp8.debug.stats import combine, derive, operand_stats, operand_stats_reference

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
DELAYED = tfp8.DelayedScaling(amax_history_len=4)


def figures(x, q, scale, fp8_max, *blocks):
    return derive(operand_stats(x, q, scale, fp8_max, *blocks).cpu())


def test_per_tensor_figures_on_a_hand_made_tensor(device):
    # scale 1, E4M3: 2**-11 flushes to zero (half the smallest subnormal 2**-9 rounds down),
    # 500 and -1000 are clamped to +-448, 0 does not count.
    x = torch.tensor([[0.0, 2.0 ** -11, 1.0, 500.0], [-1000.0, 2.0 ** -8, 2.0, 3.0]],
                     device=device)
    scale = torch.ones(1, device=device)
    q = ops.cast_to_fp8(x, scale, E4M3)
    f = figures(x, q, scale, 448.0)
    assert f["nonzero"] == 7 and f["amax"] == 1000.0
    assert f["underflow_frac"] == 1 / 7 and f["saturation_frac"] == 2 / 7
    assert f["dynamic_range_log2"] == math.log2(1000.0 / 2.0 ** -11)
    assert f["scale_min"] == f["scale_max"] == 1.0 and f["blocks"] == 1
    back = q.double().cpu()  # scale 1
    expected_db = 10 * math.log10((x.double().cpu() ** 2).sum().item()
                                  / ((x.double().cpu() - back) ** 2).sum().item())
    assert f["sqnr_db"] == pytest.approx(expected_db, rel=1e-12)
    assert f["block_min_sqnr_db"] == pytest.approx(expected_db, rel=1e-12)


def test_per_tensor_figures_with_a_scale_against_pure_torch(gen, device):
    x = randn(gen, 64, 48, device=device, scale=1e-3)
    x[3, :5] = 0
    x[7, 7] = 80.0  # saturates under the scale below
    scale = torch.tensor([2.0 ** 12], device=device)
    q = ops.cast_to_fp8(x, scale, E5M2)
    f = figures(x, q, scale, 57344.0)
    xc, qc = x.cpu().double(), q.cpu().double()
    nonzero = xc != 0
    assert f["nonzero"] == nonzero.sum().item() == 64 * 48 - 5
    assert f["underflow_frac"] == (nonzero & (qc == 0)).sum().item() / (64 * 48 - 5)
    assert f["saturation_frac"] == ((xc * 2.0 ** 12).abs() > 57344).sum().item() / (64 * 48 - 5)
    assert f["saturation_frac"] == 1 / (64 * 48 - 5)
    back = qc / 2.0 ** 12
    expected_db = 10 * math.log10((xc ** 2).sum().item() / ((xc - back) ** 2).sum().item())
    assert f["sqnr_db"] == pytest.approx(expected_db, rel=1e-9)
    assert f["dynamic_range_log2"] == pytest.approx(
        math.log2(80.0 / xc.abs()[nonzero].min().item()), rel=1e-6)


@pytest.mark.parametrize("fp8", [E4M3, E5M2])
def test_saturation_counts_exactly_the_values_the_clamp_changes(device, fp8):
    # Scale 1, values around the FP8 max: up to fp8_max + half a step, rounding gives fp8_max
    # with or without the clamp; past it (and, for E5M2, at the tie, which rounds to the odd
    # max's even neighbour) torch's unclamped conversion overflows to NaN or inf.
    fp8_max = torch.finfo(fp8).max
    tie = fp8_max * (1 + 1 / 28 if fp8 == E4M3 else 1 + 1 / 14)  # 464, 61440
    near = torch.tensor([tie, fp8_max], dtype=torch.float32)
    edges = torch.cat([near, torch.nextafter(near, near * 2), torch.nextafter(near, near * 0)])
    x = torch.cat([torch.linspace(0.9 * fp8_max, 1.2 * fp8_max, 2001), edges])
    x = torch.stack([x, -x]).to(device)
    unclamped = x.cpu().to(fp8).float()
    changed = ~torch.isfinite(unclamped) | (unclamped.abs() > fp8_max)
    tie_at, past_tie, before_tie = 2001, 2003, 2005  # where the edges are in x
    assert changed[:, past_tie].all() and not changed[:, before_tie].any()
    assert changed[:, tie_at].all() == (fp8 == E5M2)
    scale = torch.ones(1, device=device)
    q = ops.cast_to_fp8(x, scale, fp8)
    for stats in (operand_stats, operand_stats_reference):
        f = derive(stats(x, q, scale, fp8_max).cpu())
        assert f["saturation_frac"] == changed.sum().item() / x.numel(), stats


def test_current_scaling_never_counts_as_saturated(gen, device):
    # scale = fp8_max / amax in float32 can put amax * scale an ulp over fp8_max: no clamp.
    for fp8 in (E4M3, E5M2):
        fp8_max = torch.finfo(fp8).max
        for _ in range(50):
            x = randn(gen, 4, 64, device=device) * torch.rand((), generator=gen).item() * 1e3
            scale = (torch.tensor(fp8_max) / x.abs().max().cpu().float()).reshape(1).to(device)
            q = ops.cast_to_fp8(x, scale, fp8)
            assert figures(x, q, scale, fp8_max)["saturation_frac"] == 0.0


def test_exact_zero_and_all_zero_tensors(device):
    x = torch.tensor([[0.0, 0.5, -0.25, 4.0]], device=device)  # exact in E4M3
    scale = torch.ones(1, device=device)
    f = figures(x, ops.cast_to_fp8(x, scale, E4M3), scale, 448.0)
    assert f["sqnr_db"] == math.inf and f["underflow_frac"] == 0 and f["dynamic_range_log2"] == 4
    zeros = torch.zeros(2, 16, device=device)
    f = figures(zeros, ops.cast_to_fp8(zeros, scale, E4M3), scale, 448.0)
    assert f["nonzero"] == 0 and f["underflow_frac"] == f["saturation_frac"] == 0.0
    assert f["dynamic_range_log2"] == 0.0 and f["sqnr_db"] == math.inf


@pytest.mark.parametrize("blocks", [(1, 128), (128, 128), "rowwise"])
def test_block_figures_against_pure_torch(gen, device, blocks):
    rows, cols = 130, 300  # partial edge blocks both ways
    x = randn(gen, rows, cols, device=device)
    x[:, 200:210] *= 1e4  # an outlier block column
    x[5, :] *= 1e-30      # a row that flushes away in its own blocks only if scaled with others
    block_rows, block_cols = (1, cols) if blocks == "rowwise" else blocks
    q, scale_inv, _, _ = quantize_blockwise(x, block_rows, -1 if blocks == "rowwise"
                                            else block_cols, E4M3, True)
    f = figures(x, q, scale_inv.reciprocal(), 448.0, block_rows, block_cols)
    # Pure torch, block by block.
    xc, qc, si = x.cpu().double(), q.cpu().double(), scale_inv.cpu().double()
    full = si.repeat_interleave(block_rows, 0).repeat_interleave(block_cols, 1)[:rows, :cols]
    back = qc * full
    nonzero = xc != 0
    worst, amaxes, count = math.inf, [], 0
    for r0 in range(0, rows, block_rows):
        for c0 in range(0, cols, block_cols):
            xb, bb = xc[r0:r0 + block_rows, c0:c0 + block_cols], back[r0:r0 + block_rows,
                                                                       c0:c0 + block_cols]
            count += 1
            amaxes.append(xb.abs().max().item())
            noise = ((xb - bb) ** 2).sum().item()
            if noise:
                worst = min(worst, 10 * math.log10((xb ** 2).sum().item() / noise))
    assert f["blocks"] == count and f["block_amax_min"] == pytest.approx(min(amaxes), rel=1e-6)
    assert f["block_min_sqnr_db"] == pytest.approx(worst, rel=1e-9)
    assert f["underflow_frac"] == (nonzero & (qc == 0)).sum().item() / nonzero.sum().item()
    assert f["saturation_frac"] == 0.0  # power-of-two block scales never clamp
    assert f["scale_min"] == pytest.approx(1 / si.max().item()) and \
        f["scale_max"] == pytest.approx(1 / si.min().item())
    expected_db = 10 * math.log10((xc ** 2).sum().item() / ((xc - back) ** 2).sum().item())
    assert f["sqnr_db"] == pytest.approx(expected_db, rel=1e-9)


# ---- the collector ------------------------------------------------------------------------------

def linear_step(layer, x, grad, recipe=DELAYED):
    x = x.clone().requires_grad_(True)
    with tfp8.fp8_autocast(fp8_recipe=recipe):
        out = layer(x)
    out.backward(grad)


def test_linear_records_match_the_tensors_it_casts(gen, device):
    layer = tfp8.Linear(64, 32, device=device)
    x, grad = randn(gen, 20, 64, device=device), randn(gen, 20, 32, device=device, scale=1e-6)
    linear_step(layer, x, grad)  # sets the delayed scales
    fwd_scale, bwd_scale = layer.fp8_fwd_scale.clone(), layer.fp8_bwd_scale.clone()
    model = torch.nn.Sequential(layer)
    with debug.collect_stats(model) as stats:
        linear_step(layer, x, grad)
        records = {r["tensor"]: r for r in stats.step()}
    assert _fp8_hooks.observer is None
    assert sorted(records) == ["grad_output", "input", "weight"]
    assert all(r["layer"] == "0" and r["gemm"] == "" and r["step"] == 0
               for r in records.values())
    for role, t, scale, fp8 in (("input", x, fwd_scale[0], E4M3),
                                ("weight", layer.weight.detach(), fwd_scale[1], E4M3),
                                ("grad_output", grad, bwd_scale[0], E5M2)):
        q = ops.cast_to_fp8(t, scale.reshape(1), fp8)
        expected = figures(t, q, scale.reshape(1), torch.finfo(fp8).max)
        got = records[role]
        for key in ("amax", "scale_min", "underflow_frac", "saturation_frac", "nonzero",
                    "dynamic_range_log2"):
            assert got[key] == expected[key], (role, key)
        assert got["sqnr_db"] == pytest.approx(expected["sqnr_db"], rel=1e-12), role


def test_fused_casts_of_layernorm_mlp_are_recorded(gen, device):
    torch.manual_seed(gen.initial_seed() % 2**31)
    mlp = tfp8.LayerNormMLP(64, 128, device=device)
    model = torch.nn.Sequential(mlp)
    x = randn(gen, 16, 64, device=device)
    for recipe in (DELAYED, tfp8.Float8CurrentScaling(), tfp8.Float8BlockScaling()):
        with debug.collect_stats(model) as stats:
            linear_step(model, x, randn(gen, 16, 64, device=device), recipe)
            records = {(r["gemm"], r["tensor"]): r for r in stats.step()}
        roles = ("grad_output", "input", "weight")
        if isinstance(recipe, tfp8.Float8BlockScaling):  # (and the transposes' own scales)
            roles = ("grad_output", "grad_output_t", "input", "input_t", "weight", "weight_t")
        assert sorted(records) == [(g, t) for g in ("fc1", "fc2") for t in roles]
        ln = torch.nn.functional.layer_norm(x, (64,), mlp.layer_norm_weight,
                                            mlp.layer_norm_bias, mlp.eps)
        assert records["fc1", "input"]["amax"] == pytest.approx(ln.abs().max().item(),
                                                                rel=1e-6)
        assert records["fc2", "weight"]["amax"] == mlp.fc2_weight.abs().max().item()
        assert all(r["sqnr_db"] > 20 for r in records.values()), recipe


def test_frequency_and_layer_filter(gen, tmp_path):
    model = torch.nn.Sequential(tfp8.Linear(32, 32), torch.nn.ReLU(), tfp8.Linear(32, 16))
    path = str(tmp_path / "stats.jsonl")
    with debug.collect_stats(model, layers="2", frequency=2, path=path) as stats:
        counts = []
        for _ in range(5):
            linear_step(model, randn(gen, 8, 32), randn(gen, 8, 16))
            counts.append(len(stats.step()))
    assert counts == [3, 0, 3, 0, 3]
    records = debug.read_records(path)
    assert [r["step"] for r in records] == [0] * 3 + [2] * 3 + [4] * 3
    assert {r["layer"] for r in records} == {"2"} and records == stats.records
    labels, steps, matrix = debug.heatmap_matrix(path, "underflow_frac")
    assert labels == ["2:grad_output", "2:input", "2:weight"] and steps == [0, 2, 4]
    assert matrix[1][2] == records[7]["underflow_frac"]
    table = debug.worst_report(path, top=2)
    assert table.splitlines()[0].startswith("operand") and len(table.splitlines()) == 3
    pytest.importorskip("matplotlib")
    debug.plot_heatmap(path, "sqnr_db", out=str(tmp_path / "heat.png"))
    assert (tmp_path / "heat.png").stat().st_size > 1000


def test_collector_refuses_bad_arguments():
    model = torch.nn.Sequential(tfp8.Linear(16, 16))
    with pytest.raises(ValueError, match=r"layers='x\*' matches no FP8 module.*: 0"):
        debug.collect_stats(model, layers="x*")
    with pytest.raises(ValueError, match="frequency must be a positive integer, got 0"):
        debug.collect_stats(model, frequency=0)
    with pytest.raises(TypeError, match="layers must be a glob pattern"):
        debug.collect_stats(model, layers=3)


def test_a_logged_step_without_casts_warns_once():
    model = torch.nn.Sequential(tfp8.Linear(16, 16))
    with debug.collect_stats(model) as stats:
        with pytest.warns(UserWarning, match="saw no FP8 cast.*eager mode only"):
            assert stats.step() == []
        stats.step()  # no second warning (pytest's filter would fail on an unexpected one)


# ---- zero cost when off ------------------------------------------------------------------------

class _OpLog(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _ops_of_a_step(model, x, grad, recipe):
    with _OpLog() as log:
        linear_step(model, x, grad, recipe)
    return log.ops


@pytest.mark.parametrize("recipe", [DELAYED, tfp8.Float8BlockScaling()], ids=["delayed", "block"])
def test_off_unselected_or_unlogged_dispatches_the_same_operators(gen, recipe):
    model = torch.nn.Sequential(tfp8.Linear(32, 32), torch.nn.ReLU(), tfp8.Linear(32, 32))
    x, grad = randn(gen, 8, 32), randn(gen, 8, 32)
    linear_step(model, x, grad, recipe)
    baseline = _ops_of_a_step(model, x, grad, recipe)
    with debug.collect_stats(model, layers="2", frequency=2) as stats:
        with pytest.warns(UserWarning, match="saw no FP8 cast"):
            stats.step()  # step 0 logged (nothing ran); step 1 is not logged
        assert _ops_of_a_step(model, x, grad, recipe) == baseline
        stats.step()
        logged = _ops_of_a_step(model, x, grad, recipe)  # step 2: layer "2" logged
        assert len(logged) > len(baseline) and stats.step()
    alone = _ops_of_a_step(model[2], x, grad, recipe)
    with debug.collect_stats(model, layers="0") as stats:  # logged, layer "2" not selected
        linear_step(model[0], x, grad, recipe)
        assert _ops_of_a_step(model[2], x, grad, recipe) == alone
        assert {r["layer"] for r in stats.step()} == {"0"}
    assert _fp8_hooks.observer is None
    assert _ops_of_a_step(model, x, grad, recipe) == baseline  # off again


def test_microbatches_combine_to_the_figures_of_the_whole_batch(gen, device):
    # One scale for both halves (as in one step): every count and extremum of the whole batch.
    x = randn(gen, 40, 48, device=device, scale=1e-2)
    x[:20, :6] = 0
    x[31, 3] = 9.0  # clamps under the scale below
    scale = torch.tensor([64.0], device=device)
    q = ops.cast_to_fp8(x, scale, E4M3)
    halves = torch.stack([operand_stats(x[:20], q[:20], scale, 448.0),
                          operand_stats(x[20:], q[20:], scale, 448.0)])
    combined = derive(combine(halves).cpu())
    whole = figures(x, q, scale, 448.0)
    for key in ("amax", "scale_min", "scale_max", "nonzero", "underflow_frac",
                "saturation_frac", "dynamic_range_log2"):
        assert combined[key] == whole[key], key
    assert combined["sqnr_db"] == pytest.approx(whole["sqnr_db"], rel=1e-12)
    assert combined["blocks"] == 2 and combined["block_min_sqnr_db"] == pytest.approx(min(
        figures(x[:20], q[:20], scale, 448.0)["sqnr_db"],
        figures(x[20:], q[20:], scale, 448.0)["sqnr_db"]), rel=1e-12)
    empty = operand_stats(x[:0], q[:0], scale, 448.0)  # a cast of no rows counts nowhere
    assert derive(combine(torch.stack([halves[0], empty])).cpu()) == derive(halves[0].cpu())


# ---- review fixes: padding, overrides, NaN ranking, enabling again ---------------------------

@pytest.mark.parametrize("recipe", [tfp8.Float8RowwiseScaling(), tfp8.Float8BlockScaling()],
                         ids=["rowwise", "block"])
def test_block_figures_leave_the_gemm_padding_out(recipe):
    """20 rows: the layer pads its operands to 32 for the GEMM; the statistics count the 20
    rows' blocks only (the zero rows were blocks of amax 0 and scale 1: blocks 32 instead of
    20, block_amax_min 0, scale_min 1 where every real scale is 64 or more)."""
    torch.manual_seed(0)
    layer = tfp8.Linear(256, 64)
    x, g = torch.randn(20, 256), torch.randn(20, 64) * 1e-3
    with debug.collect_stats(torch.nn.Sequential(layer)) as stats:
        with tfp8.fp8_autocast(fp8_recipe=recipe):
            out = layer(x.clone().requires_grad_(True))
        out.backward(g)
        records = {r["tensor"]: r for r in stats.step()}
    for role, t in (("input", x), ("grad_output", g)):
        cols = t.shape[1] if isinstance(recipe, tfp8.Float8RowwiseScaling) else 128
        blocks = torch.stack([t[:, c:c + cols].abs().amax(1) for c in range(0, t.shape[1], cols)])
        record = records[role]
        assert record["blocks"] == blocks.numel(), role
        assert record["block_amax_min"] == pytest.approx(blocks.min().item()), role
        assert record["scale_min"] > 1.0, role


@pytest.mark.parametrize("gemms", [["fprop"], ["dgrad"], ["wgrad"]])
@pytest.mark.parametrize("module", ["Linear", "LayerNormLinear"])
def test_an_override_of_some_gemms_leaves_every_operand_recorded(module, gemms):
    """Under debug.override(gemms=...) the operands still cast to FP8 are all recorded (a
    fused cast of a role with no high-precision orientation went past the statistics:
    grad_output or a norm's output was missing)."""
    torch.manual_seed(0)
    layer = (tfp8.Linear(64, 32) if module == "Linear" else tfp8.LayerNormLinear(64, 32))
    model = torch.nn.Sequential(layer)
    debug.override(model, "0", fp8=False, gemms=gemms)
    with debug.collect_stats(model) as stats:
        with tfp8.fp8_autocast(fp8_recipe=DELAYED):
            out = layer(torch.randn(32, 64, requires_grad=True))
        out.sum().backward()
        recorded = {r["tensor"] for r in stats.step()}
    assert recorded == {"input", "weight", "grad_output"}


def test_worst_report_ranks_nan_first_and_the_rest_in_order():
    records = [dict(layer=str(i), gemm="", tensor="input", step=0, sqnr_db=v, underflow_frac=0.0,
                    saturation_frac=0.0, dynamic_range_log2=0.0, amax=1.0, scale_min=1.0)
               for i, v in enumerate([31.6, 32.0, float("nan"), 31.1, 31.3, 31.0])]
    records.append(dict(records[2], sqnr_db=40.0, step=1))  # a later, finite value of layer 2
    lines = debug.worst_report(records, "sqnr_db", top=3).splitlines()[1:]
    assert [line.split(":")[0] for line in lines] == ["2", "5", "3"]
    for bad in (0, -1, 2.5, True):  # (-1 listed all but the least bad)
        with pytest.raises(ValueError, match="top must be a positive integer"):
            debug.worst_report(records, "sqnr_db", top=bad)


def test_collecting_again_after_disable_writes(tmp_path):
    torch.manual_seed(0)
    layer = tfp8.Linear(32, 32)
    stats = debug.collect_stats(torch.nn.Sequential(layer), path=str(tmp_path / "s.jsonl"))
    for _ in range(2):
        with stats:
            with tfp8.fp8_autocast(fp8_recipe=DELAYED):
                layer(torch.randn(16, 32, requires_grad=True)).sum().backward()
            assert len(stats.step()) == 3
    assert len(debug.read_records(str(tmp_path / "s.jsonl"))) == 6


@pytest.mark.parametrize("recipe", [tfp8.Float8RowwiseScaling(), tfp8.Float8BlockScaling()],
                         ids=["rowwise", "block"])
def test_block_recipes_record_the_transposed_operands(recipe):
    """Under block scaling x^T, w^T and g^T have scales of their own (wgrad and dgrad read
    them): recorded as input_t, weight_t and grad_output_t, each with the figures of the cast
    of the transposed tensor itself. A token 1e5 times the others: 19% of x^T (the wgrad
    operand) flushes to zero, which input's figures do not show."""
    torch.manual_seed(0)
    layer = tfp8.Linear(256, 64)
    x = torch.randn(20, 256)
    x[3] *= 1e5
    g = torch.randn(20, 64)
    with debug.collect_stats(torch.nn.Sequential(layer)) as stats:
        with tfp8.fp8_autocast(fp8_recipe=recipe):
            out = layer(x.clone().requires_grad_(True))
        out.backward(g)
        records = {r["tensor"]: r for r in stats.step()}
    assert sorted(records) == ["grad_output", "grad_output_t", "input", "input_t", "weight",
                               "weight_t"]
    rowwise = isinstance(recipe, tfp8.Float8RowwiseScaling)
    fwd, bwd = recipe.fp8_format.fwd_dtype, recipe.fp8_format.bwd_dtype
    for role, t, fp8, dims in (("input", x, fwd, (1, -1) if rowwise else (1, 128)),
                               ("weight", layer.weight.detach(), fwd,
                                (1, -1) if rowwise else (128, 128)),
                               ("grad_output", g, bwd, (1, -1) if rowwise else (1, 128))):
        t_t = t.t().contiguous()
        q, scale_inv, _, _ = quantize_blockwise(t_t, *dims, fp8_dtype=fp8)
        block_rows, block_cols = (1, t_t.shape[1]) if rowwise else dims
        expected = figures(t_t, q, scale_inv.reciprocal(), torch.finfo(fp8).max, block_rows,
                           block_cols)
        got = records[role + "_t"]
        for key in ("amax", "underflow_frac", "saturation_frac", "blocks", "block_amax_min"):
            assert got[key] == expected[key], (role, key)
        assert got["sqnr_db"] == pytest.approx(expected["sqnr_db"], rel=1e-9), role
    assert records["input_t"]["underflow_frac"] > 0.15 > records["input"]["underflow_frac"]


@pytest.mark.parametrize("recipe", [tfp8.Float8RowwiseScaling(), tfp8.Float8BlockScaling()],
                         ids=["rowwise", "block"])
def test_a_reentrant_checkpoint_records_what_a_plain_step_records(recipe):
    """A reentrant checkpoint's first forward runs without gradients and makes no transposes;
    its recomputation makes them for the backward GEMMs. Under block scaling (transposes with
    blocks of their own) those are recorded then: the same records, with the same figures, as
    a step without the checkpoint (the second layer's weight_t was missing)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(tfp8.Linear(128, 128), torch.nn.GELU(), tfp8.Linear(128, 128))
    x = torch.randn(24, 128)
    tables = []
    for checkpointed in (False, True):
        with debug.collect_stats(model) as stats:
            inp = x.clone().requires_grad_(True)
            with tfp8.fp8_autocast(fp8_recipe=recipe):
                out = (torch.utils.checkpoint.checkpoint(model, inp, use_reentrant=True)
                       if checkpointed else model(inp))
            out.sum().backward()
            tables.append({(r["layer"], r["tensor"]): r for r in stats.step()})
    assert len(tables[0]) == 12 and sorted(tables[1]) == sorted(tables[0])
    for key, plain in tables[0].items():
        got = {k: v for k, v in tables[1][key].items() if k != "step"}
        assert got == {k: v for k, v in plain.items() if k != "step"}, key


@pytest.mark.parametrize("gemms, unread", [("fprop", {"input", "weight"}),
                                           ("dgrad", {"grad_output", "weight_t"}),
                                           ("wgrad", {"grad_output_t", "input_t"})])
def test_an_override_under_block_scaling_records_only_what_fp8_gemms_read(gemms, unread):
    """Under block scaling each orientation has its own blocks: with debug.override(gemms=...)
    the orientations only the high-precision GEMM read are not FP8 operands and are not
    recorded (the rows of input and weight were, with fprop in high precision)."""
    torch.manual_seed(0)
    layer = tfp8.Linear(128, 128)
    model = torch.nn.Sequential(layer)
    debug.override(model, "0", fp8=False, gemms=[gemms])
    with debug.collect_stats(model) as stats:
        with tfp8.fp8_autocast(fp8_recipe=tfp8.Float8BlockScaling()):
            out = layer(torch.randn(32, 128, requires_grad=True))
        out.sum().backward()
        recorded = {r["tensor"] for r in stats.step()}
    every = {"input", "weight", "grad_output", "input_t", "weight_t", "grad_output_t"}
    assert recorded == every - unread


@pytest.mark.parametrize("recipe", [tfp8.Float8CurrentScaling(), tfp8.Float8BlockScaling()],
                         ids=["current", "block"])
def test_a_non_finite_operand_does_not_read_as_healthy(gen, recipe):
    """One NaN in the input: its SQNR, worst block SQNR and dynamic range are NaN (the worst
    block read inf, "exact", or a finite figure, and the dynamic range 0.0, so worst_report
    ranked the broken layer best); one inf: an infinite dynamic range."""
    for bad, check in ((float("nan"), math.isnan), (float("inf"), None)):
        layer = tfp8.Linear(128, 128)
        x = randn(gen, 16, 128)
        x[2, 7] = bad
        with debug.collect_stats(torch.nn.Sequential(layer)) as stats:
            with tfp8.fp8_autocast(fp8_recipe=recipe):
                layer(x)
            record = {r["tensor"]: r for r in stats.step()}["input"]
        if check is not None:
            for key in ("sqnr_db", "block_min_sqnr_db", "dynamic_range_log2"):
                assert math.isnan(record[key]), (key, record[key])
        else:
            assert record["dynamic_range_log2"] == math.inf
            assert not record["block_min_sqnr_db"] == math.inf


# ---- several collectors ------------------------------------------------------------------------

def _three_layers():
    torch.manual_seed(0)
    return torch.nn.Sequential(tfp8.Linear(32, 32), tfp8.Linear(32, 32), tfp8.Linear(32, 32))


def _layers_logged(model, gen, *collectors) -> list:
    """One step: {layer: record count} of each collector's step()."""
    linear_step(model, randn(gen, 16, 32), randn(gen, 16, 32))
    counts = []
    for stats in collectors:
        records = stats.step()
        counts.append({layer: sum(r["layer"] == layer for r in records)
                       for layer in sorted({r["layer"] for r in records})})
    return counts


def test_nested_collectors_each_record_their_layers(gen):
    """Two collectors at once (``with a, b``): each records exactly its own layers, layer 1 in
    both (the outer one recorded nothing: the inner one had replaced it)."""
    model = _three_layers()
    with debug.collect_stats(model, layers=["0", "1"]) as a, \
            debug.collect_stats(model, layers=["1", "2"], frequency=2) as b:
        assert _layers_logged(model, gen, a, b) == [{"0": 3, "1": 3}, {"1": 3, "2": 3}]
        assert _layers_logged(model, gen, a, b) == [{"0": 3, "1": 3}, {}]  # b: step 1 unlogged
        assert a.enable() is a  # enabling an enabled collector: nothing more (not twice)
        assert _layers_logged(model, gen, a, b) == [{"0": 3, "1": 3}, {"1": 3, "2": 3}]
    assert _fp8_hooks.observer is None
    records = [r for r in a.records if r["layer"] == "1" and r["step"] == 2]
    assert records == [r for r in b.records if r["layer"] == "1" and r["step"] == 2]


def test_collectors_disabled_in_any_order_never_record_again(gen):
    """Disabled first-in-first-out: the other collector goes on alone, and once both are off
    nothing records (a.disable() switched b off too, then b.disable() put the disabled a back,
    which kept every cast in memory from then on)."""
    model = _three_layers()
    a = debug.collect_stats(model, layers="0")
    b = debug.collect_stats(model, layers="1")
    a.enable()
    b.enable()
    a.disable()
    assert _layers_logged(model, gen, a, b) == [{}, {"1": 3}]
    b.disable()
    assert _fp8_hooks.observer is None
    linear_step(model, randn(gen, 16, 32), randn(gen, 16, 32))
    assert not a._pending and not b._pending
    a.enable()
    b.enable()
    a.enable()
    a.disable()
    assert _layers_logged(model, gen, a, b) == [{}, {"1": 3}]
    b.disable()
    a.disable()  # (disabling a disabled collector: nothing to do)
    assert _fp8_hooks.observer is None


def test_a_collector_disabled_before_the_backward_records_no_gradient(gen):
    """The backward of a forward observed while enabled: grad_output's cast is not recorded
    into a collector disabled since (it is never stepped again)."""
    model = _three_layers()
    stats = debug.collect_stats(model, layers="0").enable()
    with tfp8.fp8_autocast(fp8_recipe=DELAYED):
        out = model(randn(gen, 16, 32).requires_grad_(True))
    stats.disable()
    out.backward(randn(gen, 16, 32))
    assert {key[2] for key in stats._pending} == {"input", "weight"}


@pytest.mark.parametrize("schedule", ["one", "nested", "fifo"])
def test_training_after_every_collector_is_disabled_is_bit_identical(gen, schedule):
    """Collectors on for some steps (one, two nested, two disabled first-in-first-out), then
    off: every output, gradient, parameter and FP8 state buffer is bit for bit the run's that
    never enabled one."""
    def train(use):
        model = torch.nn.Sequential(tfp8.Linear(32, 32), torch.nn.GELU(),
                                    tfp8.LayerNormMLP(32, 64))
        torch.manual_seed(0)
        for p in model.parameters():
            torch.nn.init.normal_(p, std=0.2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        a = debug.collect_stats(model, layers="0", frequency=2)
        b = debug.collect_stats(model, layers="*")
        plan = {"one": {0: [a.enable], 3: [a.disable]},
                "nested": {0: [a.enable], 1: [b.enable], 3: [b.disable, a.disable]},
                "fifo": {0: [a.enable, b.enable], 2: [a.disable], 3: [b.disable]}}[schedule]
        data = torch.Generator().manual_seed(gen.initial_seed())
        outs = []
        for step in range(6):
            for call in plan.get(step, []) if use else []:
                call()
            x = (torch.randn(16, 32, generator=data) * (1 + step)).requires_grad_(True)
            with tfp8.fp8_autocast(fp8_recipe=DELAYED):
                out = model(x)
            out.square().mean().backward()
            outs += [out.detach(), x.grad]
            opt.step()
            opt.zero_grad()
            for stats in (a, b):
                stats.step()
        assert _fp8_hooks.observer is None
        return outs + list(model.parameters()) + list(model.buffers()), a, b

    never, _, _ = train(False)
    used, a, b = train(True)
    assert len(a.records) > 0 and (schedule == "one" or len(b.records) > 0)
    for i, (x, y) in enumerate(zip(used, never)):
        assert torch.equal(x, y), i
