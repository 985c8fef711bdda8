"""What a user of an installed transformer_fp8 runs first, as a standalone script: run by
tests/test_wheel.py with the Python of a fresh virtual environment holding the wheel (from a
folder outside the checkout) and with the checkout's Python, to compare the two.

    python wheel_smoke.py INPUTS.pt RESULTS.pt --package-root DIR [--installed]

Checks that transformer_fp8, its C++ extension, every module of the package and the pytest
plugin module are imported from under DIR; imports every module of the package; runs two FP8
training steps of one Linear on the CPU (a warm-up that sets the delayed scales, then the one
saved) on the tensors of INPUTS.pt, checks them against float32 by SQNR and saves them to
RESULTS.pt. With --installed: also the distribution's metadata (the pytest11 entry point)
and a CPU-only build made against the running torch.
"""
from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import sys

import torch


def check_location(name: str, path: str, root: str) -> None:
    path = os.path.realpath(path)
    if not path.startswith(os.path.realpath(root) + os.sep):
        sys.exit(f"{name} comes from {path}, not from under {root}")


def import_every_module(package) -> list:
    """Every module and subpackage of the package, imported: a file the package imports but
    the installation lacks fails here."""
    names = [info.name for info in pkgutil.walk_packages(package.__path__, package.__name__ + ".")]
    return [importlib.import_module(name) for name in names]


def check_installed_distribution(tfp8, root: str) -> None:
    from importlib import metadata

    dist = metadata.distribution("transformer_fp8")
    if dist.version != tfp8.__version__:
        sys.exit(f"distribution version {dist.version} != transformer_fp8.__version__ "
                 f"{tfp8.__version__}")
    check_location("the distribution transformer_fp8",
                   str(dist.locate_file("transformer_fp8/__init__.py")), root)
    plugins = [ep for ep in dist.entry_points if ep.group == "pytest11"]
    if [(ep.name, ep.value) for ep in plugins] != [("transformer_fp8", "pytest_transformer_fp8")]:
        sys.exit(f"pytest11 entry points of the distribution: {plugins}")
    plugin = plugins[0].load()
    check_location(plugin.__name__, plugin.__file__, root)
    info = tfp8.build_info()
    if info["cuda"] or info["cuda_archs"] or info["cuda_version"] is not None:
        sys.exit(f"the wheel was built with TRANSFORMER_FP8_CPU_ONLY=1, build_info() says {info}")
    if info["torch_version"].split(".")[:2] != torch.__version__.split(".")[:2]:
        sys.exit(f"built against torch {info['torch_version']}, running {torch.__version__}")


def fp8_linear_steps(tfp8, inputs: dict) -> dict:
    """Two steps (forward in fp8_autocast, backward outside) of a Linear holding the given
    weights; the second step's output and gradients."""
    weight, bias = inputs["weight"], inputs["bias"]
    layer = tfp8.Linear(weight.shape[1], weight.shape[0])
    with torch.no_grad():
        layer.weight.copy_(weight)
        layer.bias.copy_(bias)
    recipe = tfp8.DelayedScaling(fp8_format=tfp8.Format.HYBRID, amax_history_len=16)
    for _ in range(2):
        layer.zero_grad()
        x = inputs["x"].clone().requires_grad_(True)
        with tfp8.fp8_autocast(fp8_recipe=recipe):
            out = layer(x)
        out.backward(inputs["grad"])
    return {"out": out.detach(), "d_x": x.grad, "d_weight": layer.weight.grad,
            "d_bias": layer.bias.grad}


def check_against_float32(results: dict, inputs: dict, sqnr) -> None:
    """FP8 against the float32 layer: the bounds of tests/test_linear.py (23 dB output, 19 dB
    gradients); a wrong scale (0 dB for a factor 2) or a wrong operand fails them."""
    x = inputs["x"].clone().requires_grad_(True)
    weight = inputs["weight"].clone().requires_grad_(True)
    expected = torch.nn.functional.linear(x, weight, inputs["bias"])
    expected.backward(inputs["grad"])
    for name, ref, bound in (("out", expected.detach(), 23.0), ("d_x", x.grad, 19.0),
                             ("d_weight", weight.grad, 19.0),
                             ("d_bias", inputs["grad"].sum(0), 40.0)):
        value = results[name]
        if value.shape != ref.shape or not torch.isfinite(value).all():
            sys.exit(f"{name}: shape {tuple(value.shape)} (expected {tuple(ref.shape)}), "
                     f"finite: {bool(torch.isfinite(value).all())}")
        db = sqnr(value, ref)
        if not db >= bound:
            sys.exit(f"{name}: SQNR against float32 {db:.1f} dB < {bound} dB")
        print(f"{name}: shape {tuple(value.shape)}, SQNR against float32 {db:.1f} dB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("inputs")
    parser.add_argument("results")
    parser.add_argument("--package-root", required=True)
    parser.add_argument("--installed", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)  # one summation order, whichever Python runs this

    import pytest_transformer_fp8
    import transformer_fp8 as tfp8
    import transformer_fp8.debug
    import transformer_fp8.testing

    print("transformer_fp8", tfp8.__file__, tfp8.build_info())
    for module in (tfp8, tfp8._C, transformer_fp8.debug, transformer_fp8.testing,
                   pytest_transformer_fp8, *import_every_module(tfp8)):
        check_location(module.__name__, module.__file__, args.package_root)
    if args.installed:
        check_installed_distribution(tfp8, args.package_root)

    inputs = torch.load(args.inputs)
    results = fp8_linear_steps(tfp8, inputs)
    check_against_float32(results, inputs, transformer_fp8.testing.sqnr)
    torch.save(results, args.results)


if __name__ == "__main__":
    main()
