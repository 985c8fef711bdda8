"""CUDA graphs: a whole FP8 training step (forward under fp8_autocast, backward, both scale
updates) captured in one torch.cuda.CUDAGraph replays like eager steps. On the CPU: a step
reads no tensor value on the host (what capture forbids), whatever the recipe."""
from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from conftest import CUDA_SKIP, DEVICE_PARAMS, assert_bitwise_equal
from integration_compare import STEP_SCALES, assert_bit_identical, record_step

import transformer_fp8 as tfp8
from transformer_fp8 import DelayedScaling, Float8CurrentScaling, fp8_autocast
from transformer_fp8.integrations import cuda_graphs
from transformer_fp8.quantization.autocast import isolated_fp8_autocast

RECIPES = [DelayedScaling(amax_history_len=4), Float8CurrentScaling()]
RECIPE_IDS = ["delayed", "current"]


def make_model(device, recipe):
    torch.manual_seed(0)
    return torch.nn.Sequential(tfp8.Linear(64, 128, recipe=recipe), torch.nn.GELU(),
                               tfp8.Linear(128, 64, recipe=recipe)).to(device)


def step(model, x, g, recipe):
    with fp8_autocast(fp8_recipe=recipe):
        out = model(x)
    out.backward(g)
    return out


def step_inputs(seed, steps, device="cpu"):
    """(x, grad_output) per step, x's magnitude changing from step to step (so do the amaxes)."""
    gen = torch.Generator().manual_seed(seed)
    return [((torch.randn(32, 64, generator=gen) * STEP_SCALES[i % len(STEP_SCALES)]).to(device),
             torch.randn(32, 64, generator=gen).to(device)) for i in range(steps)]


def sgd_in_place(*models, lr=0.05):
    """A plain SGD step written into the parameters (the addresses the graphs hold): between
    replays the weights, their amaxes and their FP8 casts change as in training (a graph that
    replayed a weight cast at capture would pass a test that never changes them)."""
    with torch.no_grad():
        for model in models:
            for p in model.parameters():
                if p.grad is not None:
                    p.sub_(p.grad, alpha=lr)


class _HostReads(TorchDispatchMode):
    """Records the operators that read a tensor's value on the host or wait for the device:
    .item() / bool(t), nonzero (its output size), and copies between the CPU and a device in
    either direction (.cpu(), .tolist() of a device tensor, a CPU tensor moved in). On the CPU
    only the first kind can show (.tolist() of a CPU tensor dispatches nothing): the CUDA case
    checks the rest."""

    _READS = (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default,
              torch.ops.aten.is_nonzero.default, torch.ops.aten.nonzero.default)
    _COPIES = (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default)

    def __init__(self):
        super().__init__()
        self.reads = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in self._READS:
            self.reads.append(str(func))
        elif func in self._COPIES:
            devices = {t.device.type for t in (*args, out) if isinstance(t, torch.Tensor)}
            if "cpu" in devices and len(devices) > 1:
                self.reads.append(f"{func} between {sorted(devices)}")
        return out


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("recipe", RECIPES, ids=RECIPE_IDS)
def test_training_step_reads_no_tensor_value_on_the_host(device, recipe):
    model = make_model(device, recipe)
    x = torch.randn(32, 64, device=device, requires_grad=True)
    g = torch.randn(32, 64, device=device)
    step(model, x, g, recipe)  # first step: recipe adoption and plans happen here
    with _HostReads() as mode:
        step(model, x, g, recipe)
    assert mode.reads == [], f"host reads in a training step: {mode.reads}"


def capture_and_replay_a_whole_step(eager, graphed, inputs, recipe, after_capture=None):
    """Three warm-up steps on a side stream (plans, workspaces, recipe adoption), one step of
    ``graphed`` captured, ``after_capture()``, then replays against eager steps of ``eager``:
    (got, expected) step records."""
    static_x = torch.zeros(32, 64, device="cuda", requires_grad=True)
    static_g = torch.zeros(32, 64, device="cuda")

    def run_eager(x, g):
        for p in eager.parameters():
            p.grad = None
        x_in = x.clone().requires_grad_(True)
        out = step(eager, x_in, g, recipe)
        return record_step(out, eager, {"input": x_in})

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for x, g in inputs[:3]:
            run_eager(x, g)
            with torch.no_grad():
                static_x.copy_(x)
                static_g.copy_(g)
            for p in graphed.parameters():
                p.grad = None
            static_x.grad = None
            step(graphed, static_x, static_g, recipe)
    torch.cuda.current_stream().wait_stream(side)
    for p in list(graphed.parameters()) + [static_x]:
        p.grad.zero_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step(graphed, static_x, static_g, recipe)  # grads accumulate into zeros
    if after_capture is not None:
        after_capture()

    expected, got = [], []
    for x, g in inputs[3:]:
        expected.append(run_eager(x, g))
        with torch.no_grad():
            static_x.copy_(x)
            static_g.copy_(g)
            for p in list(graphed.parameters()) + [static_x]:
                p.grad.zero_()
        graph.replay()
        torch.cuda.synchronize()
        got.append(record_step(static_out, graphed, {"input": static_x}))
        sgd_in_place(eager, graphed)
    return got, expected


