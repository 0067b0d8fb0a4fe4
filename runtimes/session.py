"""The one interface every backend implements: a loaded model that runs named arrays."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import TracebackType

import numpy as np

from runtimes.errors import ConfigError
from runtimes.spec import TensorSpec


@dataclass(frozen=True, slots=True)
class SessionOptions:
    """How to run a model.

    Args:
        intra_op_threads: threads inside one operator (0 = the backend's default).
        inter_op_threads: threads across operators (0 = the backend's default).
        device: "cpu", "gpu", "cuda:N", or an OpenVINO device name ("CPU", "GPU", "NPU", "AUTO").
        providers: onnxruntime execution providers in order of preference; empty picks the best
            available (TensorRT, CUDA, OpenVINO, CPU).
        performance_hint: OpenVINO "LATENCY" or "THROUGHPUT".
    """

    intra_op_threads: int = 0
    inter_op_threads: int = 0
    device: str = "cpu"
    providers: tuple[str, ...] = field(default_factory=tuple)
    performance_hint: str = "LATENCY"

    def __post_init__(self) -> None:
        if self.intra_op_threads < 0 or self.inter_op_threads < 0:
            msg = f"thread counts must be >= 0, got {self.intra_op_threads}/{self.inter_op_threads}"
            raise ConfigError(msg)
        if self.performance_hint not in ("LATENCY", "THROUGHPUT"):
            msg = f"performance_hint {self.performance_hint!r} is not LATENCY or THROUGHPUT"
            raise ConfigError(msg)


class Session:
    """A loaded model. Use as a context manager or call `close()`.

    Subclasses set `inputs`, `outputs` and `backend`, and implement `run` and `_close`.

    Example:
        >>> with runtimes.open_session("model.onnx") as s:
        ...     y = s.run({"x": x})["logits"]
    """

    backend: str = ""
    inputs: tuple[TensorSpec, ...] = ()
    outputs: tuple[TensorSpec, ...] = ()
    _closed: bool = False

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def _close(self) -> None:
        pass

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._close()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def __repr__(self) -> str:
        ins = ", ".join(f"{s.name}:{s.dtype}{list(s.shape)}" for s in self.inputs)
        return f"<{type(self).__name__} backend={self.backend} inputs=[{ins}]>"
