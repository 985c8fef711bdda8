"""Every relative link in the repository's markdown files names a tracked file or a folder
holding one (a results README the docs linked to was once never committed: on disk, not in
the repository)."""
import os
import re
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def _tracked_files() -> list:
    try:
        listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True,
                                text=True, check=True).stdout.splitlines()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: the tracked files are unknown")
    return listed


def test_relative_markdown_links_resolve():
    tracked = _tracked_files()
    known = set(tracked) | {folder for name in tracked
                            for folder in _parents(os.path.dirname(name))}
    markdown = [name for name in tracked if name.endswith(".md")]
    assert "README.md" in markdown
    broken = []
    for name in markdown:
        with open(os.path.join(ROOT, name), encoding="utf-8") as handle:
            text = handle.read()
        for target in LINK.findall(text):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # (http:, mailto:, ...)
                continue
            path = os.path.relpath(os.path.normpath(os.path.join(ROOT, os.path.dirname(name),
                                                                 target)), ROOT)
            if path not in known and path != ".":
                broken.append(f"{name}: {target}")
    assert not broken, "links to files the repository does not hold:\n" + "\n".join(broken)


def _parents(folder: str) -> list:
    """``folder`` and every folder above it (relative paths)."""
    found = []
    while folder:
        found.append(folder)
        folder = os.path.dirname(folder)
    return found
