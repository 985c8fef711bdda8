"""Every relative link in the repository's markdown files names a file or folder that exists
(a results README the docs linked to was once never committed)."""
import os
import re
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def _markdown_files() -> list:
    try:
        listed = subprocess.run(["git", "ls-files", "*.md"], cwd=ROOT, capture_output=True,
                                text=True, check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: the tracked markdown files are unknown")
    return listed


def test_relative_markdown_links_resolve():
    files = _markdown_files()
    assert "README.md" in files
    broken = []
    for name in files:
        with open(os.path.join(ROOT, name), encoding="utf-8") as handle:
            text = handle.read()
        for target in LINK.findall(text):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # (http:, mailto:, ...)
                continue
            path = os.path.normpath(os.path.join(ROOT, os.path.dirname(name), target))
            if not os.path.exists(path):
                broken.append(f"{name}: {target}")
    assert not broken, "links to missing files:\n" + "\n".join(broken)
