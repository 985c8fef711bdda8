"""Tensor parallelism on DTensor beyond the training comparison of test_tensor_parallel.py, on 2
gloo ranks: configurations whose scales cannot be the full tensors' (warned, and what they
give), what is refused (named errors, FP8 state untouched), local shards too narrow for FP8
GEMMs or uneven (high precision on every rank), the high-precision forward, activation
checkpointing, weights kept across microbatches, calibration, and torch.distributed.checkpoint
save/load."""
from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.distributed as dist
from integration_compare import sqnr_db
from multiprocess import run_ranks
from tensor_parallel_mlp import IN, batch, build, parallelize, train
from test_tensor_parallel import assert_ranks_identical, init_device_mesh

import transformer_fp8 as tfp8

pytestmark = pytest.mark.skipif(
    init_device_mesh is None or not dist.is_available() or not dist.is_gloo_available(),
    reason="needs torch.distributed with gloo and DTensor tensor parallelism")

WARNING = "not reduced over the tensor-parallel ranks"
STEPS = 3


def _delayed(reduce_amax: bool = True):
    return tfp8.DelayedScaling(amax_history_len=4, amax_compute_algo="most_recent",
                               reduce_amax=reduce_amax)


def _ours(caught) -> list:
    return [w for w in caught if WARNING in str(w.message)]


def _fp8_state(module) -> dict:
    return {k: v.clone() for k, v in module.state_dict().items() if "fp8_" in k}


def _assert_same_state(before: dict, after: dict, what: str) -> None:
    for key, value in before.items():
        assert torch.equal(value, after[key]), f"{what}: {key} changed"


# ---- configurations whose scales are the shards' own ---------------------------------------

