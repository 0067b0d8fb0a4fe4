"""`tierkit serve --mqtt ... --forward grpc://...`: MQTT escalations answered by another Open Inference
Protocol server (here tierkit's own gRPC server on loopback), with the bridge's cache and metrics."""

from __future__ import annotations

import argparse
import asyncio
import socket
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from cloud_service.cli import add_parser, build_config
from cloud_service.config import MqttConfig, ServerConfig
from cloud_service.forward import ForwardBackend, UpstreamError
from cloud_service.protocol import decode_outputs, encode_request, get_parameters, topics
from cloud_service.protocol import inference_pb2 as pb
from cloud_service.protocol.encoding import encode_input
from edge_agent.transports import open_transport
from runtimes.errors import CloudTimeout, ConfigError, EscalationError
from testkit.cloud_helpers import ServerThread, metric_value
from testkit.upstream_double import SLOW_S, UpstreamDouble
from testkit.waiting import until


def _request(x: np.ndarray, seq: int, encoding: str = "") -> pb.ModelInferRequest:
    if not encoding:
        return encode_request("digits", {"x": x}, parameters={topics.PARAM_SEQ: seq})
    request = pb.ModelInferRequest(model_name="digits")
    encode_input(request, "x", x, encoding)
    request.parameters[topics.PARAM_SEQ].int64_param = seq
    return request


@pytest.mark.parametrize("mode", ["unary", "stream"])
def test_mqtt_escalations_are_answered_by_the_forward_target(tmp_path: Path, models_dir: Path, digits_x: np.ndarray,
                                                            broker, serve, mode: str) -> None:  # type: ignore[no-untyped-def]
    upstream = serve(models_dir, metrics_address=None)
    bridge = serve(tmp_path / "empty", grpc_address=None, forward=f"grpc://{upstream.grpc}", forward_mode=mode,
                   mqtt=MqttConfig(url=broker.url, client_id=f"bridge-{mode}"))
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
    assert (config.forward_mode, config.forward_streams) == ("unary", 1)
    streamed = build_config(_args("--mqtt", "mqtt://127.0.0.1:1883", "--forward", "grpc://10.0.0.5:8001",
                                  "--forward-mode", "stream", "--forward-streams", "4"), {})
    assert (streamed.forward_mode, streamed.forward_streams) == ("stream", 4)
    with pytest.raises(ConfigError, match="forward_streams"):
        ServerConfig(models_dir=Path("."), forward="grpc://10.0.0.5:8001", forward_mode="stream", forward_streams=0)
    with pytest.raises(ConfigError, match="--mqtt"):
        build_config(_args("--forward", "grpc://10.0.0.5:8001"), {})
    with pytest.raises(ConfigError, match="--models"):
        build_config(_args("--mqtt", "mqtt://127.0.0.1:1883"), {})
    with pytest.raises(ConfigError, match="forward URL"):
        ServerConfig(models_dir=Path("."), forward="http://10.0.0.5:8001")


# --- stream mode: requests over long-lived ModelStreamInfer streams ------------------------------------

@pytest.fixture
def double() -> Iterator[UpstreamDouble]:
    upstream = UpstreamDouble()
    yield upstream
    upstream.stop()


def _named(model: str, version: str, device_id: str = "") -> pb.ModelInferRequest:
    return pb.ModelInferRequest(model_name=model, model_version=version, id=device_id)


def test_stream_answers_are_matched_by_id_and_keep_the_devices_id(double: UpstreamDouble) -> None:
    async def main() -> list[pb.ModelInferResponse]:
        backend = ForwardBackend(double.url, max_message_bytes=1 << 20, mode="stream", streams=2)
        await backend.start()
        try:
            return await asyncio.gather(*(backend.infer(_named("m", str(i), f"dev-{i % 3}"), deadline=None)
                                          for i in range(40)))
        finally:
            await backend.aclose()

    answers = asyncio.run(main())
    assert [a.model_version for a in answers] == [str(i) for i in range(40)]  # each got its own answer
    assert [a.id for a in answers] == [f"dev-{i % 3}" for i in range(40)]  # the device's id, restored
    assert len(set(double.ids)) == 40  # the upstream saw an id per request, none of the devices'
    assert not set(double.ids) & {"dev-0", "dev-1", "dev-2"}


def test_stream_answers_overtaking_each_other_reach_their_own_requests() -> None:
    upstream = UpstreamDouble(ordered=False)  # "slow" is answered after the requests sent behind it

    async def main() -> list[pb.ModelInferResponse]:
        backend = ForwardBackend(upstream.url, max_message_bytes=1 << 20, mode="stream")
        await backend.start()
        try:
            return await asyncio.gather(backend.infer(_named("slow", "0"), deadline=None),
                                        *(backend.infer(_named("m", str(i)), deadline=None) for i in range(1, 6)))
        finally:
            await backend.aclose()

    try:
        answers = asyncio.run(main())
    finally:
        upstream.stop()
    assert [(a.model_name, a.model_version) for a in answers] == [("slow", "0")] + [("m", str(i)) for i in range(1, 6)]


