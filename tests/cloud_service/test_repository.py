"""Loading the models directory: versions, variant sets, archives, signatures, and hot swap under load."""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import numpy as np
import pytest

from cloud_service.protocol import decode_outputs, encode_request
from cloud_service.protocol import inference_pb2 as pb
from cloud_service.protocol import inference_pb2_grpc as pbg
from compilers import signing
from compilers.package import ModelPackage, pack
from compilers.variants import VariantEntry, VariantSet
from runtimes.spec import TensorSpec
from testkit import zoo
from testkit.cloud_helpers import ServerThread, make_package, metric_value
from testkit.waiting import wait_for


def _direct(package: Path, x: np.ndarray) -> np.ndarray:
    with ModelPackage.open(package).open_session() as session:
        return session.run({"x": x})["logits"]


class Load:
    """Clients sending requests in threads until stopped (bounded in count and time)."""

    def __init__(self, address: str, x: np.ndarray, *, threads: int = 3, max_requests: int = 3000) -> None:
        self.x, self.stop_event = x, threading.Event()
        self.versions: list[str] = []
        self.errors: list[str] = []
        self._channel = grpc.insecure_channel(address)
        self._stub = pbg.GRPCInferenceServiceStub(self._channel)
        self._budget = max_requests // threads
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(threads)]

    def _run(self) -> None:
        deadline = time.monotonic() + 60
        for _ in range(self._budget):
            if self.stop_event.is_set() or time.monotonic() > deadline:
                return
            try:
                reply = self._stub.ModelInfer(encode_request("digits", {"x": self.x}), timeout=10)
                self.versions.append(reply.model_version)
            except grpc.RpcError as exc:
                self.errors.append(f"{exc.code()}: {exc.details()}")

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        wait_for("the load's first answers", lambda: len(self.versions) >= 5 or self.errors, timeout=20, interval=0.02)
        return self

    def answers_after(self, what: str, count: int = 10) -> None:
        """Wait for `count` more answers than there are now."""
        seen = len(self.versions)
        wait_for(f"{count} answers {what}", lambda: len(self.versions) >= seen + count or self.errors, timeout=20,
                 interval=0.02)

    def __exit__(self, *exc: object) -> None:
        self.stop_event.set()
        for t in self._threads:
            t.join(30)
        self._channel.close()


def test_new_version_swaps_in_under_load_without_a_failed_request(
        serve: Callable[..., ServerThread], models_dir: Path, digits_linear_onnx: Path, digits_x: np.ndarray) -> None:
    server = serve(models_dir, drain_timeout_s=10)
    x = digits_x[:4]
    with Load(server.grpc, x) as load:
        make_package(models_dir / "digits-v2", digits_linear_onnx, version="2")
        report = server.call(server.service.reload())
        assert report.loaded == ["digits:2"]
        load.answers_after("after version 2 was loaded")
        shutil.rmtree(models_dir / "digits-v1")
        report = server.call(server.service.reload())
        assert report.unloaded == ["digits:1"]
        load.answers_after("after version 1 was unloaded")
    assert load.errors == []
    assert len(load.versions) > 20
    assert "1" in load.versions
    assert load.versions[-1] == "2"
    assert load.versions.index("2") > 0
    with grpc.insecure_channel(server.grpc) as channel:
        reply = pbg.GRPCInferenceServiceStub(channel).ModelInfer(encode_request("digits", {"x": x}))
    np.testing.assert_allclose(decode_outputs(reply)["logits"], _direct(models_dir / "digits-v2", x),
                               rtol=1e-5, atol=1e-5)


def test_same_version_replaced_in_place_swaps(serve: Callable[..., ServerThread], models_dir: Path,
                                              digits_linear_onnx: Path, digits_x: np.ndarray) -> None:
    server = serve(models_dir)
    x = digits_x[:2]
    with Load(server.grpc, x, threads=2) as load:
        shutil.rmtree(models_dir / "digits-v1")
        make_package(models_dir / "digits-v1", digits_linear_onnx)
        assert server.call(server.service.reload()).loaded == ["digits:1"]
    assert load.errors == []
    with grpc.insecure_channel(server.grpc) as channel:
        reply = pbg.GRPCInferenceServiceStub(channel).ModelInfer(encode_request("digits", {"x": x}))
    np.testing.assert_allclose(decode_outputs(reply)["logits"], _direct(models_dir / "digits-v1", x), rtol=1e-5,
                               atol=1e-5)