def _config_worker(rank, out_dir):
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
    mesh = init_device_mesh("cpu", (2,))
    results = {}
    # reduce_amax=False: each rank's weight history holds its own shard's amax.
    recipe = _delayed(reduce_amax=False)
    model = parallelize(build(recipe), mesh)
    shard_amax = model.fc1.weight.to_local().abs().max()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results["no_reduce"] = train(model, recipe, STEPS)
    assert len(_ours(caught)) == 1, [str(w.message) for w in caught]
    recorded = results["no_reduce"][0]["fp8_state"]["fc1.fp8_fwd_amax_history"][-1, 1]
    assert torch.equal(recorded, shard_amax), (recorded, shard_amax)
    # An fp8_group without the other tensor-parallel rank: warned too (delayed and current).
    own_groups = [dist.new_group([r]) for r in range(2)]
    for make in (_delayed, tfp8.Float8CurrentScaling):
        del model
        recipe = make()
        model = parallelize(build(recipe), mesh)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            train(model, recipe, 1, group=own_groups[rank])
        assert len(_ours(caught)) == 1, (make, [str(w.message) for w in caught])
    # And none where the group holds every tensor-parallel rank.
    del model
    recipe = _delayed()
    model = parallelize(build(recipe), mesh)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(model, recipe, 1, group=dist.new_group([0, 1]))
    assert not _ours(caught), [str(w.message) for w in caught]

    # Refused: a plain tensor input (the FP8 state untouched by the failed step).
    before = _fp8_state(model)
    with pytest.raises(TypeError, match="input must be a DTensor too"), \
            tfp8.fp8_autocast(fp8_recipe=recipe):
        model.fc1.forward(torch.randn(4, IN))  # the module itself: no style hook
    _assert_same_state(before, _fp8_state(model), "after a plain-tensor input")
    del model
    # Refused: parameters_split, gradient routing; a module other than Linear; a replicated
    # weight.
    for option, value in (("parameters_split", ("a", "b")), ("fuse_wgrad_accumulation", True),
                          ("delay_wgrad_compute", True), ("return_bias", True)):
        layer = parallelize_module(tfp8.Linear(IN, 64, recipe=recipe, **{option: value}),
                                   mesh, ColwiseParallel())
        with pytest.raises(NotImplementedError, match=option), \
                tfp8.fp8_autocast(fp8_recipe=recipe):
            layer(torch.randn(4, IN))
    from torch.distributed.tensor import Replicate, Shard, distribute_module, distribute_tensor

    def shard_weight_rows(name, module, device_mesh):
        module.register_parameter("weight", torch.nn.Parameter(
            distribute_tensor(module.weight, device_mesh, [Shard(0)])))

    norm_linear = distribute_module(tfp8.LayerNormLinear(IN, 64, recipe=recipe), mesh,
                                    shard_weight_rows)
    x = torch.distributed.tensor.DTensor.from_local(torch.randn(4, IN), mesh, [Replicate()])
    with pytest.raises(NotImplementedError, match="transformer_fp8.Linear only"), \
            tfp8.fp8_autocast(fp8_recipe=recipe):
        norm_linear(x)
    replicated = distribute_module(tfp8.Linear(IN, 64, recipe=recipe), mesh)
    before = _fp8_state(replicated)
    with pytest.raises(ValueError, match=r"Shard\(0\) \(ColwiseParallel\) or Shard\(1\)"), \
            tfp8.fp8_autocast(fp8_recipe=recipe):
        replicated(x)
    _assert_same_state(before, _fp8_state(replicated), "after a replicated weight")
    # A layer left plain, given a DTensor (the output of a style with use_local_output=False):
    # named, as torch.nn.Linear refuses it (the FP8 operators named no sharding rule).
    unparallelized = tfp8.Linear(IN, 64, recipe=recipe)
    before = _fp8_state(unparallelized)
    with pytest.raises(TypeError, match="the input is a DTensor and the weight a plain"), \
            tfp8.fp8_autocast(fp8_recipe=recipe):
        unparallelized(x)
    _assert_same_state(before, _fp8_state(unparallelized), "after a DTensor input")
    del layer, norm_linear, replicated

    # Local shards whose GEMM sizes are not multiples of 16 (48 output features, 24 per
    # rank): torch's DTensor linear, with a warning, bit for bit torch.nn.Linear's.
    torch.manual_seed(5)
    narrow = tfp8.Linear(IN, 48, recipe=recipe)
    torch.manual_seed(5)
    plain = torch.nn.Linear(IN, 48)
    narrow = parallelize_module(narrow, mesh, ColwiseParallel())
    plain = parallelize_module(plain, mesh, ColwiseParallel())
    x = batch(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with tfp8.fp8_autocast(fp8_recipe=recipe):
            out = narrow(x)
    # (the local shard's sizes named: the whole layer's, (48, 64), are multiples of 16)
    assert any("runs in high precision" in str(w.message)
               and "local shards [(24, " in str(w.message) for w in caught)
    assert torch.equal(out, plain(x))
    # Uneven shards (33 output features: 17 and 16 rows) under Float8CurrentScaling, whose
    # casts all-reduce their amaxes: every rank runs in high precision (a rank choosing FP8
    # alone would wait in a collective the other never joins), bit for bit torch's.
    current = tfp8.Float8CurrentScaling()
    torch.manual_seed(6)
    uneven = parallelize_module(tfp8.Linear(IN, 33, recipe=current), mesh, ColwiseParallel())
    torch.manual_seed(6)
    plain = parallelize_module(torch.nn.Linear(IN, 33), mesh, ColwiseParallel())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with tfp8.fp8_autocast(fp8_recipe=current):
            out = uneven(x)
    assert any("runs in high precision" in str(w.message)
               and "local shards [(1, " in str(w.message) for w in caught)
    assert torch.equal(out, plain(x))  # (each rank's local columns: 17 and 16)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


def test_configurations_warned_refused_and_narrow_shards(tmp_path):
    run_ranks(_config_worker, (str(tmp_path),), tmp_path)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    # reduce_amax=False: the ranks' FP8 states differ, their results agree (the output is
    # all-reduced), and against one process they are FP8-close, no longer float32-close:
    # measured 23 dB (fc1's weight gradient) to 65 dB; bounds: the package's parity defaults.
    records = [r["no_reduce"] for r in ranks]
    assert not torch.equal(records[0][0]["fp8_state"]["fc1.fp8_fwd_amax_history"],
                           records[1][0]["fp8_state"]["fc1.fp8_fwd_amax_history"])
    single = train(build(_delayed()), _delayed(), STEPS)
    for step, (got, expected) in enumerate(zip(records[0], single)):
        assert torch.equal(got["loss"], records[1][step]["loss"])
        assert sqnr_db(expected["output"], got["output"]) >= 15.0, step
        for name, grad in expected["grads"].items():
            assert sqnr_db(grad, got["grads"][name]) >= 10.0, (step, name)


# ---- training features ----------------------------------------------------------------------

class _TorchMlp(torch.nn.Module):
    """The MLP with torch.nn.Linear layers."""

    def __init__(self, like):
        super().__init__()
        self.fc1 = torch.nn.Linear(like.fc1.in_features, like.fc1.out_features)
        self.act = torch.nn.GELU()
        self.fc2 = torch.nn.Linear(like.fc2.in_features, like.fc2.out_features)
        self.load_state_dict(tfp8.strip_fp8_state(like.state_dict()))

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


def _grads(model) -> dict:
    return {n: p.grad.full_tensor() for n, p in model.named_parameters()}


def _features_worker(rank, out_dir):
    import torch.distributed.checkpoint as dcp
    from torch.utils.checkpoint import checkpoint
    mesh = init_device_mesh("cpu", (2,))
    recipe = _delayed()
    results = {}
    # Outside fp8_autocast: bit for bit torch.nn.Linear under the same styles.
    ours = build(recipe)
    theirs = parallelize(_TorchMlp(ours), mesh)
    ours = parallelize(ours, mesh)
    outs = [m(batch(0)) for m in (ours, theirs)]
    for out, m in zip(outs, (ours, theirs)):
        out.square().mean().backward()
    assert torch.equal(outs[0], outs[1])
    for name, grad in _grads(theirs).items():
        assert torch.equal(_grads(ours)[name], grad), name
    del ours, theirs
    # Non-reentrant activation checkpointing of the whole MLP.
    for key, wrap in (("plain", None), ("checkpointed", True)):
        model = parallelize(build(recipe), mesh)
        run = (lambda x, m=model: checkpoint(m, x, use_reentrant=False)) if wrap else None
        results[key] = train(model, recipe, STEPS, run=run)
        del model, run
    # Two microbatches in one fp8_autocast: the weights cast once (is_first_microbatch) or in
    # every call give the same outputs and gradients.
    by_flags = []
    for flags in ((None, None), (True, False)):
        model = parallelize(build(recipe), mesh)
        with tfp8.fp8_autocast(fp8_recipe=recipe):
            outs = [model.fc2(model.act(model.fc1(batch(i), is_first_microbatch=flag)),
                              is_first_microbatch=flag) for i, flag in enumerate(flags)]
        sum(out.square().mean() for out in outs).backward()
        by_flags.append((outs, _grads(model)))
        del model
    for a, b in zip(by_flags[0][0], by_flags[1][0]):
        assert torch.equal(a, b)
    for name, grad in by_flags[0][1].items():
        assert torch.equal(by_flags[1][1][name], grad), name
    # Calibration: the shards' amaxes, reduced, are the full tensors'.
    model = parallelize(build(recipe), mesh)
    with tfp8.fp8_autocast(enabled=False, calibrating=True, fp8_recipe=recipe):
        model(batch(1))
    results["calibrated"] = _fp8_state(model)
    del model
    # torch.distributed.checkpoint: save after two steps; a model of other weights and a fresh
    # FP8 state loads it, and its third step is the third step of the run that went on.
    model = parallelize(build(recipe), mesh)
    train(model, recipe, 2)
    state = model.state_dict()
    assert type(state["fc1.fp8_fwd_scale"]) is torch.Tensor  # the FP8 state: plain tensors
    assert tuple(state["fc2.weight"].placements) == (torch.distributed.tensor.Shard(1),)
    checkpoint_dir = os.path.join(out_dir, "dcp")
    dcp.save(state, checkpoint_id=checkpoint_dir)
    results["went_on"] = train(model, recipe, 1, first=2)
    del model, state
    loaded = parallelize(build(recipe, seed=1), mesh)
    state = loaded.state_dict()
    dcp.load(state, checkpoint_id=checkpoint_dir)
    loaded.load_state_dict(state)
    results["loaded"] = train(loaded, recipe, 1, first=2)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


def _assert_records_equal(got: list, expected: list, what: str) -> None:
    for step, (g, e) in enumerate(zip(got, expected)):
        for key in ("loss", "output"):
            assert torch.equal(g[key], e[key]), f"{what} step {step}: {key}"
        for kind in ("grads", "fp8_state"):
            assert g[kind].keys() == e[kind].keys()
            for name in e[kind]:
                assert torch.equal(g[kind][name], e[kind][name]), f"{what} step {step}: {name}"


def test_high_precision_checkpointing_microbatches_calibration_dcp(tmp_path):
    run_ranks(_features_worker, (str(tmp_path),), tmp_path)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    assert_ranks_identical(ranks, "checkpointed")
    _assert_records_equal(ranks[0]["checkpointed"], ranks[0]["plain"], "checkpointed")
    _assert_records_equal(ranks[0]["loaded"], ranks[0]["went_on"], "loaded from dcp")
    # Calibration under tensor parallelism records what one process records, bit for bit.
    single = build(_delayed())
    with tfp8.fp8_autocast(enabled=False, calibrating=True, fp8_recipe=_delayed()):
        single(batch(1))
    expected = _fp8_state(single)
    for rank in ranks:
        for key, value in expected.items():
            assert torch.equal(rank["calibrated"][key], value), key
    assert expected["fc1.fp8_fwd_scale"].ne(1.0).all()  # calibration changed the scales


# ---- data-parallel replicas beside the tensor-parallel ranks --------------------------------

def _replica_steps(model, recipe, replica: int, fp8_group=None) -> list:
    """3 SGD steps on the replica's own batches (replica 1's 16 times larger), fp8_group left
    at None unless given: (output, input gradient, every full parameter gradient) per step."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    records = []
    for step in range(3):
        x = (batch(step) * (1 + 15 * replica)).requires_grad_(True)
        with tfp8.fp8_autocast(fp8_recipe=recipe, fp8_group=fp8_group):
            out = model(x)
        out = out.full_tensor() if hasattr(out, "full_tensor") else out
        out.float().square().mean().backward()
        grads = [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                 for p in model.parameters()]
        records.append([out.detach().clone(), x.grad.clone()] + [g.clone() for g in grads])
        opt.step()
        opt.zero_grad(set_to_none=True)
    return records


def _replicas_worker(rank, out_dir):
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "tp"))
    recipe = tfp8.Float8CurrentScaling()
    model = parallelize(build(recipe), mesh["tp"])
    replica = mesh.get_local_rank("dp")
    torch.save({"replica": replica, "steps": _replica_steps(model, recipe, replica)},
               os.path.join(out_dir, f"rank{rank}.pt"))


def test_current_scaling_reduces_over_the_weight_mesh_not_the_replicas(tmp_path):
    """Two data-parallel replicas, each a tensor-parallel mesh of its own, fp8_group=None:
    each replica trains bit for bit as one process on its own batches (every cast's amax was
    all-reduced over the whole world: the other replica's batch moved this one's scales, by
    18-33 dB, and a cast one replica ran alone waited for the other)."""
    run_ranks(_replicas_worker, (str(tmp_path),), tmp_path)
    _assert_each_replica_is_one_process(tmp_path)


def _assert_each_replica_is_one_process(tmp_path) -> None:
    """Each rank's steps bit for bit one process's under current scaling on its batches."""
    recipe = tfp8.Float8CurrentScaling()
    for rank in range(2):
        result = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        expected = _replica_steps(build(recipe), recipe, result["replica"])
        for step, (got, want) in enumerate(zip(result["steps"], expected)):
            for i, (a, b) in enumerate(zip(got, want)):
                assert torch.equal(a, b), (rank, step, i)


def _override_worker(rank, out_dir):
    from transformer_fp8 import debug
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "tp"))
    current = tfp8.Float8CurrentScaling()
    model = parallelize(build(current), mesh["tp"])
    debug.override(model, "*", recipe=current)
    replica = mesh.get_local_rank("dp")
    steps = _replica_steps(model, _delayed(), replica, fp8_group=dist.group.WORLD)
    torch.save({"replica": replica, "steps": steps}, os.path.join(out_dir, f"rank{rank}.pt"))


def test_a_current_scaling_override_reduces_over_the_weight_mesh_not_the_outer_group(tmp_path):
    """debug.override(recipe=Float8CurrentScaling()) inside a DelayedScaling context whose
    fp8_group spans the data-parallel replicas: the override's casts reduce their amaxes over
    the weight's mesh, as the recipe does on its own (they took the outer fp8_group: every
    replica's batch moved the others' scales), so each replica trains bit for bit as one
    process under that recipe on its own batches."""
    run_ranks(_override_worker, (str(tmp_path),), tmp_path)
    _assert_each_replica_is_one_process(tmp_path)


# ---- a full state_dict loaded with torch.distributed.checkpoint.state_dict -------------------

def _full_state_worker(rank, out_dir):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    recipe = _delayed()
    single = build(recipe)
    train(single, recipe, 2)
    state = {k: v.clone() for k, v in single.state_dict().items()}
    model = parallelize(build(recipe, seed=1), init_device_mesh("cpu", (2,)))
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True))
    torch.save({"parallel": train(model, recipe, 2, first=2),
                "single": train(single, recipe, 2, first=2)},
               os.path.join(out_dir, f"rank{rank}.pt"))


def test_set_model_state_dict_of_a_full_state_dict(tmp_path):
    """A one-process state_dict loaded into a freshly parallelized model with
    set_model_state_dict(full_state_dict=True), which distributes the FP8 entries as
    replicated DTensors (the load raised: .tolist() and copy_ of a DTensor): the next steps
    are those of the one process going on, within float32 rounding."""
    from test_tensor_parallel import MIN_SQNR_DB, _tensors

    run_ranks(_full_state_worker, (str(tmp_path),), tmp_path)
    for rank in range(2):
        result = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        for step, (got, expected) in enumerate(zip(result["parallel"], result["single"])):
            for (what, g), (_, e) in zip(_tensors(got), _tensors(expected)):
                assert sqnr_db(e, g) >= MIN_SQNR_DB, (rank, step, what, sqnr_db(e, g))
