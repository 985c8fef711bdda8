"""Calls that once gave wrong numbers (or corrupt state) without any error: each is now refused
with a message naming the argument, or computes the right thing."""
from __future__ import annotations

import copy
import math

import pytest
import torch
from conftest import scalar

import transformer_fp8 as tfp8
from transformer_fp8 import DelayedScaling, fp8_autocast, fused_ops, ops
from transformer_fp8.modules.attention import apply_rotary_pos_emb
from transformer_fp8.ops.blockwise import fp8_gemm_blockwise, quantize_blockwise
from transformer_fp8.optimizers import FusedAdam

E4M3 = torch.float8_e4m3fn


def _fp8(shape):
    return torch.randn(*shape).clamp(-8, 8).to(E4M3)


def _op_calls():
    """(operator, function, {argument: value}) for every operator with tensor arguments."""
    x = torch.randn(32, 64)
    s, a = scalar(2.0), scalar(0.0)
    w = torch.randn(64)
    stats = torch.rand(32) + 0.5
    h, sc, si = torch.zeros(4, 2), torch.ones(2), torch.ones(2)
    xq, xs, _, _ = quantize_blockwise(torch.randn(32, 128))
    return [
        ("amax", ops.amax, dict(x=x)),
        ("cast_to_fp8", ops.cast_to_fp8, dict(x=x, scale=s, fp8_dtype=E4M3, amax=a)),
        ("cast_transpose_to_fp8", ops.cast_transpose_to_fp8,
         dict(x=x, scale=s, fp8_dtype=E4M3, amax=a)),
        ("cast_from_fp8", ops.cast_from_fp8, dict(x_fp8=_fp8((8, 16)), scale_inv=s,
                                                   dtype=torch.float32)),
        ("compute_scale_from_amax", ops.compute_scale_from_amax,
         dict(amax=scalar(3.0), fp8_max=448.0)),
        ("fp8_gemm", ops.fp8_gemm, dict(a=_fp8((16, 32)), a_scale_inv=s, b=_fp8((16, 32)),
                                        b_scale_inv=s, out_dtype=torch.float32,
                                        bias=torch.randn(16))),
        ("update_delayed_scaling", ops.update_delayed_scaling,
         dict(amax_histories=[h], scales=[sc], scale_invs=[si], fp8_maxes=[448.0])),
        ("layernorm_fwd_fp8", fused_ops.layernorm_fwd_fp8,
         dict(x=x, weight=w, bias=w.clone(), eps=1e-5, zero_centered_gamma=False, scale=s,
              fp8_dtype=E4M3, amax=a)),
        ("rmsnorm_bwd", fused_ops.rmsnorm_bwd,
         dict(dy=x.clone(), x=x, rstd=stats, weight=w, zero_centered_gamma=False)),
        ("activation_fwd_fp8", fused_ops.activation_fwd_fp8,
         dict(x=x, activation="gelu", scale=s, fp8_dtype=E4M3, amax=a)),
        ("cast_transpose_dbias", fused_ops.cast_transpose_dbias,
         dict(x=x, scale=s, fp8_dtype=E4M3, amax=a)),
        ("quantize_blockwise", quantize_blockwise, dict(x=torch.randn(32, 128))),
        ("fp8_gemm_blockwise", fp8_gemm_blockwise,
         dict(a=xq, a_scale_inv=xs, b=xq.clone(), b_scale_inv=xs.clone(),
              out_dtype=torch.float32)),
    ]


def _mixed_device_cases():
    for op, fn, args in _op_calls():
        names = [n for n, v in args.items()
                 if isinstance(v, torch.Tensor) or isinstance(v, list) and
                 isinstance(v[0], torch.Tensor)]
        for name in names[1:]:  # (moving the first one names another argument)
            yield pytest.param(fn, args, name, id=f"{op}-{name}")


def _to_meta(value):
    return [v.to("meta") for v in value] if isinstance(value, list) else value.to("meta")


