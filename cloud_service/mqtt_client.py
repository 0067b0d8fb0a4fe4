"""The one MQTT v5 client layer under every tierkit MQTT connection (paho-mqtt 2.x).

The agent's session (`edge_agent.transports.mqtt_session`), the cloud's bridge (`cloud_service.mqtt_bridge`),
the fleet's ingest (`cloud_service.fleet.ingest`) and its broker admin (`cloud_service.fleet.dynsec`) each
keep their own events (what "up" means, where messages go); the connection is made here, the same way
for all four:

- `new_client`: MQTT v5, credentials, TLS (an `ssl.SSLContext`), bounded in-flight and queued messages,
  and TCP_NODELAY on every socket: without it a QoS 1 round trip through Mosquitto takes ~88 ms (Nagle's
  algorithm against delayed ACKs) instead of ~1.4 ms.
- `start`: a persistent session (`clean_start=False`, a Session Expiry Interval), connected in paho's
  network thread; `subscribe_all` (called from `on_connect`) restores the subscriptions on every
  (re)connection.
- `Reconnect`: full-jitter exponential backoff between attempts, so a fleet that loses its broker does not
  come back in one synchronized storm. paho's own delay doubles without jitter; paho calls `on_disconnect`
  / `on_connect_fail` right before it waits, and `Reconnect.next_wait` sets that wait there. The cap is
  low (`RECENT_CAP_S`) within `RECENT_S` of the connection last being up: a broker restart or a dropped
  connection is over in about a second, not after a doubling wait.
- `shutdown`: disconnect (optionally ending the broker session), join paho's thread, and close the
  sockets paho leaves to the garbage collector (its wake-up pair, and a connection it completed while
  being stopped).

Both the agent and the cloud service use it, so it is, with the wire contract (`cloud_service.protocol`),
one of the two parts of `cloud_service` the agent may import. It is not part of the contract: the contract
stays free of any transport library, so a reader of documents and messages needs no MQTT client. It imports
paho, and nothing of tierkit.
"""

from __future__ import annotations

import logging
import math
import random
import socket
import ssl
import time
from collections.abc import Iterable
from typing import Any

import paho.mqtt.client as paho
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.subscribeoptions import SubscribeOptions

logger = logging.getLogger(__name__)

RECONNECT_BASE_S = 0.1  # the first reconnect waits up to this long; each further attempt doubles the bound
RECONNECT_CAP_S = 30.0  # the bound's cap while the connection has been down a while
RECENT_S = 60.0  # within this long of the connection last being up ...
RECENT_CAP_S = 1.0  # ... the cap is this: be back within about a second
CONNECT_TIMEOUT_S = 10.0  # how long a first connection may take before the caller gives up


def backoff_delay(attempt: int, *, base_s: float, cap_s: float, rng: random.Random) -> float:
    """Full-jitter exponential backoff: uniform in [0, min(cap_s, base_s * 2**attempt)]."""
    return rng.uniform(0.0, min(cap_s, base_s * 2.0 ** min(attempt, 62)))


class Reconnect:
    """paho's next reconnect wait: jittered, and capped at `RECENT_CAP_S` while the connection was up recently.

    Call `up()` when the connection becomes usable, `next_wait(client)` from `on_disconnect` and
    `on_connect_fail` (paho's thread: the two are never called at once).
    """

    def __init__(self, *, base_s: float = RECONNECT_BASE_S, cap_s: float = RECONNECT_CAP_S,
                 rng: random.Random | None = None) -> None:
        self.base_s, self.cap_s = base_s, cap_s
        self.attempt = 0
        self.last_up = -math.inf  # monotonic time the connection was last up
        self._rng = rng or random.Random()

    def up(self) -> None:
        self.attempt, self.last_up = 0, time.monotonic()

    def next_wait(self, client: paho.Client) -> float:
        cap = self.cap_s
        if time.monotonic() - self.last_up < RECENT_S:
            cap = min(cap, RECENT_CAP_S)
        delay = backoff_delay(self.attempt, base_s=self.base_s, cap_s=cap, rng=self._rng)
        self.attempt += 1
        # paho's next wait is `min_delay` (reconnect_delay_set resets its doubling); max_delay must be > 0
        client.reconnect_delay_set(min_delay=delay, max_delay=max(delay, 1e-3))  # type: ignore[arg-type]
        return delay


