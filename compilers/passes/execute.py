"""Run a candidate artifact on arrays through `runtimes.open_session`.

The compiler validates and times every variant with the same sessions a device would use.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from runtimes.session import SessionOptions


class Runner(Protocol):
    """What the compiler needs from a session: `run` and `close`."""

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]: ...

    def close(self) -> None: ...


def open_runner(artifact: Path, runtime: str, *, threads: int = 0, device: str = "cpu",
                precision: str = "fp32") -> Runner:
    """A session on `artifact` with `runtime`, `threads` intra-op threads (0 = the backend's default).

    `precision` is the variant's declared precision, pinned in the session exactly as a device pins it
    (`SessionOptions.precision`), so that validation and timing measure what will run there.
    """
    from runtimes.registry import open_session

    options = SessionOptions(intra_op_threads=threads, device=device, precision=precision)
    return open_session(artifact, backend=runtime, options=options)


def run_all(runner: Runner, batches: Any) -> dict[str, np.ndarray]:
    """Run every batch of an iterable of input dicts; concatenate each output along axis 0."""
    parts: dict[str, list[np.ndarray]] = {}
    for batch in batches:
        for name, value in runner.run(batch).items():
            parts.setdefault(name, []).append(np.asarray(value))
    return {k: np.concatenate(v) for k, v in parts.items()}

