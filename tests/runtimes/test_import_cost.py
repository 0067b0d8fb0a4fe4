"""`import runtimes` and `import sdk` stay light: no backend library comes in until a session opens."""

from __future__ import annotations

import subprocess
import sys

import pytest

HEAVY = ("torch", "tensorrt", "openvino", "onnxruntime", "pynvml")


@pytest.mark.parametrize("statement", [
    "import runtimes", "import sdk", "import runtimes.energy, runtimes.hardware, runtimes.cli",
])
def test_import_pulls_no_heavy_library(statement: str) -> None:
    code = f"import sys; {statement}; print(sorted(m for m in {HEAVY!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
