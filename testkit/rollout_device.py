"""A device double for rollouts: speaks the issue-13 contract over a real Mosquitto, with scripted behaviour.

It follows the `release` of its retained desired document: downloads the archive from the fleet
(HTTP Basic with its MQTT credentials) and checks the digest, goes through the swap states
(publishing a reported document at every change), refuses a release whose golden check is scripted
to fail, soaks on it and commits. A desired document with `"rollback": true` naming the release in
its other slot flips back without a download. Every `window_s` it publishes a telemetry window with
the figures its running release is scripted to produce (`Behaviour`), tagged with the release.
"""

from __future__ import annotations

import base64
import hashlib
import json
import queue
import random
import tarfile
import threading
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from typing import Any

import paho.mqtt.client as paho
from paho.mqtt.enums import CallbackAPIVersion

from cloud_service.protocol.fleet_docs import DEFAULT_SOAK, UNSET, Soak, parse_desired
from edge_agent.fleet_sync import FleetIdentity


@dataclass(frozen=True)
class Behaviour:
    """What a release does on the device: golden check, escalation rate, p95, crashes."""

    golden_ok: bool = True
    escalation_rate: float = 0.15
    p95_ms: float = 10.0
    agreement: float = 0.96
    energy_mj: float = 2.0
    crashes_per_window: int = 0


HEALTHY = Behaviour()
GOLDEN_FAILS = Behaviour(golden_ok=False)
MORE_ESCALATIONS = Behaviour(escalation_rate=0.25)  # +10 points: a worse edge model
SLOW = Behaviour(p95_ms=30.0)  # 3x p95