def test_tampered_package_is_refused_and_the_old_version_keeps_serving(
        serve: Callable[..., ServerThread], models_dir: Path, digits_linear_onnx: Path, digits_x: np.ndarray) -> None:
    server = serve(models_dir)
    bad = make_package(models_dir / "digits-v2", digits_linear_onnx, version="2")
    data = bytearray((bad / "model.onnx").read_bytes())
    data[len(data) // 2] ^= 0x01
    (bad / "model.onnx").write_bytes(bytes(data))
    report = server.call(server.service.reload())
    assert "modified or corrupted" in report.refused["digits:2"]
    assert server.service.repository.versions("digits") == ["1"]
    with grpc.insecure_channel(server.grpc) as channel:
        reply = pbg.GRPCInferenceServiceStub(channel).ModelInfer(encode_request("digits", {"x": digits_x[:1]}))
    assert reply.model_version == "1"
    assert metric_value(server.metrics_text, "tierkit_model_loads_total", model="digits", outcome="refused") == 1
    # an unchanged refused package is not retried on every rescan
    assert server.call(server.service.reload()).refused == {}


def test_package_failing_its_smoke_check_is_refused(serve: Callable[..., ServerThread], models_dir: Path,
                                                   digits_cnn_onnx: Path) -> None:
    server = serve(models_dir)
    make_package(models_dir / "digits-v2", digits_cnn_onnx, version="2",
                 inputs=(TensorSpec("x", "float32", ("batch", 1, 28, 28)),))
    report = server.call(server.service.reload())
    assert "smoke check failed" in report.refused["digits:2"]
    assert server.service.repository.versions("digits") == ["1"]


def test_variant_set_serves_the_recommended_variant_and_each_as_a_version(
        serve: Callable[..., ServerThread], tmp_path: Path, digits_cnn_onnx: Path, digits_linear_onnx: Path,
        digits_x: np.ndarray) -> None:
    root = tmp_path / "models" / "digits-x86"
    make_package(root / "fp32", digits_cnn_onnx)
    make_package(root / "linear", digits_linear_onnx)
    entries = tuple(VariantEntry(id=v, path=v, precision="fp32", runtime="onnxruntime", passes=[], fidelity={},
                                 latency_ms={"batch_1": {"p50": p}}, size_bytes=1, recommended=v == "fp32")
                    for v, p in (("linear", 0.1), ("fp32", 0.3)))
    VariantSet(root, "digits", "x86-avx512", entries).write()
    server = serve(tmp_path / "models")
    assert server.service.repository.versions("digits") == ["fp32", "linear"]
    x = digits_x[:3]
    with grpc.insecure_channel(server.grpc) as channel:
        stub = pbg.GRPCInferenceServiceStub(channel)
        default = stub.ModelInfer(encode_request("digits", {"x": x}))
        linear = stub.ModelInfer(encode_request("digits", {"x": x}, version="linear"))
        config = stub.ModelConfig(pb.ModelConfigRequest(name="digits", version="linear")).config
    assert default.model_version == "fp32"
    np.testing.assert_allclose(decode_outputs(default)["logits"], _direct(root / "fp32", x), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(decode_outputs(linear)["logits"], _direct(root / "linear", x), rtol=1e-5, atol=1e-5)
    assert config.parameters["tierkit.variant"].string_value == "linear"


def test_signed_packages_only_with_trusted_keys(serve: Callable[..., ServerThread], tmp_path: Path,
                                                digits_cnn_onnx: Path) -> None:
    private, public = signing.generate_keypair(tmp_path / "ops")
    root = tmp_path / "models"
    make_package(root / "signed", digits_cnn_onnx, name="signed", sign_key=signing.load_private_key(private))
    make_package(root / "unsigned", digits_cnn_onnx, name="unsigned")
    server = serve(root, trusted_keys=(public,))
    assert server.service.repository.versions("signed") == ["1"]
    assert server.service.repository.versions("unsigned") == []
    assert "not signed" in server.service.last_reload.refused["unsigned:1"]


def test_archived_package_is_served(serve: Callable[..., ServerThread], tmp_path: Path, digits_cnn_onnx: Path) -> None:
    pkg = make_package(tmp_path / "build" / "digits", digits_cnn_onnx)
    (tmp_path / "models").mkdir()
    pack(pkg, tmp_path / "models" / "digits.tkpkg")
    server = serve(tmp_path / "models")
    assert server.service.repository.versions("digits") == ["1"]
    with grpc.insecure_channel(server.grpc) as channel:
        reply = pbg.GRPCInferenceServiceStub(channel).ModelInfer(
            encode_request("digits", {"x": np.zeros((2, 1, 8, 8), np.float32)}))
    assert decode_outputs(reply)["logits"].shape == (2, 10)


def test_model_without_a_batch_axis_is_served_unbatched(serve: Callable[..., ServerThread], tmp_path: Path,
                                                        digits_cnn, digits: zoo.Split) -> None:  # type: ignore[no-untyped-def]
    onnx = zoo.export_onnx(digits_cnn, digits.x_test[:1], tmp_path / "fixed.onnx", dynamic_batch=False)
    make_package(tmp_path / "models" / "fixed", onnx, name="fixed", inputs=(TensorSpec("x", "float32", (1, 1, 8, 8)),),
                 outputs=(TensorSpec("logits", "float32", (1, 10)),))
    server = serve(tmp_path / "models")
    with grpc.insecure_channel(server.grpc) as channel:
        stub = pbg.GRPCInferenceServiceStub(channel)
        config = stub.ModelConfig(pb.ModelConfigRequest(name="fixed")).config
        reply = stub.ModelInfer(encode_request("fixed", {"x": digits.x_test[:1]}))
        with pytest.raises(grpc.RpcError) as info:
            stub.ModelInfer(encode_request("fixed", {"x": digits.x_test[:2]}))
    assert config.max_batch_size == 0
    assert list(config.input[0].dims) == [1, 1, 8, 8]
    assert decode_outputs(reply)["logits"].shape == (1, 10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