@CUDA_SKIP
@pytest.mark.parametrize("recipe", RECIPES, ids=RECIPE_IDS)
def test_whole_training_step_replays_in_a_cuda_graph(recipe):
    """Three warm-up steps, a captured step, then three replays against eager steps: output,
    every gradient, the input's, and the FP8 state, bit for bit."""
    eager = make_model("cuda", recipe)
    graphed = copy.deepcopy(eager)
    assert_bit_identical(*capture_and_replay_a_whole_step(
        eager, graphed, step_inputs(0, 6, "cuda"), recipe))


# ---- make_graphed_callables ------------------------------------------------------------------
# What a graphed module runs is its forward inside an isolated fp8_autocast (the outermost for
# that module alone). On the CPU: that forward, run eagerly, gives exactly the numbers of an
# eager step with its own fp8_autocast around the module, whatever context surrounds it.

def _two_stage_models(device, recipe):
    torch.manual_seed(0)
    first = tfp8.Linear(64, 64, recipe=recipe).to(device)  # runs in the caller's context
    block = make_model(device, recipe)  # the module that gets graphed
    return first, block


def _reference_step(first, block, x, g, recipe):
    """Eager: the caller's context around `first`, an fp8_autocast of its own around `block`."""
    with fp8_autocast(fp8_recipe=recipe):
        h = first(x)
    with fp8_autocast(fp8_recipe=recipe):
        out = block(h)
    out.backward(g)
    return out


@pytest.mark.parametrize("recipe", RECIPES, ids=RECIPE_IDS)
def test_isolated_forward_of_a_graphed_module_matches_eager_steps(recipe):
    from transformer_fp8.integrations.cuda_graphs import _Fp8Callable

    first, block = _two_stage_models("cpu", recipe)
    ref_first, ref_block = copy.deepcopy(first), copy.deepcopy(block)
    isolated = _Fp8Callable(block, True, recipe, None)
    other = DelayedScaling(amax_history_len=4, margin=1)  # the caller's context differs
    got, expected = [], []
    for x, g in step_inputs(1, 4):
        for model in (first, block, ref_first, ref_block):
            model.zero_grad(set_to_none=True)
        with fp8_autocast(fp8_recipe=other):
            out = isolated(first(x))
        out.backward(g)
        got.append(record_step(out, torch.nn.ModuleList([first, block])))
        with fp8_autocast(fp8_recipe=other):
            h = ref_first(x)
        with fp8_autocast(fp8_recipe=recipe):
            ref_out = ref_block(h)
        ref_out.backward(g)
        expected.append(record_step(ref_out, torch.nn.ModuleList([ref_first, ref_block])))
    assert_bit_identical(got, expected)
    if isinstance(recipe, DelayedScaling):  # the scales did move
        assert not torch.equal(block[0].fp8_fwd_scale, torch.ones(2))


def test_make_graphed_callables_refuses_what_it_cannot_graph():
    block = make_model("cpu", DelayedScaling())
    sample = (torch.randn(32, 64),)
    with pytest.raises(TypeError, match="modules"):
        tfp8.make_graphed_callables(lambda x: x, sample, fp8_enabled=True)
    with pytest.raises(ValueError, match=r"sample_args\[0\].*CUDA"):
        tfp8.make_graphed_callables(block, sample, fp8_enabled=True)
    with pytest.raises(ValueError, match="sample_args must hold one tuple"):
        tfp8.make_graphed_callables((block, block), (sample,), fp8_enabled=True)
    with pytest.raises(TypeError, match=r"sample_args\[0\] must be a tuple of tensors"):
        tfp8.make_graphed_callables(block, (1.0,), fp8_enabled=True)
    with pytest.raises(ValueError, match="fp8_weight_caching"):
        tfp8.make_graphed_callables(block, sample, fp8_enabled=True, fp8_weight_caching=True)
    with pytest.raises(ValueError, match="fp8_calibrating"):
        tfp8.make_graphed_callables(block, sample, fp8_calibrating=True)
    with pytest.raises(ValueError, match="sample_kwargs"):
        tfp8.make_graphed_callables(block, sample, sample_kwargs=({"x": 1},))
    with pytest.raises(TypeError, match="fp8_recipe"):
        tfp8.make_graphed_callables(block, sample, fp8_enabled=True, fp8_recipe="delayed")
    with pytest.raises(TypeError, match="fp8_enabled"):
        tfp8.make_graphed_callables(block, sample, fp8_enabled=1)
    with pytest.raises(ValueError, match="fp8_recipe and recipe"):
        tfp8.make_graphed_callables(block, sample, fp8_recipe=DelayedScaling(),
                                    recipe=Float8CurrentScaling())
    # Transformer Engine 2.x's arguments: its spellings of the refused ones, and its pipeline
    # and hook options, refused by name (they were TypeErrors); fp8_enabled per module.
    with pytest.raises(ValueError, match="fp8_calibrating and calibrating|calibrating"):
        tfp8.make_graphed_callables(block, sample, calibrating=True)
    with pytest.raises(ValueError, match="fp8_weight_caching"):
        tfp8.make_graphed_callables(block, sample, cache_quantized_params=True)
    for name, value in (("retain_graph_in_backward", True), ("_order", [1, -1]),
                        ("_num_layers_per_chunk", [1]),
                        ("_reuse_graph_input_output_buffers", True),
                        ("post_warmup_hook", lambda: None), ("capture_time_hooks", [None])):
        with pytest.raises(ValueError, match=f"{name}=.* is not supported"):
            tfp8.make_graphed_callables(block, sample, **{name: value})
    with pytest.raises(TypeError, match="pre_warmup_hook must be callable"):
        tfp8.make_graphed_callables(block, sample, pre_warmup_hook=1)
    with pytest.raises(TypeError, match=r"a tuple of 2 bools"):
        tfp8.make_graphed_callables((block, block), (sample, sample), fp8_enabled=(True,))
    with pytest.raises(ValueError, match=r"sample_args\[0\].*CUDA"):  # (the tuple is fine)
        tfp8.make_graphed_callables((block, block), (sample, sample), enabled=(True, False),
                                    clone_param_grads_on_return=False)
    # Nothing was changed by a refused call.
    assert block[0].forward.__func__ is tfp8.Linear.forward


