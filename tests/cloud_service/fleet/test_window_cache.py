"""The rollout engine's window cache against the database it caches (SQLite and PostgreSQL): every read returns
what a fresh query returns, a window committed after a read with an earlier `server_ts` included."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from cloud_service.fleet.store import FleetStore
from cloud_service.fleet.telemetry import TelemetryStore
from cloud_service.fleet.window_cache import SETTLE_S, WindowCache
from testkit.rollout_harness import two_releases

T0 = 1_800_000_000.0


def _window(device: str, seq: int, ts: float, release: str) -> tuple[str, bytes, float]:
    doc = {"device": device, "boot_id": "b", "seq": seq, "ts": ts, "window_s": 1.0, "requests": 10 + seq % 7,
           "edge": 8, "cloud": 2, "compared": 2, "escalation_rate": 0.2, "agreement": 0.9, "p95_ms": 5.0,
           "p50_ms": 2.0, "energy_mj_per_request": 2.0, "release": release, "audited": 1, "audit_agreement": 1.0}
    return device, json.dumps(doc).encode(), ts


def _key(w: dict[str, Any]) -> tuple[Any, ...]:
    return (w["device_id"], w["server_ts"], w["requests"], w["release"], w["compared"], w.get("audits"))


def test_each_read_returns_what_a_fresh_query_returns_late_commits_included(store: FleetStore,
                                                                            tmp_path: Path) -> None:
    f = two_releases(store, tmp_path, 3)
    tel, devices = TelemetryStore(store), f.devices
    cache = WindowCache(store)
    seq, now = 0, T0
    for step in range(40):
        now += 1.0
        seq += 1
        batch = [_window(d, seq, now, f.first if step < 20 else f.second) for d in devices]
        if step % 9 == 4:  # a window stamped seconds ago, committed only now (its batch was slow)
            seq += 1
            batch.append(_window(devices[0], seq, now - SETTLE_S / 2, f.first))
        assert tel.ingest(batch).stored == len(batch)
        asked = devices[:2] if step % 5 else devices  # the third device now and then only
        since = now - 30 if step < 30 else now - 60  # an earlier `since` than held: read whole again
        got = cache.windows(asked, since, now=now)
        fresh = WindowCache(store).windows(asked, since, now=now)
        assert sorted(map(_key, got)) == sorted(map(_key, fresh)), step
        assert len({id(w) for w in got}) == len(got)
        cache.end_step()
    held = {id(w) for w in cache.windows(devices[:2], now - 60, now=now)}
    assert held == {id(w) for w in cache.windows(devices[:2], now - 60, now=now)}  # one dict a window, kept


def test_a_step_drops_what_it_did_not_read_and_the_memo_with_it(store: FleetStore, tmp_path: Path) -> None:
    from cloud_service.fleet.gates import SPECS

    f = two_releases(store, tmp_path, 2)
    tel = TelemetryStore(store)
    for s in range(1, 21):
        tel.ingest([_window(d, s, T0 + s, f.first) for d in f.devices])
    cache = WindowCache(store)
    now = T0 + 20
    both = cache.windows(f.devices, T0, now=now)
    assert len(both) == 40
    cache.memo.obs(SPECS[0], both)
    cache.end_step()
    one = cache.windows(f.devices[:1], T0 + 10, now=now)  # the other device not asked, the first's start later
    cache.end_step()
    assert len(one) == 11
    assert cache.memo.obs(SPECS[0], one)  # still there for the windows held ...
    memo = cache.memo._by_gate[SPECS[0].name]
    assert set(memo) == {id(w) for w in one}  # ... and only for them


def test_an_engine_clock_ahead_of_the_fleet_s_stamps_still_reads_a_late_commit(store: FleetStore,
                                                                              tmp_path: Path) -> None:
    """The mark follows the windows' own stamps: an engine process whose clock runs two minutes ahead of the
    ingesting one's still reads a window stamped before the newest one and committed after the last read."""
    f = two_releases(store, tmp_path, 1)
    tel, device = TelemetryStore(store), f.devices[0]
    tel.ingest([_window(device, s, T0 + s, f.first) for s in range(1, 11)])
    cache = WindowCache(store)
    ahead = T0 + 10 + 120
    assert len(cache.windows([device], T0, now=ahead)) == 10
    cache.end_step()
    tel.ingest([_window(device, 11, T0 + 5.5, f.first)])  # stamped 4.5 s before the newest, committed now
    got = cache.windows([device], T0, now=ahead)
    assert sorted(w["server_ts"] for w in got) == sorted([T0 + s for s in range(1, 11)] + [T0 + 5.5])
