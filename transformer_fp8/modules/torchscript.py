"""torch.jit.script is refused with an error that says so (else TorchScript's compiler stopped
at the first Python construct it does not take, an f-string in an error message, and named
nothing about why)."""
from __future__ import annotations


def refuse_torchscript(module):
    """``__prepare_scriptable__`` of every transformer_fp8 module: torch.jit.script calls it on
    the scripted module and each of its submodules before compiling them."""
    raise RuntimeError(
        f"transformer_fp8.{type(module).__name__} cannot be compiled by torch.jit.script: "
        "transformer_fp8's modules are not TorchScript-scriptable (as Transformer Engine's are "
        "not). Deploy with torch.export.export (fp8_autocast around the call), compile with "
        "torch.compile, or trace with torch.jit.trace instead")
