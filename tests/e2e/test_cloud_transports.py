"""The edge agent's own transports against the real cloud service: answers and refusals read alike on both."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from cloud_service.config import MqttConfig, ServerConfig
from cloud_service.protocol import decode_outputs, encode_request, get_parameters, topics
from compilers.package import ModelPackage
from edge_agent.transports import base as transports
from runtimes.errors import EscalationError
from testkit.cloud_helpers import ServerThread, make_package


async def _exchange(url: str, x: np.ndarray) -> tuple[np.ndarray, dict[str, object], list[BaseException]]:
    async with transports.open_transport(url, device_id="cam-5", boot_id="boot-9") as cloud:
        reply = await cloud.escalate(encode_request("", {"x": x}, parameters={topics.PARAM_SEQ: 3}), timeout_s=10)
        errors: list[BaseException] = []
        for request in (encode_request("nope", {"x": x}), encode_request("", {"x": x.astype(np.float64)})):
            try:
                await cloud.escalate(request, timeout_s=10)
            except EscalationError as exc:
                errors.append(exc)
        return decode_outputs(reply)["logits"], dict(get_parameters(reply.parameters)), errors


@pytest.mark.parametrize("kind", ["grpc", "mqtt"])
def test_edge_transports_get_answers_and_status_codes(kind: str, tmp_path: Path, digits_cnn_onnx: Path,
                                                      request: pytest.FixtureRequest) -> None:
    make_package(tmp_path / "models" / "digits", digits_cnn_onnx)
    if kind == "mqtt":
        broker = request.getfixturevalue("broker")
        config = ServerConfig(models_dir=tmp_path / "models", grpc_address=None, drain_timeout_s=2,
                              mqtt=MqttConfig(url=broker.url, client_id="cloud-e2e"))
        url = f"{broker.url}/digits"
    else:
        config = ServerConfig(models_dir=tmp_path / "models", grpc_address="127.0.0.1:0", drain_timeout_s=2)
    server = ServerThread(config)
    try:
        server.start()
        if kind == "grpc":
            url = f"grpc://{server.grpc}/digits"
        x = np.random.default_rng(1).random((2, 1, 8, 8), dtype=np.float32)
        logits, params, errors = asyncio.run(_exchange(url, x))
    finally:
        server.stop()
    with ModelPackage.open(tmp_path / "models" / "digits").open_session() as session:
        np.testing.assert_allclose(logits, session.run({"x": x})["logits"], rtol=1e-5, atol=1e-5)
    assert params[topics.PARAM_SEQ] == 3
    assert [getattr(e, "code", None) for e in errors] == ["NOT_FOUND", "INVALID_ARGUMENT"]
    assert "not served" in str(errors[0])
    assert "float64 given, float32 expected" in str(errors[1])
