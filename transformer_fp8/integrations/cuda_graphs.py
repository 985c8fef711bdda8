"""make_graphed_callables: torch.cuda.make_graphed_callables for modules with FP8 layers, with
Transformer Engine's signature.

torch's own function replays the captured kernels and nothing else. An FP8 layer's forward also
does Python work that a replay skips: it registers its amax slots with the enclosing
fp8_autocast, which then reduces them and updates the scales, and its backward queues the
grad_output update. Replayed under torch's function alone, the amaxes keep accumulating in the
histories and the scales never move.

Here each module runs, while it is warmed up and captured, inside an isolated fp8_autocast
(fp8_context.isolated_fp8_autocast): the outermost context for that module alone, whatever the
caller's contexts are. Its forward graph then ends with the forward amax reduction and update,
and its backward graph with the grad_output ones, exactly the kernels an eager step with
``fp8_autocast`` around that module runs, on the same state buffers. The warm-up steps (run on
torch's sample gradients, which are uninitialised memory) do not count: the FP8 state is put
back afterwards, in place, so the graphs read the buffers the module owns.
"""
from __future__ import annotations

from typing import Optional, Union

import torch

from .. import _fp8_hooks
from ..quantization import autocast as fp8_context
from ..quantization.recipe import GRAPHABLE_RECIPES, DelayedScaling, Recipe


def _fp8_layers(module: torch.nn.Module) -> list:
    return [m for m in module.modules() if hasattr(m, "fp8_state_tensors")]


class _Fp8Callable(torch.nn.Module):
    """The callable handed to torch: the module's own forward inside an isolated
    fp8_autocast. Its parameters are the module's (torch makes them graph inputs)."""

    def __init__(self, module: torch.nn.Module, enabled: bool, recipe: Recipe, group):
        super().__init__()
        self.module = module
        # The module's own forward: before torch (or we) replace module.forward, and for a
        # module graphed before, the forward that graphing replaced (not the old graphs).
        forward = module.forward
        self._module_forward = getattr(forward, "_tfp8_ungraphed_forward", forward)
        self._autocast_args = (enabled, recipe, group)
        # The module's mode, on the wrapper alone: train() would recurse and overwrite the
        # modes the user gave submodules (a frozen BatchNorm, a dropout switched off).
        self.training = module.training

    def forward(self, *args):
        with fp8_context.isolated_fp8_autocast(*self._autocast_args):
            return self._module_forward(*args)


def _check_sample_args(sample_args, count: int, single: bool) -> tuple:
    per_module = (sample_args,) if single else sample_args
    if not isinstance(per_module, (tuple, list)) or len(per_module) != count:
        raise ValueError(f"sample_args must hold one tuple of tensors per module ({count}), got "
                         f"{type(sample_args).__name__} of length "
                         f"{len(sample_args) if hasattr(sample_args, '__len__') else '?'}")
    for i, args in enumerate(per_module):
        if not isinstance(args, (tuple, list)) or not all(
                isinstance(a, torch.Tensor) for a in args):
            raise TypeError(f"sample_args[{i}] must be a tuple of tensors, got {args!r:.80}")
        if not all(a.is_cuda for a in args):
            raise ValueError(f"sample_args[{i}]: CUDA graphs need CUDA tensors, got devices "
                             f"{[str(a.device) for a in args]}")
    return tuple(tuple(args) for args in per_module)