@pytest.mark.parametrize("fn,args,name", list(_mixed_device_cases()))
def test_one_argument_on_meta_is_refused_naming_it(fn, args, name):
    """The dispatcher picks the meta (fake) kernel when any argument is on "meta": it used to
    return uninitialised memory on the CPU and skip the in-place state updates."""
    state = {k: [t.clone() if isinstance(t, torch.Tensor) else t for t in v]
             if isinstance(v, list) else v.clone() if isinstance(v, torch.Tensor) else v
             for k, v in args.items()}
    mixed = dict(args, **{name: _to_meta(args[name])})
    with pytest.raises(RuntimeError, match=rf"argument '{name}(\[0\])?' must be on the same "
                                           "device"):
        fn(**mixed)
    for key, value in args.items():  # nothing written in place
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, state[key]), key
        elif isinstance(value, list) and isinstance(value[0], torch.Tensor):
            assert all(torch.equal(v, o) for v, o in zip(value, state[key])), key


BAD_ARGUMENTS = {
    "cast_fp8_dtype_float32": (ops.cast_to_fp8, "fp8_dtype", torch.float32,
                               r"'fp8_dtype' must be torch.float8_e4m3fn or torch.float8_e5m2"),
    "cast_x_int": (ops.cast_to_fp8, "x", torch.ones(4, 4, dtype=torch.int32),
                   r"'x' must be float32, bfloat16 or float16"),
    "cast_scale_two_elements": (ops.cast_to_fp8, "scale", torch.ones(2),
                                r"'scale' must be a 1-element float32 tensor"),
    "gemm_out_dtype_int": (ops.fp8_gemm, "out_dtype", torch.int32,
                           r"'out_dtype' must be torch.float32, torch.bfloat16 or torch.float16"),
    "gemm_a_float32": (ops.fp8_gemm, "a", torch.randn(16, 32),
                       r"'a' must be a float8_e4m3fn or float8_e5m2 tensor"),
}


@pytest.mark.parametrize("case", BAD_ARGUMENTS, ids=list(BAD_ARGUMENTS))
@pytest.mark.parametrize("backend", ["cpu", "meta"])
def test_fake_kernels_refuse_what_the_real_kernels_refuse(case, backend):
    """The same checks, the same message, on the CPU kernel and on the meta (fake) one."""
    fn, name, value, message = BAD_ARGUMENTS[case]
    args = next(a for _, f, a in _op_calls() if f is fn)
    args = dict(args, **{name: value})
    args = {k: _to_meta(v) if backend == "meta" and isinstance(v, torch.Tensor) else v
            for k, v in args.items()}
    with pytest.raises(RuntimeError, match=message):
        fn(**args)


# ---- record_amax and the update ----------------------------------------------------------------

@pytest.mark.parametrize("column", [2, -1, 100, 2**63])
def test_record_amax_refuses_a_column_outside_the_history(column):
    history = torch.zeros(4, 2)
    with pytest.raises(ValueError, match=r"'column' must be in \[0, 2\)"):
        ops.record_amax(history, scalar(3.0), column)
    assert not history.any()


def test_record_amax_records_into_its_column():
    history = torch.zeros(4, 3)
    ops.record_amax(history, scalar(3.0), 2)
    ops.record_amax(history, scalar(1.0), 2)
    assert history[0].tolist() == [0.0, 0.0, 3.0] and not history[1:].any()


def _overlapping_states():
    base = torch.zeros(4, 2)
    shared = torch.ones(3)
    return {
        "scale_and_scale_inv_share_elements": ([torch.zeros(4, 2)], [shared[:2]], [shared[1:]]),
        "scale_is_a_history_row": ([base], [base[1]], [torch.ones(2)]),
        "histories_overlap": ([base[:2], base[1:]], [torch.ones(2), torch.ones(2)],
                              [torch.ones(2), torch.ones(2)]),
    }


@pytest.mark.parametrize("algo", ["max", "callable"])
@pytest.mark.parametrize("case", list(_overlapping_states()))
def test_update_refuses_overlapping_state(case, algo):
    histories, scales, scale_invs = _overlapping_states()[case]
    for h in histories:
        h[0] = 2.0 if h.shape[0] > 1 else h[0]
    before = [t.clone() for t in histories + scales + scale_invs]
    compute = "max" if algo == "max" else (lambda window: window.amax(dim=0))
    with pytest.raises((RuntimeError, ValueError), match="shares memory with"):
        ops.update_delayed_scaling(histories, scales, scale_invs, [448.0] * len(histories),
                                   amax_compute_algo=compute)
    for old, new in zip(before, histories + scales + scale_invs):
        assert torch.equal(old, new)


