"""Natural text that every CPython install carries, as a byte-level token stream, and the
seeded batches gpt_loss_curves.py trains on. No download, no tokenizer to fetch.

Corpora (the text of the Python running the script, so the same Python gives the same
stream; ``Corpus.sha256`` names it):
  * ``stdlib``: the language reference's text (``pydoc_data/topics.py``'s ``topics``, English
    prose, keys in sorted order) followed by every ``.py`` file of the standard library
    (code with its docstrings and comments), files in sorted path order; test suites,
    site-packages and the build's ``_sysconfigdata*`` left out.
  * ``prose``: the language reference's text followed by every docstring (module, class,
    function) of those same files, read with ``ast`` (no import), in file order and, within a
    file, ``ast.walk``'s order.
Tokens are the UTF-8 bytes (vocabulary 256). The stream is cut into pages of 16,384 tokens;
every 20th page is held out for validation, the others, in order, form the training stream.
"""
from __future__ import annotations

import ast
import functools
import hashlib
import os
import sys
import sysconfig
from dataclasses import dataclass

import torch

CORPORA = ("stdlib", "prose")
VOCAB = 256  # byte-level tokens
PAGE = 16384  # tokens per page; every VAL_EVERY-th page is validation
VAL_EVERY = 20
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


def stdlib_files(root: str | None = None) -> list[str]:
    """The standard library's .py files, sorted by path relative to ``root``."""
    root = root or sysconfig.get_paths()["stdlib"]
    found = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _SKIP_DIRS and not d.startswith("config-")]
        found += [os.path.join(folder, n) for n in names
                  if n.endswith(".py") and not n.startswith("_sysconfigdata")]
    return sorted(found, key=lambda p: os.path.relpath(p, root))


def _topics() -> str:
    """The language reference's text; empty where a trimmed install left pydoc_data out."""
    try:
        from pydoc_data.topics import topics
    except ImportError:
        return ""
    return "\n\n".join(topics[key] for key in sorted(topics))


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError):
        return None


def _docstrings(source: str) -> list[str]:
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    return [doc for node in ast.walk(tree) if isinstance(node, kinds)
            for doc in [ast.get_docstring(node)] if doc]


def corpus_text(name: str) -> tuple[str, int]:
    """(text, number of stdlib files it drew on) for corpus ``name``."""
    if name not in CORPORA:
        raise ValueError(f"corpus must be one of {CORPORA}, got {name!r}")
    parts, files = [_topics()], 0
    paths = stdlib_files()
    if not paths:
        raise RuntimeError(f"no .py files under {sysconfig.get_paths()['stdlib']}: this "
                           "Python's standard library holds no source to read")
    for path in paths:
        source = _read(path)
        if source is None:
            continue
        files += 1
        if name == "stdlib":
            parts.append(source)
        else:
            parts += _docstrings(source)
    return "\n\n".join(parts), files


@dataclass(frozen=True)
class Corpus:
    name: str
    train: torch.Tensor  # uint8 token stream
    val: torch.Tensor
    sha256: str  # of the whole byte stream
    files: int

    def describe(self) -> dict:
        return {"corpus": self.name, "sha256": self.sha256, "stdlib_files": self.files,
                "tokens": self.train.numel() + self.val.numel(),
                "train_tokens": self.train.numel(), "val_tokens": self.val.numel(),
                "python": sys.version.split()[0], "vocab": VOCAB}


@functools.lru_cache(maxsize=None)
def load(name: str = "stdlib") -> Corpus:
    text, files = corpus_text(name)
    data = text.encode("utf-8")
    stream = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    pages = list(stream.split(PAGE))
    val = [p for i, p in enumerate(pages) if i % VAL_EVERY == VAL_EVERY - 1]
    train = [p for i, p in enumerate(pages) if i % VAL_EVERY != VAL_EVERY - 1]
    return Corpus(name, torch.cat(train), torch.cat(val), hashlib.sha256(data).hexdigest(),
                  files)


class Batches:
    """batch(step) -> [batch, seq + 1] int64 tokens, a function of (seed, step) only, so a run
    resumed at any step, on any machine with the same corpus, sees the same batches.

    Epoch e cuts the training stream into non-overlapping windows of seq + 1 tokens from an
    offset drawn for that epoch (0 for the first), in an order drawn for that epoch; step s
    takes windows s * batch ... s * batch + batch - 1 of that sequence of epochs."""

    def __init__(self, stream: torch.Tensor, seq: int, batch: int, seed: int):
        if stream.numel() < 2 * (seq + 1):
            raise ValueError(f"a training stream of {stream.numel()} tokens is too short for "
                             f"windows of seq + 1 = {seq + 1}")
        self.stream, self.seq, self.batch, self.seed = stream, seq, batch, seed
        self._epochs: list[torch.Tensor] = []  # per epoch: window start positions, in order

    def _epoch(self, e: int) -> torch.Tensor:
        while len(self._epochs) <= e:
            n = len(self._epochs)
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + n)
            offset = 0 if n == 0 else int(torch.randint(self.seq + 1, (), generator=gen))
            count = (self.stream.numel() - offset) // (self.seq + 1)
            order = torch.randperm(count, generator=gen)
            self._epochs.append(offset + order * (self.seq + 1))
        return self._epochs[e]

    def epochs_for(self, steps: int) -> float:
        """Passes over the training stream that ``steps`` steps make."""
        return steps * self.batch * (self.seq + 1) / self.stream.numel()

    def batch_at(self, step: int) -> torch.Tensor:
        starts, index, e = [], step * self.batch, 0
        while len(starts) < self.batch:
            epoch = self._epoch(e)
            if index < len(epoch):
                take = epoch[index:index + self.batch - len(starts)]
                starts += take.tolist()
                index = 0
            else:
                index -= len(epoch)
            e += 1
        return torch.stack([self.stream[s:s + self.seq + 1] for s in starts]).long()


def val_windows(stream: torch.Tensor, seq: int, count: int) -> torch.Tensor:
    """[n, seq + 1] int64: ``count`` (at most) non-overlapping windows spread evenly over the
    validation stream."""
    available = stream.numel() // (seq + 1)
    if available == 0:
        raise ValueError(f"a validation stream of {stream.numel()} tokens holds no window of "
                         f"{seq + 1}")
    picks = torch.linspace(0, available - 1, min(count, available)).round().long().unique()
    return torch.stack([stream[i * (seq + 1):(i + 1) * (seq + 1)] for i in picks.tolist()]).long()
