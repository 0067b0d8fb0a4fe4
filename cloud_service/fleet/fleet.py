"""`Fleet`: the registry, desired state and telemetry store over one database, as the API and CLI use them.

Example:
    >>> fleet = Fleet.open(FleetConfig(data_dir=Path("fleet-data")))
    >>> fleet.set_layer("site=berlin", {"threshold": 0.7})
    >>> fleet.devices({"site": "berlin"})
"""

from __future__ import annotations

import logging
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from cloud_service.fleet import schema as t
from cloud_service.fleet.ca import FleetCA
from cloud_service.fleet.desired import DesiredState
from cloud_service.fleet.dynsec import BrokerUnavailable, DynsecAdmin, DynsecOptions
from cloud_service.fleet.registry import Enrolled, Registry, write_file
from cloud_service.fleet.releases import ReleaseRegistry, configured_keys
from cloud_service.fleet.rollouts import Rollouts
from cloud_service.fleet.store import DEFAULT_DATA_DIR, FleetStore, default_url
from cloud_service.fleet.telemetry import TelemetryLimits, TelemetryStore

logger = logging.getLogger(__name__)
CLOUD_LOAD_S = 300.0  # the dashboard's cloud tiles: escalations and the cloud's refusals over the last 5 minutes


@dataclass(frozen=True)
class FleetConfig:
    """Args:
    data_dir: the CA, the SQLite database (unless `db_url`) and the broker password file live here.
    db_url: sqlite:///PATH or postgresql://USER@HOST/DB; default: SQLite (WAL) in `data_dir`.
    broker_passwd: a Mosquitto password file the fleet rewrites on every enrollment and revocation.
    broker_reload: a command run after rewriting it (e.g. `systemctl reload mosquitto`, or `kill -HUP PID`).
    broker_users: extra broker accounts written into that file (the fleet's own, bridges).
    crl_file: where to write the CA's revocation list (PEM) at start and after every revocation, for a broker's
        `crlfile` (then `broker_reload` runs); `GET /v1/ca/crl` serves the same list.
    dynsec: a broker with Mosquitto's dynamic-security plugin: each device's broker client is created at
        enrollment and deleted at revocation through `$CONTROL/dynamic-security/v1` (instead of a password file).
    drift_after_s: how long reported may differ from desired before the device is listed as drift.
    online_after_s: a device not heard from for longer is offline.
    limits: telemetry size, daily byte cap, clock skew and raw retention.
    release_keys: public keys releases must be signed with (besides DATA_DIR/release-keys/*.pub).
    cloud_capacity_rps: escalations/s the cloud tier sustains, for rollouts that give no figure of their own.
    """

    data_dir: Path = DEFAULT_DATA_DIR
    db_url: str | None = None
    broker_passwd: Path | None = None
    broker_reload: str | None = None
    broker_users: dict[str, str] = field(default_factory=dict)
    crl_file: Path | None = None
    dynsec: DynsecOptions | None = None
    drift_after_s: float = 300.0
    online_after_s: float = 120.0
    limits: TelemetryLimits = field(default_factory=TelemetryLimits)
    release_keys: tuple[Path, ...] = ()
    cloud_capacity_rps: float | None = None


