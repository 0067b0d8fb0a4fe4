"""Device accounts on a Mosquitto that runs the dynamic-security plugin, kept by the fleet as it enrolls and revokes.

Enrolling a device creates its broker logins (username = device id with the password the fleet issued, and
`CN=<device id>` for its certificate on a `use_subject_as_username` listener) with a role of its own
(`cloud_service.identity.device_role`: its own telemetry, reported and escalate topics to write, its desired
and reply topics to read); revoking deletes them, and the plugin disconnects the device at once.
Commands go to `$CONTROL/dynamic-security/v1` over the fleet's own broker login (its role must allow that topic,
as `tierkit broker init` writes it); each command carries correlation data, so several fleet processes can
share the response topic. Inside `tierkit fleet serve` the commands travel on the ingest connection (`attach`):
the fleet's account has its client id pinned, so it holds one connection.

An enrollment whose broker account cannot be created fails (503) and leaves its token unused: the device
retries. A revocation the broker misses is caught up by `reconcile()`, which every fleet process runs
periodically: it deletes the broker clients of revoked devices.

Example:
    >>> admin = DynsecAdmin(DynsecOptions(host="broker", username="tierkit-fleet", password=pw))
    >>> admin.add_device("dev-1a2b", password)
    >>> admin.remove_device("dev-1a2b")
"""

from __future__ import annotations

import json
import os
import socket
import threading
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from cloud_service.fleet.errors import FleetError
from cloud_service.identity import CONTROL_TOPIC, device_from_username, dynsec_commands, remove_commands
from cloud_service.security import MqttTls

RESPONSE_TOPIC = CONTROL_TOPIC + "/response"
_ABSENT = ("not found",)  # "Client not found", "Role not found": already gone


class BrokerUnavailable(FleetError):
    """The broker did not carry out an account change (unreachable, or it refused the command)."""

    http_status = 503


@dataclass(frozen=True)
class DynsecOptions:
    """Args: host/port: the broker; username/password: the fleet's own broker login, whose role may publish to
    `$CONTROL/dynamic-security/v1`; client_id: default `tierkit-fleet-admin-HOST-PID`; timeout_s: per command."""

    host: str = "127.0.0.1"
    port: int = 1883
    username: str = "tierkit-fleet"
    password: str | None = None
    client_id: str = ""
    timeout_s: float = 5.0
    tls: MqttTls | None = None


