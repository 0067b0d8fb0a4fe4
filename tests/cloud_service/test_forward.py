"""`tierkit serve --mqtt ... --forward grpc://...`: MQTT escalations answered by another Open Inference
Protocol server (here tierkit's own gRPC server on loopback), with the bridge's cache and metrics."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

import numpy as np
import pytest

from cloud_service.cli import add_parser, build_config
from cloud_service.config import MqttConfig, ServerConfig
from cloud_service.protocol import decode_outputs, encode_request, get_parameters, topics
from cloud_service.protocol import inference_pb2 as pb
from cloud_service.protocol.encoding import encode_input
from edge_agent.transports import open_transport
from runtimes.errors import ConfigError, EscalationError
from tests.cloud_service.helpers import ServerThread, metric_value


def _request(x: np.ndarray, seq: int, encoding: str = "") -> pb.ModelInferRequest:
    if not encoding:
        return encode_request("digits", {"x": x}, parameters={topics.PARAM_SEQ: seq})
    request = pb.ModelInferRequest(model_name="digits")
    encode_input(request, "x", x, encoding)
    request.parameters[topics.PARAM_SEQ].int64_param = seq
    return request


def test_mqtt_escalations_are_answered_by_the_forward_target(tmp_path: Path, models_dir: Path, digits_x: np.ndarray,
                                                            broker, serve) -> None:  # type: ignore[no-untyped-def]
    upstream = serve(models_dir, metrics_address=None)
    bridge = serve(tmp_path / "empty", grpc_address=None, forward=f"grpc://{upstream.grpc}",
                   mqtt=MqttConfig(url=broker.url, client_id="bridge-1"))
    x = digits_x[:3]

    async def main() -> None:
        async with open_transport(f"grpc://{upstream.grpc}/digits", device_id="cam-1") as direct:
            want = decode_outputs(await direct.escalate(_request(x, 1), timeout_s=10))["logits"]
        async with open_transport(f"{broker.url}/digits", device_id="cam-2", boot_id="boot-a") as device:
            first = await device.escalate(_request(x, 7), timeout_s=10)
            again = await device.escalate(_request(x, 7), timeout_s=10)  # a re-send: same device, boot, seq
            half = await device.escalate(_request(x, 8, "fp16+zstd"), timeout_s=10)
            np.testing.assert_allclose(decode_outputs(first)["logits"], want, rtol=1e-6)
            np.testing.assert_allclose(decode_outputs(again)["logits"], want, rtol=1e-6)
            assert get_parameters(again.parameters).get(topics.PARAM_CACHED) is True
            np.testing.assert_allclose(decode_outputs(half)["logits"], want, atol=0.05)
            with pytest.raises(EscalationError) as missing:
                await device.escalate(encode_request("nope", {"x": x}), timeout_s=10)
            assert missing.value.code == "NOT_FOUND"  # the upstream's own status, passed through
            with pytest.raises(EscalationError) as frame:
                await device.escalate(_request(np.zeros((1, 8, 8, 1), np.uint8), 9, "frame"), timeout_s=10)
            assert frame.value.code == "INVALID_ARGUMENT"

    asyncio.run(main())
    # the duplicate never reached the upstream: 1 direct + 2 forwarded (seq 7 once, seq 8)
    assert upstream.call(_served(upstream)) == 3
    text = bridge.metrics_text
    assert metric_value(text, "tierkit_requests_total", model="digits", protocol="mqtt") == 3
    assert metric_value(text, "tierkit_mqtt_duplicates_total") == 1


async def _served(server: ServerThread) -> int:
    return sum(m.stats.to_proto(m.name, m.version).inference_stats.success.count for m in server.service.repository)


def test_forward_target_down_answers_unavailable(tmp_path: Path, broker, serve) -> None:  # type: ignore[no-untyped-def]
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here
    serve(tmp_path / "empty", grpc_address=None, forward=f"grpc://127.0.0.1:{port}",
          mqtt=MqttConfig(url=broker.url, client_id="bridge-2"))

    async def main() -> None:
        async with open_transport(f"{broker.url}/digits", device_id="cam-3") as device:
            with pytest.raises(EscalationError) as down:
                await device.escalate(_request(np.zeros((1, 1, 8, 8), np.float32), 1), timeout_s=10)
            assert down.value.code == "UNAVAILABLE"

    asyncio.run(main())


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    return parser.parse_args(["serve", *argv])


def test_cli_forward_needs_mqtt_and_a_grpc_url() -> None:
    config = build_config(_args("--mqtt", "mqtt://127.0.0.1:1883", "--forward", "grpc://10.0.0.5:8001"), {})
    assert config.forward == "grpc://10.0.0.5:8001"
    assert config.grpc_address is None  # no local gRPC server unless asked for
    with pytest.raises(ConfigError, match="--mqtt"):
        build_config(_args("--forward", "grpc://10.0.0.5:8001"), {})
    with pytest.raises(ConfigError, match="--models"):
        build_config(_args("--mqtt", "mqtt://127.0.0.1:1883"), {})
    with pytest.raises(ConfigError, match="forward URL"):
        ServerConfig(models_dir=Path("."), forward="http://10.0.0.5:8001")
