"""pytest plugin of transformer_fp8 (entry point ``pytest11``): the ``fp8_parity`` fixture.

    def test_my_model_in_fp8(fp8_parity):
        model = build_model_with_fp8_layers()
        reference = copy.deepcopy(model).float()
        report = fp8_parity(model, reference, torch.randn(8, 128, 512))
        print(report)                          # the table, shown with -s or on failure

``fp8_parity(model, reference, inputs, **kwargs)`` is transformer_fp8.testing.assert_fp8_parity
with the project's thresholds: ``fp8_min_sqnr_db`` and ``fp8_grad_min_sqnr_db`` in the pytest
ini file override the package's defaults; keyword arguments override both.

This module is a top-level one, not part of the transformer_fp8 package, so that pytest loading
it (in every session of an environment where transformer_fp8 is installed) imports neither
torch nor the package: they are imported when a test asks for the fixture.
"""
from __future__ import annotations

import functools

import pytest

_INI_OPTIONS = (
    ("fp8_min_sqnr_db", "min_sqnr_db",
     "transformer_fp8: fp8_parity's default minimum SQNR (dB) of outputs and losses"),
    ("fp8_grad_min_sqnr_db", "grad_min_sqnr_db",
     "transformer_fp8: fp8_parity's default minimum SQNR (dB) of gradients"),
)


def pytest_addoption(parser) -> None:
    for ini_name, _, help_text in _INI_OPTIONS:
        try:  # a number in pytest 9's native TOML table ([tool.pytest]) too
            parser.addini(ini_name, help_text, type=float | str, default=None)
        except (TypeError, ValueError, AssertionError):  # (a pytest without union types)
            parser.addini(ini_name, help_text, default=None)


def _ini_thresholds(config) -> dict:
    thresholds = {}
    for ini_name, argument, _ in _INI_OPTIONS:
        value = config.getini(ini_name)
        if value in (None, ""):
            continue
        try:
            thresholds[argument] = float(value)
        except ValueError:
            raise pytest.UsageError(f"ini option {ini_name} must be a number of dB, got "
                                    f"{value!r}") from None
    return thresholds


@pytest.fixture
def fp8_parity(request):
    """assert_fp8_parity with the thresholds of the ini file (see the module docstring)."""
    from transformer_fp8.testing import assert_fp8_parity

    return functools.partial(assert_fp8_parity, **_ini_thresholds(request.config))