class Fleet:
    """Everything the operator-facing surfaces need, over one `FleetStore`."""

    def __init__(self, config: FleetConfig, store: FleetStore) -> None:
        self.config, self.store = config, store
        self.ca = FleetCA.load_or_create(config.data_dir)
        self.registry = Registry(store, self.ca)
        self.desired = DesiredState(store, drift_after_s=config.drift_after_s)
        self.telemetry = TelemetryStore(store, config.limits)
        self.releases = ReleaseRegistry(store, config.data_dir, configured_keys(config.data_dir, config.release_keys))
        self.rollouts = Rollouts(store, self.releases)
        self.ingest: Any = None  # an MqttIngest once `tierkit fleet serve` connects one
        self.dynsec = DynsecAdmin(config.dynsec) if config.dynsec is not None else None
        self._crl: tuple[Any, str] = (None, "")
        self._sync_lock = threading.Lock()

    @classmethod
    def open(cls, config: FleetConfig) -> Fleet:
        return cls(config, FleetStore.open(config.db_url or default_url(config.data_dir)))

    def close(self) -> None:
        if self.dynsec is not None:
            self.dynsec.close()
        self.store.close()

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- registry ------------------------------------------------------------------------------

    def enroll(self, token: str, csr_pem: str, *, hardware: dict[str, Any], agent_version: str) -> Enrolled:
        got = self.registry.enroll(token, csr_pem, hardware=hardware, agent_version=agent_version,
                                   on_issue=self.dynsec.add_device if self.dynsec is not None else None)
        self.sync_broker()
        return got

    def revoke(self, device_id: str) -> None:
        self.registry.revoke(device_id)
        if self.dynsec is not None:
            try:
                self.dynsec.remove_device(device_id)  # the broker disconnects it now
            except BrokerUnavailable as exc:
                logger.warning("device %s is revoked; the broker will drop it at the next reconcile: %s",
                               device_id, exc)
        self.sync_broker()

    def crl_pem(self) -> str:
        """The CA's certificate revocation list (PEM): signed again when a revocation was added (by any fleet
        process: the list comes from the database) and every day, well before its nextUpdate."""
        revoked = sorted(self.registry.revoked_certificates())
        key = (tuple(revoked), int(time.time() // 86400))
        if self._crl[0] != key:
            self._crl = (key, self.ca.crl(revoked))
        return self._crl[1]

    def write_crl(self) -> bool:
        """Write the revocation list to `crl_file` (atomically) when configured and changed. Returns whether
        it was written."""
        path = self.config.crl_file
        if path is None:
            return False
        pem = self.crl_pem()
        if path.exists() and path.read_text() == pem:
            return False
        write_file(path, pem, mode=0o644)  # a CRL is public: the broker reads it
        return True

    def refresh_crl(self) -> None:
        """Periodic: a revocation made by another fleet process, or the daily re-signing, reaches `crl_file`
        (and the broker, through the reload command)."""
        if self.config.crl_file is not None and self.write_crl():
            self.sync_broker()

    def reconcile_broker(self) -> list[str]:
        """With dynamic security: delete the broker clients of revoked devices still there (a revocation the
        broker missed). Returns those removed."""
        if self.dynsec is None:
            return []
        revoked = {d["device_id"] for d in self.registry.devices() if d["revoked_at"] is not None}
        return self.dynsec.reconcile(revoked)

    def sync_broker(self) -> None:
        """Rewrite the broker password file (active devices only) and the CRL file, and run the reload command."""
        if self.config.broker_passwd is None and self.config.crl_file is None:
            return
        with self._sync_lock:  # one writer at a time: a file read from the database before another enrollment
            # committed must not replace one read after it (that device could not log in until the next rewrite)
            self._sync_broker()

    def _sync_broker(self) -> None:
        if self.config.broker_passwd is not None:
            self.registry.write_broker_passwords(self.config.broker_passwd, extra=self.config.broker_users)
        self.write_crl()
        if self.config.broker_reload:
            done = subprocess.run(self.config.broker_reload, shell=True, capture_output=True, timeout=30, check=False)
            if done.returncode:
                logger.warning("broker reload %r failed (%d): %s", self.config.broker_reload, done.returncode,
                               done.stderr.decode(errors="replace")[:300])

    def devices(self, labels: dict[str, str] | None = None) -> list[dict[str, Any]]:
        now = time.time()
        out = self.registry.devices(labels)
        reported = self.desired.reported_versions()
        drift = {d["device_id"] for d in self.desired.drift(now=now)}
        desired = self.desired.effective_versions()
        data_drift = self.telemetry.data_drift()
        for d in out:
            seen = d["last_seen"]
            d["online"] = d["revoked_at"] is None and seen is not None and now - seen <= self.config.online_after_s
            d["reported_version"] = reported.get(d["device_id"])
            d["desired_version"] = desired.get(d["device_id"])
            d["drift"] = d["device_id"] in drift
            d["data_drift"] = data_drift.get(d["device_id"], False)  # its inputs changed (edge_agent.drift)
        return out

    def show(self, device_id: str) -> dict[str, Any]:
        dev = self.registry.device(device_id)
        return {"device": dev, "desired": self.desired.effective(dev), "reported": self.desired.reported(device_id),
                "usage": self.telemetry.usage(device_id),
                "recent": self.telemetry.windows([device_id], since=time.time() - 3600)[-20:]}

    # -- desired -------------------------------------------------------------------------------

    def set_layer(self, selector: str, document: Any, *, priority: int | None = None) -> int:
        version = self.desired.set_layer(selector, document, priority=priority)
        if self.ingest is not None:
            self.ingest.publish_desired()
        return version

    # -- telemetry -----------------------------------------------------------------------------

    def telemetry_query(self, *, device: str | None = None, labels: dict[str, str] | None = None,
                        since: float = 0.0, until: float | None = None, limit: int = 5000) -> dict[str, Any]:
        """Raw windows and hourly roll-ups for one device, or the devices carrying `labels` (None: all)."""
        devices: list[str] | None = None
        if device is not None:
            devices = [device]
        elif labels:
            devices = [d["device_id"] for d in self.registry.devices(labels)]
        return {"windows": self.telemetry.windows(devices, since=since, until=until or float("inf"), limit=limit),
                "rollups": self.telemetry.rollups(devices, since=since)}

    def stats(self) -> dict[str, Any]:
        """Counts by SQL (a 10,000-device fleet is not listed to count it)."""
        d = t.devices.c
        live = d.revoked_at.is_(None)
        with self.store.begin() as conn:
            total, revoked, online = conn.execute(sa.select(
                sa.func.count(), sa.func.count(d.revoked_at),
                sa.func.count().filter(live, d.last_seen >= time.time() - self.config.online_after_s))).one()
        return {"devices": int(total), "online": int(online), "revoked": int(revoked),
                "drift": self.desired.drift_count(), "dropped": self.telemetry.drops(),
                "cloud": self.telemetry.cloud_load(since=time.time() - CLOUD_LOAD_S),
                "ingest": dict(self.ingest.stats) if self.ingest is not None else {},
                "mqtt_connected": bool(self.ingest is not None and self.ingest.connected.is_set())}
