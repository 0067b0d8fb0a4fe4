"""Run a candidate artifact on arrays: through `runtimes.open_session`, or directly where a backend is absent.

The compiler validates every variant with the same sessions a device would use (the runtimes
API). If this checkout's `runtimes` lacks the backend module (an older runtimes layer), a minimal
onnxruntime or OpenVINO session is opened here instead, so that compiling still works.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from runtimes.errors import InferenceError
from runtimes.session import SessionOptions

logger = logging.getLogger(__name__)


class Runner(Protocol):
    """What the compiler needs from a session: `run` and `close`."""

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]: ...

    def close(self) -> None: ...


def open_runner(artifact: Path, runtime: str, *, threads: int = 0, device: str = "cpu") -> Runner:
    """A session on `artifact` with `runtime`, `threads` intra-op threads (0 = the backend's default)."""
    from runtimes.registry import open_session

    options = SessionOptions(intra_op_threads=threads, device=device)
    try:
        return open_session(artifact, backend=runtime, options=options)
    except ModuleNotFoundError as exc:
        if not (exc.name or "").startswith("runtimes.") or runtime not in ("onnxruntime", "openvino"):
            raise
        logger.debug("runtimes has no %s backend module yet; opening %s directly", runtime, artifact.name)
        return _OrtRunner(artifact, threads) if runtime == "onnxruntime" else _OvRunner(artifact, threads)


def run_all(runner: Runner, batches: Any) -> dict[str, np.ndarray]:
    """Run every batch of an iterable of input dicts; concatenate each output along axis 0."""
    parts: dict[str, list[np.ndarray]] = {}
    for batch in batches:
        for name, value in runner.run(batch).items():
            parts.setdefault(name, []).append(np.asarray(value))
    return {k: np.concatenate(v) for k, v in parts.items()}


class _OrtRunner:
    def __init__(self, artifact: Path, threads: int) -> None:
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        self._sess: Any = ort.InferenceSession(str(artifact), so, providers=["CPUExecutionProvider"])
        self._names = [o.name for o in self._sess.get_outputs()]

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        try:
            return dict(zip(self._names, self._sess.run(self._names, dict(inputs)), strict=True))
        except Exception as exc:
            msg = f"onnxruntime failed while running: {exc}"
            raise InferenceError(msg) from exc

    def close(self) -> None:
        self._sess = None


class _OvRunner:
    def __init__(self, artifact: Path, threads: int) -> None:
        import openvino as ov

        config: dict[str, Any] = {"PERFORMANCE_HINT": "LATENCY"}
        if threads:
            config["INFERENCE_NUM_THREADS"] = threads
        self._compiled: Any = ov.Core().compile_model(str(artifact), "CPU", config)
        self._request: Any = self._compiled.create_infer_request()
        self._names = [p.get_any_name() for p in self._compiled.outputs]

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        try:
            result = self._request.infer(dict(inputs))
        except Exception as exc:
            msg = f"OpenVINO failed while running: {exc}"
            raise InferenceError(msg) from exc
        return {n: np.array(v) for n, v in zip(self._names, result.to_tuple(), strict=True)}

    def close(self) -> None:
        self._request = self._compiled = None