def make_graphed_callables(modules, sample_args, num_warmup_iters: int = 3,
                           allow_unused_input: bool = False, sample_kwargs=None,
                           fp8_enabled: bool = False, fp8_calibrating: bool = False,
                           fp8_recipe: Optional[Recipe] = None, fp8_group=None,
                           fp8_weight_caching: bool = False, pool=None, *,
                           enabled=None, recipe: Optional[Recipe] = None,
                           amax_reduction_group=None, calibrating: Optional[bool] = None,
                           cache_quantized_params: Optional[bool] = None,
                           retain_graph_in_backward: bool = False, _order=None,
                           _num_layers_per_chunk=None,
                           _reuse_graph_input_output_buffers: bool = False,
                           clone_param_grads_on_return: bool = True, pre_warmup_hook=None,
                           post_warmup_hook=None,
                           capture_time_hooks=None) -> Union[torch.nn.Module, tuple]:
    """CUDA-graph the forward and backward of each module (an nn.Module or a tuple of them, with
    one tuple of sample tensors each, as torch.cuda.make_graphed_callables takes), FP8 layers
    included. Returns the modules, whose forward now replays the graphs in the training mode
    they were captured in (and runs eagerly in the other).

    fp8_enabled / fp8_recipe / fp8_group (Transformer Engine's names; also enabled / recipe /
    amax_reduction_group): how the FP8 layers run in the graphs, whatever fp8_autocast
    surrounds the call later; fp8_enabled may be a tuple, one bool per module. Each replay does what
    an eager step with ``fp8_autocast`` around
    the module does, the scale updates included: bit for bit the same numbers. With
    DelayedScaling the amax reduction across the group covers the graphed module's own layers,
    in its graph; every rank must replay the same graphs (as collectives in graphs require).

    A call without gradients (torch.no_grad, inference_mode) runs eagerly too: an evaluation
    forward leaves the FP8 state alone, as eager fp8_autocast does, where the captured forward
    graph would update it.

    The graphs hold the addresses of the parameters, buffers and FP8 state: after graphing, a
    module whose tensors were replaced (moved or cast with .to() / .half(), loaded with
    load_state_dict(assign=True) or with another amax history length) raises at its next call
    (graph it again). Each replay's arguments must have the shapes, dtypes and devices of
    sample_args and may require a gradient only where their sample did (a replay copies them
    into the captured inputs, which would broadcast or convert silently; refused by name).
    pre_warmup_hook is called once before the warm-up. Not supported
    (refused): fp8_calibrating / calibrating, fp8_weight_caching / cache_quantized_params,
    sample_kwargs, retain_graph_in_backward, post_warmup_hook, capture_time_hooks, Megatron-LM's
    pipeline schedule (_order, _num_layers_per_chunk, _reuse_graph_input_output_buffers),
    modules with hooks (as torch refuses them), delay_wgrad_compute and fuse_wgrad_accumulation
    (their weight gradients are handed over in Python, which a replay skips), attention dropout
    drawn from an RNG tracker (get_rng_state_tracker: its fork switches generator states, which
    capture forbids).

    clone_param_grads_on_return (default True, as Transformer Engine): the parameter gradients
    a replay returns are the graph's output buffers, which the next replay overwrites; autograd
    installs such a gradient as ``param.grad`` without a copy where it is None, so accumulated
    microbatches (or zero_grad(set_to_none=False)) would add a buffer to itself. Each graphed
    parameter's gradient is then copied before it is accumulated (a hook on the parameter).
    False: as torch returns them (no copy; a gradient is valid until the next replay).
    """
    fp8_enabled = _merge("fp8_enabled", fp8_enabled, False, "enabled", enabled)
    fp8_recipe = _merge("fp8_recipe", fp8_recipe, None, "recipe", recipe)
    fp8_group = _merge("fp8_group", fp8_group, None, "amax_reduction_group", amax_reduction_group)
    fp8_calibrating = _merge("fp8_calibrating", fp8_calibrating, False, "calibrating",
                             calibrating)
    fp8_weight_caching = _merge("fp8_weight_caching", fp8_weight_caching, False,
                                "cache_quantized_params", cache_quantized_params)
    for name, value, default in (
            ("retain_graph_in_backward", retain_graph_in_backward, False),
            ("_order", _order, None), ("_num_layers_per_chunk", _num_layers_per_chunk, None),
            ("_reuse_graph_input_output_buffers", _reuse_graph_input_output_buffers, False),
            ("post_warmup_hook", post_warmup_hook, None),
            ("capture_time_hooks", capture_time_hooks, None)):
        if value is not default and value != default:
            raise ValueError(f"{name}={value!r:.60} is not supported by transformer_fp8's "
                             f"make_graphed_callables; leave it at {default!r}")
    if not isinstance(clone_param_grads_on_return, bool):
        raise TypeError("clone_param_grads_on_return must be True or False, got "
                        f"{type(clone_param_grads_on_return).__name__}")
    if isinstance(num_warmup_iters, bool) or not isinstance(num_warmup_iters, int) \
            or num_warmup_iters < 1:
        # (the first FP8 step adopts recipes, sizes histories and sets up cuBLASLt: host work
        # and allocations that must not fall inside the capture)
        raise ValueError("num_warmup_iters must be an integer >= 1 (the first step sets up "
                         f"the FP8 state outside the capture), got {num_warmup_iters!r}")
    if pre_warmup_hook is not None and not callable(pre_warmup_hook):
        raise TypeError(f"pre_warmup_hook must be callable, got {type(pre_warmup_hook).__name__}")
    if fp8_recipe is None:
        fp8_recipe = DelayedScaling()
    if not isinstance(fp8_recipe, GRAPHABLE_RECIPES):
        raise TypeError("fp8_recipe must be None, a DelayedScaling or a Float8CurrentScaling, "
                        f"got {type(fp8_recipe).__name__}")
    for name, value in (("fp8_calibrating", fp8_calibrating),
                        ("fp8_weight_caching", fp8_weight_caching)):
        if value is not False:
            raise ValueError(f"{name} is not supported by transformer_fp8's "
                             f"make_graphed_callables; pass False, got {value!r}")
    if sample_kwargs:
        raise ValueError("sample_kwargs is not supported: the graphed forward takes tensors as "
                         "positional arguments only (as torch.cuda.make_graphed_callables)")
    single = isinstance(modules, torch.nn.Module)
    module_list = (modules,) if single else modules
    if not isinstance(module_list, (tuple, list)) or not all(
            isinstance(m, torch.nn.Module) for m in module_list):
        raise TypeError("modules must be an nn.Module or a tuple of nn.Modules, got "
                        f"{type(modules).__name__}")
    module_list = tuple(module_list)
    for i, module in enumerate(module_list):
        _check_graphable(module, i)
    enabled_per_module = _enabled_per_module(fp8_enabled, len(module_list))
    per_module_args = _check_sample_args(sample_args, len(module_list), single)

    layers = [layer for m in module_list for layer in _fp8_layers(m)]
    for module, module_enabled in zip(module_list, enabled_per_module):
        if module_enabled:
            for layer in _fp8_layers(module):  # the state gets its final shapes before capture
                layer.prepare_fp8_recipe(fp8_recipe)
    with torch.no_grad():
        saved = [[t.clone() for t in layer.fp8_state_tensors()] for layer in layers]

    callables = tuple(_Fp8Callable(m, module_enabled, fp8_recipe, fp8_group)
                      for m, module_enabled in zip(module_list, enabled_per_module))
    if pre_warmup_hook is not None:
        pre_warmup_hook()
    try:
        graphed = torch.cuda.make_graphed_callables(
            callables, per_module_args, num_warmup_iters=num_warmup_iters,
            allow_unused_input=allow_unused_input, pool=pool)
    finally:
        # Undo the warm-up's updates (made from torch's uninitialised sample gradients), in
        # place: the graphs read and write these very tensors. Also when capture failed.
        with torch.no_grad():
            for layer, tensors in zip(layers, saved):
                for current, before in zip(layer.fp8_state_tensors(), tensors):
                    current.copy_(before)
    for module, wrapper, args in zip(module_list, graphed, per_module_args):
        module.forward = _graphed_forward(module, wrapper, args)
    if clone_param_grads_on_return:
        clone_returned_param_grads(module_list)
    return module_list[0] if single else module_list


