"""CudaRNGStatesTracker on a GPU: forks drive the current CUDA device's default generator, as
Transformer Engine's do; attention dropout and checkpoint recomputation on CUDA tensors.
(Skipped without a GPU; tests/test_rng_tracker.py holds the CPU cases.)"""
import pytest
import torch
from conftest import CUDA_SKIP

import transformer_fp8 as tfp8
from transformer_fp8.distributed import CudaRNGStatesTracker

pytestmark = CUDA_SKIP


def _tracker(seed):
    tracker = CudaRNGStatesTracker()
    tracker.add("model-parallel-rng", seed)
    return tracker


def test_fork_draws_the_seeded_cuda_stream_and_restores_the_default_one():
    tracker = _tracker(77)
    torch.cuda.manual_seed(5)
    expected_outside = torch.rand(8, device="cuda")
    torch.cuda.manual_seed(5)
    with tracker.fork():
        inside = torch.rand(8, device="cuda")
    outside = torch.rand(8, device="cuda")
    reference = torch.Generator(device="cuda").manual_seed(77)
    assert torch.equal(inside, torch.rand(8, device="cuda", generator=reference))
    assert torch.equal(outside, expected_outside)
    with tracker.fork():  # the tracked stream goes on where the first fork left it
        assert torch.equal(torch.rand(8, device="cuda"),
                           torch.rand(8, device="cuda", generator=reference))


def test_saved_states_replay_cuda_draws():
    tracker = _tracker(3)
    saved = tracker.get_states()
    with tracker.fork():
        first = torch.randn(1000, device="cuda")
    tracker.set_states(saved)
    with tracker.fork():
        assert torch.equal(torch.randn(1000, device="cuda"), first)


def _attention(tracker):
    torch.manual_seed(0)
    return tfp8.DotProductAttention(2, 8, attention_dropout=0.3, attn_mask_type="no_mask",
                                    get_rng_state_tracker=lambda: tracker).cuda()


def _qkv(seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(64, 2, 2, 8, generator=g).cuda().requires_grad_() for _ in range(3)]


def test_cuda_attention_dropout_follows_the_tracker_seed_only():
    q, k, v = _qkv()
    outs = []
    for seed, outside in ((10, 1), (10, 2), (11, 1)):
        torch.cuda.manual_seed(outside)  # the default CUDA generator does not matter
        outs.append(_attention(_tracker(seed))(q, k, v))
    assert torch.equal(outs[0], outs[1])
    assert not torch.equal(outs[0], outs[2])


def _grads(mode):
    tracker = _tracker(21)
    attn = _attention(tracker)
    q, k, v = _qkv()
    torch.cuda.manual_seed(0)
    if mode == "plain":
        out = attn(q, k, v)
    elif mode == "core":
        out = attn(q, k, v, checkpoint_core_attention=True)
    else:
        out = tfp8.checkpoint(attn, q, k, v, get_rng_state_tracker=lambda: tracker,
                              use_reentrant=mode == "reentrant")
    out.square().sum().backward()
    return out.detach(), [t.grad for t in (q, k, v)]


@pytest.mark.parametrize("mode", ["reentrant", "non-reentrant", "core"])
def test_cuda_checkpoint_with_tracker_gives_the_gradients_without_checkpoint(mode):
    out_ref, ref = _grads("plain")
    out, got = _grads(mode)
    assert torch.equal(out, out_ref)
    for a, b in zip(got, ref):
        assert torch.equal(a, b)
