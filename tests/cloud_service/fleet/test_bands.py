"""The fleet view's percentile bands: on PostgreSQL computed in the database (percentile_cont over the hourly
sums), elsewhere in numpy; both give the same bands, by fleet, by label and by release."""

from __future__ import annotations

import json
import time

import pytest

from cloud_service.fleet import schema as t
from cloud_service.fleet import view
from cloud_service.fleet.store import FleetStore
from cloud_service.fleet.telemetry import TelemetryLimits, TelemetryStore

DEVICES, HOURS = 30, 3


def _fill(store: FleetStore, now: float) -> None:
    with store.begin() as conn:
        conn.execute(t.devices.insert(), [
            {"device_id": f"d{i:02d}", "labels": json.dumps({"site": f"s{i % 3}"}), "hardware": "{}",
             "agent_version": "0.1.0", "cert_serial": f"{i:x}", "mqtt_password_hash": "", "enrolled_at": now,
             "last_seen": now, "model_digest": "", "variant": "int8", "threshold": 0.8} for i in range(DEVICES)])
        conn.execute(t.reported.insert(), [  # a third report no release: "none"; d29 never reported: "?"
            {"device_id": f"d{i:02d}", "version": None, "received_at": now,
             "document": json.dumps({"release": f"sha256:{i % 2 + 1}{0:063x}" if i % 3 else None})}
            for i in range(DEVICES - 1)])
    tel = TelemetryStore(store, TelemetryLimits(daily_bytes=10**9, max_skew_s=10**9))
    for h in range(HOURS):
        ts = now - (HOURS - h) * 3600 + 60
        batch = [(f"d{i:02d}", json.dumps({
            "device": f"d{i:02d}", "boot_id": "b", "seq": h, "ts": ts, "window_s": 3600,
            "requests": 0 if i == 7 else 100 + 3 * i, "p95_ms": 5 + (i * 7 + h) % 11,
            "escalation_rate": 0.1 + 0.01 * (i % 9), **({"agreement": 0.9 + 0.003 * i} if i % 4 else {}),
            "energy_mj_per_request": 2.0 + 0.1 * (i % 5), "energy_label": "modeled", "degraded": i % 3,
            "variant": "int8", "threshold": 0.8}).encode(), ts) for i in range(DEVICES)]
        assert tel.ingest(batch).stored == DEVICES


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
@pytest.mark.parametrize("by", ["fleet", "label:site", "release"])
def test_bands_in_the_database_match_numpy(db_url: str, by: str) -> None:
    store = FleetStore.open(db_url)
    try:
        now = time.time()
        _fill(store, now)
        since = int((now - 24 * 3600) // 3600 * 3600)
        got = view.bands(store, by=by, now=now)
        with store.begin() as conn:
            want = view._bands_numpy(conn, by, since)
    finally:
        store.close()
    assert sorted(got["groups"]) == sorted(want["groups"])
    assert len(got["groups"]) == {"fleet": 1, "label:site": 3, "release": 4}[by]
    for name, body in want["groups"].items():
        mine = got["groups"][name]
        assert mine["devices"] == body["devices"]
        assert [p["t"] for p in mine["series"]] == [p["t"] for p in body["series"]]
        for a, b in zip(mine["series"], body["series"], strict=True):
            for figure in view.FIGURES:
                assert (a[figure] is None) == (b[figure] is None), (name, figure)
                if b[figure] is not None:
                    assert a[figure] == pytest.approx(b[figure], rel=1e-6, abs=1e-9), (name, figure)
