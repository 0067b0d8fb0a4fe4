"""The MQTT transport through a real Mosquitto, with a responder playing the cloud."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import paho.mqtt.client as paho
import pytest
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from cloud_service.protocol import decode_inputs, encode_request, encode_response, get_parameters, topics
from cloud_service.protocol import inference_pb2 as pb
from edge_agent.transports import TransportOptions, open_transport
from edge_agent.transports.mqtt import ERROR_PROPERTY, STATUS_PROPERTY, MqttTransport, backoff_delay
from runtimes.errors import CloudTimeout, CloudUnavailable, EscalationError
from testkit.broker import Broker
from testkit.grpc_doubler import make_pki
from testkit.waiting import until

pytestmark = pytest.mark.mqtt

X = np.arange(64, dtype=np.float32).reshape(1, 1, 8, 8)
FAST = TransportOptions(reconnect_min_s=0.05, reconnect_max_s=0.5, connect_timeout_s=2.0)


class Responder:
    """A cloud stand-in: subscribes to every device's escalations and replies 2x (or an error status)."""

    def __init__(self, broker: Broker, *, status: str = "") -> None:
        self.status = status
        self.requests: list[pb.ModelInferRequest] = []
        self.subscribed = threading.Event()
        self.client = paho.Client(CallbackAPIVersion.VERSION2, client_id="responder", protocol=paho.MQTTv5)
        self.client.on_socket_open = lambda c, u, s: s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.client.on_connect = lambda c, u, f, rc, p: c.subscribe("tierkit/v1/+/escalate", qos=1)
        self.client.on_subscribe = lambda c, u, mid, rcs, p: self.subscribed.set()
        self.client.on_message = self.on_message
        self.client.connect(broker.host, broker.port)
        self.client.loop_start()
        assert self.subscribed.wait(5), "responder did not subscribe"

    def on_message(self, client: paho.Client, userdata: Any, message: paho.MQTTMessage) -> None:
        request = pb.ModelInferRequest.FromString(message.payload)
        self.requests.append(request)
        props = Properties(PacketTypes.PUBLISH)
        props.CorrelationData = message.properties.CorrelationData
        if self.status:
            props.UserProperty = [(STATUS_PROPERTY, self.status), (ERROR_PROPERTY, "model is not loaded")]
            payload = b""
        else:
            payload = encode_response(request.model_name, {"y": decode_inputs(request)["x"] * 2},
                                      request_id=request.id).SerializeToString()
        client.publish(message.properties.ResponseTopic, payload, qos=1, properties=props)

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()
        self.client._reset_sockets(sockpair_only=True)  # else paho leaves it to __del__ (ResourceWarning)


@pytest.fixture
def responder(broker: Broker) -> Iterator[Responder]:
    r = Responder(broker)
    yield r
    r.close()


def _url(broker: Broker) -> str:
    return f"mqtt://{broker.host}:{broker.port}/digits"


def test_round_trip(broker: Broker, responder: Responder) -> None:
    async def main() -> None:
        async with open_transport(_url(broker), device_id="cam-7", boot_id="b1", options=FAST) as cloud:
            assert isinstance(cloud, MqttTransport)
            assert cloud.connected
            results = await asyncio.gather(*(
                cloud.escalate(encode_request("", {"x": X + i}, request_id=str(i)), timeout_s=5.0) for i in range(8)))
        for i, response in enumerate(results):
            assert response.id == str(i)
            assert response.raw_output_contents[0] == ((X + i) * 2).tobytes()
        params = get_parameters(responder.requests[0].parameters)
        assert responder.requests[0].model_name == "digits"
        assert params[topics.PARAM_DEVICE] == "cam-7"
        assert abs(int(params[topics.PARAM_DEADLINE_MS]) - time.time() * 1000) < 10_000

    asyncio.run(main())


def test_error_reply_is_escalation_error_with_code(broker: Broker) -> None:
    responder = Responder(broker, status="NOT_FOUND")
    try:
        async def main() -> None:
            async with open_transport(_url(broker), device_id="cam-7", options=FAST) as cloud:
                with pytest.raises(EscalationError, match="not loaded") as info:
                    await cloud.escalate(encode_request("", {"x": X}), timeout_s=5.0)
            assert info.value.code == "NOT_FOUND"  # type: ignore[attr-defined]

        asyncio.run(main())
    finally:
        responder.close()


def test_timeout_when_no_responder(broker: Broker) -> None:
    async def main() -> float:
        async with open_transport(_url(broker), device_id="cam-7", options=FAST) as cloud:
            start = time.perf_counter()
            with pytest.raises(CloudTimeout, match="escalate"):
                await cloud.escalate(encode_request("", {"x": X}), timeout_s=0.2)
            return time.perf_counter() - start

    assert asyncio.run(main()) < 0.2 + 0.15


def test_tcp_nodelay_is_set(broker: Broker) -> None:
    async def main() -> None:
        async with open_transport(_url(broker), device_id="cam-7", options=FAST) as cloud:
            assert isinstance(cloud, MqttTransport)
            sock = cloud.socket()
            assert sock is not None
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0

    asyncio.run(main())