def _copied(grad: torch.Tensor) -> torch.Tensor:
    return grad.clone()


def clone_returned_param_grads(modules) -> None:
    """Each parameter of ``modules`` that takes a gradient gets it copied before autograd
    accumulates it (a hook on the parameter, once per parameter): a graph replay returns its
    output buffers, which the next replay overwrites (make_graphed_callables' docstring)."""
    for module in modules:
        for param in module.parameters():
            if param.requires_grad and not getattr(param, "_tfp8_grad_copied", False):
                param.register_hook(_copied)
                param._tfp8_grad_copied = True


def _enabled_per_module(fp8_enabled, count: int) -> tuple:
    """fp8_enabled as one bool per module (Transformer Engine 2.x takes a bool or a tuple)."""
    if isinstance(fp8_enabled, (tuple, list)):
        values = tuple(fp8_enabled)
    else:
        values = (fp8_enabled,) * count
    if len(values) != count or not all(isinstance(v, bool) for v in values):
        raise TypeError(f"fp8_enabled must be True or False, or a tuple of {count} bools (one per "
                        f"module), got {fp8_enabled!r:.80}")
    return values


def _check_graphable(module: torch.nn.Module, index: int) -> None:
    hooks = [name for name in ("_forward_pre_hooks", "_forward_hooks", "_backward_hooks",
                               "_backward_pre_hooks") if getattr(module, name, None)]
    if hooks:
        # (torch refuses hooks on the modules it is given; it is given our wrapper instead)
        raise ValueError(f"modules[{index}] ({type(module).__name__}) has hooks registered "
                         f"({', '.join(hooks)}); a graph would skip them. Register them after "
                         "make_graphed_callables, as torch.cuda.make_graphed_callables requires")
    for layer in _fp8_layers(module):
        if getattr(layer, "need_backward_dw", lambda: False)():
            raise ValueError(f"modules[{index}]: {type(layer).__name__} was built with "
                             "delay_wgrad_compute=True, whose weight gradients backward_dw() "
                             "hands over in Python, which a graph replay skips; build it "
                             "without delay_wgrad_compute to graph it")
        if getattr(layer, "fuse_wgrad_accumulation", False):
            raise ValueError(f"modules[{index}]: {type(layer).__name__} was built with "
                             "fuse_wgrad_accumulation=True, whose weight gradients are added to "
                             "main_grad in Python, outside autograd, which a graph replay "
                             "skips; build it without fuse_wgrad_accumulation to graph it")
    for name, sub in module.named_modules():
        if (getattr(sub, "get_rng_state_tracker", None) is not None
                and getattr(sub, "attention_dropout", 0.0) > 0.0):
            raise ValueError(f"modules[{index}]: {name or type(sub).__name__} draws attention "
                             f"dropout (p={sub.attention_dropout}) from an RNG tracker "
                             "(get_rng_state_tracker), whose fork sets generator states, which "
                             "CUDA graph capture forbids; graph it with attention_dropout=0 or "
                             "without a tracker (torch's default generator is captured)")