def set_nodelay(sock: Any) -> None:
    """TCP_NODELAY on a new MQTT socket (paho's `on_socket_open`); a warning where the socket has no TCP options."""
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except (OSError, AttributeError) as exc:  # a proxy or websocket wrapper may not expose it
        logger.warning("cannot set TCP_NODELAY on the MQTT socket (%s): replies may take ~40 ms more", exc)


def new_client(client_id: str, *, username: str | None = None, password: str | None = None,
               tls: ssl.SSLContext | None = None, manual_ack: bool = False,
               max_inflight: int | None = None, max_queued: int | None = None,
               connect_timeout_s: float | None = None) -> paho.Client:
    """A paho MQTT v5 client with credentials, TLS (when `tls` is given) and TCP_NODELAY on its sockets.

    Its callbacks are the caller's to set; one that replaces `on_socket_open` should call `set_nodelay`.
    """
    client = paho.Client(CallbackAPIVersion.VERSION2, client_id=client_id, protocol=paho.MQTTv5,
                         manual_ack=manual_ack)
    if connect_timeout_s is not None:
        client.connect_timeout = connect_timeout_s
    if max_inflight is not None:  # paho holds unacknowledged messages in memory only: bound them
        client.max_inflight_messages_set(max_inflight)
    if max_queued is not None:
        client.max_queued_messages_set(max_queued)
    if username is not None:
        client.username_pw_set(username, password)
    if tls is not None:
        client.tls_set_context(tls)
    client.on_socket_open = lambda _c, _u, sock: set_nodelay(sock)
    return client


def start(client: paho.Client, host: str, port: int, *, keepalive_s: float, session_expiry_s: int | None = None,
          receive_maximum: int | None = None) -> None:
    """Connect in paho's network thread (it reconnects by itself): a persistent session when
    `session_expiry_s` is given (`clean_start=False`), so the broker keeps subscriptions and QoS 1
    messages across reconnects."""
    props = Properties(PacketTypes.CONNECT)  # type: ignore[no-untyped-call]
    if session_expiry_s is not None:
        props.SessionExpiryInterval = session_expiry_s
    if receive_maximum is not None:
        props.ReceiveMaximum = receive_maximum
    client.connect_async(host, port, keepalive=round(keepalive_s), clean_start=session_expiry_s is None,
                         properties=props)
    client.loop_start()


def subscribe_all(client: paho.Client, topics: Iterable[str], *, no_local: bool = False) -> list[int | None]:
    """Subscribe each topic at QoS 1 (from `on_connect`, so every reconnection restores them); their mids."""
    return [client.subscribe(topic, options=SubscribeOptions(qos=1, noLocal=no_local))[1] for topic in topics]


def shutdown(client: paho.Client, *, end_session: bool = False) -> None:
    """Disconnect (ending the broker's session for this client id with `end_session`), join paho's thread
    (it may sleep up to a reconnect wait), and close the sockets paho leaves to the garbage collector.

    Blocking: from an event loop, run it with `asyncio.to_thread`.
    """
    props = None
    if end_session:
        props = Properties(PacketTypes.DISCONNECT)  # type: ignore[no-untyped-call]
        props.SessionExpiryInterval = 0
    try:
        client.disconnect(properties=props)
    finally:
        client.loop_stop()
        # paho closes its wake-up socket pair only in __del__, which the reference cycle through the callbacks
        # delays to a gc pass; and a connection it completed while its thread was stopping is never closed
        client._reset_sockets()
