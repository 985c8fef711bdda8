"""update_delayed_scaling and compute_scale_from_amax against reference.py, bit for bit.

The reference runs on CPU copies of the very same inputs; histories, scales and scale_invs are
compared by their bits, so a NaN stored in a history must be the same NaN.
"""
from __future__ import annotations

import math

import pytest
import torch
from conftest import CUDA_SKIP, DEVICE_PARAMS, FLT_MAX, assert_bitwise_equal, rand_positive

import transformer_fp8 as tfp8
from transformer_fp8 import DelayedScaling, ops
from transformer_fp8 import reference as ref

INF, NAN = float("inf"), float("nan")
CUR_KINDS = ["zero", "tiny", "normal", "inf", "nan", "mixed"]
TINY_VALUES = [1e-40, 1e-45, 1e-38]  # subnormal (scale overflows -> FLT_MAX), and the edge


def f32(value: float) -> float:
    """``value`` rounded to float32 (as a Python float)."""
    return torch.tensor(value, dtype=torch.float32).item()


def pick(gen: torch.Generator, choices, n: int) -> list:
    return [choices[i] for i in torch.randint(0, len(choices), (n,), generator=gen).tolist()]


def cur_row(gen: torch.Generator, kind: str, n: int) -> torch.Tensor:
    """This step's amax for n columns: all of one kind, or each column a random kind."""
    kinds = pick(gen, CUR_KINDS[:-1], n) if kind == "mixed" else [kind] * n
    normal = rand_positive(gen, n)
    tiny = pick(gen, TINY_VALUES, n)
    value = {"zero": lambda i: 0.0, "tiny": lambda i: tiny[i], "normal": lambda i: normal[i],
             "inf": lambda i: INF, "nan": lambda i: NAN}
    return torch.tensor([value[k](i) for i, k in enumerate(kinds)], dtype=torch.float32)


def make_state(gen, L: int, n: int, cur_kind: str, history_specials: bool, device="cpu"):
    """(history [L, n], scale [n], scale_inv [n]); rows 1.. of the history may hold inf/NaN/0."""
    history = rand_positive(gen, L, n)
    if history_specials and L > 1:
        mask = torch.rand(L - 1, n, generator=gen) < 0.3
        specials = torch.tensor(pick(gen, [INF, NAN, 0.0, 1e-40], (L - 1) * n)).view(L - 1, n)
        history[1:] = torch.where(mask, specials, history[1:])
    history[0] = cur_row(gen, cur_kind, n)
    scale = rand_positive(gen, n)
    return history.to(device), scale.to(device), (1.0 / scale).to(device)


def clone_states(states, device="cpu"):
    return [tuple(t.detach().to(device).clone() for t in state) for state in states]


def run_op(states, fp8_maxes, **kwargs) -> None:
    hs, ss, sis = zip(*states)
    ops.update_delayed_scaling(list(hs), list(ss), list(sis), fp8_maxes, **kwargs)


def run_reference(states, fp8_maxes, margin=0, amax_compute_algo="max") -> list:
    expected = clone_states(states)
    for (h, s, si), fp8_max in zip(expected, fp8_maxes):
        ref.update_delayed_scaling_reference(h, s, si, fp8_max, margin, amax_compute_algo)
    return expected


def assert_states_equal(got, expected) -> None:
    for i, (g, e) in enumerate(zip(got, expected)):
        for name, gt, et in zip(("history", "scale", "scale_inv"), g, e):
            assert_bitwise_equal(gt, et, f"tensor {i} {name}")


# ----------------------------------------------------------------------------- C++ path

