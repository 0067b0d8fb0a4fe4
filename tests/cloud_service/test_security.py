"""TLS and mutual TLS on gRPC; the shipped Mosquitto config (TLS, client certificates, passwords, ACLs)."""

from __future__ import annotations

import os
import ssl
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from cloud_service.config import MqttConfig
from cloud_service.protocol import encode_request, topics
from cloud_service.protocol import inference_pb2 as pb
from cloud_service.protocol import inference_pb2_grpc as pbg
from cloud_service.security import GrpcTls, MqttTls
from runtimes.errors import ConfigError
from testkit.broker import Broker
from testkit.cloud_helpers import Device, Pki, ServerThread, metric_value
from testkit.deploy_broker import DeployBroker, need_mosquitto
from testkit.waiting import wait_for


def _channel(address: str, pki: Pki, *, client_cert: bool) -> grpc.Channel:
    creds = grpc.ssl_channel_credentials(
        root_certificates=pki.ca.read_bytes(),
        private_key=pki.client_key.read_bytes() if client_cert else None,
        certificate_chain=pki.client_cert.read_bytes() if client_cert else None)
    return grpc.secure_channel(address, creds)


def _live(channel: grpc.Channel) -> bool:
    return pbg.GRPCInferenceServiceStub(channel).ServerLive(pb.ServerLiveRequest(), timeout=5).live


def test_grpc_tls(serve: Callable[..., ServerThread], models_dir: Path, pki: Pki) -> None:
    server = serve(models_dir, grpc_tls=GrpcTls(pki.server_cert, pki.server_key))
    with _channel(server.grpc, pki, client_cert=False) as channel:
        assert _live(channel)
        reply = pbg.GRPCInferenceServiceStub(channel).ModelInfer(
            encode_request("digits", {"x": np.zeros((1, 1, 8, 8), np.float32)}))
        assert reply.outputs[0].name == "logits"
    with grpc.insecure_channel(server.grpc) as plain, pytest.raises(grpc.RpcError) as info:
        _live(plain)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_grpc_mutual_tls(serve: Callable[..., ServerThread], models_dir: Path, pki: Pki) -> None:
    server = serve(models_dir, grpc_tls=GrpcTls(pki.server_cert, pki.server_key, client_ca_file=pki.ca))
    with _channel(server.grpc, pki, client_cert=True) as channel:
        assert _live(channel)
    with _channel(server.grpc, pki, client_cert=False) as channel, pytest.raises(grpc.RpcError):
        _live(channel)
    grpcclient = pytest.importorskip("tritonclient.grpc")
    client = grpcclient.InferenceServerClient(url=server.grpc, ssl=True, root_certificates=str(pki.ca),
                                              private_key=str(pki.client_key), certificate_chain=str(pki.client_cert))
    assert client.is_model_ready("digits")
    client.close()


@pytest.fixture
def deploy_broker(tmp_path: Path, pki: Pki) -> Iterator[DeployBroker]:
    need_mosquitto()
    broker = DeployBroker(tmp_path / "broker", pki).start()
    yield broker
    broker.stop()


def _device_tls(pki: Pki, *, client_cert: bool = True) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(pki.ca))
    if client_cert:
        ctx.load_cert_chain(str(pki.client_cert), str(pki.client_key))
    return ctx


@pytest.mark.mqtt
def test_shipped_mosquitto_config_tls_certificates_passwords_and_acls(
        deploy_broker: DeployBroker, serve: Callable[..., ServerThread], models_dir: Path, pki: Pki) -> None:
    mqtt = MqttConfig(url=f"mqtts://127.0.0.1:{deploy_broker.cloud_port}", client_id="tierkit-cloud",
                      username="tierkit-cloud", password=deploy_broker.passwords["tierkit-cloud"],
                      tls=MqttTls(ca_file=pki.ca))
    server = serve(models_dir, grpc_address=None, mqtt=mqtt)
    device = Device("127.0.0.1", deploy_broker.port, "cam-1", tls=_device_tls(pki))
    try:
        payload = encode_request("digits", {"x": np.zeros((1, 1, 8, 8), np.float32)}).SerializeToString()
        reply = device.ask(payload, b"ok")
        assert reply is not None
        assert pb.ModelInferResponse.FromString(reply.payload).outputs[0].name == "logits"
        # cam-1 may not publish into cam-2's subtree: the broker refuses, the server never sees it
        device.send(payload, b"denied", topic=topics.escalate_topic("cam-2"))
        # a request of its own after it is a barrier: the broker handles one client's publishes in order
        assert device.ask(payload, b"after") is not None
        wait_for("the second request counted", lambda: metric_value(
            server.metrics_text, "tierkit_requests_total", protocol="mqtt") >= 2, timeout=10)
        assert metric_value(server.metrics_text, "tierkit_requests_total", protocol="mqtt") == 2
    finally:
        device.close()


@pytest.mark.mqtt
def test_shipped_mosquitto_config_refuses_the_unauthenticated(deploy_broker: DeployBroker, pki: Pki,
                                                              serve: Callable[..., ServerThread],
                                                              models_dir: Path) -> None:
    from runtimes.errors import BackendUnavailable

    with pytest.raises((RuntimeError, OSError)):  # device listener: no client certificate, no session
        Device("127.0.0.1", deploy_broker.port, "cam-1", tls=_device_tls(pki, client_cert=False), timeout=2)
    wrong = MqttConfig(url=f"mqtts://127.0.0.1:{deploy_broker.cloud_port}", client_id="tierkit-cloud",
                       username="tierkit-cloud", password="wrong", tls=MqttTls(ca_file=pki.ca))
    with pytest.raises(BackendUnavailable, match="refused the connection"):
        serve(models_dir, grpc_address=None, mqtt=wrong)


@pytest.mark.mqtt
def test_mqtt_bridge_with_a_client_certificate(tmp_path: Path, pki: Pki, serve: Callable[..., ServerThread],
                                               models_dir: Path) -> None:
    tls = (f"cafile {pki.ca}\ncertfile {pki.server_cert}\nkeyfile {pki.server_key}\n"
           "require_certificate true\nuse_identity_as_username true\n")
    broker = Broker(tmp_path / "broker", extra_conf=("user root\n" if os.geteuid() == 0 else "") + tls).start()
    try:
        mqtt = MqttConfig(url=f"mqtts://127.0.0.1:{broker.port}", client_id="cloud-cert",
                          tls=MqttTls(ca_file=pki.ca, cert_file=pki.cloud_cert, key_file=pki.cloud_key))
        serve(models_dir, grpc_address=None, mqtt=mqtt)
        device = Device("127.0.0.1", broker.port, "cam-1", tls=_device_tls(pki))
        try:
            reply = device.ask(encode_request("digits", {"x": np.zeros((1, 1, 8, 8), np.float32)}).SerializeToString())
            assert reply is not None
            assert pb.ModelInferResponse.FromString(reply.payload).outputs[0].name == "logits"
        finally:
            device.close()
        with pytest.raises(ConfigError):  # a certificate without its key is refused up front
            MqttTls(ca_file=pki.ca, cert_file=pki.cloud_cert)
    finally:
        broker.stop()
