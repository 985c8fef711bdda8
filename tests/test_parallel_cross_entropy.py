"""parallel_cross_entropy (transformer_fp8/cross_entropy.py) against torch's cross_entropy over
the whole vocabulary in float64: losses and the logits' gradients, per token and reduced, with
label smoothing and ignored tokens, on one device and with the vocabulary split across two
gloo ranks."""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from multiprocess import WORLD, run_ranks

import transformer_fp8 as tfp8

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _reference(logits, target, label_smoothing, reduce_loss, ignore_idx, grad_output):
    """torch's cross_entropy in float64: the loss and d(loss * grad_output)/d logits."""
    x = logits.detach().double().requires_grad_()
    loss = F.cross_entropy(x.flatten(0, 1), target.flatten(), ignore_index=ignore_idx,
                           label_smoothing=label_smoothing,
                           reduction="mean" if reduce_loss else "none")
    if not reduce_loss:
        loss = loss.reshape(target.shape)
    (loss * grad_output.double()).sum().backward()
    return loss.detach(), x.grad


def _case(shape, dtype, device, ignored_fraction, seed):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(shape, generator=gen) * 4).to(dtype).to(device)
    target = torch.randint(0, shape[-1], shape[:2], generator=gen)
    target[torch.rand(shape[:2], generator=gen) < ignored_fraction] = -100
    return logits, target.to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
@pytest.mark.parametrize("reduce_loss", [False, True])
@pytest.mark.parametrize("shape", [(2, 3, 11), (5, 1, 128), (1, 7, 1000)])
def test_matches_torch_cross_entropy(device, dtype, label_smoothing, reduce_loss, shape):
    logits, target = _case(shape, dtype, device, 0.25, seed=sum(shape))
    grad_output = (torch.tensor(0.7) if reduce_loss else torch.rand(shape[:2]) + 0.5).to(device)
    x = logits.clone().requires_grad_()
    loss = tfp8.parallel_cross_entropy(x, target, label_smoothing, reduce_loss)
    (loss * grad_output).sum().backward()
    want_loss, want_grad = _reference(logits, target, label_smoothing, reduce_loss, -100,
                                      grad_output)
    assert loss.dtype == torch.float32 and loss.shape == want_loss.shape
    assert x.grad.dtype == dtype and x.grad.shape == logits.shape
    torch.testing.assert_close(loss.double(), want_loss, rtol=1e-5, atol=1e-5)
    # the gradient is computed in float32 and rounded once to the logits' dtype
    torch.testing.assert_close(x.grad, want_grad.to(dtype), rtol=1e-5 if dtype ==
                               torch.float32 else 1e-2, atol=1e-6 if dtype == torch.float32
                               else 1e-4)