@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("L", [1, 2, 31, 1024])
@pytest.mark.parametrize("n", [1, 2, 3])
@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("margin", [0, 2])
@pytest.mark.parametrize("cur_kind", CUR_KINDS)
def test_matches_reference(device, gen, L, n, algo, margin, cur_kind):
    fp8_max = 448.0 if (L + n) % 2 else 57344.0
    states = [make_state(gen, L, n, cur_kind, history_specials=False, device=device)]
    expected = run_reference(states, [fp8_max], margin, algo)
    run_op(states, [fp8_max], margin=margin, amax_compute_algo=algo)
    assert_states_equal(states, expected)


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("L", [2, 3, 31, 1024])
@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("cur_kind", CUR_KINDS)
def test_history_with_inf_and_nan(device, gen, L, algo, cur_kind):
    states = [make_state(gen, L, 8, cur_kind, history_specials=True, device=device)]
    expected = run_reference(states, [448.0], 1, algo)
    run_op(states, [448.0], margin=1, amax_compute_algo=algo)
    assert_states_equal(states, expected)


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_many_tensors_in_one_call(device, gen, algo):
    shapes = [(1, 3), (2, 1), (31, 2), (1024, 3), (5, 64), (16, 7), (300, 1), (1024, 1)]
    states = [make_state(gen, L, n, "mixed", history_specials=i % 2 == 1, device=device)
              for i, (L, n) in enumerate(shapes)]
    fp8_maxes = [448.0 if i % 3 else 57344.0 for i in range(len(shapes))]
    expected = run_reference(states, fp8_maxes, 2, algo)
    run_op(states, fp8_maxes, margin=2, amax_compute_algo=algo)
    assert_states_equal(states, expected)


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("L", [1, 2, 31, 1024])
@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_unrecorded_columns_untouched(device, gen, L, algo):
    history, scale, _ = make_state(gen, L, 6, "normal", history_specials=True, device=device)
    history[0, ::2] = 0.0  # columns 0, 2, 4: nothing recorded this step
    scale_inv = rand_positive(gen, 6).to(device)  # deliberately not 1/scale
    before = clone_states([(history, scale, scale_inv)])[0]
    run_op([(history, scale, scale_inv)], [448.0], amax_compute_algo=algo)
    for got, old in zip((history, scale, scale_inv), before):
        assert_bitwise_equal(got[..., ::2], old[..., ::2], "unrecorded columns")
    assert (history[0] == 0).all()
    assert_bitwise_equal(scale_inv[1::2], 1.0 / scale[1::2], "recorded scale_inv")


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_repeated_steps(device, gen):
    """Several steps in a row (record, update) stay identical to the reference."""
    states = [make_state(gen, 4, 3, "normal", False, device), make_state(gen, 1, 2, "nan", True,
                                                                          device)]
    expected = clone_states(states)
    for _ in range(6):
        for state, exp in zip(states, expected):
            new = cur_row(gen, "mixed", state[0].shape[1])
            state[0][0], exp[0][0] = new.to(device), new
        run_op(states, [448.0, 57344.0], margin=0)
        expected = run_reference(expected, [448.0, 57344.0], 0)
        assert_states_equal(states, expected)


# ----------------------------------------------------------------------------- hand-computed

@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("algo,margin,expected_amax", [("max", 0, [5.0, 9.0]),
                                                       ("most_recent", 0, [5.0, 2.0]),
                                                       ("max", 2, [5.0, 9.0])])
def test_hand_computed_example(device, algo, margin, expected_amax):
    # Columns: 0 recorded 5 (window 2, 3, 5); 1 nothing recorded; 2 recorded 2 (window 9, inf, 2).
    history = torch.tensor([[5.0, 0.0, 2.0],
                            [2.0, 7.0, 9.0],
                            [3.0, 1.0, INF]], device=device)
    scale = torch.tensor([1.0, 0.5, 4.0], device=device)
    scale_inv = torch.tensor([1.0, 3.0, 0.25], device=device)  # column 1 inconsistent on purpose
    ops.update_delayed_scaling([history], [scale], [scale_inv], [448.0], margin=margin,
                               amax_compute_algo=algo)
    assert history.cpu().tolist() == [[0.0, 0.0, 0.0], [3.0, 7.0, INF], [5.0, 1.0, 2.0]]
    expected_scale = torch.tensor([448.0 / expected_amax[0] / 2**margin, 0.5,
                                   448.0 / expected_amax[1] / 2**margin], dtype=torch.float32)
    expected_inv = 1.0 / expected_scale
    expected_inv[1] = 3.0
    assert_bitwise_equal(scale, expected_scale.to(device), "scale")
    assert_bitwise_equal(scale_inv, expected_inv.to(device), "scale_inv")
    if algo == "max" and margin == 0:
        assert scale[0].item() == f32(89.6) and scale[2].item() == f32(448.0 / 9.0)


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("cur,expected_scale", [(1e-40, FLT_MAX), (INF, 0.75), (NAN, 0.75),
                                                (448.0, 1.0), (3.5, 128.0)])