@CUDA_SKIP
@pytest.mark.parametrize("recipe", RECIPES, ids=RECIPE_IDS)
def test_make_graphed_callables_replays_like_eager_steps(recipe):
    first, block = _two_stage_models("cuda", recipe)
    ref_first, ref_block = copy.deepcopy(first), copy.deepcopy(block)
    sample = (torch.randn(32, 64, device="cuda", requires_grad=True),)
    graphed = tfp8.make_graphed_callables(block, sample, fp8_enabled=True, fp8_recipe=recipe)
    assert graphed is block
    torch.cuda.synchronize()
    # The warm-up steps are undone: the state is the one before graphing.
    for (name, t), u in zip(block.state_dict().items(), ref_block.state_dict().values()):
        assert_bitwise_equal(t, u, f"after graphing: {name}")
    got, expected = [], []
    for x, g in step_inputs(1, 5, "cuda"):
        for model in (first, block, ref_first, ref_block):
            model.zero_grad(set_to_none=True)
        with fp8_autocast(fp8_recipe=recipe):
            out = block(first(x))
        out.backward(g)
        ref_out = _reference_step(ref_first, ref_block, x, g, recipe)
        torch.cuda.synchronize()
        got.append(record_step(out, torch.nn.ModuleList([first, block])))
        expected.append(record_step(ref_out, torch.nn.ModuleList([ref_first, ref_block])))
        sgd_in_place(first, block, ref_first, ref_block)
    assert_bit_identical(got, expected)
    # In eval mode (not the captured mode) the module runs eagerly, still under the recipe.
    block.eval()
    ref_block.eval()
    with torch.no_grad(), fp8_autocast(fp8_recipe=recipe):
        h = first(x)
    with torch.no_grad():
        got = block(h)
    with torch.no_grad(), fp8_autocast(fp8_recipe=recipe):
        expected = ref_block(h)
    assert_bitwise_equal(got, expected, "eval forward")


@CUDA_SKIP
def test_make_graphed_callables_takes_fp8_enabled_per_module():
    """Transformer Engine 2.x's fp8_enabled tuple: the first module graphed in FP8, the second
    in high precision (its own FP8 state untouched), like eager steps run so."""
    recipe = DelayedScaling(amax_history_len=4)
    torch.manual_seed(0)
    stages = (make_model("cuda", recipe), make_model("cuda", recipe))
    refs = copy.deepcopy(stages)
    samples = tuple((torch.randn(32, 64, device="cuda", requires_grad=True),) for _ in stages)
    tfp8.make_graphed_callables(stages, samples, fp8_enabled=(True, False), fp8_recipe=recipe)
    got, expected = [], []
    for x, g in step_inputs(3, 4, "cuda"):
        for model in stages + refs:
            model.zero_grad(set_to_none=True)
        out = stages[1](stages[0](x))
        out.backward(g)
        with fp8_autocast(fp8_recipe=recipe):
            h = refs[0](x)
        ref_out = refs[1](h)
        ref_out.backward(g)
        torch.cuda.synchronize()
        got.append(record_step(out, torch.nn.ModuleList(stages)))
        expected.append(record_step(ref_out, torch.nn.ModuleList(refs)))
        sgd_in_place(*stages, *refs)
    assert_bit_identical(got, expected)
    assert torch.all(stages[1][0].fp8_fwd_scale == 1), "the high-precision stage kept its state"


@CUDA_SKIP
def test_make_graphed_callables_takes_several_modules_in_order():
    recipe = DelayedScaling(amax_history_len=4)
    torch.manual_seed(0)
    stages = (make_model("cuda", recipe), make_model("cuda", recipe))
    refs = copy.deepcopy(stages)
    samples = tuple((torch.randn(32, 64, device="cuda", requires_grad=True),) for _ in stages)
    graphed = tfp8.make_graphed_callables(stages, samples, fp8_enabled=True, fp8_recipe=recipe)
    assert graphed == stages
    got, expected = [], []
    for x, g in step_inputs(2, 4, "cuda"):
        x = x.requires_grad_(True)
        for model in stages + refs:
            model.zero_grad(set_to_none=True)
        out = stages[1](stages[0](x))
        out.backward(g)
        x_ref = x.detach().clone().requires_grad_(True)
        with fp8_autocast(fp8_recipe=recipe):
            h = refs[0](x_ref)
        with fp8_autocast(fp8_recipe=recipe):
            ref_out = refs[1](h)
        ref_out.backward(g)
        torch.cuda.synchronize()
        got.append(record_step(out, torch.nn.ModuleList(stages), {"input": x}))
        expected.append(record_step(ref_out, torch.nn.ModuleList(refs), {"input": x_ref}))
        sgd_in_place(*stages, *refs)
    assert_bit_identical(got, expected)


