"""get_cpu_offload_context (Transformer Engine 2.8's CPU offloading of saved activations):
training through it is bit for bit training without it, with and without FP8 and activation
checkpointing; what it offloads; its argument checks. The CUDA cases (device memory, streams)
are written for a GPU session and skip here."""
from __future__ import annotations

import contextlib
import gc

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from conftest import CUDA_SKIP, DEVICE_PARAMS
from integration_compare import assert_bit_identical, mean_square, record_step, step_batches

import transformer_fp8 as tfp8
from transformer_fp8 import DelayedScaling, Float8CurrentScaling
from transformer_fp8 import cpu_offload
from transformer_fp8.cpu_offload import _offloadable
from transformer_fp8.modules import linear_fused_step

H, F, HEADS, SEQ, BATCH = 32, 64, 2, 24, 2  # 48 rows
RECIPES = [pytest.param(DelayedScaling(amax_history_len=4), id="delayed"),
           pytest.param(Float8CurrentScaling(), id="current"),
           pytest.param(None, id="no_fp8")]


def _stack(kind: str, recipe, device="cpu", layers: int = 4, hidden: int = H, ffn: int = F):
    torch.manual_seed(0)
    if kind == "mlp":
        made = [tfp8.LayerNormMLP(hidden, ffn, recipe=recipe) for _ in range(layers)]
    else:
        made = [tfp8.TransformerLayer(hidden, ffn, HEADS, hidden_dropout=0.0,
                                      attention_dropout=0.0, recipe=recipe)
                for _ in range(layers)]
    return torch.nn.ModuleList(made).to(device)


def _plain(layers):
    def run(x):
        for layer in layers:
            x = layer(x)
        return x
    return run


def _offloaded(layers, context, synchronizer, checkpoint=None):
    """Transformer Engine's usage: each layer in the context, its output through the
    synchronizer; checkpoint="inside" / "inside_reentrant" checkpoints each layer in it."""
    def call(layer, x):
        if checkpoint == "inside":
            return torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)
        if checkpoint == "inside_reentrant":
            return tfp8.checkpoint(layer, x)
        return layer(x)

    def run(x):
        for layer in layers:
            with context:
                x = call(layer, x)
            x = synchronizer(x)
        return x
    return run


def _train(layers, run, batches, recipe) -> list:
    """SGD steps, the forward in fp8_autocast (enabled only with a recipe): a StepRecord each
    (loss, every gradient, the input's, the FP8 state)."""
    opt = torch.optim.SGD(layers.parameters(), lr=0.1)
    records = []
    for batch in batches:
        x = batch.clone().requires_grad_(True)
        with tfp8.fp8_autocast(enabled=recipe is not None, fp8_recipe=recipe):
            out = run(x)
        loss = mean_square(out)
        loss.backward()
        records.append(record_step(loss, layers, {"input": x}))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return records


def _batches(device="cpu", steps=3):
    return step_batches(torch.Generator().manual_seed(1), steps, SEQ, BATCH, H, device=device)


def _observe(context) -> list:
    """(layer index, tensor) of every tensor the context offloads from now on."""
    seen = []
    context._observer = lambda index, t: seen.append((index, t))
    return seen


# ---- training through the context is training without it -------------------------------------

@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("kind", ["mlp", "transformer"])
def test_training_is_bit_identical_with_offloading(kind, recipe, device):
    plain = _stack(kind, recipe, device)
    offloaded = _stack(kind, recipe, device)
    context, synchronizer = tfp8.get_cpu_offload_context(True, num_layers=2, model_layers=4)
    seen = _observe(context)
    got = _train(offloaded, _offloaded(offloaded, context, synchronizer), _batches(device),
                 recipe)
    expected = _train(plain, _plain(plain), _batches(device), recipe)
    assert_bit_identical(got, expected)
    assert seen and {index for index, _ in seen} == {0, 1}
    if recipe is not None:
        assert any(t.dtype in (torch.float8_e4m3fn, torch.uint8) for _, t in seen), \
            "the FP8 copies of activations are offloaded"