def test_single_slot_history(device, cur, expected_scale):
    """L = 1: the window is cur alone; a subnormal amax overflows the scale to FLT_MAX; inf and
    NaN keep the old scale (0.75) yet reset the history and refresh scale_inv."""
    history = torch.tensor([[cur]], device=device)
    scale, scale_inv = torch.tensor([0.75], device=device), torch.tensor([123.0], device=device)
    ops.update_delayed_scaling([history], [scale], [scale_inv], [448.0])
    assert history.item() == 0.0
    assert scale.item() == expected_scale
    expected_inv = 1.0 / torch.tensor([expected_scale], dtype=torch.float32)
    assert_bitwise_equal(scale_inv, expected_inv.to(device), "scale_inv")
    assert scale_inv.item() > 0.0  # 1/FLT_MAX is subnormal, not flushed to zero


# ----------------------------------------------------------------------------- callables

def finite_state(gen, L, n, device):
    """A state whose window values are all finite (cur zero, tiny or normal)."""
    history = rand_positive(gen, L, n)
    history[0] = torch.tensor(pick(gen, [0.0, 1e-40, 0.5, 3.0, 200.0], n))
    scale = rand_positive(gen, n)
    return history.to(device), scale.to(device), (1.0 / scale).to(device)


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("L", [1, 2, 31, 1024])
@pytest.mark.parametrize("algo,fn", [("max", lambda w: w.amax(0)),
                                     ("most_recent", lambda h: h[0])],
                         ids=["max", "most_recent"])
