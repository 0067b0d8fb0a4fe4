"""Small compile targets for the compiler tests: onnxruntime fp32 plus the rungs a test is about."""

from __future__ import annotations

from typing import Any

from compilers import PassSpec, Rung, Target


def ort_target(*rungs: Rung, name: str = "test-ort") -> Target:
    """A small onnxruntime-only target: fp32 plus the given rungs (keeps a test to what it checks)."""
    return Target(name, ("onnxruntime",), ("fp32", "int8"), (Rung("fp32", "onnxruntime"), *rungs))


def static_rung(label: str = "static", **params: Any) -> Rung:
    """An int8 rung quantized by onnxruntime's static QDQ pass, with extra pass parameters."""
    return Rung("int8", "onnxruntime", (PassSpec("quantize_ort", {"mode": "static", **params}),), label)