@pytest.mark.parametrize("recipe", RECIPES[:2])
def test_the_python_autograd_functions_are_offloaded_bit_identically_too(recipe, monkeypatch):
    # (the test above runs the C++ steps, whose saved variables are saved in C++)
    for switch in ("ENABLED", "NORM_ENABLED", "NORM_MLP_ENABLED"):
        monkeypatch.setattr(linear_fused_step, switch, False)
    test_training_is_bit_identical_with_offloading("transformer", recipe, "cpu")


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("checkpoint", ["inside", "inside_reentrant", "outside",
                                        "outside_reentrant"])
def test_activation_checkpointing_inside_or_outside_the_context(checkpoint, recipe):
    """Bit for bit training without either. Inside: the checkpoint saves the layer's input
    (both modes: torch's non-reentrant one through a node of its own), which is offloaded, and
    keeps nothing else. Outside (the whole loop checkpointed): nothing is offloaded (the
    checkpoint's forward runs under no_grad, or with its own hooks, which the context leaves
    in charge)."""
    plain = _stack("mlp", recipe)
    offloaded = _stack("mlp", recipe)
    context, synchronizer = tfp8.get_cpu_offload_context(True, num_layers=2, model_layers=4)
    seen = _observe(context)
    if checkpoint.startswith("inside"):
        run = _offloaded(offloaded, context, synchronizer, checkpoint)
    else:
        loop = _offloaded(offloaded, context, synchronizer)
        reentrant = checkpoint == "outside_reentrant"
        def run(x):  # noqa: E306
            return torch.utils.checkpoint.checkpoint(loop, x, use_reentrant=reentrant)
    got = _train(offloaded, run, _batches(), recipe)
    expected = _train(plain, _plain(plain), _batches(), recipe)
    assert_bit_identical(got, expected)
    if checkpoint.startswith("inside"):
        assert [(i, tuple(t.shape)) for i, t in seen] == [(0, (SEQ, BATCH, H)),
                                                          (1, (SEQ, BATCH, H))] * 3
    else:
        assert seen == []


def test_forwards_without_backward_and_accumulated_microbatches():
    """A no_grad forward counts its layers (the next training forward starts at layer 0 again);
    two forwards before their backwards each offload and reload their own tensors."""
    recipe = DelayedScaling(amax_history_len=4)
    plain, offloaded = _stack("mlp", recipe), _stack("mlp", recipe)
    context, synchronizer = tfp8.get_cpu_offload_context(True, num_layers=1, model_layers=4)
    seen = _observe(context)
    run = _offloaded(offloaded, context, synchronizer)
    a, b = _batches(steps=2)
    results = []
    for model, forward in ((offloaded, run), (plain, _plain(plain))):
        with torch.no_grad(), tfp8.fp8_autocast(fp8_recipe=recipe):
            evaluated = forward(a)
        xs = [a.clone().requires_grad_(True), b.clone().requires_grad_(True)]
        with tfp8.fp8_autocast(fp8_recipe=recipe):
            outs = [forward(x) for x in xs]
        for out in reversed(outs):
            mean_square(out).backward()
        results.append([evaluated, *outs, *(x.grad for x in xs),
                        *(p.grad for p in model.parameters())])
    for got, expected in zip(*results):
        assert torch.equal(got, expected)
    assert len(seen) == 2 * 8 and {i for i, _ in seen} == {0}


# ---- what is offloaded -------------------------------------------------------------------------