def test_graphing_keeps_the_modes_of_submodules():
    from transformer_fp8.integrations.cuda_graphs import _Fp8Callable

    block = torch.nn.Sequential(tfp8.Linear(64, 64), torch.nn.Dropout(0.5), tfp8.Linear(64, 64))
    block[1].eval()  # switched off by the user inside a training model
    wrapper = _Fp8Callable(block, True, DelayedScaling(), None)
    assert wrapper.training and block.training and not block[1].training


def _graphed_on_cpu(block, recipe, sample=(torch.empty(8, 64),)):
    """make_graphed_callables' forward around torch's replay, the replay recorded and run as
    the eager wrapper (the checks before a replay, tested on the CPU)."""
    from transformer_fp8.integrations.cuda_graphs import _Fp8Callable, _graphed_forward

    wrapper = _Fp8Callable(block, True, recipe, None)
    replays, captured_mode = [], block.training

    def replay(*args):  # (torch's: a replay in the captured mode, else the eager forward)
        if wrapper.training == captured_mode:
            replays.append(args)
        return _Fp8Callable.forward(wrapper, *args)

    wrapper.forward = replay  # (torch's graphed forward in its place)
    block.forward = _graphed_forward(block, wrapper, sample)
    return replays


@pytest.mark.parametrize("replace", ["history_length", "half", "bfloat16", "assign", "buffer"])
def test_a_graphed_module_refuses_replaced_tensors(gen, replace):
    """The graphs hold the addresses of the parameters, buffers and FP8 state: a module whose
    tensors were replaced must not replay. .half() and load_state_dict(assign=True) replace the
    parameters' storage and keep the FP8 state's (float32): they replayed before, on freed
    memory."""
    recipe = DelayedScaling(amax_history_len=4)
    block = make_model("cpu", recipe)
    replays = _graphed_on_cpu(block, recipe)
    block(torch.randn(8, 64, generator=gen))  # unchanged tensors: replays
    assert len(replays) == 1
    if replace == "history_length":
        block.load_state_dict(make_model("cpu", DelayedScaling(amax_history_len=8)).state_dict())
    elif replace in ("half", "bfloat16"):
        getattr(block, replace)()
    elif replace == "assign":
        state = {k: v.clone() for k, v in block.state_dict().items() if "fp8" not in k}
        block.load_state_dict(state, strict=False, assign=True)
    else:
        block[0].fp8_fwd_scale = block[0].fp8_fwd_scale.clone()
    with pytest.raises(RuntimeError, match="were replaced after make_graphed_callables"):
        block(torch.randn(8, 64, generator=gen).to(block[0].weight.dtype))
    assert len(replays) == 1


@pytest.mark.parametrize("recipe", RECIPES, ids=RECIPE_IDS)
def test_a_graphed_module_refuses_fp8_weights_replaced(gen, recipe):
    """An FP8 weight (quantized_model_init) is a wrapper whose own data_ptr() is 0: its FP8
    data and scales replaced by load_state_dict(assign=True) left every address the check read
    unchanged, and the graphs would have read freed memory."""
    with tfp8.quantized_model_init(recipe=recipe):
        block = torch.nn.Sequential(tfp8.Linear(64, 64, bias=False, recipe=recipe))
    replays = _graphed_on_cpu(block, recipe)
    block(torch.randn(8, 64, generator=gen))
    block.load_state_dict(block.state_dict(), assign=True)
    with pytest.raises(RuntimeError, match="were replaced after make_graphed_callables"):
        block(torch.randn(8, 64, generator=gen))
    assert len(replays) == 1


def test_a_graphed_module_refuses_arguments_unlike_its_samples(gen):
    """A replay copies each argument into its captured input with copy_, which broadcasts a
    smaller shape and converts another dtype silently; an argument that requires grad where its
    sample did not got None as its gradient. Each is refused by name; in the mode not captured
    (eval here) the module runs eagerly and takes any input."""
    recipe = DelayedScaling(amax_history_len=4)
    block = make_model("cpu", recipe)
    replays = _graphed_on_cpu(block, recipe, (torch.empty(8, 64),))
    wrong = {
        "a smaller shape": ((torch.randn(1, 64, generator=gen),), "must have the shape"),
        "another dtype": ((torch.randn(8, 64, generator=gen).double(),), "must have the shape"),
        "two arguments": ((torch.randn(8, 64), torch.randn(8, 64)), "captured with 1"),
        "no argument": ((), "captured with 1"),
        "a gradient": ((torch.randn(8, 64, requires_grad=True),), "requires a gradient"),
        "not a tensor": (([0.0] * 64,), "must be a tensor"),
    }
    for what, (args, message) in wrong.items():
        with pytest.raises((ValueError, TypeError), match=message):
            block(*args)
        assert not replays, what
    block(torch.randn(8, 64, generator=gen))
    assert len(replays) == 1
    block.eval()
    assert block(torch.randn(3, 64, generator=gen)).shape == (3, 64)
    assert len(replays) == 1, "eval mode: eagerly"
    block.train()
    graded = make_model("cpu", recipe)
    replays = _graphed_on_cpu(graded, recipe, (torch.empty(8, 64, requires_grad=True),))
    graded(torch.randn(8, 64, generator=gen))  # (a gradient computed and dropped: allowed)
    assert len(replays) == 1


