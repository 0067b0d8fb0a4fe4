"""The fleet store on SQLite and on a real PostgreSQL: registry, enrollment, desired layering, drift, telemetry."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509

from cloud_service.fleet.ca import FleetCA
from cloud_service.fleet.desired import DesiredState
from cloud_service.fleet.errors import EnrollmentRefused, Forbidden, InvalidDocument, Unauthorized, UnknownDevice
from cloud_service.fleet.registry import Registry
from cloud_service.fleet.store import FleetStore
from cloud_service.fleet.telemetry import TelemetryLimits, TelemetryStore
from edge_agent.fleet_sync import generate_key_and_csr
from testkit.windows import window_json


@pytest.fixture
def registry(store: FleetStore, tmp_path: Path) -> Registry:
    return Registry(store, FleetCA.load_or_create(tmp_path / "ca"))


def _enroll(registry: Registry, labels: dict[str, str]) -> str:
    token = registry.create_token(labels)
    return registry.enroll(token, generate_key_and_csr()[1], hardware={"cpu": "x86"}, agent_version="0.1").device_id


def test_migrations_are_idempotent(db_url: str) -> None:
    FleetStore.open(db_url).close()
    s = FleetStore.open(db_url)  # a second process starting on the same database
    s.migrate()
    s.close()


def test_enrollment_issues_a_certificate_for_the_device_key(registry: Registry) -> None:
    token = registry.create_token({"site": "berlin", "kind": "cam"})
    _key, csr = generate_key_and_csr("whatever-the-device-says")
    got = registry.enroll(token, csr, hardware={"cpu": "avx512"}, agent_version="0.1.0")
    cert = x509.load_pem_x509_certificate(got.cert_pem.encode())
    ca = x509.load_pem_x509_certificate(got.ca_pem.encode())
    cert.verify_directly_issued_by(ca)
    assert cert.subject.rfc4514_string() == f"CN={got.device_id}"
    assert cert.public_key() == x509.load_pem_x509_csr(csr.encode()).public_key()
    dev = registry.device(got.device_id)
    assert dev["labels"] == {"site": "berlin", "kind": "cam"}
    assert dev["hardware"] == {"cpu": "avx512"}
    assert "mqtt_password_hash" not in dev


def test_tokens_are_one_time_and_expire(registry: Registry) -> None:
    token = registry.create_token({"site": "a"})
    registry.enroll(token, generate_key_and_csr()[1])
    with pytest.raises(EnrollmentRefused, match="already used"):
        registry.enroll(token, generate_key_and_csr()[1])
    expired = registry.create_token({}, expires_s=1)
    with pytest.raises(EnrollmentRefused, match="expired"):
        registry.enroll(expired, generate_key_and_csr()[1], now=time.time() + 5)
    with pytest.raises(EnrollmentRefused, match="unknown"):
        registry.enroll("tke_made_up", generate_key_and_csr()[1])
    fresh = registry.create_token({})
    with pytest.raises(EnrollmentRefused, match="not a PEM CSR"):
        registry.enroll(fresh, "garbage")
    registry.enroll(fresh, generate_key_and_csr()[1])  # a refused CSR did not burn the token
    assert len(registry.devices()) == 2


def test_racing_enrollments_with_one_token_give_one_device(registry: Registry) -> None:
    token = registry.create_token({})
    csrs = [generate_key_and_csr()[1] for _ in range(4)]
    results: list[str] = []

    def go(csr: str) -> None:
        try:
            results.append(registry.enroll(token, csr).device_id)
        except EnrollmentRefused:
            results.append("refused")

    threads = [threading.Thread(target=go, args=(c,)) for c in csrs]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    assert sorted(results).count("refused") == 3
    assert len(registry.devices()) == 1


def test_operator_tokens(registry: Registry) -> None:
    admin, ro = registry.create_operator_token("ops", "admin"), registry.create_operator_token("viewer", "read")
    assert registry.authorize(admin, write=True) == "ops"
    assert registry.authorize(ro, write=False) == "viewer"
    with pytest.raises(Forbidden, match="read-only"):
        registry.authorize(ro, write=True)
    with pytest.raises(Unauthorized):
        registry.authorize("tko_admin_forged", write=False)
    with pytest.raises(InvalidDocument, match="role"):
        registry.create_operator_token("x", "root")


def test_desired_layers_merge_by_priority(registry: Registry, store: FleetStore) -> None:
    berlin = _enroll(registry, {"site": "berlin", "kind": "cam"})
    paris = _enroll(registry, {"site": "paris", "kind": "cam"})
    state = DesiredState(store)
    v1 = state.set_layer("*", {"budget": {"latency_ms": 50}, "threshold": 0.9, "telemetry_interval_s": 60})
    v2 = state.set_layer("site=berlin", {"threshold": 0.7, "budget": {"energy_mj": 4}})
    v3 = state.set_layer(f"device={berlin}", {"telemetry_interval_s": 30})
    assert v1 < v2 < v3
    eb = state.effective(registry.device(berlin))
    assert eb is not None
    assert eb["document"] == {"budget": {"latency_ms": 50, "energy_mj": 4}, "threshold": 0.7,
                              "telemetry_interval_s": 30}
    assert eb["version"] == v3
    ep = state.effective(registry.device(paris))
    assert ep is not None
    assert ep["document"] == {"budget": {"latency_ms": 50}, "threshold": 0.9, "telemetry_interval_s": 60}
    assert ep["version"] == v1
    changed = state.refresh(registry.devices())
    assert {d for d, _v, _doc in changed} == {berlin, paris}
    assert len(state.refresh(registry.devices())) == 2  # not published yet: offered again
    for d, v, _doc in changed:
        state.mark_published(d, v)
    assert state.refresh(registry.devices()) == []  # nothing new: nothing to republish
    v4 = state.set_layer("kind=cam,site=berlin", {"threshold": 0.6})  # more specific label layer, same priority
    computed: list[str] = []
    effective = state.effective
    state.effective = lambda dev, layers=None: computed.append(dev["device_id"]) or effective(dev, layers)  # type: ignore[method-assign]
    assert [(d, v) for d, v, _ in state.refresh(registry.devices())] == [(berlin, v4)]
    assert computed == [berlin]  # only the device the new layer matches is recomputed
    assert state.refresh(registry.devices()) == [(berlin, v4, state.effective(registry.device(berlin))["document"])]
    del state.effective
    eb2 = state.effective(registry.device(berlin))
    assert eb2 is not None
    assert eb2["version"] == v4
    assert eb2["document"]["threshold"] == 0.6


@pytest.mark.parametrize(("doc", "problem"), [
    ({"threshold": 1.5}, "threshold"), ({"budget": {"latency_ms": -1}}, "budget.latency_ms"),
    ({"treshold": 0.5}, "treshold"), ({}, "non-empty"), ({"budget": {"latency": 3}}, "budget.latency")])
def test_invalid_desired_documents_are_refused(store: FleetStore, doc: dict[str, object], problem: str) -> None:
    state = DesiredState(store)
    with pytest.raises(InvalidDocument, match=problem):
        state.set_layer("*", doc)
    assert state.layers() == []


def test_reported_state_and_drift(registry: Registry, store: FleetStore) -> None:
    a, b = _enroll(registry, {"site": "x"}), _enroll(registry, {"site": "x"})
    state = DesiredState(store, drift_after_s=10)
    v = state.set_layer("site=x", {"threshold": 0.5})
    state.refresh(registry.devices())
    state.record_reported(a, {"desired_version": v, "model_digest": "sha256:abc", "variant": "int8",
                              "threshold": 0.5})
    assert state.drift() == []  # too recent to call drift
    late = state.drift(now=time.time() + 60)
    assert [d["device_id"] for d in late] == [b]
    assert late[0]["reported_version"] is None
    dev = registry.device(a)
    assert (dev["model_digest"], dev["variant"], dev["threshold"]) == ("sha256:abc", "int8", 0.5)
    registry.revoke(b)
    assert state.drift(now=time.time() + 60) == []
    with pytest.raises(UnknownDevice):
        registry.revoke("dev-nope")


def _window(device: str, seq: int, *, boot: str = "b1", ts: float | None = None, extra: dict[str, str] | None = None,
            **kw: Any) -> bytes:
    fields: dict[str, Any] = {"window_s": 10, "requests": 100, "p50_ms": 2.0, "p95_ms": 9.0 + seq,
                              "escalation_rate": 0.2, "agreement": 0.95, "energy_mj_per_request": 1.5,
                              "energy_label": "modeled", "degraded": 1, "variant": "int8", "threshold": 0.8}
    return window_json(device, seq, boot_id=boot, ts=ts, extra=extra, **{**fields, **kw})


def test_telemetry_dedup_drops_and_caps(registry: Registry, store: FleetStore) -> None:
    a, b = _enroll(registry, {}), _enroll(registry, {})
    revoked = _enroll(registry, {})
    registry.revoke(revoked)
    tel = TelemetryStore(store, TelemetryLimits(max_message_bytes=2000, daily_bytes=len(_window(a, 1)) * 5 + 10))
    now = time.time()
    batch = [(a, _window(a, i), now) for i in range(1, 4)]
    batch += [(a, _window(a, 1), now),                         # replayed window
              (a, b"{not json", now), (a, _window(a, 9, extra={"padding": "x" * 3000}), now),  # malformed, oversized
              (b, _window(a, 4), now),                         # b publishing a's window
              ("dev-ghost", _window("dev-ghost", 1), now), (revoked, _window(revoked, 1), now),
              (a, json.dumps({"device": a, "boot_id": "b1", "seq": -1, "ts": now}).encode(), now),
              (a, _window(a, 7, boot="b\x00"), now)]  # NUL: no database text column holds it
    res = tel.ingest(batch)
    assert res.stored == 3
    assert dict(res.dropped) == {"replayed": 1, "malformed": 3, "oversized": 1, "impersonating": 1,
                                 "unknown": 1, "revoked": 1}
    again = tel.ingest([(a, _window(a, i), now) for i in range(1, 4)])  # a whole redelivered batch
    assert again.stored == 0
    assert again.dropped["replayed"] == 3
    over = tel.ingest([(a, _window(a, i), now) for i in range(4, 8)])  # cap fits 5 windows a day
    assert over.stored == 2
    assert over.dropped["capped"] == 2
    usage = tel.usage(a)
    assert usage[0]["cut_windows"] == 2
    rows = tel.windows([a])
    assert usage[0]["bytes"] == sum(r["bytes"] for r in rows)
    assert [r["seq"] for r in rows] == [1, 2, 3, 4, 5]
    assert tel.windows([b]) == []
    drops = tel.drops()
    assert drops["replayed"] == 4
    assert drops["capped"] == 2
    assert registry.device(a)["last_seen"] == pytest.approx(now)
    # at the cap: a redelivered window is a replay (never counted against the cap), a new one is cut
    full = tel.ingest([(a, _window(a, 2), now), (a, _window(a, 8), now), (a, _window(a, 8), now)])
    assert (full.stored, dict(full.dropped)) == (0, {"replayed": 2, "capped": 1})
    assert tel.usage(a)[0]["cut_windows"] == 3
    assert [r["seq"] for r in tel.windows([a])] == [1, 2, 3, 4, 5]


def test_a_batch_crossing_the_cap_keeps_order_and_counts(registry: Registry, store: FleetStore) -> None:
    a, b = _enroll(registry, {}), _enroll(registry, {})

    def _w(device: str, seq: int) -> bytes:  # every window the same size
        return _window(device, seq, ts=float(int(time.time())))

    size = len(_w(a, 10))
    tel = TelemetryStore(store, TelemetryLimits(daily_bytes=size * 3))
    now = time.time() // 86400 * 86400 + 1000.0  # well inside one UTC day
    tel.ingest([(a, _w(a, 10), now)])
    # in one batch: a replay, two new windows that fit, a replay of one of them, two that the cap cuts,
    # and another device's windows that are not affected by a's cap
    res = tel.ingest([(a, _w(a, 10), now), (a, _w(a, 11), now), (b, _w(b, 10), now),
                      (a, _w(a, 12), now), (a, _w(a, 11), now), (a, _w(a, 13), now),
                      (a, _w(a, 14), now + 1), (b, _w(b, 11), now + 2)])
    assert res.stored == 4
    assert dict(res.dropped) == {"replayed": 2, "capped": 2}
    assert [r["seq"] for r in tel.windows([a])] == [10, 11, 12]
    assert [r["seq"] for r in tel.windows([b])] == [10, 11]
    (ua,), (ub,) = tel.usage(a), tel.usage(b)
    assert (ua["bytes"], ua["cut_windows"], ua["cut_bytes"]) == (size * 3, 2, size * 2)
    assert (ub["bytes"], ub["cut_windows"]) == (size * 2, 0)
    assert registry.device(a)["last_seen"] == pytest.approx(now)
    assert registry.device(b)["last_seen"] == pytest.approx(now + 2)
    # the cut windows were taken back out: sent again the next day they are new, not replays
    later = tel.ingest([(a, _w(a, 13), now + 86400)])
    assert (later.stored, dict(later.dropped)) == (1, {})


def test_clock_skew_is_flagged_and_both_clocks_kept(registry: Registry, store: FleetStore) -> None:
    a = _enroll(registry, {})
    tel = TelemetryStore(store, TelemetryLimits(max_skew_s=30))
    now = time.time()
    tel.ingest([(a, _window(a, 1, ts=now - 3600), now), (a, _window(a, 2, ts=now - 1), now)])
    rows = tel.windows([a])
    assert [(r["seq"], r["skewed"]) for r in rows] == [(1, True), (2, False)]
    assert rows[0]["device_ts"] == pytest.approx(now - 3600)
    assert rows[0]["server_ts"] == pytest.approx(now)


def test_retention_rolls_raw_windows_up_hourly(registry: Registry, store: FleetStore) -> None:
    a = _enroll(registry, {})
    tel = TelemetryStore(store, TelemetryLimits(retention_s=86400, daily_bytes=10**9, max_skew_s=10**9))
    hour = (time.time() // 3600 - 48) * 3600
    agreement = {1: 0.5, 2: None, 3: 0.9, 4: 0.7}
    old = [(a, _window(a, i, requests=10 * i, escalation_rate=0.1 * i, agreement=agreement[i]), hour + 60 * i)
           for i in range(1, 5)]
    tel.ingest([*old[:2], (a, _window(a, 99), time.time())])
    assert tel.roll_up() == 2
    tel.ingest(old[2:])  # late windows of the same hour fold into the existing row
    assert tel.roll_up() == 2
    assert tel.roll_up() == 0
    assert [r["seq"] for r in tel.windows([a])] == [99]
    (r,) = tel.rollups([a])
    assert r["hour"] == hour
    assert r["windows"] == 4
    assert r["requests"] == 100
    assert r["p95_ms_max"] == 13.0
    assert r["escalation_rate"] == pytest.approx(sum(0.1 * i * 10 * i for i in range(1, 5)) / 100)
    assert r["degraded"] == 4
    weights = {i: 10 * i * 0.1 * i for i in (1, 3, 4)}  # escalations per window: requests x rate
    assert r["agreement"] == pytest.approx(sum(agreement[i] * w for i, w in weights.items()) / sum(weights.values()))