@pytest.mark.parametrize("num_layers", [0, 1, 2, 4])
def test_the_offloaded_layers_activations_are_offloaded_not_parameters_or_scales(num_layers):
    """LayerNormMLP under DelayedScaling saves per layer: its input [rows, H], fc1's output
    [rows, F], the FP8 transposes of the norm's output, fc1's weight, the activation and fc2's
    weight, the norm's mean and rstd [rows]: offloaded. Not: the norm's weight (a Parameter)
    and the four scale_invs (one element each). Nothing of the layers from num_layers on. The
    memory of each offloaded tensor but the caller's input is freed by the end of the forward
    (nothing else holds it)."""
    recipe = DelayedScaling(amax_history_len=4)
    layers = _stack("mlp", recipe)
    context, synchronizer = tfp8.get_cpu_offload_context(True, num_layers, 4)
    seen, kept = [], []
    context._observer = lambda index, t: (seen.append((index, tuple(t.shape), t.dtype)),
                                          kept.append(StorageWeakRef(t.untyped_storage())))
    x = _batches(steps=1)[0].requires_grad_(True)
    with tfp8.fp8_autocast(fp8_recipe=recipe):
        out = _offloaded(layers, context, synchronizer)(x)
    gc.collect()
    alive = [ref for ref in kept if not ref.expired()]
    assert alive == [] if num_layers == 0 else alive == kept[:1], "held after the forward"
    mean_square(out).backward()
    rows, fp8 = SEQ * BATCH, torch.float8_e4m3fn
    per_layer = sorted([((rows, H), torch.float32), ((rows, F), torch.float32),
                        ((H, rows), fp8), ((H, F), fp8), ((F, rows), fp8), ((F, H), fp8),
                        ((rows,), torch.float32), ((rows,), torch.float32)], key=str)
    for index in range(4):
        got = sorted([(shape, dtype) for i, shape, dtype in seen if i == index], key=str)
        assert got == (per_layer if index < num_layers else []), f"layer {index}"


@pytest.mark.parametrize("num_layers, model_layers, points", [
    (1, 4, [3]), (2, 4, [1, 3]), (3, 4, [1, 2, 3]), (4, 4, [0, 1, 2, 3]), (2, 5, [2, 4]),
    (3, 8, [2, 5, 7])])
def test_layers_start_coming_back_on_transformer_engine_2_8s_schedule(num_layers, model_layers,
                                                                      points, monkeypatch):
    """Offloaded layer i starts coming back when backward reaches layer points[i] (the
    synchronizer's node, before that layer's backward): Transformer Engine 2.8's window map
    (its group i is reloaded at layer_window_map[i])."""
    assert cpu_offload._reload_points(num_layers, model_layers) == points
    events = []
    reload = cpu_offload._Layer.reload
    monkeypatch.setattr(cpu_offload._Layer, "reload",
                        lambda self: (events.append(("reload", self.index)), reload(self)))
    torch.manual_seed(0)
    layers = [torch.nn.Linear(16, 16) for _ in range(model_layers)]
    context, synchronizer = tfp8.get_cpu_offload_context(True, num_layers, model_layers)
    x = torch.randn(4, 16, requires_grad=True)
    for index, layer in enumerate(layers):
        with context:
            x = torch.tanh(layer(x))
        x = synchronizer(x)
        x.register_hook(lambda grad, index=index: events.append(("backward of", index)))
    x.sum().backward()
    first, now = {}, None
    for what, index in events:
        if what == "backward of":
            now = index
        else:
            first.setdefault(index, now)
    assert first == dict(enumerate(points))


def test_the_rule_leaves_parameters_their_views_scalars_and_subclasses():
    weight = torch.nn.Parameter(torch.randn(4, 3))
    assert _offloadable(torch.randn(4, 3)) and _offloadable(torch.randn(4, 3)[1:])
    assert not _offloadable(weight) and not _offloadable(weight.t())
    assert not _offloadable(torch.ones(1)) and not _offloadable(torch.tensor(2.0))
    assert not _offloadable(torch.empty(0))
    assert not _offloadable(torch.randn(4, 3, device="meta"))
    assert not _offloadable(torch.eye(4).to_sparse())
    assert not _offloadable(torch.eye(4).to_sparse_csr())
    assert not _offloadable(torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]))


def test_a_sparse_tensor_saved_in_an_offloaded_layer_stays_sparse():
    """torch.sparse.mm saves its sparse operand: kept where it is (offloading read its strides
    and failed in backward), the gradient as without the context."""
    grads = []
    for enabled in (False, True):
        context, synchronizer = tfp8.get_cpu_offload_context(enabled, 1, 1)
        weight = torch.arange(16.0).view(4, 4).requires_grad_()
        with context:
            out = torch.sparse.mm(torch.eye(4).to_sparse(), weight * 2)
        synchronizer(out).pow(2).sum().backward()
        grads.append(weight.grad)
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=0)