@pytest.mark.parametrize("recipe", RECIPES, ids=RECIPE_IDS)
def test_a_graphed_module_runs_eagerly_without_gradients(gen, recipe):
    """An evaluation forward in training mode under no_grad / inference_mode runs eagerly and
    leaves the FP8 state alone, as eager fp8_autocast does (the captured forward graph, which
    ends with the scale update, replayed it before)."""
    block, reference = make_model("cpu", recipe), make_model("cpu", recipe)
    replays = _graphed_on_cpu(block, recipe)
    x = torch.randn(8, 64, generator=gen) * 3
    for context in (torch.no_grad, torch.inference_mode):
        before = [t.clone() for t in block.state_dict().values()]
        with context():
            got = block(x)
        with context(), fp8_autocast(fp8_recipe=recipe):
            expected = reference(x)
        assert not replays
        assert_bitwise_equal(got, expected)
        for t, u in zip(block.state_dict().values(), before):
            assert_bitwise_equal(t, u, "the FP8 state after an evaluation forward")
    block(x)
    assert len(replays) == 1  # with gradients: the graphs


def test_make_graphed_callables_refuses_hooks_and_delayed_wgrad():
    recipe = DelayedScaling()
    sample = (torch.randn(32, 64),)
    block = make_model("cpu", recipe)
    handle = block.register_forward_pre_hook(lambda module, args: None)
    with pytest.raises(ValueError, match=r"modules\[0\] \(Sequential\) has hooks registered "
                                         r"\(_forward_pre_hooks\)"):
        tfp8.make_graphed_callables(block, sample, fp8_enabled=True)
    handle.remove()
    delayed = torch.nn.Sequential(tfp8.Linear(64, 64, delay_wgrad_compute=True))
    with pytest.raises(ValueError, match="delay_wgrad_compute=True"):
        tfp8.make_graphed_callables((block, delayed), (sample, sample), fp8_enabled=True)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="num_warmup_iters must be an integer >= 1"):
            tfp8.make_graphed_callables(block, sample, fp8_enabled=True, num_warmup_iters=bad)
    # (main_grad written in Python: the warm-up failed inside torch, having added garbage)
    fused = torch.nn.Sequential(tfp8.Linear(64, 64, fuse_wgrad_accumulation=True))
    with pytest.raises(ValueError, match="fuse_wgrad_accumulation=True"):
        tfp8.make_graphed_callables(fused, sample, fp8_enabled=True)
    # (a tracker's fork sets generator states, which capture refuses deep inside torch)
    tracker = tfp8.distributed.CudaRNGStatesTracker()
    attention = tfp8.DotProductAttention(2, 16, attention_dropout=0.1,
                                         get_rng_state_tracker=lambda: tracker)
    with pytest.raises(ValueError, match=r"attention dropout \(p=0.1\) from an RNG tracker"):
        tfp8.make_graphed_callables(torch.nn.Sequential(attention), sample)
    assert block.forward.__func__ is torch.nn.Sequential.forward  # nothing changed


class _StaticGradLinear(torch.autograd.Function):
    """x @ w.T whose backward returns the weight gradient in one buffer it keeps, as a CUDA
    graph replay returns its static output buffers."""

    buffer = None

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x)
        return x @ w.t()

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        if _StaticGradLinear.buffer is None:
            _StaticGradLinear.buffer = torch.empty(g.shape[1], x.shape[1])
        _StaticGradLinear.buffer.copy_(g.t() @ x)
        return None, _StaticGradLinear.buffer.detach()


@pytest.mark.parametrize("clone", [True, False])
def test_returned_parameter_gradients_are_copied_before_they_accumulate(clone):
    """A replay returns the graph's gradient buffers; autograd installs one as param.grad
    without a copy: two accumulated microbatches gave 2 x the second one's gradient (the buffer
    added to itself). clone_returned_param_grads (make_graphed_callables'
    clone_param_grads_on_return, default True) copies them first: the sum of both."""
    from transformer_fp8.integrations.cuda_graphs import clone_returned_param_grads
    layer = torch.nn.Linear(4, 3, bias=False)
    _StaticGradLinear.buffer = None
    if clone:
        clone_returned_param_grads([layer])
        clone_returned_param_grads([layer])  # (a module graphed again: one hook)
    xs = [torch.randn(5, 4), torch.randn(5, 4) * 10]
    for x in xs:
        _StaticGradLinear.apply(x, layer.weight).sum().backward()
    expected = sum(torch.ones(5, 3).t() @ x for x in xs)
    if clone:
        torch.testing.assert_close(layer.weight.grad, expected)
        assert layer.weight.grad.data_ptr() != _StaticGradLinear.buffer.data_ptr()
    else:  # (what torch's replay gives: the buffer added to itself)
        assert layer.weight.grad.data_ptr() == _StaticGradLinear.buffer.data_ptr()
        torch.testing.assert_close(layer.weight.grad, 2 * torch.ones(5, 3).t() @ xs[1])