def test_cpu_gemm_applies_the_scales_after_the_product():
    """a_scale_inv = 1e36 and b_scale_inv = 1e-36: dequantising each operand first overflowed
    to inf; cuBLASLt multiplies by the product of the scales, which is 1."""
    a, b = _fp8((16, 32)), _fp8((16, 32))
    out = ops.fp8_gemm(a, scalar(1e36), b, scalar(1e-36), torch.float32)
    expected = a.float() @ b.float().T
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=0)


# ---- recipes and modules -------------------------------------------------------------------

@pytest.mark.parametrize("margin", [33, 140, 1000])
def test_margin_that_underflows_the_scale_is_refused(margin):
    with pytest.raises(ValueError, match=rf"margin must be an integer in \[0, 32\].*got {margin}$"):
        DelayedScaling(margin=margin)


@pytest.mark.parametrize("recipe", [42, "DelayedScaling", DelayedScaling])
def test_prepare_fp8_recipe_refuses_what_is_not_a_recipe(recipe):
    layer = tfp8.Linear(32, 32)
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    with pytest.raises(TypeError, match="prepare_fp8_recipe: recipe must be None, a Delayed"):
        layer.prepare_fp8_recipe(recipe)
    for k, v in layer.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_largest_margin_still_trains_finitely():
    recipe = DelayedScaling(margin=32, amax_history_len=2)
    layer = tfp8.Linear(32, 32)
    for _ in range(3):
        with fp8_autocast(fp8_recipe=recipe):
            out = layer(torch.randn(16, 32) * 400)
        out.sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(layer.weight.grad).all()
    assert (layer.fp8_fwd_scale > 0).all() and torch.isfinite(layer.fp8_fwd_scale_inv).all()


@pytest.mark.parametrize("norm", [tfp8.LayerNorm, tfp8.RMSNorm])
@pytest.mark.parametrize("dtype", [torch.int64, torch.bool])
def test_norms_refuse_integer_inputs(norm, dtype):
    with pytest.raises(TypeError, match="must be a floating-point tensor"):
        norm(16)(torch.ones(4, 16, dtype=dtype))


@pytest.mark.parametrize("module", ["LayerNormLinear", "LayerNorm"])
def test_infinite_eps_is_refused_at_construction(module):
    with pytest.raises(ValueError, match="eps must be a finite number"):
        if module == "LayerNorm":
            tfp8.LayerNorm(16, eps=math.inf)
        else:
            tfp8.LayerNormLinear(16, 16, eps=math.inf)


@pytest.mark.parametrize("shape", [(0, 16), (16, 0)])
def test_linear_without_features_works_inside_fp8_autocast(shape):
    layer = tfp8.Linear(*shape)
    x = torch.randn(4, shape[0], requires_grad=True)
    with fp8_autocast():
        out = layer(x)
    out.sum().backward()
    expected = torch.nn.functional.linear(x, layer.weight, layer.bias)
    assert torch.equal(out, expected) and out.shape == (4, shape[1])


class _FailingGrad(torch.autograd.Function):
    """Identity whose backward hands the next layer a gradient of the wrong shape."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g[:, :-1]


@pytest.mark.parametrize("then", ["next_step", "state_dict"])
def test_a_backward_that_raises_discards_its_grad_output_amaxes(then):
    """As a forward that raises inside fp8_autocast: the failed step changes no scale, and
    neither the next step's update nor a checkpoint carries the failed step's amaxes."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(tfp8.Linear(32, 32), tfp8.Linear(32, 32))
    recipe = DelayedScaling(amax_history_len=4)
    with fp8_autocast(fp8_recipe=recipe):
        out = model[1](_FailingGrad.apply(model[0](torch.randn(16, 32))))
    bwd_state = [t.clone() for t in model[1].fp8_state_tensors()[3:]]
    with pytest.raises(RuntimeError, match="invalid gradient"):
        (out * 1e4).sum().backward()  # model[1] records a huge amax, then the pass fails
    assert model[1].fp8_bwd_amax_history[0, 0] > 1e3  # recorded before the failure
    if then == "state_dict":
        state = model.state_dict()
        assert state["1.fp8_bwd_amax_history"][0, 0] == 0, "a checkpoint without the amax"
        for saved, name in zip(bwd_state, ("history", "scale", "scale_inv")):
            assert torch.equal(state["1.fp8_bwd_" + ("amax_" if name == "history" else "")
                                     + name], saved), name
        return
    good = torch.nn.Sequential(copy.deepcopy(model[0]), copy.deepcopy(model[1]))
    for m, b in zip(good, (model[0].fp8_state_tensors()[3:], bwd_state)):
        for t, saved in zip(m.fp8_state_tensors()[3:], b):
            t.copy_(saved)  # the state the failed step started from
    x = torch.randn(16, 32)
    for m in (model, good):
        with fp8_autocast(fp8_recipe=recipe):
            m(x).sum().backward()
    for got, expected in zip(model[1].fp8_state_tensors(), good[1].fp8_state_tensors()):
        assert torch.equal(got, expected), "the next update saw the failed step's amax"


