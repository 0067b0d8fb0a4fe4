"""MQTT ingestion: telemetry and reported state in through a shared subscription, desired state out.

Every `tierkit fleet serve` process subscribes to `$share/{group}/tierkit/v1/+/telemetry` and
`.../reported`, so several processes on one database split the devices' messages between them
(the broker balances; there is no cluster code here). The connection is the one MQTT client layer's
(`cloud_service.mqtt_client`: jittered reconnect, subscriptions restored on every reconnection).
paho's network thread only queues messages;
a writer thread stores them in batches (one transaction each), so the database's speed, not one
round trip per window, bounds the ingest rate. While the database is locked or gone the batch is
kept and retried; nothing is acknowledged twice into the store (dedup on device, boot id, seq).

The effective desired document of each device is published retained, QoS 1, on
`tierkit/v1/{device}/desired` whenever its version changes:
`{"version": 12, "budget": {...}, "threshold": 0.7, "telemetry_interval_s": 60}`.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import paho.mqtt.client as paho

from cloud_service import mqtt_client
from cloud_service.fleet.desired import DesiredState
from cloud_service.fleet.errors import FleetError, StoreUnavailable
from cloud_service.fleet.registry import Registry
from cloud_service.fleet.telemetry import TelemetryStore
from cloud_service.mqtt_client import Reconnect
from cloud_service.protocol import topics
from cloud_service.protocol.fleet_docs import parse_reported
from cloud_service.security import MqttTls
from runtimes.errors import ConfigError

logger = logging.getLogger(__name__)
CONTROL_RESPONSE_TOPIC = "$CONTROL/dynamic-security/v1/response"


@dataclass(frozen=True)
class IngestOptions:
    """Args: host/port: the broker; group: the shared-subscription group all fleet processes use;
    username/password: the fleet's own broker account; tls: TLS to the broker (`mqtts://`);
    session_expiry_s: how long the broker queues for this client id while it is away;
    batch_max: windows per transaction;
    batch_wait_s: how long a batch waits to fill; queue_max: messages held while the store is slow."""

    host: str = "127.0.0.1"
    port: int = 1883
    group: str = "tierkit-fleet"
    client_id: str = ""
    username: str | None = None
    password: str | None = None
    tls: MqttTls | None = None
    session_expiry_s: int = 3600
    batch_max: int = 1000
    batch_wait_s: float = 0.05
    queue_max: int = 200_000


class MqttIngest:
    """Subscribe, batch, store; publish desired documents. `start()` / `stop()` (threads, like paho)."""

    def __init__(self, options: IngestOptions, registry: Registry, desired: DesiredState,
                 telemetry: TelemetryStore) -> None:
        self.options, self.registry, self.desired, self.telemetry = options, registry, desired, telemetry
        self.queue: queue.Queue[tuple[str, str, bytes, float]] = queue.Queue(options.queue_max)
        self.stats: Counter[str] = Counter()
        self.connected = threading.Event()
        self._stop = threading.Event()
        self.admin: Any = None  # a DynsecAdmin attached to this connection (`attach_admin`)
        client_id = options.client_id or f"tierkit-fleet-{socket.gethostname()}-{os.getpid()}"
        c = mqtt_client.new_client(client_id, username=options.username, password=options.password,
                                   tls=options.tls.context() if options.tls is not None else None, max_inflight=1000)
        c.on_connect, c.on_message, c.on_disconnect = self._on_connect, self._on_message, self._on_disconnect
        c.on_subscribe, c.on_connect_fail = self._on_subscribe, self._on_connect_fail
        self._reconnect = Reconnect()
        self._reconnect.next_wait(c)
        self.client = c
        self._writer = threading.Thread(target=self._write_loop, name="fleet-ingest", daemon=True)

    def attach_admin(self, admin: Any) -> None:
        """Carry the dynamic-security commands of `admin` (a DynsecAdmin) on this connection; before `start`."""
        self.admin = admin
        admin.attach(self.client, self.connected)

    def start(self) -> MqttIngest:
        # a persistent session: QoS 1 windows queue at the broker while this process restarts (same client id)
        mqtt_client.start(self.client, self.options.host, self.options.port, keepalive_s=30,
                          session_expiry_s=self.options.session_expiry_s)
        self._writer.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        mqtt_client.shutdown(self.client)
        self._writer.join(10)

    def _on_connect(self, client: paho.Client, _u: Any, _f: Any, rc: Any, _p: Any = None) -> None:
        if rc.is_failure:
            logger.warning("the broker refused the fleet's connection: %s", rc)
            return
        g = self.options.group
        subs = [f"$share/{g}/{topics.ROOT}/+/telemetry", f"$share/{g}/{topics.ROOT}/+/reported"]
        if self.admin is not None:
            subs.append(CONTROL_RESPONSE_TOPIC)
        mqtt_client.subscribe_all(client, subs)  # on every (re)connection
        self._reconnect.up()
        self.connected.set()

    def _on_subscribe(self, _c: Any, _u: Any, _mid: int, reasons: list[Any], _p: Any = None) -> None:
        refused = [str(r) for r in reasons if r.is_failure]
        if refused:
            self.stats["subscriptions_refused"] += len(refused)
            logger.error("the broker refused %d of the fleet's subscriptions (%s): nothing is ingested through them; "
                         "check the fleet account's role (tierkit broker init --fleet-group for --group %s)",
                         len(refused), ", ".join(refused), self.options.group)

    def _on_disconnect(self, client: paho.Client, *_a: Any) -> None:
        self.connected.clear()
        self._reconnect.next_wait(client)

    def _on_connect_fail(self, client: paho.Client, _u: Any) -> None:
        self._reconnect.next_wait(client)

    def _on_message(self, _c: Any, _u: Any, msg: paho.MQTTMessage) -> None:
        if msg.topic == CONTROL_RESPONSE_TOPIC:
            if self.admin is not None:
                self.admin.on_response(msg)
            return
        kind = msg.topic.rsplit("/", 1)[-1]
        try:
            device = topics.device_from_topic(msg.topic)
        except ValueError:
            self.stats["bad_topic"] += 1
            return
        try:
            self.queue.put_nowait((kind, device, bytes(msg.payload), time.time()))
        except queue.Full:
            self.stats["queue_full"] += 1

    # -- the writer thread ---------------------------------------------------------------------

    def _write_loop(self) -> None:
        pending: list[tuple[str, str, bytes, float]] = []
        while not self._stop.is_set() or not self.queue.empty() or pending:
            if not pending:
                pending = self._take()
                if not pending:
                    continue
            try:
                self._store(pending)
                pending = []
            except StoreUnavailable as exc:
                # keep the batch: dedup makes the retry safe even if the first attempt half-reached the server
                logger.warning("telemetry batch of %d kept for retry: %s", len(pending), exc)
                self.stats["store_retries"] += 1
                if self._stop.wait(0.5) and self.stats["store_retries"] > 20:
                    return
            except Exception:
                logger.exception("a telemetry batch could not be stored; it is dropped")
                self.stats["batch_errors"] += 1
                pending = []

    def _take(self) -> list[tuple[str, str, bytes, float]]:
        try:
            first = self.queue.get(timeout=0.2)
        except queue.Empty:
            return []
        batch = [first]
        deadline = time.monotonic() + self.options.batch_wait_s
        while len(batch) < self.options.batch_max:
            left = deadline - time.monotonic()
            try:
                batch.append(self.queue.get(timeout=max(left, 0)) if left > 0 else self.queue.get_nowait())
            except queue.Empty:
                break
        return batch

    def _store(self, batch: list[tuple[str, str, bytes, float]]) -> None:
        windows = [(device, payload, ts) for kind, device, payload, ts in batch if kind == "telemetry"]
        if windows:
            res = self.telemetry.ingest(windows)
            self.stats["stored"] += res.stored
            self.stats.update(res.dropped)
        for kind, device, payload, ts in batch:
            if kind == "reported" and payload:
                self._reported(device, payload, ts)

    def _reported(self, device: str, payload: bytes, ts: float) -> None:
        dropped: Counter[str] = Counter()
        try:
            report = parse_reported(payload)
            if report.device not in (None, device):
                dropped["impersonating"] += 1
            else:
                self.registry.check_active(device)
                self.desired.record_reported(device, report, now=ts)
                self.stats["reported"] += 1
        except ConfigError:
            dropped["malformed"] += 1
        except StoreUnavailable:
            raise
        except FleetError as exc:
            dropped["revoked" if "revoked" in str(exc) else "unknown"] += 1
        if dropped:
            self.stats.update(dropped)
            with self.telemetry.store.begin() as conn:
                self.telemetry.count_drops(conn, dropped)

    # -- desired -------------------------------------------------------------------------------

    def publish_desired(self) -> int:
        """Recompute effective documents; publish (retained) those whose version changed. Returns how many."""
        changed = self.desired.refresh(self.registry.devices(include_revoked=False))
        if not self.client.is_connected():
            return 0  # recorded but unpublished: offered again by the next refresh
        n = 0
        for device, version, doc in changed:
            info = self.client.publish(topics.desired_topic(device), json.dumps({"version": version, **doc}),
                                       qos=1, retain=True)
            info.wait_for_publish(5.0)
            if info.is_published():
                self.desired.mark_published(device, version)
                n += 1
        return n