def _captured_tensors(submodules: list) -> list[tuple]:
    """The address and dtype of every tensor the graphs hold: the parameters and buffers (the
    FP8 state among them) of the graphed module's submodules, read from their dicts directly
    (every replay checks them: a few tens of microseconds for hundreds of tensors), and the
    tensors an FP8 weight holds (the wrapper's own data_ptr() is 0: a weight whose FP8 data
    was replaced, by load_state_dict(assign=True), kept the same address)."""
    return [(t.data_ptr(), t.dtype) if not hasattr(t, "held_tensors") else
            (t.dtype, *(held.data_ptr() for held in t.held_tensors()))
            for m in submodules for tensors in (m._parameters, m._buffers)
            for t in tensors.values() if t is not None]


def _signature(args) -> list[tuple]:
    return [(tuple(a.shape), a.dtype, a.device, a.requires_grad) for a in args]


def _check_replay_args(module: torch.nn.Module, args: tuple, captured: list[tuple]) -> None:
    """A replay copies each argument into the tensor it was captured with: copy_ would broadcast
    a smaller shape and convert another dtype without a word, and an argument that requires
    a gradient its sample did not gets None (the graph computed none): refused, by name."""
    if len(args) != len(captured):
        raise ValueError(f"{type(module).__name__} (graphed): called with {len(args)} "
                         f"argument(s), captured with {len(captured)} (sample_args)")
    for i, (arg, (shape, dtype, device, requires_grad)) in enumerate(zip(args, captured)):
        if not isinstance(arg, torch.Tensor):
            raise TypeError(f"{type(module).__name__} (graphed): argument {i} must be a tensor "
                            f"as its sample was, got {type(arg).__name__}")
        if (tuple(arg.shape), arg.dtype, arg.device) != (shape, dtype, device):
            raise ValueError(
                f"{type(module).__name__} (graphed): argument {i} must have the shape, dtype "
                f"and device of its sample ({list(shape)}, {dtype}, {device}), got "
                f"({list(arg.shape)}, {arg.dtype}, {arg.device}); graph it again for new shapes")
        if arg.requires_grad and not requires_grad:
            raise ValueError(
                f"{type(module).__name__} (graphed): argument {i} requires a gradient but its "
                "sample did not, so the graphs compute none for it (it would get None); pass "
                "a sample that requires grad")


