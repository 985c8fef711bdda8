"""Shared helpers of the transformer_fp8 test suite.

* ``device`` / ``DEVICE_PARAMS``: every device-dependent test runs on "cpu" and, where a GPU
  exists, "cuda"; the CUDA parameter is always collected and skipped with a reason otherwise.
* ``gen``: a fresh torch.Generator per test. Its seed comes from the session seed (random each
  run, printed in the pytest header; set TFP8_TEST_SEED to replay a run) and the test's id, so
  every test draws its own inputs and a failure can be reproduced.
* Comparison helpers: ``bits`` / ``assert_bitwise_equal`` (NaN compared by its bits),
  ``assert_same_values`` (bitwise except that any NaN matches any NaN) and ``sqnr``. Training
  runs through an integration (compile, checkpointing, DDP, ...) are compared with eager ones
  by ``integration_compare.py``.

Helpers live here and are imported by the test modules (``from conftest import ...``).
"""
from __future__ import annotations

import os
import random
import zlib

# The bit-for-bit resume tests repeat CPU float32 matmuls (MKL) and compare the results. MKL
# picks its thread count from the machine's load unless told not to, and without its
# reproducibility mode the summation order may also depend on memory alignment: ask for a fixed
# count and for reproducible results. Set before torch (and MKL) are loaded.
os.environ.setdefault("MKL_DYNAMIC", "FALSE")
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")

import pytest  # noqa: E402
import torch  # noqa: E402

HAS_CUDA = torch.cuda.is_available()

CUDA_SKIP = pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")
DEVICE_PARAMS = [pytest.param("cpu", id="cpu"),
                 pytest.param("cuda", id="cuda", marks=CUDA_SKIP)]

FP8_DTYPES = [torch.float8_e4m3fn, torch.float8_e5m2]
HP_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
FLT_MAX = torch.finfo(torch.float32).max

SESSION_SEED = int(os.environ.get("TFP8_TEST_SEED", random.SystemRandom().randrange(2**31)))


def pytest_report_header(config):
    return f"transformer_fp8 tests: TFP8_TEST_SEED={SESSION_SEED}"


def pytest_terminal_summary(terminalreporter):
    # Also at the end, where `pytest -q` (which prints no header) shows it: a failure on random
    # inputs is replayed with this seed.
    terminalreporter.write_line(f"transformer_fp8 tests: TFP8_TEST_SEED={SESSION_SEED}")


def _needs_cuda(item) -> bool:
    """A test that runs only where a GPU is (a "cuda" parameter, CUDA_SKIP's mark) or does
    something else there (the cuda_branch mark)."""
    callspec = getattr(item, "callspec", None)
    if callspec is not None and any(isinstance(v, str) and v == "cuda"
                                    for v in callspec.params.values()):
        return True
    return item.get_closest_marker("cuda_branch") is not None or any(
        mark.kwargs.get("reason") == "no CUDA device" for mark in item.iter_markers("skipif"))


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda_branch: a test with a branch of its own for a GPU "
                            "machine (kept by TFP8_TEST_CUDA_ONLY=1)")


def pytest_collection_modifyitems(config, items):
    # TFP8_TEST_CUDA_ONLY=1 (scripts/gpu_check.sh on a short GPU lease): only the tests that a
    # machine without a GPU skips, since CI runs every other one.
    if os.environ.get("TFP8_TEST_CUDA_ONLY") != "1":
        return
    keep = [item for item in items if _needs_cuda(item)]
    config.hook.pytest_deselected(items=[item for item in items if not _needs_cuda(item)])
    items[:] = keep


def pytest_make_parametrize_id(config, val, argname):
    """Readable test ids for dtypes: test_x[float8_e4m3fn-...] rather than [fp8_dtype0-...]."""
    if isinstance(val, torch.dtype):
        return str(val).removeprefix("torch.")
    if isinstance(val, tuple) and all(isinstance(v, int) for v in val):
        return "shape" + "x".join(map(str, val))
    return None