class DynsecAdmin:
    """A paho connection that sends dynamic-security commands and waits for their answers (thread-safe)."""

    def __init__(self, options: DynsecOptions) -> None:
        self.options = options
        self._lock = threading.Lock()
        self._pending: dict[str, tuple[threading.Event, list[dict[str, Any]]]] = {}
        self._client: Any = None
        self._subscribed = threading.Event()
        self._shared: tuple[Any, threading.Event] | None = None

    def attach(self, client: Any, connected: threading.Event) -> None:
        """Send commands on `client` (a running paho client that subscribes to `RESPONSE_TOPIC` on every connect
        and hands its messages to `on_response`) instead of a connection of its own."""
        self.close()
        self._shared = (client, connected)

    def on_response(self, msg: Any) -> None:
        """A message on `RESPONSE_TOPIC` from an attached client."""
        self._on_message(None, None, msg)

    def _connect(self) -> Any:
        from cloud_service import mqtt_client  # paho, only where the admin connects on its own

        o = self.options
        c = mqtt_client.new_client(o.client_id or f"tierkit-fleet-admin-{socket.gethostname()}-{os.getpid()}",
                                   username=o.username, password=o.password,
                                   tls=o.tls.context() if o.tls is not None else None)
        c.on_connect = lambda cl, _u, _f, rc, _p=None: None if rc.is_failure else cl.subscribe(RESPONSE_TOPIC, qos=1)
        c.on_subscribe = lambda *_a: self._subscribed.set()
        c.on_message = self._on_message
        try:
            c.connect(o.host, o.port, keepalive=30)
        except OSError as exc:
            msg = f"the broker at {o.host}:{o.port} is unreachable for account changes ({exc})"
            raise BrokerUnavailable(msg) from None
        c.loop_start()
        if not self._subscribed.wait(o.timeout_s):
            mqtt_client.shutdown(c)
            msg = (f"the broker at {o.host}:{o.port} did not accept the fleet's admin login ({o.username!r}) or its "
                   f"subscription to {RESPONSE_TOPIC}; check the fleet's broker password and role")
            raise BrokerUnavailable(msg)
        return c

    def _on_message(self, _c: Any, _u: Any, msg: Any) -> None:
        try:
            responses = json.loads(msg.payload).get("responses", [])
        except (ValueError, AttributeError):
            return
        for r in responses:
            waiter = self._pending.get(str(r.get("correlationData", "")))
            if waiter is not None:
                waiter[1].append(r)
                waiter[0].set()

    def execute(self, commands: Iterable[dict[str, Any]], *, ignore: tuple[str, ...] = ()) -> list[dict[str, Any]]:
        """Send `commands` (one request) and return their responses; `BrokerUnavailable` when one failed with an
        error not containing any of `ignore`, or when no answer came in time."""
        cmds = [dict(c) for c in commands]
        tag = uuid.uuid4().hex
        for i, c in enumerate(cmds):
            c["correlationData"] = f"{tag}-{i}"
        with self._lock:
            if self._shared is not None:
                if not self._shared[1].is_set():
                    msg = (f"the broker at {self.options.host}:{self.options.port} is unreachable for account "
                           "changes (the fleet is not connected to it)")
                    raise BrokerUnavailable(msg)
                self._client = self._shared[0]
            elif self._client is None or not self._client.is_connected():
                self.close()
                self._subscribed.clear()
                self._client = self._connect()
            waiters: dict[str, tuple[threading.Event, list[dict[str, Any]]]] = {
                c["correlationData"]: (threading.Event(), []) for c in cmds}
            self._pending.update(waiters)
            try:
                info = self._client.publish(CONTROL_TOPIC, json.dumps({"commands": cmds}), qos=1)
                for key, (event, _got) in waiters.items():
                    if not event.wait(self.options.timeout_s):
                        msg = f"the broker did not answer the dynamic-security command {key.rsplit('-', 1)[-1]} in time"
                        raise BrokerUnavailable(msg)
                info.wait_for_publish(self.options.timeout_s)
            finally:
                for key in waiters:
                    self._pending.pop(key, None)
        out = [got[0] for _e, got in waiters.values()]
        for c, r in zip(cmds, out, strict=True):
            err = r.get("error")
            if err and not any(s in str(err) for s in ignore):
                msg = f"the broker refused {c['command']} for {c.get('username') or c.get('rolename')}: {err}"
                raise BrokerUnavailable(msg)
        return out

    def add_device(self, device: str, password: str) -> None:
        """Create the device's role, its password login (client id pinned to the device id, so no other login
        can take over its session) and its certificate login `CN=<device>`."""
        self.execute(dynsec_commands(device, password=password))

    def remove_device(self, device: str) -> None:
        """Delete the device's logins (the broker disconnects them at once) and its role; absent ones are fine."""
        self.execute(remove_commands(device), ignore=_ABSENT)

    def clients(self) -> list[str]:
        """Every client username the plugin holds."""
        (r,) = self.execute([{"command": "listClients", "verbose": False, "count": -1, "offset": 0}])
        return [str(u) for u in r.get("data", {}).get("clients", [])]

    def reconcile(self, revoked: set[str]) -> list[str]:
        """Delete the broker logins of revoked devices that are still there; returns those devices."""
        gone = sorted({d for d in map(device_from_username, self.clients()) if d is not None and d in revoked})
        for device in gone:
            self.remove_device(device)
        return gone

    def close(self) -> None:
        c, self._client = self._client, None
        if c is not None and self._shared is None:
            from cloud_service import mqtt_client

            mqtt_client.shutdown(c)
