"""CudaRNGStatesTracker (transformer_fp8.distributed) and the get_rng_state_tracker arguments
of the attention modules and checkpoint (CPU)."""
import pytest
import torch

import transformer_fp8 as tfp8
from transformer_fp8.distributed import CudaRNGStatesTracker


def _tracker(seed=1234):
    tracker = CudaRNGStatesTracker()
    tracker.add("model-parallel-rng", seed)
    return tracker


def test_exported_under_transformer_engine_names():
    assert tfp8.CudaRNGStatesTracker is CudaRNGStatesTracker
    assert tfp8.distributed.CudaRNGStatesTracker is CudaRNGStatesTracker


def test_add_duplicate_name_or_seed_and_unknown_fork_refused():
    tracker = _tracker(1)
    with pytest.raises(ValueError, match="seed 1 already exists"):
        tracker.add("other", 1)
    with pytest.raises(ValueError, match="'model-parallel-rng' already exists"):
        tracker.add("model-parallel-rng", 2)
    tracker.add("other", 2)  # (the refused adds recorded nothing)
    with pytest.raises(ValueError, match="'missing' is not added"):
        with tracker.fork("missing"):
            pass
    with pytest.raises(TypeError, match="seed must be an int"):
        tracker.add("third", 1.5)
    tracker.reset()
    assert tracker.get_states() == {}
    tracker.add("model-parallel-rng", 1)  # name and seed free again after reset()


def test_fork_draws_the_seeded_stream_and_leaves_the_default_generator_alone():
    tracker = _tracker(77)
    torch.manual_seed(5)
    expected_outside = torch.rand(8)
    torch.manual_seed(5)
    with tracker.fork():
        inside = torch.rand(8)
    outside = torch.rand(8)
    # The region drew from the tracker's stream (as if seeded with 77) ...
    assert torch.equal(inside, torch.rand(8, generator=torch.Generator().manual_seed(77)))
    # ... and the default generator went on as if it had drawn nothing.
    assert torch.equal(outside, expected_outside)
    # A second fork goes on where the first left the tracked stream.
    with tracker.fork():
        second = torch.rand(8)
    reference = torch.Generator().manual_seed(77)
    torch.rand(8, generator=reference)
    assert torch.equal(second, torch.rand(8, generator=reference))


def test_get_states_set_states_replay_the_stream():
    tracker = _tracker(3)
    saved = tracker.get_states()
    with tracker.fork():
        first = torch.rand(4)
    tracker.set_states(saved)
    with tracker.fork():
        again = torch.rand(4)
    assert torch.equal(first, again)
    with tracker.fork():  # (set_states copied: the saved dict still holds the start)
        torch.rand(4)
    tracker.set_states(saved)
    with tracker.fork():
        assert torch.equal(torch.rand(4), first)
    with pytest.raises(TypeError, match="states must be a dict"):
        tracker.set_states([1])


def _attention(tracker, dropout=0.5):
    torch.manual_seed(0)
    return tfp8.DotProductAttention(2, 8, attention_dropout=dropout, attn_mask_type="no_mask",
                                    get_rng_state_tracker=(lambda: tracker))


def _qkv(seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(6, 2, 2, 8, generator=g, requires_grad=True) for _ in range(3)]


def test_attention_dropout_is_deterministic_per_tracker_seed():
    q, k, v = _qkv()
    outs = {}
    for name, seed in (("a", 10), ("b", 10), ("c", 11)):
        torch.manual_seed(123 if name == "a" else 456)  # the default generator does not matter
        outs[name] = _attention(_tracker(seed))(q, k, v)
    assert torch.equal(outs["a"], outs["b"])
    assert not torch.equal(outs["a"], outs["c"])
    # Without dropout in effect the tracker is not needed: eval mode never forks.
    attn = _attention(CudaRNGStatesTracker())
    attn.eval()
    attn(q, k, v)


def test_attention_dropout_leaves_default_generator_alone():
    q, k, v = _qkv()
    attn = _attention(_tracker(10))
    torch.manual_seed(9)
    attn(q, k, v)
    after = torch.rand(4)
    torch.manual_seed(9)
    assert torch.equal(after, torch.rand(4))