def _saved_copies(device):
    """exp(x) through a context of one layer: (x, the synchronizer's output, the copies)."""
    context, synchronizer = tfp8.get_cpu_offload_context(True)
    x = torch.randn(64, 64, device=device, requires_grad=True)
    with context:
        y = x.exp()  # saves its output
    layer = context._layer
    y = synchronizer(y)
    return x, y, [ref() for ref in layer.saved]


def test_a_cpu_model_gets_copies_back():
    """On the CPU the saved tensor is copied into new CPU memory: backward reads the copy."""
    x, y, copies = _saved_copies("cpu")
    assert len(copies) == 1 and copies[0].cpu.data_ptr() != y.data_ptr()
    assert torch.equal(y.grad_fn._saved_result, y)
    assert y.grad_fn._saved_result.data_ptr() == copies[0].cpu.data_ptr()
    (2 * y).sum().backward()
    assert torch.equal(x.grad, 2 * x.detach().exp())


def _linear_stack(context, synchronizer, layers, x, on_layer=None):
    for i, layer in enumerate(layers):
        context._observer = lambda index, t, i=i: on_layer(i) if on_layer else None
        with context:
            x = torch.tanh(layer(x))
        x = synchronizer(x)
    return x


def test_the_same_model_layers_are_offloaded_in_every_forward():
    """Which model layers (not the context's own labels) are offloaded, across training forwards
    and a no_grad forward between them."""
    torch.manual_seed(0)
    layers = [torch.nn.Linear(8, 8) for _ in range(4)]
    context, synchronizer = tfp8.get_cpu_offload_context(True, 2, 4)
    for step in range(3):
        by_layer = set()
        with torch.no_grad() if step == 1 else torch.enable_grad():
            x = _linear_stack(context, synchronizer, layers,
                              torch.randn(2, 8, requires_grad=True), by_layer.add)
        if step != 1:
            x.sum().backward()
            assert by_layer == {0, 1}, (step, by_layer)


def test_a_backward_reloads_only_its_own_forwards_layers(monkeypatch):
    torch.manual_seed(0)
    layers = [torch.nn.Linear(8, 8) for _ in range(4)]
    context, synchronizer = tfp8.get_cpu_offload_context(True, 2, 4)
    outs, lists = [], []
    for _ in range(2):  # two micro-batches
        x = torch.randn(2, 8, requires_grad=True)
        mine = []
        for layer in layers:
            with context:
                x = torch.tanh(layer(x))
            mine.append(context._layer)
            x = synchronizer(x)
        outs.append(x)
        lists.append(mine)
    reloaded = []
    reload = cpu_offload._Layer.reload
    monkeypatch.setattr(cpu_offload._Layer, "reload",
                        lambda self: (reloaded.append(self), reload(self)))
    outs[1].sum().backward()
    assert reloaded and all(any(layer is mine for mine in lists[1]) for layer in reloaded), \
        "micro-batch 0's layers reloaded in micro-batch 1's backward"


def _grad_after_in_place_write(context, synchronizer):
    x = torch.arange(1., 5., requires_grad=True)
    with context:
        y = x.exp()  # saves its output
        y.mul_(2)    # modifies the saved tensor
    y = synchronizer(y)
    y.sum().backward()
    return x.grad


def _second_layer_of_two(num_layers):
    context, synchronizer = tfp8.get_cpu_offload_context(True, num_layers, model_layers=2)
    with context:
        pass
    synchronizer(torch.zeros(2))  # layer 0 done: the next is layer 1
    return context, synchronizer


@pytest.mark.parametrize("where", ["num_layers=0", "layer not offloaded", "offloaded tensor",
                                   "kept by an offloaded layer"])