@dataclass
class SimDevice:
    """One simulated device. `start()` connects and runs its loop in a thread; `stop()` goes offline."""

    ident: FleetIdentity
    host: str
    port: int
    running: str | None
    behaviours: dict[str, Behaviour] = field(default_factory=dict)
    rate_rps: float = 40.0
    window_s: float = 0.3
    download: bool = True
    ran: set[str] = field(default_factory=set)  # every release it ever activated
    flipped_back_at: float | None = None  # when it last ran a rollback (time.time())
    _client: Any = None
    _thread: threading.Thread | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _desired: queue.Queue[dict[str, Any]] = field(default_factory=queue.Queue)

    def __post_init__(self) -> None:
        self.slots: dict[str, Any] = {"A": self.running, "B": None, "active": "A" if self.running else None}
        self.swap: dict[str, Any] | None = None
        self.soak_target: Soak = DEFAULT_SOAK
        self.soaked_requests, self.soak_started = 0, 0.0
        self.crashes, self.seq, self.desired_version = 0, 0, None
        self.rng = random.Random(self.ident.device_id)

    @property
    def device_id(self) -> str:
        return self.ident.device_id

    def start(self) -> SimDevice:
        self._stop.clear()
        self.boot_id = uuid.uuid4().hex[:12]
        c = paho.Client(CallbackAPIVersion.VERSION2, client_id=self.ident.mqtt_username, protocol=paho.MQTTv5)
        c.username_pw_set(self.ident.mqtt_username, self.ident.mqtt_password)
        connected = threading.Event()

        def on_connect(client: paho.Client, _u: Any, _f: Any, rc: Any, _p: Any = None) -> None:
            if not rc.is_failure:
                client.subscribe(f"tierkit/v1/{self.device_id}/desired", qos=1)
                connected.set()

        c.on_connect = on_connect
        c.on_message = lambda _c, _u, m: self._desired.put(json.loads(m.payload)) if m.payload else None
        c.connect(self.host, self.port, keepalive=30)
        c.loop_start()
        if not connected.wait(10):
            c.loop_stop()
            c._reset_sockets()  # paho leaves its socket pair (and a late connection) to gc
            msg = f"{self.device_id} could not connect to the broker"
            raise RuntimeError(msg)
        self._client = c
        self._report()
        self._thread = threading.Thread(target=self._loop, name=f"sim-{self.device_id}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
            self._thread = None
        if self._client is not None:
            self._client.disconnect()
            self._client.loop_stop()
            self._client._reset_sockets()  # paho leaves its socket pair (and a late connection) to gc
            self._client = None

    # -- the loop ------------------------------------------------------------------------------

    def _loop(self) -> None:
        next_window = time.monotonic() + self.window_s
        while not self._stop.is_set():
            try:
                doc = self._desired.get(timeout=max(0.0, next_window - time.monotonic()))
                self._apply(doc)
            except queue.Empty:
                pass
            if time.monotonic() >= next_window:
                next_window += self.window_s
                self._window()

    def _behaviour(self) -> Behaviour:
        return self.behaviours.get(self.running or "", HEALTHY)

    def figures(self) -> dict[str, Any]:
        """The window's figures (what the running release is scripted to produce)."""
        b = self._behaviour()
        n = max(1, round(self.rate_rps * self.window_s))
        noise = self.rng.uniform(-0.01, 0.01)
        self.crashes += b.crashes_per_window
        return {"window_s": self.window_s, "requests": n, "p50_ms": b.p95_ms / 2, "p95_ms": b.p95_ms * (1 + noise),
                "escalation_rate": min(1.0, max(0.0, b.escalation_rate + noise)), "agreement": b.agreement,
                "energy_mj_per_request": b.energy_mj, "degraded": 0, "crashes": b.crashes_per_window}

    def _window(self) -> None:
        fig = self.figures()
        n = int(fig["requests"])
        self.seq += 1
        self._publish("telemetry", {
            "device": self.device_id, "boot_id": self.boot_id, "seq": self.seq, "ts": time.time(),
            "energy_label": "modeled:test", "variant": "fp32", "threshold": 0.8, **fig, "release": self.running})
        if self.swap and self.swap["state"] in ("active", "soaking"):
            self.soaked_requests += n
            self.swap["soak"] = {"requests": self.soaked_requests, "seconds": time.time() - self.soak_started}
            want = self.soak_target
            if ((want.requests is not None and self.soaked_requests >= want.requests)
                    or (want.seconds is not None and time.time() - self.soak_started >= want.seconds)):
                self._state("committed")
            elif self.swap["state"] == "active":
                self._state("soaking")

    def _apply(self, raw: dict[str, Any]) -> None:
        doc = parse_desired(raw)  # the agent's own parser: a document it would refuse fails here too
        self.desired_version = doc.version
        target = doc.release if doc.release is not UNSET else None
        if not target or target == self.running:
            self._report()
            return
        self.soak_target = doc.soak_or_default()
        other = "B" if self.slots["active"] == "A" else "A"
        if doc.rollback and self.slots.get(other) == target:  # an A/B pointer flip, no download
            self.slots["active"], self.running = other, target
            self.swap = {"state": "committed", "target": target, "since": time.time()}
            self.flipped_back_at = time.time()
            self._report()
            return
        self.swap = {"state": "downloading", "target": target, "since": time.time()}
        self._report()
        if self.download:
            self._fetch(target)
        for state in ("verifying", "staged", "golden"):
            self._state(state)
        if not self.behaviours.get(target, HEALTHY).golden_ok:
            self.swap.update(state="refused", error="golden inputs do not reproduce (max rel. error 0.31)")
            self.golden = {"ok": False, "max_rel_error": 0.31, "variant": "fp32"}
            self._report()
            return
        self.slots[other] = target
        self.slots["active"], self.running = other, target
        self.ran.add(target)
        self.soaked_requests, self.soak_started = 0, time.time()
        self._state("active")

    def _fetch(self, digest: str) -> None:
        auth = base64.b64encode(f"{self.ident.mqtt_username}:{self.ident.mqtt_password}".encode()).decode()
        req = urllib.request.Request(f"{self.ident.fleet_url}/v1/releases/{digest}/archive",
                                     headers={"Authorization": f"Basic {auth}"})
        with urllib.request.urlopen(req, timeout=30) as resp:
            data = resp.read()
        import io

        with tarfile.open(fileobj=io.BytesIO(data)) as tar:
            member = next(m for m in tar.getmembers() if m.name.endswith("release.json"))
            fh = tar.extractfile(member)
            assert fh is not None
            body = fh.read()
        got = "sha256:" + hashlib.sha256(body).hexdigest()
        if got != digest:
            msg = f"{self.device_id}: downloaded release is {got}, not {digest}"
            raise AssertionError(msg)

    def _state(self, state: str) -> None:
        assert self.swap is not None
        self.swap.update(state=state, since=time.time())
        self._report()

    def _report(self) -> None:
        golden = getattr(self, "golden", None) if self.swap and self.swap.get("state") == "refused" else (
            {"ok": True, "max_rel_error": 1e-6, "variant": "fp32"} if self.running else None)
        self._publish("reported", {
            "device": self.device_id, "boot_id": self.boot_id, "desired_version": self.desired_version,
            "release": self.running, "swap": self.swap, "slots": dict(self.slots), "golden": golden,
            "crashes": self.crashes, "variant": "fp32", "threshold": 0.8}, retain=True)

    def _publish(self, kind: str, doc: dict[str, Any], *, retain: bool = False) -> None:
        if self._client is not None:
            self._client.publish(f"tierkit/v1/{self.device_id}/{kind}", json.dumps(doc), qos=1, retain=retain)
