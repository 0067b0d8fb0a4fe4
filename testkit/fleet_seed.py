"""A large fleet written straight into PostgreSQL (generate_series): devices, labels, reported and desired
documents, a day of telemetry windows, and the sums ingest keeps beside them (`telemetry_hourly`,
`telemetry_minutes`), aggregated from those windows the way `TelemetryStore.ingest` folds them.

Enrolling 10,000 devices signs 10,000 certificates and ingesting a day of their windows takes minutes; this
takes seconds, so the fleet view can be tested and measured at that scale.

Example:
    >>> token = seed(FleetStore.open(pg.url), FleetShape(devices=10_000, windows_per_hour=6), now=time.time())
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import sqlalchemy as sa

from cloud_service.fleet.registry import Registry
from cloud_service.fleet.store import FleetStore


@dataclass(frozen=True)
class FleetShape:
    """Args: devices: `dev-00000` ...; sites: the `site` label's values (`site0` ...; every fifth device is
    `kind=gateway`, the rest `kind=camera`); releases: devices report release `i % releases` (the last runs
    20 % slower); hours: of windows, up to now; windows_per_hour: per device (the agent's default 10 s
    interval is 360); offline_every / drift_every: every Nth device is offline (seen an hour ago) / reports
    an older desired version than it was sent (drift)."""

    devices: int = 10_000
    sites: int = 8
    releases: int = 3
    hours: int = 24
    windows_per_hour: int = 6
    offline_every: int = 20
    drift_every: int = 100


def release_digest(k: int) -> str:
    return "sha256:" + f"{k + 1:x}" * 64


def _devices(conn: sa.Connection, shape: FleetShape, now: float) -> None:
    p = {"n": shape.devices, "sites": shape.sites, "now": now, "off": shape.offline_every,
         "drift": shape.drift_every, "k": shape.releases}
    ids = "SELECT i, 'dev-' || lpad(i::text, 5, '0') AS id FROM generate_series(0, :n - 1) AS i"
    conn.execute(sa.text(
        "INSERT INTO devices (device_id, labels, hardware, agent_version, cert_serial, mqtt_password_hash, "
        "enrolled_at, last_seen, model_digest, variant, threshold) "
        f"SELECT id, json_build_object('site', 'site' || (i % :sites), 'kind', "
        "CASE WHEN i % 5 = 0 THEN 'gateway' ELSE 'camera' END)::text, '{}', '0.1.0', to_hex(i), '', "
        ":now - 86400, CASE WHEN i % :off = 0 THEN :now - 3600 ELSE :now - i % 60 END, "
        f"'sha256:' || repeat('ab', 32), 'int8', 0.8 FROM ({ids}) d"), p)
    conn.execute(sa.text(
        "INSERT INTO device_labels (key, value, device_id) "
        f"SELECT 'site', 'site' || (i % :sites), id FROM ({ids}) d UNION ALL "
        f"SELECT 'kind', CASE WHEN i % 5 = 0 THEN 'gateway' ELSE 'camera' END, id FROM ({ids}) d"), p)
    conn.execute(sa.text(
        "INSERT INTO desired_effective (device_id, version, document, since, published_version) "
        f"SELECT id, 2, '{{\"version\": 2}}', :now - 86400, 2 FROM ({ids}) d"), p)
    conn.execute(sa.text(
        "INSERT INTO reported (device_id, version, document, received_at) "
        "SELECT id, CASE WHEN i % :drift = 1 THEN 1 ELSE 2 END, "
        "json_build_object('version', CASE WHEN i % :drift = 1 THEN 1 ELSE 2 END, 'release', "
        "'sha256:' || repeat(to_hex(i % :k + 1), 64))::text, :now "
        f"FROM ({ids}) d"), p)


def _windows(conn: sa.Connection, shape: FleetShape, now: float) -> None:
    step = 3600.0 / shape.windows_per_hour
    slots = shape.hours * shape.windows_per_hour
    p = {"n": shape.devices, "slots": slots, "step": step, "start": now - slots * step, "k": shape.releases}
    conn.execute(sa.text(
        "INSERT INTO telemetry (device_id, boot_id, seq, device_ts, server_ts, skewed, window_s, requests, p50_ms, "
        "p95_ms, escalation_rate, agreement, energy_mj_per_request, energy_label, degraded, variant, threshold, "
        "bytes, document) "
        "SELECT id, 'seed', s, ts, ts, false, :step, req, p95 / 2, p95, esc, agr, energy, 'modeled:cpu', deg, 'int8', "
        "0.8, 300, json_build_object('device', id, 'boot_id', 'seed', 'seq', s, 'ts', ts, 'window_s', :step, "
        "'requests', req, 'p50_ms', p95 / 2, 'p95_ms', p95, 'escalation_rate', esc, 'agreement', agr, "
        "'energy_mj_per_request', energy, 'energy_label', 'modeled:cpu', 'degraded', deg, 'variant', 'int8', "
        "'threshold', 0.8, 'data_drift', i % 997 = 3 AND s = :slots - 1)::text "
        "FROM (SELECT i, s, 'dev-' || lpad(i::text, 5, '0') AS id, "
        "  :start + (s + 1) * :step - 1 - (i % 600) * :step / 600.0 AS ts, 40 + i % 90 AS req, "
        "  (4 + (i % 11) * 0.5 + ((s + i) % 5) * 0.75) * CASE WHEN i % :k = :k - 1 THEN 1.2 ELSE 1 END AS p95, "
        "  0.08 + 0.002 * (i % 60) + 0.02 * sin(s / 20.0) AS esc, 0.97 - 0.0006 * (i % 50) AS agr, "
        "  2.0 + 0.05 * (i % 9) AS energy, CASE WHEN (s + i) % 7 = 0 THEN 1 ELSE 0 END AS deg "
        "  FROM generate_series(0, :n - 1) AS i, generate_series(0, :slots - 1) AS s) w"), p)


def _sums(conn: sa.Connection) -> None:
    """The sums ingest keeps (`telemetry._hourly`, `telemetry._minutes`), from the windows just written."""
    weight = "CASE WHEN requests * escalation_rate <> 0 THEN requests * escalation_rate ELSE 1.0 END"
    conn.execute(sa.text(
        "INSERT INTO telemetry_hourly (device_id, hour, windows, requests, p95_sum, escalations, energy_mj, degraded, "
        "agreement_sum, agreement_weight) "
        "SELECT device_id, CAST(floor(server_ts / 3600) AS BIGINT) * 3600, count(*), sum(requests), sum(p95_ms), "
        "sum(requests * escalation_rate), sum(requests * energy_mj_per_request), sum(degraded), "
        f"coalesce(sum(agreement * {weight}), 0), coalesce(sum({weight}) FILTER (WHERE agreement IS NOT NULL), 0) "
        "FROM telemetry GROUP BY 1, 2"))
    conn.execute(sa.text(
        "INSERT INTO telemetry_minutes (minute, windows, requests, escalations, cloud_refused) "
        "SELECT CAST(floor(server_ts / 60) AS BIGINT) * 60, count(*), sum(requests), "
        "sum(requests * escalation_rate), 0 FROM telemetry GROUP BY 1"))


def touch(url: str, shape: FleetShape, *, now: float | None = None) -> None:
    """The devices heard from again as seeded (every `offline_every`th an hour ago, the others in the last
    minute), at `now`: a fleet seeded minutes earlier shows the same online count."""
    now = time.time() if now is None else now
    engine = sa.create_engine(url)
    try:
        with engine.begin() as conn:
            conn.execute(sa.text(
                "UPDATE devices SET last_seen = CASE WHEN CAST(substr(device_id, 5) AS INTEGER) % :off = 0 "
                "THEN :now - 3600 ELSE :now - CAST(substr(device_id, 5) AS INTEGER) % 60 END"),
                {"off": shape.offline_every, "now": now})
    finally:
        engine.dispose()


def seed(store: FleetStore, shape: FleetShape, *, now: float | None = None) -> str:
    """Write the fleet into an empty, migrated PostgreSQL store; returns a read-only operator token."""
    if store.dialect != "postgresql":
        msg = "fleet_seed writes with PostgreSQL's generate_series: give it a PostgreSQL store"
        raise ValueError(msg)
    now = time.time() if now is None else now
    with store.begin() as conn:
        _devices(conn, shape, now)
        _windows(conn, shape, now)
        _sums(conn)
    with store.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(sa.text("ANALYZE"))
    return Registry(store).create_operator_token("viewer", "read")