def _overrides(layers: list) -> list:
    """The debug overrides of the FP8 layers (transformer_fp8.debug.override): the graphs run
    the computation they chose at capture."""
    return [layer.__dict__.get("_fp8_override") for layer in layers]


def _graphed_forward(module: torch.nn.Module, wrapper: _Fp8Callable, sample_args: tuple):
    replay_or_eager = wrapper.forward  # torch's: replays in the captured training mode
    captured_mode, captured_args = wrapper.training, _signature(sample_args)
    submodules = list(module.modules())
    captured = _captured_tensors(submodules)
    layers = _fp8_layers(module)
    captured_overrides = _overrides(layers)

    def forward(*args):
        # The graphs hold the addresses of the module's tensors: a module whose parameters or
        # FP8 state were replaced (.to(), .half(), load_state_dict(assign=True) or another
        # history length) must not replay (graphed again, it replays new graphs:
        # _Fp8Callable takes the ungraphed forward).
        if _captured_tensors(submodules) != captured:
            raise RuntimeError(
                f"{type(module).__name__}: its parameters, buffers or FP8 state tensors were "
                "replaced after make_graphed_callables captured them (moved or cast with .to() "
                "or .half(), loaded with assign=True, or resized to another amax history "
                "length); the graphs would use freed memory. Graph the module again.")
        if _overrides(layers) != captured_overrides:
            raise RuntimeError(
                f"{type(module).__name__}: a debug override of its FP8 layers was set or "
                "cleared after make_graphed_callables captured them; the graphs would run the "
                "computation chosen before. Graph the module again.")
        observer = _fp8_hooks.observer
        if not torch.is_grad_enabled() or (
                observer is not None and any(observer.observes(layer) for layer in layers)):
            # An evaluation forward: eagerly, so that its fp8_autocast exit discards the
            # amaxes as eager steps do (the captured forward graph updates the scales). A
            # step whose statistics a debug collector logs: eagerly too, the same numbers
            # (a replay runs no Python, so no statistics).
            return _Fp8Callable.forward(wrapper, *args)
        wrapper.training = module.training  # the mode the caller set on the module
        if module.training == captured_mode:  # (a replay; the other mode runs eagerly)
            _check_replay_args(module, args, captured_args)
        return replay_or_eager(*args)

    forward._tfp8_ungraphed_forward = wrapper._module_forward
    return forward


def _merge(old_name, old_value, old_default, new_name, new_value):
    """Transformer Engine 1.x and 2.x spell some arguments differently; accept either."""
    if new_value is None:
        return old_value
    if old_value is not old_default and old_value != new_value:
        raise ValueError(f"{old_name} and {new_name} are two names for the same argument and "
                         f"must agree; pass one (got {old_value!r} and {new_value!r})")
    return new_value
