"""Replicas: gRPC clients balance over two servers; two `tierkit serve` processes share one broker's escalations.

The loss test plays the device's part the way the edge agent does: an escalation that gets no answer
within a timeout is sent again with the same (device, boot id, seq), which a replica answers at most
once per cache lifetime.
"""

from __future__ import annotations

import contextlib
import signal
import time
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest

from cloud_service.config import ServerConfig
from cloud_service.protocol import decode_outputs, encode_request, topics
from cloud_service.protocol import inference_pb2 as pb
from cloud_service.protocol import inference_pb2_grpc as pbg
from compilers.package import ModelPackage
from testkit.cloud_helpers import Device, ServeProcess, ServerThread, make_package, metric_value
from testkit.waiting import wait_for


@pytest.fixture
def models(tmp_path: Path, digits_cnn_onnx: Path) -> Path:
    make_package(tmp_path / "models" / "digits", digits_cnn_onnx)
    return tmp_path / "models"


def test_grpc_client_round_robins_over_two_replicas(models: Path) -> None:
    servers = [ServerThread(ServerConfig(models_dir=models, grpc_address="127.0.0.1:0", drain_timeout_s=2))
               for _ in range(2)]
    try:
        for server in servers:
            server.start()
        target = "ipv4:" + ",".join(s.grpc for s in servers)
        options = [("grpc.lb_policy_name", "round_robin")]
        with grpc.insecure_channel(target, options=options) as channel:
            stub = pbg.GRPCInferenceServiceStub(channel)
            for _ in range(20):
                stub.ModelInfer(encode_request("digits", {"x": np.zeros((1, 1, 8, 8), np.float32)}), timeout=10)
        counts = [metric_value(s.metrics_text, "tierkit_requests_total", model="digits") for s in servers]
        assert sum(counts) == 20
        assert min(counts) >= 5, counts
    finally:
        for server in servers:
            server.stop()


def _count(replica: ServeProcess) -> float:
    with urllib.request.urlopen(f"http://{replica.addresses['metrics']}/metrics", timeout=10) as page:
        return metric_value(page.read().decode(), "tierkit_requests_total", protocol="mqtt")


class Escalations:
    """Sends escalations at a steady pace and re-sends the unanswered ones, like a device."""

    def __init__(self, device: Device, x: np.ndarray) -> None:
        self.device, self.x = device, x
        self.answers: dict[int, np.ndarray] = {}
        self.resent = 0

    def _payload(self, i: int) -> bytes:
        params = {topics.PARAM_DEVICE: self.device.device_id, topics.PARAM_BOOT: "boot-1", topics.PARAM_SEQ: i}
        return encode_request("digits", {"x": self.x[i % len(self.x)][None]}, parameters=params).SerializeToString()

    def _collect(self) -> None:
        while not self.device.replies.empty():
            message = self.device.replies.get()
            response = pb.ModelInferResponse.FromString(message.payload)
            if topics.STATUS_PROPERTY not in response.parameters:
                self.answers[int(message.properties.CorrelationData)] = decode_outputs(response)["logits"][0]

    def send(self, seqs: range, *, pace_s: float, on: dict[int, object] | None = None) -> None:
        for i in seqs:
            self.device.send(self._payload(i), str(i).encode())
            if on and i in on:
                on[i]()  # type: ignore[operator]
            time.sleep(pace_s)  # the device's request rate (pacing, not waiting for anything)
            self._collect()

    def _missing(self, expected: range) -> list[int]:
        self._collect()
        return [i for i in expected if i not in self.answers]

    def settle(self, expected: range, *, rounds: int, wait_s: float, resend: bool) -> list[int]:
        """Up to `rounds` rounds: each ends once every answer is in, or after `wait_s`; then (with `resend`) the
        missing requests are sent again. Returns the requests still unanswered."""
        for _ in range(rounds):
            with contextlib.suppress(AssertionError):  # a round's end is not a failure: the caller checks
                wait_for("every answer", lambda: not self._missing(expected), timeout=wait_s, interval=0.05)
            missing = self._missing(expected)
            if not missing or not resend:
                return missing
            for i in missing:
                self.resent += 1
                self.device.send(self._payload(i), str(i).encode())
        return self._missing(expected)


@pytest.mark.mqtt
def test_two_replicas_share_escalations_and_losing_one_loses_nothing(broker, models: Path) -> None:  # type: ignore[no-untyped-def]
    argv = ("--models", str(models), "--no-grpc", "--mqtt", broker.url, "--metrics", "127.0.0.1:0")
    a = ServeProcess(*argv, "--mqtt-client-id", "replica-a")
    b = ServeProcess(*argv, "--mqtt-client-id", "replica-b")
    replicas = [a, b]
    device = Device(broker.host, broker.port, "cam-1")
    x = np.random.default_rng(0).random((16, 1, 8, 8), dtype=np.float32)
    try:
        run = Escalations(device, x)
        # 1. both replicas take a share
        run.send(range(0, 60), pace_s=0.005)
        assert run.settle(range(0, 60), rounds=1, wait_s=10.0, resend=False) == []
        shares = (_count(a), _count(b))
        assert min(shares) >= 10, shares
        # 2. graceful stop (SIGTERM) of one replica mid-stream: no escalation lost, nothing re-sent
        run.send(range(60, 160), pace_s=0.005, on={80: lambda: a.proc.send_signal(signal.SIGTERM)})
        assert run.settle(range(60, 160), rounds=1, wait_s=10.0, resend=False) == []
        assert a.proc.wait(30) == 0
        # 3. a replacement joins, then is killed (SIGKILL) mid-stream: what it held is re-sent and answered.
        # Its session outlives it by session_expiry_s (5 s, so a broker restart loses nothing) and the broker
        # routes its share there until then: re-sending for longer than that settles everything.
        c = ServeProcess(*argv, "--mqtt-client-id", "replica-c")
        replicas.append(c)
        run.send(range(160, 260), pace_s=0.005, on={200: lambda: c.proc.send_signal(signal.SIGKILL)})
        assert run.settle(range(160, 260), rounds=10, wait_s=1.0, resend=True) == []
        c.proc.wait(10)
        assert _count(b) >= 100
    finally:
        device.close()
        for replica in replicas:
            replica.stop()
    with ModelPackage.open(models / "digits").open_session() as session:
        expected = session.run({"x": x})["logits"]
    for i, logits in run.answers.items():
        np.testing.assert_allclose(logits, expected[i % len(x)], rtol=1e-5, atol=1e-5)
    assert len(run.answers) == 260
