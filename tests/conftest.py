"""Fixtures for the whole suite: real models trained on real data that ships offline, a real broker, and the
cloud service's real packages, servers and CA (used by tests/cloud_service and tests/security)."""

from __future__ import annotations

import gc
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cloud_service.config import ServerConfig
from compilers.variants import VariantSet
from runtimes.registry import register_backend
from testkit import zoo
from testkit.cloud_helpers import Pki, ServerThread, make_package, write_pki
from testkit.packages import make_variant_set

# torch's OpenMP threads spin while they wait for work; on a 2-core host other processes load, the spinning
# starves everything else. Measured at load average ~13: training the digits linear model took 50-58 s wall
# (10.6-12.4 s CPU) spinning, 7.2 s (1.8 s CPU) passive; the digits CNN 250 s (31.7 s CPU) spinning, past
# pytest's 300 s timeout in loaded runs, and 1.0 s passive. The thread count is unchanged, and a passive run's
# weights differ from a spinning one's no more than two spinning runs' do (training is not bit-reproducible
# across runs either way: 0.24 and 0.26 at most). Set before anything imports torch; subprocesses inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# The fake backend is a test double: the product does not ship it, the suite plugs it in.
register_backend("fake", "testkit.fake_backend:FakeBackend")


@pytest.fixture(autouse=True, scope="module")
def _collect_garbage_per_module() -> Iterator[None]:
    """A full gc pass after each test module, so that a resource left unclosed in a reference cycle
    (a socket, a file) fails the module that leaked it, not the end of the whole session."""
    yield
    gc.collect()


@pytest.fixture(scope="session")
def digits() -> zoo.Split:
    return zoo.digits(seed=0)


@pytest.fixture(scope="session")
def digits_cnn(digits: zoo.Split):  # type: ignore[no-untyped-def]
    """A small CNN trained on digits' train split (~99% on test), as a torch module."""
    return zoo.train(zoo.small_cnn(), digits, epochs=10, seed=0)


@pytest.fixture(scope="session")
def digits_linear(digits: zoo.Split):  # type: ignore[no-untyped-def]
    """Logistic regression on digits (~96% on test), as a torch module."""
    return zoo.train(zoo.linear_classifier(), digits, epochs=30, lr=1e-2, seed=0)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def digits_cnn_onnx(digits_cnn, digits: zoo.Split, model_dir: Path) -> Path:  # type: ignore[no-untyped-def]
    """The digits CNN exported to ONNX: input "x" (batch, 1, 8, 8) float32, output "logits" (batch, 10)."""
    return zoo.export_onnx(digits_cnn, digits.x_test[:1], model_dir / "digits_cnn.onnx")


@pytest.fixture(scope="session")
def digits_linear_onnx(digits_linear, digits: zoo.Split, model_dir: Path) -> Path:  # type: ignore[no-untyped-def]
    return zoo.export_onnx(digits_linear, digits.x_test[:1], model_dir / "digits_linear.onnx")


@pytest.fixture(scope="session")
def digits_ladder(digits_linear_onnx: Path, digits_cnn_onnx: Path, digits: zoo.Split,
                  tmp_path_factory: pytest.TempPathFactory) -> VariantSet:
    """Two real variants of one model: a fast logistic regression (~96%) and a small CNN (~99%)."""
    return make_variant_set(tmp_path_factory.mktemp("ladder") / "digits",
                            {"linear": digits_linear_onnx, "cnn": digits_cnn_onnx}, name="digits",
                            x_val=digits.x_val, y_val=digits.y_val)


@pytest.fixture(scope="session")
def digits_cnn_reference(digits_cnn, digits: zoo.Split) -> np.ndarray:  # type: ignore[no-untyped-def]
    """torch's logits for digits.x_test: the reference every backend is compared with."""
    return zoo.predict(digits_cnn, digits.x_test)


@pytest.fixture
def broker(tmp_path: Path):  # type: ignore[no-untyped-def]
    """A fresh Mosquitto on a free loopback port (TCP_NODELAY, persistence on); stopped after the test."""
    from testkit.broker import Broker

    b = Broker(tmp_path / "broker").start()
    yield b
    b.stop()


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
