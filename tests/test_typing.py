"""`mypy --strict` passes on the typed core listed under [tool.mypy] `files` in pyproject.toml.

The list grows file by file as modules settle; this test only insists that it never shrinks below
the bottom layer, the finished compilers modules, the wire contract and the CLI root.
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CORE = {
    "runtimes",
    "compilers",
    "cloud_service",
    "edge_agent",
    "sdk",
}


def test_strict_list_covers_the_core() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]
    assert config["strict"] is True
    assert CORE.issubset(config["files"])


def test_mypy_strict_passes() -> None:
    pytest.importorskip("mypy")
    # No file arguments: mypy checks `files` from pyproject.toml. The cache under the repository root
    # (shared with `make typecheck`) turns a ~30 s cold run into a few seconds.
    proc = subprocess.run([sys.executable, "-m", "mypy", "--config-file", "pyproject.toml"], cwd=ROOT,
                          capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