def test_stream_deadline_and_error_fail_only_their_own_request(double: UpstreamDouble) -> None:
    async def main() -> None:
        backend = ForwardBackend(double.url, max_message_bytes=1 << 20, mode="stream")
        await backend.start()
        loop = asyncio.get_running_loop()
        try:
            started = loop.time()
            slow = loop.create_task(backend.infer(_named("slow", "1"), deadline=started + 0.1))
            failing = loop.create_task(backend.infer(_named("fail", "2"), deadline=None))
            fine = loop.create_task(backend.infer(_named("ok", "3", "cam"), deadline=None))
            with pytest.raises(CloudTimeout):
                await slow
            assert loop.time() - started < SLOW_S  # given up at its deadline, not when the answer came
            # the error on the stream names no request: it is the oldest waiting one's, and the unary
            # call asked again gives the upstream's status
            with pytest.raises(UpstreamError) as failed:
                await failing
            assert failed.value.grpc_status == "INVALID_ARGUMENT"
            answer = await fine
            assert (answer.model_version, answer.id) == ("3", "cam")  # the late "slow" answer was dropped
            again = await backend.infer(_named("ok", "4"), deadline=loop.time() + 5)
            assert again.model_version == "4"
            assert backend.streaming
        finally:
            await backend.aclose()

    asyncio.run(main())


def test_stream_mode_falls_back_to_unary_without_the_stream_rpc() -> None:
    upstream = UpstreamDouble(stream=False)

    async def main() -> None:
        backend = ForwardBackend(upstream.url, max_message_bytes=1 << 20, mode="stream")
        await backend.start()
        try:
            answers = await asyncio.gather(*(backend.infer(_named("m", str(i)), deadline=None) for i in range(5)))
            assert [a.model_version for a in answers] == [str(i) for i in range(5)]
            assert not backend.streaming
            assert (await backend.infer(_named("m", "9"), deadline=None)).model_version == "9"
        finally:
            await backend.aclose()

    try:
        asyncio.run(main())
    finally:
        upstream.stop()


def test_stream_forward_to_tierkit_serve_matches_direct_and_survives_a_restart(
        models_dir: Path, digits_x: np.ndarray, serve) -> None:  # type: ignore[no-untyped-def]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # a short drain: stopping waits for open streams (the backend's) that long
    upstream = serve(models_dir, grpc_address=f"127.0.0.1:{port}", metrics_address=None, drain_timeout_s=0.5)
    rows = [digits_x[i:i + 1] for i in range(8)]

    async def main() -> None:
        async with open_transport(f"grpc://{upstream.grpc}/digits", device_id="cam-1") as direct:
            want = [decode_outputs(await direct.escalate(_request(x, 1), timeout_s=10))["logits"] for x in rows]
        backend = ForwardBackend(f"grpc://127.0.0.1:{port}", max_message_bytes=1 << 20, mode="stream")
        await backend.start()
        try:
            got = await asyncio.gather(*(backend.infer(_request(x, i), deadline=None) for i, x in enumerate(rows)),
                                       backend.infer(encode_request("nope", {"x": rows[0]}), deadline=None),
                                       return_exceptions=True)
            for answer, expected in zip(got[:-1], want, strict=True):
                assert isinstance(answer, pb.ModelInferResponse), answer
                np.testing.assert_allclose(decode_outputs(answer)["logits"], expected, rtol=1e-6)
            assert isinstance(got[-1], UpstreamError)
            assert got[-1].grpc_status == "NOT_FOUND"
            upstream.stop()  # the stream breaks: requests fail UNAVAILABLE until the upstream is back
            with pytest.raises(UpstreamError) as down:
                await backend.infer(_request(rows[0], 1), deadline=None)
            assert down.value.grpc_status == "UNAVAILABLE"
            serve(models_dir, grpc_address=f"127.0.0.1:{port}", metrics_address=None)

            async def answered() -> pb.ModelInferResponse | None:
                try:
                    return await backend.infer(_request(rows[0], 1), deadline=None)
                except UpstreamError:
                    return None

            # the channel reconnects with backoff; a new stream opens for the next request
            answer = await until("an answer through the upstream that came back", answered, timeout=10, interval=0.2)
            np.testing.assert_allclose(decode_outputs(answer)["logits"], want[0], rtol=1e-6)
            assert backend.streaming
        finally:
            await backend.aclose()

    asyncio.run(main())


def test_an_upstream_refusal_passes_its_hint_on_and_holds_forwarding_back_until_it_passes() -> None:
    from cloud_service.errors import ServerBusy
    from cloud_service.forward import UpstreamError
    from testkit.upstream_double import BUSY_HINT_MS

    upstream = UpstreamDouble(stream=False)

    async def main() -> None:
        backend = ForwardBackend(upstream.url, max_message_bytes=1 << 20)
        await backend.start()
        try:
            with pytest.raises(UpstreamError) as refused:
                await backend.infer(_named("busy", "1"), deadline=None)
            assert refused.value.grpc_status == "RESOURCE_EXHAUSTED"
            assert refused.value.retry_after_ms == BUSY_HINT_MS
            with pytest.raises(ServerBusy) as held:  # refused here, at once: the upstream asked for a pause
                await backend.infer(_named("m", "2"), deadline=None)
            assert 0 < held.value.retry_after_ms <= BUSY_HINT_MS
            assert upstream.ids.count("") == 1  # the second never reached the upstream
            await asyncio.sleep(BUSY_HINT_MS / 1000 + 0.05)  # the pause the upstream asked for: what is tested
            assert (await backend.infer(_named("m", "3"), deadline=None)).model_version == "3"
        finally:
            await backend.aclose()

    try:
        asyncio.run(main())
    finally:
        upstream.stop()