def test_transformer_layer_and_mha_pass_the_tracker_to_attention():
    x = torch.randn(6, 2, 16)
    outs = []
    for seed in (10, 10, 11):
        tracker = _tracker(seed)
        torch.manual_seed(0)
        layer = tfp8.TransformerLayer(16, 32, 2, hidden_dropout=0.0, attention_dropout=0.5,
                                      get_rng_state_tracker=lambda: tracker)
        assert layer.self_attention.core_attention.get_rng_state_tracker() is tracker
        outs.append(layer(x))
    assert torch.equal(outs[0], outs[1]) and not torch.equal(outs[0], outs[2])


def _grads(checkpointed, tracker_for_checkpoint=True, core=False):
    tracker = _tracker(21)
    attn = _attention(tracker, dropout=0.3)
    q, k, v = _qkv()
    torch.manual_seed(0)
    if core:
        out = attn(q, k, v, checkpoint_core_attention=True)
    elif checkpointed:
        getter = (lambda: tracker) if tracker_for_checkpoint else None
        out = tfp8.checkpoint(attn, q, k, v, get_rng_state_tracker=getter,
                              use_reentrant=checkpointed == "reentrant")
    else:
        out = attn(q, k, v)
    out.square().sum().backward()
    return out.detach(), [t.grad for t in (q, k, v)]


@pytest.mark.parametrize("mode", ["reentrant", "non-reentrant", "core"])
def test_checkpoint_with_tracker_gives_the_gradients_without_checkpoint(mode):
    out_ref, ref = _grads(False)
    out, got = _grads(mode, core=mode == "core")
    assert torch.equal(out, out_ref)
    for a, b in zip(got, ref):
        assert torch.equal(a, b)


def test_checkpoint_without_the_tracker_recomputes_other_masks():
    # The region forks the tracker, which torch's own RNG restore does not cover.
    _, ref = _grads(False)
    _, got = _grads("non-reentrant", tracker_for_checkpoint=False)
    assert not all(torch.equal(a, b) for a, b in zip(got, ref))


def test_bad_tracker_arguments_refused():
    with pytest.raises(TypeError, match="get_rng_state_tracker must be a callable"):
        tfp8.DotProductAttention(2, 8, get_rng_state_tracker=CudaRNGStatesTracker())
    with pytest.raises(TypeError, match="must return a tracker with a fork"):
        tfp8.DotProductAttention(2, 8, get_rng_state_tracker=lambda: None)
    with pytest.raises(TypeError, match="get_rng_state_tracker must be a callable"):
        tfp8.TransformerLayer(16, 32, 2, get_rng_state_tracker=object())
    with pytest.raises(TypeError, match="get_rng_state_tracker must be a callable"):
        tfp8.checkpoint(torch.sin, torch.ones(2, requires_grad=True),
                        get_rng_state_tracker=CudaRNGStatesTracker())
    # A tracker without the default name: the fork names what is missing at forward.
    attn = _attention(CudaRNGStatesTracker())
    with pytest.raises(ValueError, match="'model-parallel-rng' is not added"):
        attn(*_qkv())
    # The GEMM modules draw their weights in its fork at construction (test_rng_tracker_weights).
    with pytest.raises(TypeError, match="get_rng_state_tracker must be a callable"):
        tfp8.Linear(16, 16, get_rng_state_tracker=CudaRNGStatesTracker())
    with pytest.raises(ValueError, match="'model-parallel-rng' is not added"):
        tfp8.Linear(16, 16, get_rng_state_tracker=CudaRNGStatesTracker)


def test_sequence_parallel_attention_dropout_draws_outside_the_fork():
    """As Transformer Engine: with sequence_parallel the caller's region is already inside the
    tracker's fork (Megatron-LM), so the mask comes from the default generator; a fork nested
    in the caller's would draw the numbers of the caller's next dropout."""
    q, k, v = _qkv()
    tracker = _tracker(10)
    before = tracker.get_states()
    torch.manual_seed(0)
    attn = tfp8.DotProductAttention(2, 8, attention_dropout=0.5, attn_mask_type="no_mask",
                                    sequence_parallel=True,
                                    get_rng_state_tracker=(lambda: tracker))
    torch.manual_seed(9)
    out = attn(q, k, v)
    after_default = torch.rand(4)
    assert tracker.get_states() == before  # (states are replaced, never changed in place)
    torch.manual_seed(9)
    plain = tfp8.DotProductAttention(2, 8, attention_dropout=0.5, attn_mask_type="no_mask")
    assert torch.equal(plain(q, k, v), out)  # (the default generator's mask)
    assert torch.equal(torch.rand(4), after_default)