@pytest.fixture(params=DEVICE_PARAMS)
def device(request) -> str:
    return request.param


@pytest.fixture(autouse=True)
def _forget_compiled_fp8_modules():
    """A test that compiled FP8 modules (or ran compiled autograd) leaves them noted for every
    later step of their recipe (amax_step.note_compiled, backward_step.note_compiled_backward)
    while torch.compile's caches keep them alive: forget them after it, so that tests run in any
    order see only their own modules."""
    yield
    from transformer_fp8.quantization import amax_step, backward_step
    if amax_step._COMPILED_MODULES or backward_step._COMPILED_BACKWARD_SEEN[0]:
        torch._dynamo.reset()
        amax_step._COMPILED_MODULES.clear()
        backward_step._COMPILED_BACKWARD_SEEN[0] = False
        backward_step._HELD_BACKWARD_STEPS.clear()


@pytest.fixture
def gen(request) -> torch.Generator:
    """A CPU generator seeded from the session seed and this test's id."""
    seed = (SESSION_SEED * 1_000_003 + zlib.crc32(request.node.nodeid.encode())) % 2**63
    return torch.Generator().manual_seed(seed)


# ----------------------------------------------------------------------------- random inputs

def randn(gen: torch.Generator, *shape, dtype=torch.float32, device="cpu",
          scale: float = 1.0) -> torch.Tensor:
    """Standard normal values times ``scale``, drawn on the CPU (one generator for every
    device), then cast and moved."""
    x = torch.randn(tuple(shape), generator=gen, dtype=torch.float64) * scale
    return x.to(dtype).to(device)


def rand_positive(gen: torch.Generator, *shape, device="cpu") -> torch.Tensor:
    """Positive float32 values spread over many binades (exp of a normal, 1e-3 .. 1e3)."""
    return torch.exp(torch.randn(*shape, generator=gen) * 2.5).to(device)


def scalar(value: float, device="cpu") -> torch.Tensor:
    """A 1-element float32 tensor: the shape of a scale, scale_inv or amax slot."""
    return torch.tensor([value], dtype=torch.float32, device=device)


# ----------------------------------------------------------------------------- comparisons

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of a floating tensor, on the CPU, as integers of the same width."""
    return t.detach().cpu().contiguous().view(_INT_OF_SIZE[t.element_size()])


def assert_bitwise_equal(out: torch.Tensor, ref: torch.Tensor, what: str = "") -> None:
    assert out.dtype == ref.dtype, f"{what}: dtype {out.dtype} != {ref.dtype}"
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    diff = bits(out) != bits(ref)
    if diff.any():
        idx = diff.nonzero()[:5].tolist()
        o, r = out.detach().cpu(), ref.detach().cpu()
        samples = [(i, o[tuple(i)].item(), r[tuple(i)].item()) for i in idx]
        pytest.fail(f"{what}: {int(diff.sum())} of {diff.numel()} elements differ bitwise; "
                    f"first (index, out, ref): {samples}")


def assert_same_values(out: torch.Tensor, ref: torch.Tensor, what: str = "") -> None:
    """Bitwise equal, except that NaN matches NaN whatever its sign and payload."""
    assert out.dtype == ref.dtype and out.shape == ref.shape, what
    out_nan, ref_nan = torch.isnan(out.cpu()), torch.isnan(ref.cpu())
    assert torch.equal(out_nan, ref_nan), f"{what}: NaN positions differ"
    assert_bitwise_equal(torch.where(out_nan, 0, out.cpu()), torch.where(ref_nan, 0, ref.cpu()),
                         what)


def sqnr(ref: torch.Tensor, out: torch.Tensor) -> float:
    """Signal to quantisation-noise ratio of ``out`` against ``ref`` in dB, computed in float64
    (inf when equal): the package's transformer_fp8.testing.sqnr, reference first."""
    from transformer_fp8.testing import sqnr as package_sqnr

    return package_sqnr(out, ref)
