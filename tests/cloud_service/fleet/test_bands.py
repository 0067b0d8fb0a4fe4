"""The fleet view's percentile bands, stored per hour (on SQLite and PostgreSQL): the same percentiles as
computed directly from the windows sent, by fleet, label and release; computed once and then read; an hour
computed again when a window arrives late; at most MAX_GROUPS groups."""

from __future__ import annotations

import json
import time
from typing import Any

import numpy as np
import pytest
import sqlalchemy as sa

from cloud_service.fleet import bands
from cloud_service.fleet import schema as t
from cloud_service.fleet.errors import InvalidDocument
from cloud_service.fleet.registry import insert_devices
from cloud_service.fleet.store import FleetStore
from cloud_service.fleet.telemetry import TelemetryLimits, TelemetryStore
from testkit.windows import window_json

DEVICES, HOURS = 30, 3


def _window(i: int, h: int, ts: float, **over: Any) -> tuple[str, bytes, float]:
    fields: dict[str, Any] = {
        "window_s": 3600, "requests": 0 if i == 7 else 100 + 3 * i, "p95_ms": 5 + (i * 7 + h) % 11,
        "escalation_rate": 0.1 + 0.01 * (i % 9), "agreement": 0.9 + 0.003 * i if i % 4 else None,
        "energy_mj_per_request": 2.0 + 0.1 * (i % 5), "energy_label": "modeled", "degraded": i % 3,
        "variant": "int8", "threshold": 0.8}
    return f"d{i:02d}", window_json(f"d{i:02d}", h, ts=ts, **{**fields, **over}), ts