@CUDA_SKIP
def test_graphed_microbatches_accumulate_their_gradients():
    """Two microbatches per step, gradients accumulated (zero_grad(set_to_none=False) too):
    the graphed steps give the eager steps' accumulated gradients bit for bit."""
    recipe = DelayedScaling(amax_history_len=4)
    first, block = _two_stage_models("cuda", recipe)
    ref_first, ref_block = copy.deepcopy(first), copy.deepcopy(block)
    sample = (torch.randn(32, 64, device="cuda", requires_grad=True),)
    tfp8.make_graphed_callables(block, sample, fp8_enabled=True, fp8_recipe=recipe)
    inputs = step_inputs(3, 6, "cuda")
    for set_to_none in (True, False):
        for model in (first, block, ref_first, ref_block):
            model.zero_grad(set_to_none=set_to_none)
        for x, g in inputs[:2] if set_to_none else inputs[2:4]:
            with fp8_autocast(fp8_recipe=recipe):
                out = block(first(x))
            out.backward(g)
            _reference_step(ref_first, ref_block, x, g, recipe)
        torch.cuda.synchronize()
        for p, q in zip(block.parameters(), ref_block.parameters()):
            assert_bitwise_equal(p.grad, q.grad, f"accumulated, set_to_none={set_to_none}")


@CUDA_SKIP
@pytest.mark.parametrize("recipe", RECIPES, ids=RECIPE_IDS)
def test_make_graphed_callables_of_fused_modules_replays_like_eager_steps(recipe):
    """LayerNormLinear and LayerNormMLP (two GEMMs, fused norm and activation casts) graphed:
    replays give the eager steps' outputs, gradients and FP8 state bit for bit."""
    torch.manual_seed(0)
    block = torch.nn.Sequential(
        tfp8.LayerNormLinear(64, 64, normalization="RMSNorm", recipe=recipe),
        tfp8.LayerNormMLP(64, 128, activation="swiglu", recipe=recipe)).cuda()
    reference = copy.deepcopy(block)
    sample = (torch.randn(32, 64, device="cuda", requires_grad=True),)
    tfp8.make_graphed_callables(block, sample, fp8_enabled=True, fp8_recipe=recipe)
    assert_graphed_steps_like_eager(block, reference, recipe, seed=3)


def assert_graphed_steps_like_eager(graphed, reference, recipe, seed, inputs=None):
    """Steps of a graphed module (its replays) and of its eager reference under fp8_autocast,
    an SGD step on both after each: outputs, gradients and FP8 state bit for bit. ``inputs``:
    the steps' (x, grad_output), by default step_inputs(seed, 4, "cuda")."""
    got, expected = [], []
    for x, g in step_inputs(seed, 4, "cuda") if inputs is None else inputs:
        for model in (graphed, reference):
            model.zero_grad(set_to_none=True)
        x_g, x_r = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        out = graphed(x_g)
        out.backward(g)
        ref_out = step(reference, x_r, g, recipe)
        torch.cuda.synchronize()
        got.append(record_step(out, graphed, {"input": x_g}))
        expected.append(record_step(ref_out, reference, {"input": x_r}))
        sgd_in_place(graphed, reference)
    assert_bit_identical(got, expected)


def _fp8_gemm_inputs(gen, M, N, K):
    from transformer_fp8 import ops
    a = torch.randn(M, K, generator=gen).cuda()
    b = torch.randn(N, K, generator=gen).cuda()
    sa = ops.compute_scale_from_amax(ops.amax(a).reshape(1), 448.0)
    sb = ops.compute_scale_from_amax(ops.amax(b).reshape(1), 448.0)
    return (ops.cast_to_fp8(a, sa, torch.float8_e4m3fn), 1 / sa,
            ops.cast_to_fp8(b, sb, torch.float8_e4m3fn), 1 / sb, torch.bfloat16)


