"""Transformer Engine's get_rng_state_tracker / rng_tracker_name of the GEMM modules: weights
drawn inside the tracker's fork (modules/weight_rng.py), at construction and in
reset_parameters(); biases and the default generator's other draws as without a tracker."""
import pytest
import torch

import transformer_fp8 as tfp8
from transformer_fp8.distributed import CudaRNGStatesTracker
from transformer_fp8.modules.te_args import te_default_init

TRACKER_SEED, OTHER_SEED = 1234, 99


def _tracker():
    tracker = CudaRNGStatesTracker()
    tracker.add("model-parallel-rng", TRACKER_SEED)
    tracker.add("other", OTHER_SEED)
    return tracker


BUILDERS = {
    "Linear": lambda **kw: tfp8.Linear(32, 48, init_method=te_default_init, **kw),
    "LayerNormLinear": lambda **kw: tfp8.LayerNormLinear(32, 48, **kw),
    "LayerNormMLP": lambda **kw: tfp8.LayerNormMLP(32, 64, **kw),
    "GroupedLinear": lambda **kw: tfp8.GroupedLinear(2, 32, 48, **kw),
}


def _weights(module):
    return [p for n, p in module.named_parameters()
            if "weight" in n and "layer_norm" not in n]


def _drawn_from(seed, shapes):
    """What te_default_init draws for ``shapes``, one after another, from a generator seeded
    with ``seed`` (the tracker's states are such generators)."""
    torch.manual_seed(seed)
    drawn = [torch.empty(shape) for shape in shapes]
    for tensor in drawn:
        te_default_init(tensor)
    return drawn


@pytest.mark.parametrize("kind", list(BUILDERS))
def test_weights_are_drawn_from_the_trackers_stream(kind):
    tracker = _tracker()
    built = []
    for default_seed in (0, 1):
        torch.manual_seed(default_seed)
        built.append(BUILDERS[kind](get_rng_state_tracker=lambda: tracker))
    first, second = built
    shapes = [w.shape for w in _weights(first)]
    for got, want in zip(_weights(first), _drawn_from(TRACKER_SEED, shapes)):
        assert torch.equal(got.detach(), want)
    # The second module continues the stream the first one left (another fork of the name).
    continued = _drawn_from(TRACKER_SEED, shapes * 2)[len(shapes):]
    for got, want in zip(_weights(second), continued):
        assert torch.equal(got.detach(), want)
    # The default generator draws no weight: it goes on as if only what the module draws
    # outside the fork had been drawn (Linear's torch.nn.Linear initialisation, which
    # init_method then replaces; nothing for the others).
    torch.manual_seed(5)
    BUILDERS[kind](get_rng_state_tracker=lambda: tracker)
    after = torch.rand(4)
    torch.manual_seed(5)
    if kind == "Linear":
        torch.nn.Linear(32, 48)
    assert torch.equal(after, torch.rand(4))
    # reset_parameters() draws again inside the fork.
    first.reset_parameters()
    redrawn = _drawn_from(TRACKER_SEED, shapes * 4)[3 * len(shapes):]
    for got, want in zip(_weights(first), redrawn):
        assert torch.equal(got.detach(), want)


@pytest.mark.parametrize("kind", ["Linear", "GroupedLinear"])
def test_rng_tracker_name_picks_the_state(kind):
    module = BUILDERS[kind](get_rng_state_tracker=_tracker, rng_tracker_name="other")
    shapes = [w.shape for w in _weights(module)]
    for got, want in zip(_weights(module), _drawn_from(OTHER_SEED, shapes)):
        assert torch.equal(got.detach(), want)


def test_linear_default_initialisation_draws_its_weight_in_the_fork():
    """Linear without init_method: torch.nn.Linear's initialisation, the weight drawn again
    inside the fork, the bias as torch.nn.Linear's (from the default generator)."""
    tracker = _tracker()
    torch.manual_seed(3)
    layer = tfp8.Linear(32, 48, get_rng_state_tracker=lambda: tracker)
    torch.manual_seed(3)
    plain = torch.nn.Linear(32, 48)
    assert torch.equal(layer.bias, plain.bias)
    torch.manual_seed(TRACKER_SEED)
    expected = torch.nn.init.kaiming_uniform_(torch.empty(48, 32), a=5 ** 0.5)
    assert torch.equal(layer.weight.detach(), expected)


def test_transformer_layer_weights_depend_on_the_tracker_seed_only():
    layers = []
    for default_seed, tracker_seed in ((0, 7), (1, 7), (0, 8)):
        tracker = CudaRNGStatesTracker()
        tracker.add("model-parallel-rng", tracker_seed)
        torch.manual_seed(default_seed)
        layers.append(tfp8.TransformerLayer(32, 64, 2, get_rng_state_tracker=lambda: tracker))
    gemm_weights = [[p for n, p in layer.named_parameters()
                     if n.endswith("weight") and not n.endswith("layer_norm_weight")]
                    for layer in layers]
    assert len(gemm_weights[0]) == 6  # query, key, value, proj, fc1, fc2
    for a, b, c in zip(*gemm_weights):
        assert torch.equal(a, b) and not torch.equal(a, c)


def test_bad_arguments_are_refused_naming_them():
    with pytest.raises(TypeError, match="LayerNormMLP: get_rng_state_tracker must be a callable"):
        tfp8.LayerNormMLP(32, 64, get_rng_state_tracker=CudaRNGStatesTracker())
    with pytest.raises(TypeError, match="GroupedLinear: rng_tracker_name must be a string"):
        tfp8.GroupedLinear(2, 32, 48, get_rng_state_tracker=_tracker, rng_tracker_name=3)
    with pytest.raises(ValueError, match="'missing' is not added"):
        tfp8.Linear(32, 48, get_rng_state_tracker=_tracker, rng_tracker_name="missing")
