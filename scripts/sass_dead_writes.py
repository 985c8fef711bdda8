"""Looks for values the compiler lost in the kernels' machine code, without a GPU.

Compiles every csrc/cuda/kernels/*.cu for sm_90 (nvcc), disassembles it (cuobjdump -sass) and
reports, per kernel, each instruction whose result register is written again, inside one basic
block, before anything reads it. ptxas leaves no such dead computation behind, except when it
mis-allocates a register: that is how the fp16 reglu backward's lost high word looked in the
SASS (a PRMT packing two results, overwritten by the next F2FP before the store, which then
stored an unrelated register; fused_store.cuh's store_vec avoids it).

    python scripts/sass_dead_writes.py [file.cu ...]      # default: every kernel file

Needs nvcc, cuobjdump and nvdisasm (CUOBJDUMP=/path/to/cuobjdump, else from PATH, else PyPI's
nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm where installed). Exit status 1 when a dead write
is found, 2 when a tool is missing. Moves (ptxas leaves redundant ones), 64-bit multiply-adds
and FP64 operations (register pairs the text does not mark) are not reported: the check is
about lost 32-bit results.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KERNELS = ROOT / "csrc" / "cuda" / "kernels"
# Instructions that write no general register.
NO_DEST = ("ST", "STG", "STS", "BRA", "EXIT", "BAR", "RED", "ATOM", "RET", "CALL", "MEMBAR", "NOP",
           "ISETP", "FSETP", "HSETP", "DSETP", "PLOP3", "BSSY", "BSYNC", "WARPSYNC", "YIELD",
           "DEPBAR", "ERRBAR", "CCTL", "FENCE", "U")
# Results that are register pairs or quads; writes of these are not reported.
WIDE_DEST = ("IMAD.WIDE", "LDG.E.64", "LDG.E.128", "LDS.64", "LDS.128", "LDC.64", "DADD", "DMUL",
             "DFMA", "MUFU.RCP64H", "F2F.F64", "I2F.F64")
MOVES = ("MOV", "IMAD.MOV.U32", "IMAD.MOV", "IMAD.U32", "CS2R", "MOV32I")
ENDS_BLOCK = ("BRA", "EXIT", "RET", "BSYNC", "CALL", "WARPSYNC")


def registers(text: str) -> list[int]:
    """The general registers an operand text names (R4.64: R4 and R5)."""
    out = []
    for m in re.finditer(r"\bR(\d+)(\.64)?\b", text):
        out.append(int(m.group(1)))
        if m.group(2):
            out.append(int(m.group(1)) + 1)
    return out


def reads_and_writes(text: str) -> tuple[list[int], list[int], bool]:
    """(registers read, registers written, predicated) of one instruction."""
    body = re.sub(r"^@!?U?P\w+\s+", "", text)
    predicated = body != text
    op = body.split()[0]
    operands = body[len(op):].split(",")
    if op.startswith(NO_DEST):
        reads = registers(body[len(op):])
        if op.startswith("DSETP"):  # FP64 operands are pairs
            reads += [r + 1 for r in reads]
        width = 4 if ".128" in op else 2 if ".64" in op else 1
        if op.startswith(("STG", "STS", "ST.", "RED", "ATOM")) and width > 1:
            data = registers(operands[-1])[:1]  # the data operand is a pair or a quad
            reads += [r + k for r in data for k in range(1, width)]
        return reads, [], predicated
    written = registers(operands[0])[:1]
    reads = registers(",".join(operands[1:]))
    if op.startswith("IMAD.WIDE"):  # its addend is a register pair
        reads += [r + 1 for r in registers(operands[-1])]
    if op.startswith(("DADD", "DMUL", "DFMA")):  # FP64 operands are pairs
        reads += [r + 1 for r in reads]
    elif op.startswith(("F2F.", "F2I.")) and op.endswith(".F64"):
        # a conversion from FP64 (F2F.F32.F64 R21, R20) reads the pair R20:R21
        reads += [r + 1 for r in reads]
    return reads, written, predicated


def dead_writes(block: list[tuple[str, str]]) -> list[tuple[tuple, tuple]]:
    found, pending = [], {}
    for addr, text in block:
        reads, written, predicated = reads_and_writes(text)
        for r in reads:
            pending.pop(r, None)
        for r in written:
            if predicated:  # a predicated write may not happen: the old value may live on
                pending.pop(r, None)
                continue
            if r in pending and r != 255:
                found.append((pending[r], (addr, text)))
            pending[r] = (addr, text)
    return found


def kernels(sass: str):
    """(name, [(address, instruction)]) per function of a cuobjdump listing."""
    for part in re.split(r"(?=\n\s+Function : )", sass):
        m = re.search(r"Function : (\S+)", part)
        if m:
            yield m.group(1), [(a, t.strip()) for a, t in
                               re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", part)]


def basic_blocks(lines):
    targets = {t.lstrip("0") for _, text in lines
               for t in re.findall(r"BRA\s+(?:`\()?(?:0x)?([0-9a-f]+)", text)}
    block = []
    for addr, text in lines:
        if addr.lstrip("0") in targets and block:
            yield block
            block = []
        block.append((addr, text))
        if text.split()[-1:] and re.sub(r"^@!?U?P\w+\s+", "", text).startswith(ENDS_BLOCK):
            yield block
            block = []
    if block:
        yield block


def check(cu_file: Path, cuobjdump: str, workdir: str) -> int:
    cubin = os.path.join(workdir, cu_file.stem + ".cubin")
    subprocess.run(["nvcc", "-O3", "-std=c++17", "-arch=sm_90", "-cubin", "-o", cubin,
                    str(cu_file), f"-I{ROOT / 'csrc'}", f"-I{KERNELS}"], check=True)
    env = dict(os.environ)  # (cuobjdump runs nvdisasm, found beside it in PyPI's packages)
    env["PATH"] = os.pathsep.join([str(Path(cuobjdump).parent), env.get("PATH", "")])
    done = subprocess.run([cuobjdump, "-sass", cubin], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        if "nvdisasm" in done.stderr:
            raise ToolMissing(done.stderr.strip())
        raise RuntimeError(f"cuobjdump failed on {cubin}: {done.stderr.strip()}")
    sass = done.stdout
    count = 0
    for name, lines in kernels(sass):
        for block in basic_blocks(lines):
            for (w_addr, w_text), (o_addr, o_text) in dead_writes(block):
                op = w_text.split()[0]
                if op in MOVES or op.startswith(WIDE_DEST):
                    continue
                count += 1
                print(f"{cu_file.name}: {name}\n    {w_addr}: {w_text}\n"
                      f"    overwritten unread at {o_addr}: {o_text}")
    print(f"{cu_file.name}: {count} dead write(s)")
    return count


class ToolMissing(Exception):
    pass


def find_cuobjdump() -> str | None:
    found = os.environ.get("CUOBJDUMP") or shutil.which("cuobjdump")
    if found:
        return found
    try:  # PyPI's nvidia-cuda-cuobjdump: nvidia/cu*/bin/cuobjdump
        import nvidia
    except ImportError:
        return None
    for root in getattr(nvidia, "__path__", []):
        for candidate in sorted(Path(root).glob("cu*/bin/cuobjdump")):
            return str(candidate)
    return None


def main(argv: list[str]) -> int:
    cuobjdump = find_cuobjdump()
    if cuobjdump is None or shutil.which("nvcc") is None:
        print("needs nvcc and cuobjdump (set CUOBJDUMP)", file=sys.stderr)
        return 2
    files = [Path(a) for a in argv] or sorted(KERNELS.glob("*.cu"))
    try:
        with tempfile.TemporaryDirectory() as workdir:
            total = sum(check(f, cuobjdump, workdir) for f in files)
    except ToolMissing as missing:
        print(f"needs nvdisasm beside cuobjdump: {missing}", file=sys.stderr)
        return 2
    return 1 if total else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