# ---- torch.compile ---------------------------------------------------------------------------

def test_compile_of_a_model_converted_without_recipe_adopts_it_at_fp8_autocast():
    """The recipe is known when fp8_autocast is entered, outside the compiled region: the layers
    take its history length there, so the compiled region never resizes one."""
    torch.manual_seed(0)
    model = tfp8.convert_to_fp8(torch.nn.Sequential(torch.nn.Linear(32, 16)))  # length 1024
    eager = copy.deepcopy(model)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    torch._dynamo.reset()
    recipe = DelayedScaling(amax_history_len=8)
    for step in range(3):
        x = torch.randn(4, 32) * (step + 1)
        with fp8_autocast(fp8_recipe=recipe):
            got, expected = compiled(x), eager(x)
        got.sum().backward()
        expected.sum().backward()
        assert torch.equal(got, expected)
    assert model[0].fp8_fwd_amax_history.shape[0] == 8
    assert torch.equal(model[0].weight.grad, eager[0].weight.grad)
    assert torch.equal(model[0].fp8_fwd_scale, eager[0].fp8_fwd_scale)


def test_a_model_built_on_meta_compiles_as_often_as_one_built_on_cpu():
    """to_empty() gives the fresh FP8 state of the module as built (the recipe it was built
    for included), so the compiled model is not recompiled for it."""
    from integration_compare import counting_aot_eager

    recipe = DelayedScaling(amax_history_len=4)
    counts = []
    for device in ("cpu", "meta"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(tfp8.Linear(32, 32, device=device, recipe=recipe),
                                    tfp8.Linear(32, 16, device=device, recipe=recipe))
        if device == "meta":
            model.to_empty(device="cpu")
            for layer in model:
                layer.reset_parameters()
        backend, graphs = counting_aot_eager()
        torch._dynamo.reset()
        compiled = torch.compile(model, fullgraph=True, backend=backend)
        for _ in range(3):
            with fp8_autocast(fp8_recipe=recipe):
                compiled(torch.randn(8, 32)).sum().backward()
        counts.append(len(graphs))
    assert counts == [1, 1], f"graphs compiled (cpu-built, meta-built): {counts}"


@pytest.mark.parametrize("call,error,message", [
    (lambda: ops.cast_to_fp8(None, scalar(1.0), E4M3), TypeError,
     r"cast_to_fp8: argument 'x' must be a tensor, got NoneType"),
    (lambda: ops.cast_to_fp8(torch.ones(4), scalar(1.0), 5), TypeError,
     r"argument 'fp8_dtype' must be a torch.dtype, got 5"),
    (lambda: ops.fp8_gemm(_fp8((16, 16)), None, _fp8((16, 16)), scalar(1.0), torch.float32),
     TypeError, r"argument 'a_scale_inv' must be a tensor"),
    (lambda: quantize_blockwise(torch.ones(4, 4), 2**63), ValueError,
     r"argument 'block_rows' must be an integer in the int64 range"),
], ids=["none_tensor", "int_dtype", "none_scale_inv", "int_overflow"])
def test_wrappers_name_the_argument_the_dispatcher_would_not(call, error, message):
    with pytest.raises(error, match=message):
        call()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device"))])
def test_update_keeps_an_underflowing_scale_normal(device):
    """scale = fp8_max / amax / 2**margin below float32's smallest normal becomes that normal
    (as an overflow becomes FLT_MAX), so scale_inv stays finite: a huge amax with the
    operator's largest margin once gave scale 0 and scale_inv inf."""
    tiny = torch.finfo(torch.float32).tiny
    history = torch.tensor([[1e38, 1.0]], device=device)
    scale, scale_inv = torch.ones(2, device=device), torch.ones(2, device=device)
    ops.update_delayed_scaling([history], [scale], [scale_inv], [448.0], margin=1000)
    assert scale.tolist() == [tiny, tiny]
    assert scale_inv.tolist() == [2.0 ** 126, 2.0 ** 126]
    assert torch.equal(ops.compute_scale_from_amax(torch.tensor([1e38], device=device), 448.0,
                                                   margin=200), torch.tensor([tiny], device=device))


def test_a_negated_view_as_amax_slot_is_refused():
    slot = torch.zeros(1)._neg_view()
    with pytest.raises(ValueError, match="'amax' is written in place and must not be a negated"):
        ops.cast_to_fp8(torch.randn(4, 4), scalar(1.0), E4M3, slot)


def test_meta_input_to_a_meta_built_linear_inside_fp8_autocast():
    """Shape inference on "meta" (torch.autocast knows no such device): the FP8 path runs on
    the fake kernels and gives the output's shape and dtype."""
    layer = tfp8.Linear(32, 16, device="meta")
    with fp8_autocast():
        out = layer(torch.empty(4, 32, device="meta"))
    assert out.device.type == "meta" and out.shape == (4, 16) and out.dtype == torch.float32
    with fp8_autocast(), pytest.raises(RuntimeError,
                                       match="argument 'input'.*must be on the weight's device"):
        tfp8.Linear(32, 16)(torch.empty(4, 32, device="meta"))


@pytest.mark.parametrize("enabled", [False, True], ids=["high_precision", "fp8"])
@pytest.mark.parametrize("value", [[[1.0] * 32], (1.0,) * 32, 3.0, None])
def test_an_input_that_is_not_a_tensor_is_refused_by_name(value, enabled):
    layer = tfp8.Linear(32, 32)
    with pytest.raises(TypeError, match="Linear: input must be a tensor, got"):
        with tfp8.fp8_autocast(enabled=enabled):
            layer(value)


def _cross_entropy(**options):
    logits, target = torch.randn(2, 3, 10), torch.randint(0, 10, (2, 3))
    return tfp8.parallel_cross_entropy(logits, target, **options)


@pytest.mark.parametrize("call,error,message", [
    # int(1.5) == 1: token id 1 was ignored
    (lambda: _cross_entropy(ignore_idx=1.5), TypeError,
     r"parallel_cross_entropy: ignore_idx must be an int, got float 1.5"),
    # bool("no") is True: the mean was returned
    (lambda: _cross_entropy(reduce_loss="no"), TypeError,
     r"parallel_cross_entropy: reduce_loss must be True or False, got str 'no'"),
    (lambda: _cross_entropy(label_smoothing="0.1"), TypeError,
     r"parallel_cross_entropy: label_smoothing must be a number in \[0, 1\], got str '0.1'"),
    # (was torch.distributed's "Default process group has not been initialized")
    (lambda: _cross_entropy(dist_process_group=3), TypeError,
     r"parallel_cross_entropy: dist_process_group must be None or a "
     r"torch.distributed.ProcessGroup, got int"),
    # an integer t was rotated by angles cast to integers
    (lambda: apply_rotary_pos_emb(torch.ones(5, 2, 4, 8, dtype=torch.int32), _freqs()),
     TypeError, r"apply_rotary_pos_emb: t must be a floating-point tensor, got torch.int32"),
    # complex angles lost their imaginary part (.float())
    (lambda: apply_rotary_pos_emb(torch.randn(5, 2, 4, 8), _freqs().to(torch.complex64)),
     TypeError, r"rotary_pos_emb must hold real angles \(a floating-point tensor\), got "
     r"torch.complex64"),
    # (was torch's "Tensor on device meta is not on the expected device cpu!")
    (lambda: apply_rotary_pos_emb(torch.randn(5, 2, 4, 8), _freqs().to("meta")), ValueError,
     r"apply_rotary_pos_emb: rotary_pos_emb must be on t's device cpu, got meta"),
    # torch.optim.Adam refuses it; a negative decay grew the weights
    (lambda: FusedAdam([torch.nn.Parameter(torch.randn(4))], weight_decay=-0.1), ValueError,
     r"FusedAdam: argument 'weight_decay' must be >= 0, got -0.1"),
    # a group added later went unchecked
    (lambda: FusedAdam([torch.nn.Parameter(torch.randn(4))]).add_param_group(
        {"params": [torch.nn.Parameter(torch.randn(4))], "lr": -1.0}), ValueError,
     r"FusedAdam: argument 'lr' must be >= 0, got -1.0"),
    # (was AttributeError: 'str' object has no attribute 'named_modules')
    (lambda: tfp8.convert_to_fp8("model"), TypeError,
     r"convert_to_fp8: module must be a torch.nn.Module, got str"),
    # (was torch's "Trying to create tensor with negative dimension -1: [8, -1]")
    (lambda: tfp8.Linear(-1, 8), ValueError, r"Linear: in_features must be >= 0, got -1"),
    (lambda: tfp8.Linear(8, 8.5), TypeError, r"Linear: out_features must be an int, got float"),
], ids=["ce_ignore_idx", "ce_reduce_loss", "ce_label_smoothing", "ce_group", "rope_int_t",
        "rope_complex_freqs", "rope_freqs_device", "adam_weight_decay", "adam_group_lr",
        "convert_not_module", "linear_negative", "linear_float"])
def test_arguments_once_taken_for_other_values_are_refused(call, error, message):
    with pytest.raises(error, match=message):
        call()


def _freqs():
    return tfp8.RotaryPositionEmbedding(8)(5)


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")
def test_arguments_still_accepted_by_the_new_checks():
    """What the checks above must keep taking: numpy numbers, a 0-d tensor, empty layers."""
    import numpy as np
    torch.manual_seed(0)
    a = _cross_entropy(ignore_idx=np.int64(3), label_smoothing=np.float32(0.1),
                       reduce_loss=np.bool_(True))
    torch.manual_seed(0)
    b = _cross_entropy(ignore_idx=3, label_smoothing=torch.tensor(0.1), reduce_loss=True)
    assert a.shape == () and torch.equal(a, b)
    assert tfp8.Linear(np.int64(16), 0).weight.shape == (0, 16)
    q = torch.randn(5, 2, 4, 8)
    assert torch.equal(apply_rotary_pos_emb(q, _freqs().long()),
                       apply_rotary_pos_emb(q, _freqs().long().float()))


@pytest.mark.parametrize("enabled", [False, True], ids=["high_precision", "fp8"])
@pytest.mark.parametrize("module", ["Linear", "LayerNormLinear", "LayerNormMLP"])
def test_is_first_microbatch_that_is_not_a_bool_is_refused(module, enabled):
    """A string was truthy: is_first_microbatch="False" cast and kept the weight."""
    layer = getattr(tfp8, module)(32, 32)
    with tfp8.fp8_autocast(enabled=enabled):
        with pytest.raises(TypeError, match=rf"{module}: is_first_microbatch must be None, True "
                           r"or False, got 'False'"):
            layer(torch.randn(4, 32), is_first_microbatch="False")
        layer(torch.randn(4, 32), is_first_microbatch=False)  # (still taken)


@pytest.mark.parametrize("call,message", [
    (lambda: tfp8.strip_fp8_state("model.pt"),
     r"strip_fp8_state: state_dict must be a mapping \(a module's state_dict\(\)\), got str"),
    (lambda: tfp8.enable_fp8_all_gather("model"),
     r"enable_fp8_all_gather: model must be a torch.nn.Module, got str"),
    (lambda: tfp8.load_fp8_state("model", {}),
     r"load_fp8_state: model must be a torch.nn.Module, got str"),
], ids=["strip_fp8_state", "enable_fp8_all_gather", "load_fp8_state"])
def test_model_functions_name_an_argument_that_is_not_a_model(call, message):
    """(They used to raise AttributeError: 'str' object has no attribute ...)"""
    with pytest.raises(TypeError, match=message):
        call()