def test_sequence_first_and_non_contiguous_inputs():
    """[SQ, B, V] transposed views of [B, SQ, V] logits give the transposed results."""
    logits, target = _case((3, 5, 17), torch.float32, "cpu", 0.2, seed=1)
    x = logits.clone().requires_grad_()
    loss = tfp8.parallel_cross_entropy(x.transpose(0, 1), target.t())
    loss.sum().backward()
    want_loss, want_grad = _reference(logits, target, 0.0, False, -100, torch.ones(3, 5))
    torch.testing.assert_close(loss.t().double(), want_loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(x.grad.double(), want_grad, rtol=1e-5, atol=1e-7)


def test_masked_vocabulary_columns_and_a_custom_ignore_index():
    """-inf logits (padded vocabulary) add nothing and get zero gradient; ignore_idx other than
    -100 (here 0, a real id) is ignored."""
    logits, target = _case((2, 4, 9), torch.float32, "cpu", 0.0, seed=2)
    logits[..., 7:] = float("-inf")
    target = target.clamp(max=6)
    target[0, :2] = 0
    x = logits.clone().requires_grad_()
    loss = tfp8.parallel_cross_entropy(x, target, reduce_loss=True, ignore_idx=0)
    loss.backward()
    want_loss, want_grad = _reference(logits, target, 0.0, True, 0, torch.tensor(1.0))
    torch.testing.assert_close(loss.double(), want_loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(x.grad.double(), want_grad, rtol=1e-5, atol=1e-7)
    assert (x.grad[..., 7:] == 0).all() and (x.grad[0, :2] == 0).all()


@pytest.mark.parametrize("reduce_loss", [False, True])
def test_an_ignored_token_gets_a_zero_gradient_whatever_its_logits(reduce_loss):
    """A padding position (target ignore_idx) whose logits hold NaN or inf: its loss and its
    row of the gradient are 0, as in Transformer Engine (the row was NaN: NaN * 0), and the
    other tokens' gradients are torch's."""
    logits, target = _case((1, 4, 8), torch.float32, "cpu", 0.0, seed=5)
    logits[0, 1, 4] = float("nan")
    logits[0, 2] = float("inf")
    target[0, 1:3] = -100
    x = logits.clone().requires_grad_()
    loss = tfp8.parallel_cross_entropy(x, target, reduce_loss=reduce_loss)
    grad_output = torch.rand(()) if reduce_loss else torch.rand(1, 4)
    (loss * grad_output).sum().backward()
    kept = [0, 3]
    want_loss, want_grad = _reference(logits[:, kept], target[:, kept], 0.0, reduce_loss, -100,
                                      grad_output if reduce_loss else grad_output[:, kept])
    torch.testing.assert_close(loss.double() if reduce_loss else loss[:, kept].double(),
                               want_loss, rtol=1e-6, atol=1e-7)
    assert (x.grad[0, 1:3] == 0).all()
    torch.testing.assert_close(x.grad[:, kept].double(), want_grad, rtol=1e-5, atol=1e-7)


def test_all_ignored_and_empty():
    logits, target = _case((2, 3, 5), torch.float32, "cpu", 1.0, seed=3)
    x = logits.clone().requires_grad_()
    loss = tfp8.parallel_cross_entropy(x, target, label_smoothing=0.2, reduce_loss=True)
    loss.backward()
    assert loss.item() == 0.0 and (x.grad == 0).all()
    empty = torch.zeros(0, 3, 5, requires_grad=True)
    out = tfp8.parallel_cross_entropy(empty, torch.zeros(0, 3, dtype=torch.long))
    out.sum().backward()
    assert out.shape == (0, 3) and empty.grad.shape == (0, 3, 5)


@pytest.mark.parametrize("inp,target,options,message", [
    (torch.zeros(6, 5), torch.zeros(6, dtype=torch.long), {}, "inp must be"),
    (torch.zeros(2, 3, 5, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long), {},
     "inp must be"),
    (torch.zeros(2, 3, 0), torch.zeros(2, 3, dtype=torch.long), {}, "inp must be"),
    (torch.zeros(2, 3, 5), torch.zeros(2, 3), {}, "target must be an integer"),
    (torch.zeros(2, 3, 5), torch.zeros(2, 4, dtype=torch.long), {}, "one id per token"),
    (torch.zeros(2, 3, 5), torch.zeros(3, 2, dtype=torch.long), {}, "one id per token"),
    (torch.zeros(2, 3, 5), torch.zeros(2, 3, dtype=torch.long), {"label_smoothing": 1.5},
     "label_smoothing must be in"),
])
def test_bad_input_is_refused(inp, target, options, message):
    with pytest.raises(ValueError, match=message):
        tfp8.parallel_cross_entropy(inp, target, **options)


@pytest.mark.parametrize("bad_id", [5, -1])
def test_a_target_outside_the_vocabulary_raises(bad_id):
    target = torch.zeros(2, 3, dtype=torch.long)
    target[1, 2] = bad_id
    with pytest.raises(RuntimeError, match="outside"):
        tfp8.parallel_cross_entropy(torch.zeros(2, 3, 5), target)


def _split_vocab_worker(rank: int, out_dir: str) -> None:
    results = {}
    for label_smoothing in (0.0, 0.1):
        for reduce_loss in (False, True):
            logits, target = _case((3, 4, 2 * 13), torch.float32, "cpu", 0.25, seed=7)
            logits[0, 0, 20:] = float("-inf")  # a masked column block on rank 1 only
            shard = logits.chunk(WORLD, -1)[rank].clone().requires_grad_()
            grad_output = torch.tensor(0.5) if reduce_loss else torch.rand(
                3, 4, generator=torch.Generator().manual_seed(1)) + 0.5
            loss = tfp8.parallel_cross_entropy(shard, target, label_smoothing, reduce_loss,
                                               dist_process_group=dist.group.WORLD)
            (loss * grad_output).sum().backward()
            results[(label_smoothing, reduce_loss)] = (loss.detach(), shard.grad)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


def test_vocabulary_split_across_ranks_matches_the_whole(tmp_path):
    """Two gloo ranks, each holding half the vocabulary (targets on both halves): every rank's
    loss is the whole vocabulary's, and its gradient is its slice of the whole gradient."""
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("needs torch.distributed with gloo")
    run_ranks(_split_vocab_worker, (str(tmp_path),), tmp_path)
    for rank in range(WORLD):
        results = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        for (label_smoothing, reduce_loss), (loss, grad) in results.items():
            logits, target = _case((3, 4, 2 * 13), torch.float32, "cpu", 0.25, seed=7)
            logits[0, 0, 20:] = float("-inf")
            grad_output = torch.tensor(0.5) if reduce_loss else torch.rand(
                3, 4, generator=torch.Generator().manual_seed(1)) + 0.5
            want_loss, want_grad = _reference(logits, target, label_smoothing, reduce_loss,
                                              -100, grad_output)
            torch.testing.assert_close(loss.double(), want_loss, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(grad.double(), want_grad.chunk(WORLD, -1)[rank],
                                       rtol=1e-5, atol=1e-7)


def test_compiles_in_one_graph_bit_identical_to_eager():
    logits, target = _case((2, 3, 11), torch.float32, "cpu", 0.3, seed=5)
    results = []
    torch._dynamo.reset()
    compiled = torch.compile(tfp8.parallel_cross_entropy, backend="aot_eager", fullgraph=True)
    for fn in (tfp8.parallel_cross_entropy, compiled):
        x = logits.clone().requires_grad_()
        loss = fn(x, target, 0.1, True)
        loss.backward()
        results.append((loss.detach(), x.grad))
    for got, want in zip(results[1], results[0]):
        assert torch.equal(got, want)