def _fill(store: FleetStore, now: float) -> TelemetryStore:
    with store.begin() as conn:
        insert_devices(conn, [
            {"device_id": f"d{i:02d}", "labels": json.dumps({"site": f"s{i % 3}"}), "hardware": "{}",
             "agent_version": "0.1.0", "cert_serial": f"{i:x}", "mqtt_password_hash": "", "enrolled_at": now,
             "last_seen": now, "model_digest": "", "variant": "int8", "threshold": 0.8} for i in range(DEVICES)])
        conn.execute(t.reported.insert(), [  # a third report no release: "none"; d29 never reported: "?"
            {"device_id": f"d{i:02d}", "version": None, "received_at": now,
             "document": json.dumps({"release": f"sha256:{i % 2 + 1}{0:063x}" if i % 3 else None})}
            for i in range(DEVICES - 1)])
    tel = TelemetryStore(store, TelemetryLimits(daily_bytes=10**9, max_skew_s=10**9))
    for h in range(HOURS):
        ts = (now // 3600 - HOURS + h) * 3600 + 60
        assert tel.ingest([_window(i, h, ts) for i in range(DEVICES)]).stored == DEVICES
    return tel


def _group(i: int, by: str) -> str:
    if by == "fleet":
        return "fleet"
    if by == "label:site":
        return f"site=s{i % 3}"
    return "?" if i == DEVICES - 1 else f"sha256:{i % 2 + 1}{0:063x}"[:23] if i % 3 else "none"


def _expected(by: str, h: int) -> dict[str, dict[str, Any]]:
    """Per group, the percentiles across devices of each device's figure, from the windows as sent."""
    per: dict[str, dict[str, list[float]]] = {}
    for i in range(DEVICES):
        n = 0 if i == 7 else 100 + 3 * i
        fig = {"p95_ms": 5 + (i * 7 + h) % 11, "escalation_rate": 0.1 + 0.01 * (i % 9) if n else None,
               "agreement": 0.9 + 0.003 * i if i % 4 else None,
               "energy_mj_per_request": 2.0 + 0.1 * (i % 5) if n else None,
               "degraded_share": (i % 3) / n if n else None}
        g = per.setdefault(_group(i, by), {f: [] for f in bands.FIGURES} | {"n": []})
        g["n"].append(1)
        for f, v in fig.items():
            if v is not None:
                g[f].append(v)
    return {name: {"devices": len(g["n"]), **{f: list(np.percentile(g[f], [50, 95])) if g[f] else None
                                              for f in bands.FIGURES}} for name, g in per.items()}


@pytest.mark.parametrize("by", ["fleet", "label:site", "release"])
def test_stored_bands_are_the_percentiles_across_devices_of_the_windows_sent(db_url: str, by: str) -> None:
    store = FleetStore.open(db_url)
    try:
        now = time.time()
        _fill(store, now)
        got = bands.bands(store, by=by, now=now)
    finally:
        store.close()
    assert len(got["groups"]) == {"fleet": 1, "label:site": 3, "release": 4}[by]
    for h in range(HOURS):
        for name, want in _expected(by, h).items():
            point = got["groups"][name]["series"][h]
            assert point["t"] == (now // 3600 - HOURS + h) * 3600
            assert point["devices"] == want["devices"], (name, h)
            for f in bands.FIGURES:
                assert (point[f] is None) == (want[f] is None), (name, f)
                if want[f] is not None:
                    assert point[f] == pytest.approx(want[f], rel=1e-6, abs=1e-9), (name, h, f)


def test_an_hour_is_computed_once_and_again_only_when_a_window_arrives_late(db_url: str) -> None:
    store = FleetStore.open(db_url)
    try:
        now = time.time()
        tel = _fill(store, now)
        first = bands.bands(store, by="label:site", now=now)
        assert len(bands.refresh(store, by="label:site", now=now)) == 0  # read: nothing computed again
        # the stored rows are what a read returns: the device-hours are not read again
        with store.begin() as conn:
            conn.execute(t.fleet_bands.update().where(t.fleet_bands.c.grouping == "label:site")
                         .values(devices=t.fleet_bands.c.devices + 1000))
        assert bands.bands(store, by="label:site", now=now)["groups"]["site=s0"]["devices"] == 1010
        # a late window for the first (closed) hour: that hour alone is computed again, at the next read
        hour0 = int((now // 3600 - HOURS) * 3600)
        assert tel.ingest([_window(0, 99, hour0 + 120, p95_ms=500.0)]).stored == 1
        assert bands.refresh(store, by="label:site", now=now) == [hour0]
        got = bands.bands(store, by="label:site", now=now)["groups"]["site=s0"]["series"]
        assert got[0]["devices"] == 10
        assert got[1]["devices"] == 1010
        assert got[0]["p95_ms"][1] > first["groups"]["site=s0"]["series"][0]["p95_ms"][1]
    finally:
        store.close()


def test_the_open_hour_is_recomputed_at_most_every_fresh_s(db_url: str) -> None:
    store = FleetStore.open(db_url)
    try:
        now = time.time()
        tel = _fill(store, now)
        assert bands.bands(store, now=now)
        open_hour = int(now // 3600 * 3600)
        assert tel.ingest([_window(i, 50, open_hour + 1) for i in range(5)]).stored == 5
        assert bands.refresh(store, now=open_hour + 2, fresh_s=60) == [open_hour]  # new hour: computed
        assert tel.ingest([_window(i, 51, open_hour + 3) for i in range(5, 9)]).stored == 4
        assert bands.refresh(store, now=open_hour + 30, fresh_s=60) == []  # fresh enough
        assert bands.refresh(store, now=open_hour + 70, fresh_s=60) == [open_hour]
        series = bands.bands(store, now=open_hour + 70)["groups"]["fleet"]["series"]
        assert series[-1]["t"] == open_hour
        assert series[-1]["devices"] == 9
    finally:
        store.close()


def test_groups_are_capped_and_a_bad_grouping_is_refused(tmp_path: Any) -> None:
    store = FleetStore.open(f"sqlite:///{tmp_path / 'fleet.db'}")
    try:
        now = time.time()
        n = bands.MAX_GROUPS + 10
        with store.begin() as conn:
            insert_devices(conn, [
                {"device_id": f"d{i:02d}", "labels": json.dumps({"serial": f"s{i}", "site": "a"}), "hardware": "{}",
                 "agent_version": "", "cert_serial": "", "mqtt_password_hash": "", "enrolled_at": now}
                for i in range(n)])
        tel = TelemetryStore(store, TelemetryLimits(daily_bytes=10**9, max_skew_s=10**9))
        assert tel.ingest([_window(i, 0, now) for i in range(n)]).stored == n
        got = bands.bands(store, by="label:serial", now=now)["groups"]
        assert len(got) == bands.MAX_GROUPS
        assert got[bands.OTHER]["devices"] == 11
        assert list(bands.bands(store, by="label:nosuch", now=now)["groups"]) == ["nosuch=?"]
        with pytest.raises(InvalidDocument, match="label:KEY"):
            bands.bands(store, by="site")
        with store.begin() as conn:
            assert conn.execute(sa.select(sa.func.count()).select_from(t.fleet_bands)
                                .where(t.fleet_bands.c.grouping == "label:site")).scalar_one() == 1
    finally:
        store.close()