@CUDA_SKIP
def test_two_graphs_replayed_at_once_on_two_streams_match_eager(gen):
    """Two graphs of cuBLASLt GEMMs, both captured on torch.cuda.graph's one capture stream,
    replayed at the same time on two streams while eager GEMMs run on a third: each must give
    its eager result, bit for bit (a cuBLASLt workspace shared between them would not)."""
    from transformer_fp8 import ops
    from transformer_fp8.ops.blockwise import fp8_gemm_blockwise, quantize_blockwise

    # Long K, few output tiles: the shapes cuBLASLt splits over K, through its workspace.
    per_tensor = _fp8_gemm_inputs(gen, 256, 256, 16384)
    x = torch.randn(256, 16384, generator=gen).cuda()
    w = torch.randn(384, 16384, generator=gen).cuda()
    xq, xs, _, _ = quantize_blockwise(x, 1, 128, torch.float8_e4m3fn, True)
    wq, ws, _, _ = quantize_blockwise(w, 128, 128, torch.float8_e4m3fn, True)
    blocked = (xq, xs, wq, ws, torch.bfloat16)
    eager_inputs = _fp8_gemm_inputs(gen, 512, 128, 32768)

    calls = [lambda: ops.fp8_gemm(*per_tensor), lambda: fp8_gemm_blockwise(*blocked)]
    expected = [call() for call in calls]
    expected_eager = ops.fp8_gemm(*eager_inputs)
    graphs, outputs = [], []
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up before capture, as torch.cuda.graph asks
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(side)
    for call in calls:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outputs.append(call())
        graphs.append(graph)

    streams = [torch.cuda.Stream() for _ in range(3)]
    for _ in range(20):
        for s in streams:
            s.wait_stream(torch.cuda.current_stream())
        eager_out = []
        for graph, s in zip(graphs, streams):
            with torch.cuda.stream(s):
                graph.replay()
        with torch.cuda.stream(streams[2]):
            eager_out.append(ops.fp8_gemm(*eager_inputs))
        for s in streams:
            torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        for name, got, want in zip(("per-tensor graph", "block-scaled graph"), outputs, expected):
            assert torch.equal(got, want), name
        assert torch.equal(eager_out[0], expected_eager), "eager GEMM beside the replays"


ISOLATED_MODULES = {
    "Linear": lambda recipe: tfp8.Linear(64, 64, recipe=recipe),
    "LayerNormLinear": lambda recipe: tfp8.LayerNormLinear(64, 64, normalization="RMSNorm",
                                                           recipe=recipe),
    "LayerNormMLP": lambda recipe: tfp8.LayerNormMLP(64, 128, activation="swiglu",
                                                     recipe=recipe),
    "both": lambda recipe: torch.nn.Sequential(
        tfp8.LayerNormLinear(64, 64, normalization="RMSNorm", recipe=recipe),
        tfp8.LayerNormMLP(64, 128, activation="swiglu", recipe=recipe)),
}


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("module", list(ISOLATED_MODULES))
@pytest.mark.parametrize("recipe", RECIPES, ids=RECIPE_IDS)
def test_isolated_context_steps_like_fp8_autocast(recipe, module, device):
    """What make_graphed_callables captures, run eagerly: the forward inside
    isolated_fp8_autocast, the backward after the context has exited (as torch's capture and
    replays run them) give fp8_autocast's steps bit for bit, grad_output histories included.
    (The C++ steps' backward hook held the isolated context's BackwardStep weakly: it was gone
    by the backward, and LayerNormLinear's and LayerNormMLP's grad_output update never ran;
    the graphed test on the H100 found it.)"""
    torch.manual_seed(0)
    model = ISOLATED_MODULES[module](recipe).to(device)
    reference = copy.deepcopy(model)
    got, expected = [], []
    for x, g in step_inputs(5, 4, device):
        x_g, x_r = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        with isolated_fp8_autocast(True, recipe, None):
            out = model(x_g)
        out.backward(g)
        ref_out = step(reference, x_r, g, recipe)
        got.append(record_step(out, model, {"input": x_g}))
        expected.append(record_step(ref_out, reference, {"input": x_r}))
        for m in (model, reference):
            m.zero_grad(set_to_none=True)
    assert_bit_identical(got, expected)


def _regraph_block(recipe, device):
    torch.manual_seed(0)
    return torch.nn.Sequential(tfp8.Linear(64, 64, recipe=recipe), torch.nn.GELU(),
                               tfp8.Linear(64, 64, recipe=recipe)).to(device)


def test_graphing_again_wraps_the_modules_own_forward():
    """make_graphed_callables' own steps around the capture (on the CPU, torch's replay left
    out): after a first graphing, a second one wraps the module's forward, not the first
    graphed forward (which then refused the replaced state it was meant to recover from)."""
    recipe = DelayedScaling(amax_history_len=4)
    block = _regraph_block(recipe, "cpu")
    x = torch.randn(32, 64)

    def graph(module):  # make_graphed_callables, its capture left out
        wrapper = cuda_graphs._Fp8Callable(module, True, recipe, None)
        wrapper(x)
        module.forward = cuda_graphs._graphed_forward(module, wrapper, (x,))
        return wrapper

    graph(block)
    block.load_state_dict(_regraph_block(DelayedScaling(amax_history_len=8), "cpu").state_dict())
    with pytest.raises(RuntimeError, match="Graph the module again"):
        block(x)
    for layer in cuda_graphs._fp8_layers(block):
        layer.prepare_fp8_recipe(recipe)
    wrapper = graph(block)
    assert wrapper._module_forward.__func__ is torch.nn.Sequential.forward
    block(x)  # the new pointers