def test_a_saved_tensor_modified_in_place_raises_as_without_the_context(where):
    """PyTorch's version check (which any saved-tensor hooks turn off) is kept."""
    if where == "kept by an offloaded layer":  # a one-element tensor stays in place
        context, synchronizer = tfp8.get_cpu_offload_context(True)
        x = torch.randn(4, requires_grad=True)
        with context:
            scale = x[:1].exp()
            y = x * scale  # saves scale as is
            scale.mul_(2)
        y = synchronizer(y)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.sum().backward()
        return
    context, synchronizer = {
        "num_layers=0": lambda: tfp8.get_cpu_offload_context(True, 0, 1),
        "layer not offloaded": lambda: _second_layer_of_two(1),
        "offloaded tensor": lambda: tfp8.get_cpu_offload_context(True, 1, 1)}[where]()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        _grad_after_in_place_write(context, synchronizer)


def test_layers_not_offloaded_install_no_hooks():
    for context, _ in (tfp8.get_cpu_offload_context(True, 0, 1), _second_layer_of_two(1)):
        with context:
            assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None


def test_in_place_ops_on_the_synchronizers_output_work():
    torch.manual_seed(0)
    layers = [tfp8.LayerNormMLP(32, 64) for _ in range(2)]
    grads = []
    for enabled in (False, True):
        context, synchronizer = tfp8.get_cpu_offload_context(enabled, 1, 2)
        x0 = torch.randn(8, 32, generator=torch.Generator().manual_seed(1), requires_grad=True)
        x = x0
        for layer in layers:
            with context:
                x = layer(x)
            x = synchronizer(x)
            x.mul_(0.5)
        x.sum().backward()
        grads.append(x0.grad)
    assert torch.equal(*grads)


def test_an_exception_in_the_context_restarts_the_layer_count():
    torch.manual_seed(0)
    layers = [torch.nn.Linear(8, 8) for _ in range(4)]
    context, synchronizer = tfp8.get_cpu_offload_context(True, 2, 4)
    x = torch.randn(2, 8, requires_grad=True)
    for layer in layers[:2]:
        with context:
            x = torch.tanh(layer(x))
        x = synchronizer(x)
    with pytest.raises(ValueError, match="stop"):
        with context:
            raise ValueError("stop")  # in layer 2
    for _ in range(2):
        by_layer = set()
        out = _linear_stack(context, synchronizer, layers,
                            torch.randn(2, 8, requires_grad=True), by_layer.add)
        out.sum().backward()
        assert by_layer == {0, 1}


def test_entering_during_cuda_graph_capture_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    context, _ = tfp8.get_cpu_offload_context(True)
    with pytest.raises(RuntimeError, match="CUDA graph"):
        with context:
            pass


def test_an_expanded_view_is_copied_at_its_unexpanded_size():
    context, synchronizer = tfp8.get_cpu_offload_context(True)
    x = torch.randn(1, 64, requires_grad=True)
    w = torch.randn(32, 64, requires_grad=True)
    with context:
        y = x.expand(32, 64) * w  # saves the expanded view of x (and w)
    layer = context._layer
    y = synchronizer(y)
    copies = sorted((ref().cpu.untyped_storage().nbytes() for ref in layer.saved))
    assert copies == [x.untyped_storage().nbytes(), w.untyped_storage().nbytes()]
    (y * y).sum().backward()
    assert torch.equal(w.grad, 2 * (x.detach() * w.detach()) * x.detach())
    assert torch.equal(x.grad, (2 * (x.detach() * w.detach()) * w.detach()).sum(0, keepdim=True))


# ---- arguments ---------------------------------------------------------------------------------

def test_disabled_gives_a_nullcontext_and_the_identity():
    for arguments in ({}, {"enabled": False, "num_layers": 9, "model_layers": 2}):
        context, synchronizer = tfp8.get_cpu_offload_context(**arguments)
        assert isinstance(context, contextlib.nullcontext)
        t = torch.randn(3, requires_grad=True)
        assert synchronizer(t) is t