def test_broker_down_is_cloud_unavailable_at_once(tmp_path: Any) -> None:
    down = Broker(tmp_path / "down")  # never started: nothing listens on its port

    async def main() -> None:
        cloud = open_transport(_url(down), device_id="cam-7", options=FAST)
        async with cloud:
            start = time.perf_counter()
            with pytest.raises(CloudUnavailable, match=str(down.port)):
                await cloud.escalate(encode_request("", {"x": X}), timeout_s=5.0)
            elapsed = time.perf_counter() - start
            assert elapsed < 0.1, elapsed

    asyncio.run(main())


def test_reconnects_after_broker_restart(broker: Broker, responder: Responder) -> None:
    async def main() -> None:
        async with open_transport(_url(broker), device_id="cam-7", options=FAST) as cloud:
            assert isinstance(cloud, MqttTransport)
            await cloud.escalate(encode_request("", {"x": X}), timeout_s=5.0)
            await asyncio.to_thread(broker.stop)
            await until("the transport to see the broker gone", lambda: not cloud.connected, timeout=5)
            with pytest.raises(CloudUnavailable):
                await cloud.escalate(encode_request("", {"x": X}), timeout_s=1.0)
            await asyncio.to_thread(broker.start)
            assert await cloud.wait_connected(10.0), "no reconnect within 10 s"
            assert responder.subscribed.wait(5)

            async def answered() -> Any:  # the responder reconnects on its own (paho's loop), a moment later
                try:
                    return await cloud.escalate(encode_request("", {"x": X}), timeout_s=0.5)
                except (CloudTimeout, CloudUnavailable):
                    return None

            response = await until("a reply after the broker restart", answered, timeout=30, interval=0.1)
            assert response.raw_output_contents[0] == (X * 2).tobytes()

    asyncio.run(main())


def test_publish_waits_for_the_broker_ack(broker: Broker) -> None:
    async def main() -> None:
        async with open_transport(_url(broker), device_id="cam-7", options=FAST) as cloud:
            assert isinstance(cloud, MqttTransport)
            await cloud.publish(topics.telemetry_topic("cam-7"), b'{"latency_ms": 1.2}', qos=1)
            await cloud.publish(topics.telemetry_topic("cam-7"), b"{}", qos=0)

    asyncio.run(main())


def test_mutual_tls_with_server_name_override(tmp_path: Path) -> None:
    pki = make_pki(tmp_path / "pki")
    broker = Broker(tmp_path / "tls", extra_conf=(
        f"cafile {pki['ca']}\ncertfile {pki['server.crt']}\nkeyfile {pki['server.key']}\n"
        "require_certificate true\n"
        # mosquitto started as root drops to the mosquitto user, which cannot read pytest's private tmp dirs
        "user root\n")).start()
    url = f"mqtts://127.0.0.1:{broker.port}/digits"
    good = TransportOptions(ca_file=str(pki["ca"]), cert_file=str(pki["client.crt"]), key_file=str(pki["client.key"]),
                            server_name="cloud.test", connect_timeout_s=2.0, reconnect_min_s=0.05)
    no_cert = TransportOptions(ca_file=str(pki["ca"]), server_name="cloud.test", connect_timeout_s=2.0,
                               reconnect_min_s=0.05)

    async def main() -> None:
        async with open_transport(url, device_id="cam-7", options=good) as cloud:
            assert isinstance(cloud, MqttTransport)
            assert cloud.connected
            await cloud.publish(topics.telemetry_topic("cam-7"), b"{}", qos=1)
        async with open_transport(url, device_id="cam-8", options=no_cert) as cloud:
            with pytest.raises(CloudUnavailable):
                await cloud.escalate(encode_request("", {"x": X}), timeout_s=1.0)
        # without the override, 127.0.0.1 does not match the certificate's name
        unnamed = dataclasses.replace(good, server_name=None)
        async with open_transport(url, device_id="cam-9", options=unnamed) as cloud:
            with pytest.raises(CloudUnavailable):
                await cloud.escalate(encode_request("", {"x": X}), timeout_s=1.0)

    try:
        asyncio.run(main())
    finally:
        broker.stop()


def test_backoff_is_full_jitter_within_the_cap() -> None:
    rng = random.Random(7)
    for attempt in range(12):
        cap = min(2.0, 0.1 * 2**attempt)
        delays = [backoff_delay(attempt, base_s=0.1, cap_s=2.0, rng=rng) for _ in range(200)]
        assert all(0.0 <= d <= cap for d in delays)
        assert max(delays) > 0.8 * cap
        assert min(delays) < 0.2 * cap
    # seeded: reproducible, and different devices (seeds) do not line up
    assert backoff_delay(3, base_s=0.1, cap_s=2.0, rng=random.Random(1)) == \
        backoff_delay(3, base_s=0.1, cap_s=2.0, rng=random.Random(1))
    assert backoff_delay(3, base_s=0.1, cap_s=2.0, rng=random.Random(1)) != \
        backoff_delay(3, base_s=0.1, cap_s=2.0, rng=random.Random(2))
    assert backoff_delay(10_000, base_s=0.1, cap_s=2.0, rng=rng) <= 2.0
