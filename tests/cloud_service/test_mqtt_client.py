"""The one MQTT client layer: jittered reconnect waits, and a real connection that restores its
subscriptions after a broker restart and leaves no socket open once shut down."""

from __future__ import annotations

import random
import threading
from typing import Any

import paho.mqtt.client as paho
import pytest

from cloud_service import mqtt_client
from cloud_service.mqtt_client import RECENT_CAP_S, Reconnect, backoff_delay
from testkit.waiting import wait_for

pytestmark = pytest.mark.mqtt


class _Waits:
    """Stands in for paho's reconnect_delay_set: records the waits it is given."""

    def __init__(self) -> None:
        self.waits: list[float] = []

    def reconnect_delay_set(self, min_delay: float, max_delay: float) -> None:
        assert max_delay >= min_delay
        self.waits.append(min_delay)


def test_backoff_is_full_jitter_under_a_doubling_bound() -> None:
    rng = random.Random(0)
    for attempt in range(12):
        bound = min(30.0, 0.1 * 2**attempt)
        draws = [backoff_delay(attempt, base_s=0.1, cap_s=30.0, rng=rng) for _ in range(200)]
        assert all(0.0 <= d <= bound for d in draws)
        assert max(draws) > 0.7 * bound  # spread over the whole range, not pinned at its end
        assert min(draws) < 0.3 * bound


def test_reconnect_waits_are_capped_near_a_second_while_the_link_was_up_recently() -> None:
    never_up, was_up, client = Reconnect(rng=random.Random(1)), Reconnect(rng=random.Random(1)), _Waits()
    was_up.up()
    for _ in range(20):
        never_up.next_wait(client)  # type: ignore[arg-type]
    long_waits = client.waits[:]
    client.waits.clear()
    for _ in range(20):
        was_up.next_wait(client)  # type: ignore[arg-type]
    assert max(client.waits) <= RECENT_CAP_S
    assert max(long_waits) > 5 * RECENT_CAP_S  # past a few attempts the bound grows toward its 30 s cap


def test_a_client_restores_its_subscription_after_a_broker_restart_and_shuts_down_clean(broker: Any) -> None:
    got: list[bytes] = []
    granted = threading.Event()
    client = mqtt_client.new_client("layer-test")
    reconnect = Reconnect(base_s=0.05)

    def on_connect(c: paho.Client, _u: Any, _f: Any, reason: Any, _p: Any) -> None:
        if not reason.is_failure:
            mqtt_client.subscribe_all(c, ["tierkit/v1/layer-test/desired"])

    def on_subscribe(*_a: Any) -> None:
        reconnect.up()
        granted.set()

    client.on_connect, client.on_subscribe = on_connect, on_subscribe
    client.on_message = lambda _c, _u, m: got.append(m.payload)
    client.on_disconnect = lambda c, *_a: reconnect.next_wait(c)
    client.on_connect_fail = lambda c, _u: reconnect.next_wait(c)
    publisher = mqtt_client.new_client("layer-publisher")
    mqtt_client.start(client, broker.host, broker.port, keepalive_s=5, session_expiry_s=60)
    try:
        assert granted.wait(10)
        granted.clear()
        broker.restart()
        assert granted.wait(15), "the subscription was not restored after the broker came back"
        publisher.connect(broker.host, broker.port)
        publisher.loop_start()
        publisher.publish("tierkit/v1/layer-test/desired", b"after-restart", qos=1).wait_for_publish(5)
        wait_for("the message published after the restart", lambda: got == [b"after-restart"], timeout=10)
    finally:
        mqtt_client.shutdown(publisher)
        mqtt_client.shutdown(client, end_session=True)
    assert client.socket() is None
    assert client._sockpairR is None
    assert client._sockpairW is None