def test_arguments_are_checked_as_transformer_engine_does():
    # Transformer Engine 2.8: nothing to offload is a ValueError, also when disabled.
    for enabled in (True, False):
        with pytest.raises(ValueError, match="offload_activations and offload_weights"):
            tfp8.get_cpu_offload_context(enabled, offload_activations=False)
    # offload_weights is deprecated and does nothing; alone, offloading is off.
    with pytest.warns(DeprecationWarning, match="offload_weights=True has no effect"):
        context, synchronizer = tfp8.get_cpu_offload_context(
            True, offload_activations=False, offload_weights=True)
    assert isinstance(context, contextlib.nullcontext)
    with pytest.warns(DeprecationWarning):
        context, _ = tfp8.get_cpu_offload_context(True, offload_weights=True)
    assert not isinstance(context, contextlib.nullcontext)
    # Counts Transformer Engine 2.8 fails on later (a KeyError at the first synchronizer call,
    # a meaningless schedule): refused here, naming the argument.
    for arguments, error, name in (({"num_layers": 5, "model_layers": 4}, ValueError,
                                    "num_layers"),
                                   ({"num_layers": -1}, ValueError, "num_layers"),
                                   ({"model_layers": 0, "num_layers": 0}, ValueError,
                                    "model_layers"),
                                   ({"num_layers": 1.0}, TypeError, "num_layers"),
                                   ({"model_layers": True}, TypeError, "model_layers")):
        with pytest.raises(error, match=name):
            tfp8.get_cpu_offload_context(True, **arguments)
    tfp8.get_cpu_offload_context(True, num_layers=4, model_layers=4, double_buffering=True)


# ---- CUDA --------------------------------------------------------------------------------------

def _ceil_block(n: int) -> int:
    return -(-n // 512) * 512  # the CUDA caching allocator's block granularity


@CUDA_SKIP
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("kind", ["mlp", "transformer"])
def test_cuda_memory_held_until_backward_drops_by_the_offloaded_tensors(kind, recipe):
    """Every layer offloaded: the device memory held between forward and backward is the
    plain run's less the storages its layers saved that the rule picks (the input's is the
    caller's), and the results are the plain run's bit for bit. Every tensor is under 1 MiB
    (the caching allocator's small pool, whose blocks are the request rounded up to 512 bytes:
    the accounting is exact)."""
    layers_count, hidden, ffn = 4, 128, 512
    x0 = torch.randn(64, 4, hidden, generator=torch.Generator().manual_seed(2)).cuda()
    results, held, storages = [], [], {}

    def record(t):
        ptr = t.untyped_storage().data_ptr()
        if _offloadable(t) and ptr != x.untyped_storage().data_ptr():
            storages[ptr] = t.untyped_storage().nbytes()
        return t

    # (a first, unmeasured run makes the first-use allocations: cuBLASLt's workspace, ...)
    for mode in ("warm-up", "plain", "offloaded"):
        layers = _stack(kind, recipe, "cuda", layers_count, hidden, ffn)
        context, synchronizer = tfp8.get_cpu_offload_context(mode == "offloaded", layers_count,
                                                             layers_count)
        hooks = (torch.autograd.graph.saved_tensors_hooks(record, lambda t: t)
                 if mode == "plain" else contextlib.nullcontext())
        x = x0.clone().requires_grad_(True)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        with tfp8.fp8_autocast(enabled=recipe is not None, fp8_recipe=recipe):
            out = x
            for layer in layers:
                with context, hooks:
                    out = layer(out)
                out = synchronizer(out)
        torch.cuda.synchronize()
        held.append(torch.cuda.memory_allocated() - before)
        mean_square(out).backward()
        results.append([out.detach(), x.grad, *(p.grad for p in layers.parameters())])
    expected = sum(_ceil_block(n) for n in storages.values())
    assert storages and held[1] - held[2] == expected, (held[1:], expected, len(storages))
    for got, plain in zip(results[2], results[1]):
        assert torch.equal(got, plain)


@CUDA_SKIP
def test_cuda_tensors_wait_in_pinned_memory_and_come_back_on_the_device():
    x, y, copies = _saved_copies("cuda")
    assert len(copies) == 1 and copies[0].cpu.is_pinned() and copies[0].on_device is None
    (2 * y).sum().backward()  # the synchronizer's backward starts the copy back
    assert copies[0].on_device.device == x.device
    assert torch.equal(x.grad, 2 * x.detach().exp())