def test_callable_amax_algo_equals_builtin(device, gen, L, algo, fn):
    """On finite histories, h.amax(0) is "max" and h[0] (this step's amax, as Transformer
    Engine passes the history) is "most_recent": same bits."""
    states = [finite_state(gen, L, 5, device), finite_state(gen, max(1, L // 2), 2, device)]
    python_path = clone_states(states, device)
    run_op(states, [448.0, 57344.0], margin=1, amax_compute_algo=algo)
    run_op(python_path, [448.0, 57344.0], margin=1, amax_compute_algo=fn)
    assert_states_equal(python_path, states)


def expected_scales(old_scale, amax, fp8_max, margin):
    usable = torch.isfinite(amax) & (amax > 0)
    return torch.where(usable, ops.compute_scale_from_amax(amax, fp8_max, margin), old_scale)


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("L", [1, 2, 31])
def test_callable_amax_algo_with_non_finite(device, gen, L):
    """A NaN-propagating callable: the roll is the C++ one, the callable's amax is applied."""
    state = make_state(gen, L, 12, "mixed", history_specials=True, device=device)
    window = torch.cat([state[0][1:], state[0][:1]])
    recorded = state[0][0] != 0
    callable_amax = window.amax(0)  # NaN propagates: such columns keep their scale
    (_, old_scale, old_scale_inv), = clone_states([state], device)
    (cxx_history, _, _), = cxx_path = clone_states([state], device)
    run_op(cxx_path, [448.0], margin=2)
    run_op([state], [448.0], margin=2, amax_compute_algo=lambda w: w.amax(0))
    history, scale, scale_inv = state
    assert_bitwise_equal(history, cxx_history, "roll")
    new_scale = torch.where(recorded, expected_scales(old_scale, callable_amax, 448.0, 2),
                            old_scale)
    assert_bitwise_equal(scale, new_scale, "scale")
    assert_bitwise_equal(scale_inv, torch.where(recorded, 1.0 / new_scale, old_scale_inv),
                         "scale_inv")


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("amax_algo", ["max", "most_recent", lambda h: h[0]],
                         ids=["max", "most_recent", "callable"])
def test_callable_scaling_factor(device, gen, amax_algo):
    states = [make_state(gen, L, 7, "mixed", history_specials=True, device=device)
              for L in (1, 3, 31)]
    cxx_path = clone_states(states, device)
    before = clone_states(states, device)
    recipe = DelayedScaling(margin=1)
    calls = []

    def two(amax, scale, fp8_max, recipe_arg):
        calls.append((amax.clone(), scale.clone(), fp8_max, recipe_arg))
        return torch.full_like(scale, 2.0)

    algo_name = amax_algo if isinstance(amax_algo, str) else "most_recent"
    run_op(cxx_path, [448.0] * 3, margin=1, amax_compute_algo=algo_name)
    run_op(states, [448.0] * 3, margin=1, amax_compute_algo=amax_algo,
           scaling_factor_compute_algo=two, recipe=recipe)
    assert len(calls) == 3
    kept = []
    for (h, s, si), (hc, _, _), (h0, s0, si0), call in zip(states, cxx_path, before, calls):
        amax, old_scale, fp8_max, recipe_arg = call
        recorded = h0[0] != 0  # (the callable's 2.0 is taken whatever the amax)
        kept.append(bool((~torch.isfinite(amax) | (amax <= 0))[recorded].any()))
        assert_bitwise_equal(h, hc, "roll")
        assert_bitwise_equal(s, torch.where(recorded, 2.0, s0), "scale")
        assert_bitwise_equal(si, torch.where(recorded, 0.5, si0), "scale_inv")
        assert amax.shape == s.shape and fp8_max == 448.0 and recipe_arg is recipe
        assert_bitwise_equal(old_scale, s0, "scale passed to the callable")
    assert any(kept), "amaxes that are not finite and positive among the recorded columns"


@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_callable_scaling_factor_keeps_the_contracts_guards(algo):
    """Transformer Engine's formula as a callable, (fp8_max / amax) / 2**margin: a grad_output
    with an inf (a step GradScaler skips) gave it an amax of 0 ('max': an empty window) or -inf
    ('most_recent'), and the scale written was inf or -0.0 (the next steps' gradients all 0 or
    NaN, the checkpoint refused at load). A result that is no finite positive scale leaves the
    old one; any other result is taken, whatever the amax (a static scale, a back-off)."""
    history = torch.zeros(4, 6)
    history[0] = torch.tensor([float("inf"), 0.0, 3.0, 1e-38, 5.0, 7.0])
    history[1, 1] = 0.0
    scale, scale_inv = torch.full((6,), 3.0), torch.full((6,), 1 / 3.0)

    def formula(amax, old, fp8_max, recipe):
        out = (fp8_max / amax) / (2 ** recipe.margin)
        out[4], out[5] = float("nan"), -2.0  # (a callable's own NaN and negative results)
        return out

    recipe = DelayedScaling(amax_compute_algo=algo, scaling_factor_compute_algo=formula)
    run_op([(history, scale, scale_inv)], [448.0], amax_compute_algo=algo,
           scaling_factor_compute_algo=formula, recipe=recipe)
    expected = torch.tensor([3.0, 3.0, 0.0, 3.0, 3.0, 3.0])  # (448 / 1e-38: inf in float32)
    expected[2] = 448.0 / torch.tensor(3.0)  # (the callable's float32 division)
    assert_bitwise_equal(scale, expected, "scale")
    assert_bitwise_equal(scale_inv, torch.where(expected == 3.0, 1 / 3.0, 1.0 / expected))
    # A static scale and a back-off on a non-finite amax are taken as returned.
    history[0] = torch.tensor([float("inf"), 2.0, 3.0, 4.0, 5.0, 6.0])
    static = DelayedScaling(amax_compute_algo=algo,
                            scaling_factor_compute_algo=lambda a, s, m, r: torch.full_like(s, 8.0))
    run_op([(history, scale, scale_inv)], [448.0], amax_compute_algo=algo,
           scaling_factor_compute_algo=static.scaling_factor_compute_algo, recipe=static)
    assert_bitwise_equal(scale, torch.full((6,), 8.0))
    history[0] = torch.tensor([float("inf"), 2.0, 3.0, 4.0, 5.0, 6.0])

    def back_off(amax, old, fp8_max, recipe):
        return torch.where(torch.isfinite(amax), old, old / 2)

    run_op([(history, scale, scale_inv)], [448.0], amax_compute_algo=lambda h: h.amax(0),
           scaling_factor_compute_algo=back_off, recipe=recipe)
    assert_bitwise_equal(scale, torch.tensor([4.0, 8.0, 8.0, 8.0, 8.0, 8.0]))


def test_callable_amax_algo_sees_the_history_as_transformer_engine_passes_it(gen):
    """Transformer Engine calls amax_compute_algo on the history before the roll: row 0 this
    step's amax, rows 1..L-1 the earlier ones, oldest first. A callable written for it (h[0]:
    the current amax) must give here what it gives there: the scales of "most_recent", and a
    history equal to the state's own, step after step."""
    L, amaxes = 4, [1.0, 2.0, 4.0, 8.0, 16.0]
    seen, scales, te_scales = [], [], []
    history, scale, scale_inv = torch.zeros(L, 1), torch.ones(1), torch.ones(1)
    te_history = torch.zeros(L, 1)
    for a in amaxes:
        history[0, 0] = te_history[0, 0] = a
        before = history.clone()
        ops.update_delayed_scaling([history], [scale], [scale_inv], [448.0], 0,
                                   lambda h: seen.append(h.clone()) or h[0].clone())
        assert torch.equal(seen[-1], before)  # the history itself, not a reordered window
        scales.append(scale.item())
        # Transformer Engine's roll (torch.roll by -1, row 0 reset), written out.
        te_history = torch.roll(te_history, -1, 0)
        te_history[0] = 0
        te_scales.append(448.0 / a)
        assert torch.equal(history, te_history)
    assert scales == te_scales


def test_callable_most_recent_trains_like_the_named_algorithm(gen):
    """Through a Linear layer over steps whose amaxes grow: lambda h: h[0] and "most_recent"
    give the same FP8 state, bit for bit (as in Transformer Engine)."""
    states = []
    for algo in ("most_recent", lambda h: h[0].clone()):
        torch.manual_seed(0)
        layer = tfp8.Linear(32, 32)
        recipe = DelayedScaling(amax_history_len=4, amax_compute_algo=algo)
        for step in range(5):
            x = torch.randn(16, 32, generator=gen.manual_seed(step)) * 2.0 ** step
            with tfp8.fp8_autocast(fp8_recipe=recipe):
                layer(x).sum().backward()
        states.append({k: v.clone() for k, v in layer.state_dict().items()
                       if "fp8" in k and k != "fp8_recipe_fields"})  # (records the algo)
    assert states[0].keys() == states[1].keys()
    for key in states[0]:
        assert_bitwise_equal(states[1][key], states[0][key], key)


# ----------------------------------------------------------------------------- current scaling

AMAX_VALUES = [0.0, -0.0, -1.0, -INF, 1e-45, 1e-40, 1e-38, 1e-30, 2.0**-20, 0.37, 1.0, 3.3,
               448.0, 57344.0, 1e30, FLT_MAX, INF, NAN]


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("fp8_max", [448.0, 57344.0])
@pytest.mark.parametrize("margin", [0, 3])
def test_compute_scale_from_amax(device, gen, fp8_max, margin):
    amax = torch.cat([torch.tensor(AMAX_VALUES), rand_positive(gen, 200)]).to(device)
    out = ops.compute_scale_from_amax(amax, fp8_max, margin)
    assert out.dtype == torch.float32 and out.shape == amax.shape
    expected = ref.compute_scale_from_amax_reference(amax.cpu(), fp8_max, margin)
    assert_bitwise_equal(out, expected)
    # Independent spot checks: unusable amax -> 1.0; subnormal amax -> FLT_MAX.
    values = out[: len(AMAX_VALUES)].cpu().tolist()
    for a, s in zip(AMAX_VALUES, values):
        if not (math.isfinite(a) and a > 0):
            assert s == 1.0, a
    assert values[AMAX_VALUES.index(1e-40)] == FLT_MAX
    assert values[AMAX_VALUES.index(1.0)] == fp8_max / 2**margin


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_compute_scale_from_amax_shapes(device, gen):
    base = rand_positive(gen, 6, 8).to(device)
    for amax in (base, base.t(), base[::2, 1::3], base[0, 0], base[:0]):
        out = ops.compute_scale_from_amax(amax, 448.0, 1)
        assert out.shape == amax.shape
        assert_bitwise_equal(out, ref.compute_scale_from_amax_reference(amax.cpu(), 448.0, 1))


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("fp8_max", [448.1, 0.1, 57344.0 * 0.9])
def test_fp8_max_not_representable_in_float32(device, gen, fp8_max):
    """fp8_max is a `float` (double) argument: the fp64 division must use it as given, like the
    reference, not a float32 rounding of it."""
    amax = rand_positive(gen, 1000).to(device)
    assert_bitwise_equal(ops.compute_scale_from_amax(amax, fp8_max, 0),
                         ref.compute_scale_from_amax_reference(amax.cpu(), fp8_max, 0),
                         "compute_scale_from_amax")
    states = [make_state(gen, 4, 64, "normal", history_specials=False, device=device)]
    expected = run_reference(states, [fp8_max])
    run_op(states, [fp8_max])
    assert_states_equal(states, expected)


@CUDA_SKIP
def test_one_kernel_launch_for_many_tensors(gen):
    """300 tensors of L = 1024, updated every step: one kernel and no copy (the descriptors
    travel as kernel parameters)."""
    histories = [rand_positive(gen, 1024, 2).cuda() for _ in range(300)]
    scales = [torch.ones(2, device="cuda") for _ in histories]
    scale_invs = [torch.ones(2, device="cuda") for _ in histories]
    maxes = [448.0] * len(histories)
    ops.update_delayed_scaling(histories, scales, scale_invs, maxes)  # first step
    for h in histories:
        h[0].fill_(3.0)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        ops.update_delayed_scaling(histories, scales, scale_invs, maxes,
                                   amax_compute_algo="most_recent")
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels = [n for n in names if "update_delayed_scaling" in n]
    assert len(kernels) == 1, names
    assert not any("Memcpy" in n for n in names), names
    expected = torch.full((2,), 448.0 / 3.0, device="cuda")
    assert all(torch.equal(s, expected) for s in scales)


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("count", [64, 65, 640, 641, 1300])
def test_many_tensors_across_launch_batches(device, gen, count):
    """The CUDA launcher passes at most 64 or 640 descriptors per launch: every tensor is
    updated exactly once whatever the count (counts on both sides of each batch size)."""
    states = [make_state(gen, 3, 1 + i % 3, "normal", history_specials=True, device=device)
              for i in range(count)]
    maxes = [448.0 if i % 2 else 57344.0 for i in range(count)]
    expected = run_reference(states, maxes, margin=1)
    run_op(states, maxes, margin=1)
    assert_states_equal(states, expected)


@CUDA_SKIP
def test_update_replays_in_a_cuda_graph(gen):
    """A captured update keeps its own descriptors: replays after other eager calls (with other
    tensor lists) still update the captured tensors, like the eager op does."""
    states = [make_state(gen, 8, 2, "normal", history_specials=False, device="cuda")
              for _ in range(5)]
    others = [make_state(gen, 8, 2, "normal", history_specials=False, device="cuda")
              for _ in range(7)]
    maxes = [448.0] * len(states)
    eager = clone_states(states, "cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        graph = torch.cuda.CUDAGraph()
        capture_input = clone_states(states, "cuda")
        with torch.cuda.graph(graph, stream=stream):
            run_op(capture_input, maxes)
    torch.cuda.current_stream().wait_stream(stream)
    for step in range(3):
        run_op(others, [448.0] * len(others))  # an eager call in between, other tensors
        fresh = torch.rand(len(states), 2, generator=gen).add_(0.5).cuda()
        for i, (h, _, _) in enumerate(capture_input):
            h[0].copy_(fresh[i])
        for i, (h, _, _) in enumerate(eager):
            h[0].copy_(fresh[i])
        graph.replay()
        run_op(eager, maxes)
        torch.cuda.synchronize()
        assert_states_equal(capture_input, eager)


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("bad", ["amax_scalar", "amax_whole_window", "amax_not_tensor",
                                 "scale_wrong_shape", "amax_raises_on_second"])
def test_bad_callable_is_named_and_changes_no_state(device, gen, bad):
    """A recipe callable returning the wrong shape (or failing) for any tensor gives an error
    naming the argument, and no history, scale or scale_inv changes, not even of the tensors
    before it in the list."""
    states = [make_state(gen, 4, 2, "normal", history_specials=False, device=device)
              for _ in range(3)]
    before = clone_states(states, device)
    calls = []

    def algo(window):
        calls.append(window)
        if bad == "amax_scalar":
            return window.amax()
        if bad == "amax_whole_window":
            return window
        if bad == "amax_not_tensor":
            return 1.0
        if bad == "amax_raises_on_second" and len(calls) == 2:
            raise RuntimeError("user algorithm failed")
        return window.amax(dim=0)

    def scale_algo(amax, scale, fp8_max, recipe):
        return torch.ones(5) if bad == "scale_wrong_shape" else fp8_max / amax

    expected = {"amax_scalar": (ValueError, "amax_compute_algo must return"),
                "amax_whole_window": (ValueError, "amax_compute_algo must return"),
                "amax_not_tensor": (TypeError, "amax_compute_algo must return"),
                "scale_wrong_shape": (ValueError, "scaling_factor_compute_algo must return"),
                "amax_raises_on_second": (RuntimeError, "user algorithm failed")}[bad]
    with pytest.raises(expected[0], match=expected[1]):
        run_op(states, [448.0] * 3, amax_compute_algo=algo,
               scaling_factor_compute_algo=scale_algo)
    assert_states_equal(states, before)


def test_a_module_built_for_current_scaling_is_left_out_of_delayed_steps():
    """A module built with recipe=Float8CurrentScaling() beside a model trained under
    DelayedScaling: it adopted that recipe at the first delayed context (history resized,
    recipe record written) and joined its steps, also where built on one rank only. Now it
    keeps its state as built, until it runs under a delayed recipe itself."""
    import transformer_fp8 as tfp8

    current = tfp8.Linear(32, 32, recipe=tfp8.Float8CurrentScaling())
    before = {k: v.clone() for k, v in current.state_dict().items() if "fp8_" in k}
    delayed = tfp8.DelayedScaling(amax_history_len=4)
    model = tfp8.Linear(32, 32, recipe=delayed)
    for _ in range(2):
        with tfp8.fp8_autocast(fp8_recipe=delayed):
            model(torch.randn(16, 32)).sum().backward()
    for key, value in current.state_dict().items():
        if "fp8_" in key:
            assert torch.equal(value, before[key]), key
    with tfp8.fp8_autocast(fp8_recipe=tfp8.Float8CurrentScaling()):
        current(torch.randn(16, 32)).sum().backward()
    with tfp8.fp8_autocast(fp8_recipe=delayed):  # run under it: it takes it
        current(torch.randn(16, 32)).sum().backward()
    assert current.fp8_fwd_amax_history.shape[0] == 4
    assert current.fp8_fwd_amax_history.any()
