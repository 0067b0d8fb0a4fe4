"""Fixtures of the cloud service tests: real packages of the digits CNN, a real server in a thread, a CA."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cloud_service.config import ServerConfig
from testkit.cloud_helpers import Pki, ServerThread, make_package, write_pki


@pytest.fixture
def models_dir(tmp_path: Path, digits_cnn_onnx: Path) -> Path:
    """A models directory holding the digits CNN as `digits` version 1."""
    root = tmp_path / "models"
    make_package(root / "digits-v1", digits_cnn_onnx)
    return root


@pytest.fixture(scope="session")
def digits_x(digits) -> np.ndarray:  # type: ignore[no-untyped-def]
    return np.ascontiguousarray(digits.x_test[:64])


@pytest.fixture
def serve() -> Iterator[Callable[..., ServerThread]]:
    """Start servers: `serve(models_dir, **ServerConfig fields)`; all are stopped after the test."""
    started: list[ServerThread] = []

    def start(models: Path, **fields: Any) -> ServerThread:
        fields.setdefault("grpc_address", "127.0.0.1:0")
        fields.setdefault("drain_timeout_s", 5.0)
        server = ServerThread(ServerConfig(models_dir=models, **fields))
        started.append(server)
        return server.start()

    yield start
    for server in reversed(started):
        server.stop()


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return write_pki(tmp_path_factory.mktemp("pki"))