@CUDA_SKIP
def test_a_module_graphed_again_replays_its_new_graphs():
    """Graphed, then given a state of another history length (its graphed forward refuses),
    graphed again: replays like eager steps, bit for bit."""
    recipe = DelayedScaling(amax_history_len=4)
    block = _regraph_block(recipe, "cuda")
    sample = (torch.randn(32, 64, device="cuda", requires_grad=True),)
    tfp8.make_graphed_callables(block, sample, fp8_enabled=True, fp8_recipe=recipe)
    loaded = _regraph_block(DelayedScaling(amax_history_len=8), "cuda").state_dict()
    block.load_state_dict(loaded)
    with pytest.raises(RuntimeError, match="Graph the module again"):
        block(sample[0])
    reference = _regraph_block(recipe, "cuda")
    reference.load_state_dict(loaded)
    tfp8.make_graphed_callables(block, sample, fp8_enabled=True, fp8_recipe=recipe)
    assert_graphed_steps_like_eager(block, reference, recipe, seed=6)


def test_a_captured_update_keeps_the_tensors_it_writes(monkeypatch):
    """A step captured while another model of the same recipe exists (the eager copy): the
    captured update covers that model's states too, and keeps their tensors when the model is
    freed (the plan went with it, and replays wrote freed memory). On the CPU, with capture
    pretended (the plans' devices taken for CUDA ones)."""
    from transformer_fp8.quantization import amax_step, update_plan
    init = update_plan.UpdatePlan.__init__

    def on_cuda_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.on_cuda = True

    monkeypatch.setattr(update_plan.UpdatePlan, "__init__", on_cuda_init)
    monkeypatch.setattr(amax_step, "_CAPTURED_PLANS", {})
    monkeypatch.setattr(amax_step, "_stream_capturing", lambda: False)
    recipe = DelayedScaling(amax_history_len=4)
    eager = make_model("cpu", recipe)
    graphed = copy.deepcopy(eager)
    inputs = step_inputs(1, 4)
    for x, g in inputs[:3]:
        for model in (eager, graphed):
            step(model, x.clone().requires_grad_(True), g, recipe)
    kept = [weakref.ref(t) for layer in (eager[0], eager[2])
            for t in (layer.fp8_fwd_amax_history, layer.fp8_bwd_amax_history)]
    monkeypatch.setattr(amax_step, "_stream_capturing", lambda: True)
    x, g = inputs[3]
    step(graphed, x.clone().requires_grad_(True), g, recipe)  # "captured"
    monkeypatch.setattr(amax_step, "_stream_capturing", lambda: False)
    del eager
    gc.collect()
    assert all(ref() is not None for ref in kept)


@CUDA_SKIP
def test_replays_leave_the_memory_of_a_freed_model_alone():
    """A whole step captured while another model of the recipe exists, which is then freed:
    the replays still update what the capture covered, never memory handed out since (small
    tensors allocated after the free, where the freed model's FP8 state was, stay as written),
    and still match eager steps bit for bit."""
    recipe = DelayedScaling(amax_history_len=4)
    models = {"bystander": make_model("cuda", recipe)}
    eager = make_model("cuda", recipe)
    graphed = copy.deepcopy(eager)
    inputs = step_inputs(7, 6, "cuda")
    step(models["bystander"], inputs[0][0].clone().requires_grad_(True), inputs[0][1], recipe)
    fillers = []

    def free_the_bystander():
        del models["bystander"]
        gc.collect()
        torch.cuda.synchronize()
        fillers.extend(torch.full((n,), -7.0, device="cuda") for n in (2, 4, 8)
                       for _ in range(200))

    got, expected = capture_and_replay_a_whole_step(eager, graphed, inputs, recipe,
                                                    free_the_bystander)
    assert all(bool((t == -7.0).all()) for t in fillers)
    assert_bit_identical(got, expected)


def test_a_graphed_module_refuses_an_override_set_after_capture(gen):
    """A debug override set (or cleared) after graphing: the graphs would run the computation
    chosen at capture (the override was ignored, silently)."""
    from transformer_fp8 import debug

    recipe = DelayedScaling(amax_history_len=4)
    block = make_model("cpu", recipe)
    replays = _graphed_on_cpu(block, recipe)
    debug.override(block, "0", fp8=False)
    with pytest.raises(RuntimeError, match="debug override of its FP8 layers was set"):
        block(torch.randn(8, 64, generator=gen))
    debug.clear_overrides(block)
    block(torch.randn(8, 64, generator=gen))  # as captured again: replays
    assert len(replays) == 1


def test_a_step_a_collector_logs_runs_eagerly(gen):
    """A debug collector logging the step: the graphed module runs eagerly (a replay runs no
    Python and recorded nothing), with the eager step's numbers and FP8 state."""
    from transformer_fp8 import debug

    recipe = DelayedScaling(amax_history_len=4)
    block, reference = make_model("cpu", recipe), make_model("cpu", recipe)
    replays = _graphed_on_cpu(block, recipe)
    x = torch.randn(8, 64, generator=gen) * 3
    with debug.collect_stats(block, frequency=2) as stats:
        got = block(x)  # step 0: logged
        got.square().sum().backward()
        records = stats.step()
        block(x).square().sum().backward()  # step 1: not logged, replayed
        stats.step()
    assert records and len(replays) == 1
    with fp8_autocast(fp8_recipe=recipe):
        expected = reference(x)
    expected.square().sum().backward()
    assert_bitwise_equal(got, expected)
