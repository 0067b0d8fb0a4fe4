"""The public SDK surface: a handful of names, sorted `__all__`, and a light `import sdk`."""

from __future__ import annotations

import subprocess
import sys

import sdk

PUBLIC = ["Budget", "Prediction", "TieredModel", "TierkitError", "__version__", "compile", "load"]


def test_all_is_sorted_and_complete() -> None:
    assert sdk.__all__ == sorted(sdk.__all__)
    assert sdk.__all__ == PUBLIC
    for name in sdk.__all__:
        assert hasattr(sdk, name), name
    public = {n for n in vars(sdk) if not n.startswith("_") and n not in {"cli", "demo"}}
    assert public == set(PUBLIC) - {"__version__"}


def test_errors_and_budget_are_the_shared_ones() -> None:
    from edge_agent.budget import Budget
    from runtimes.errors import TierkitError

    assert sdk.Budget is Budget
    assert sdk.TierkitError is TierkitError
    assert isinstance(sdk.__version__, str)


def test_import_sdk_pulls_no_heavy_backend() -> None:
    code = ("import sys, sdk; print(sorted(m for m in ('torch', 'tensorrt', 'openvino', 'onnxruntime') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
