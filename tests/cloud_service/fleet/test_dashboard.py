"""The dashboard in Debian's headless Chromium (driven by Playwright), over a fleet with telemetry, drift and a
rollout whose canary failed its escalation gate.

Set TIERKIT_DASHBOARD_SCREENSHOT=PATH to keep the screenshot.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cloud_service.fleet.ca import FleetCA
from cloud_service.fleet.desired import DesiredState
from cloud_service.fleet.registry import Registry
from cloud_service.fleet.releases import ReleaseRegistry
from cloud_service.fleet.rollout_engine import RolloutEngine
from cloud_service.fleet.rollouts import Rollouts, make_options
from cloud_service.fleet.store import FleetStore
from cloud_service.fleet.telemetry import TelemetryLimits, TelemetryStore
from compilers.signing import generate_keypair, load_private_key, load_public_key
from edge_agent.fleet_sync import generate_key_and_csr
from testkit.chromium import CHROMIUM, FLAGS
from testkit.fleet_process import FleetProcess
from testkit.waiting import wait_for


def _populate(data: Path, now: float) -> tuple[str, list[str], str]:
    """Six devices on two sites, half an hour of windows each, one berlin device behind on desired state."""
    store = FleetStore.open(f"sqlite:///{data / 'fleet.db'}")
    try:
        reg = Registry(store, FleetCA.load_or_create(data))
        devices = []
        for i in range(6):
            site = "berlin" if i < 3 else "paris"
            tok = reg.create_token({"site": site, "kind": "cam"})
            devices.append(reg.enroll(tok, generate_key_and_csr()[1], hardware={"cpu": "x86"},
                                      agent_version="0.1.0").device_id)
        tel = TelemetryStore(store, TelemetryLimits(daily_bytes=10**9))
        batch = []
        for i, dev in enumerate(devices):
            for k in range(60):
                ts = now - 1800 + 30 * k
                doc = {"device": dev, "boot_id": "b", "seq": k, "ts": ts, "window_s": 30, "requests": 300,
                       "p95_ms": 8 + 3 * i + 2 * ((k + i) % 7), "escalation_rate": 0.1 + 0.02 * i,
                       "agreement": 0.97 - 0.015 * i - 0.01 * ((k + 2 * i) % 5), "energy_mj_per_request": 1.5 + 0.3 * i,
                       "energy_label": "modeled", "degraded": (k + i) % 4, "variant": "int8", "threshold": 0.8}
                batch.append((dev, json.dumps(doc).encode(), ts))
        assert tel.ingest(batch).stored == 360
        desired = DesiredState(store)
        version = desired.set_layer("site=berlin", {"threshold": 0.7})
        desired.refresh(reg.devices())
        for dev in devices[:2]:
            desired.record_reported(dev, {"desired_version": version, "model_digest": "sha256:0123456789abcdef",
                                          "variant": "int8", "threshold": 0.7}, now=now)
        for dev in devices[3:]:
            desired.record_reported(dev, {"model_digest": "sha256:0123456789abcdef", "variant": "int8",
                                          "threshold": 0.8}, now=now)
        _rollout(store, data, desired, tel, devices, now - 900, devices[2])
        admin = reg.create_operator_token("viewer", "read")
        return admin, devices, devices[2]
    finally:
        store.close()


def _rollout(store: FleetStore, data: Path, desired: DesiredState, tel: TelemetryStore, devices: list[str],
             t0: float, behind: str) -> None:
    """A rollout driven by an engine in-process: the canary escalates 10 points more than control; rolled back."""
    from testkit.rollout_harness import tiny_variant_set

    (data / "release-keys").mkdir()
    key, pub = generate_keypair(data / "release-keys" / "ops")
    releases = ReleaseRegistry(store, data, [load_public_key(pub)])
    variants = tiny_variant_set(data.parent / "model")
    digests = []
    for version in ("1", "2"):
        policy = data.parent / f"policy{version}.yaml"
        policy.write_text(f"version: '{version}'\nbudget: {{latency_ms: 40}}\n")
        digests.append(releases.create(variants, policy, sign_key=load_private_key(key))["digest"])
    first, second = digests
    def report(dev: str, **doc: object) -> None:  # what the device reported before, plus `doc`
        old = desired.reported(dev)
        desired.record_reported(dev, {**(old["document"] if old else {}), **doc})

    for dev in devices:
        report(dev, release=first)
    rid = Rollouts(store, releases).deploy(second, {"kind": "cam"}, make_options(
        waves="1,100%", soak="100", evidence={"bucket_s": 5.0}))
    engine = RolloutEngine(store, desired, releases, holder="dashboard-test")
    engine.step(now=t0)
    shown = Rollouts(store, releases).show(rid)
    canary = next(d["device_id"] for d in shown["device_list"] if d["state"] == "assigned")
    batch = []
    for k in range(12):
        ts = t0 + 5 * (k + 1)
        for i, dev in enumerate(devices):
            on = dev == canary
            # the canary escalates 11 points more than before; the others as before (each its own level)
            doc = {"device": dev, "boot_id": "r", "seq": k, "ts": ts, "window_s": 5, "requests": 100,
                   "p95_ms": 10 + i, "escalation_rate": 0.1 + 0.02 * i + (0.11 if on else 0) + 0.005 * (k % 3),
                   "agreement": 0.95,
                   "energy_mj_per_request": 2.0, "energy_label": "modeled", "degraded": 0, "variant": "int8",
                   "release": second if on else first, "crashes": 0}
            batch.append((dev, json.dumps(doc).encode(), ts))
    tel.ingest(batch)
    for step in (20, 35, 50):
        engine.step(now=t0 + step)
    report(canary, release=second, swap={"state": "committed", "target": second, "soak": {"requests": 400}})
    engine.step(now=t0 + 61)
    assert Rollouts(store, releases).get(rid)["state"] == "rolled_back"
    # the canary flipped back and reported it (unless it is the device the test keeps behind on purpose)
    desired.refresh(Registry(store).devices())
    if canary != behind:
        report(canary, release=first, desired_version=desired.effective_versions()[canary])


@pytest.fixture
def dashboard(tmp_path: Path) -> Iterator[tuple[FleetProcess, str, list[str], str]]:
    if not Path(CHROMIUM).exists():
        pytest.skip("chromium is not installed (make test installs it: apt-get install chromium)")
    pytest.importorskip("playwright.sync_api")
    data = tmp_path / "fleet-data"
    data.mkdir()
    token, devices, behind = _populate(data, time.time())
    proc = FleetProcess(data, None, "--drift-after", "1s").start()
    try:
        yield proc, token, devices, behind
    finally:
        proc.stop()


def test_dashboard_shows_devices_plots_and_drift(dashboard: tuple[FleetProcess, str, list[str], str],
                                                 tmp_path: Path) -> None:
    from playwright.sync_api import sync_playwright

    proc, token, devices, behind = dashboard
    wait_for("drift to be listed", lambda: proc.call("GET", "/v1/drift", token=token)[1], timeout=20)
    profile = tmp_path / "chromium-profile"
    with sync_playwright() as pw:
        ctx = pw.chromium.launch_persistent_context(str(profile), executable_path=CHROMIUM, headless=True,
                                                    args=FLAGS, viewport={"width": 1400, "height": 1300})
        try:
            page = ctx.new_page()
            page.goto(f"{proc.url}/#token={token}")
            page.wait_for_selector("body[data-loaded='1']", timeout=30_000)
            rows = page.locator("#devices tbody tr")
            assert rows.count() == 6
            assert sorted(rows.evaluate_all("rs => rs.map(r => r.dataset.device)")) == sorted(devices)
            assert page.locator("#n-devices").inner_text() == "6"
            assert page.locator("#n-drift").inner_text() == "1"
            row = page.locator(f"#devices tr[data-device='{behind}']")
            assert "drift" in row.inner_text()
            assert "site=berlin" in row.inner_text()
            assert page.locator("#drift tbody tr").count() == 1
            assert behind in page.locator("#drift tbody").inner_text()
            for metric in ("p95_ms", "escalation_rate", "agreement", "energy_mj_per_request", "degraded_share"):
                lines = page.locator(f".plot[data-metric='{metric}'] polyline.series")
                assert lines.count() == 2, metric  # the fleet's band: p50 and p95 across devices
                assert len((lines.first.get_attribute("points") or "").split()) >= 1  # an hour or two of windows
            polylines = "document.querySelectorAll(\".plot[data-metric='p95_ms'] polyline\").length"
            page.select_option("#group", "label:site")
            page.wait_for_function(f"{polylines} == 4")
            assert "site=berlin (3 devices)" in page.locator("#legend").inner_text()
            page.select_option("#group", "release")
            page.wait_for_function(f"{polylines} >= 2")
            page.fill("#filter", "site=paris")
            page.dispatch_event("#filter", "change")
            page.wait_for_function("document.getElementById('page-info').textContent.endsWith('of 3')")
            assert rows.count() == 3
            page.fill("#filter", "")
            page.dispatch_event("#filter", "change")
            page.wait_for_function("document.getElementById('page-info').textContent.endsWith('of 6')")
            page.wait_for_selector("body[data-rollouts='1']")  # drawn after the first paint
            rollout = page.locator("#rollouts tbody tr")
            assert rollout.count() == 1
            assert "rolled_back" in rollout.inner_text()
            assert page.locator("#rollout").get_attribute("data-state") == "rolled_back"
            waves = page.locator("#waves tbody tr")
            assert waves.count() == 2
            assert "failed" in waves.first.inner_text()
            gate = page.locator("#gates tr[data-gate='escalation_rate']")
            assert "FAIL" in gate.inner_text()
            estimate = float(gate.locator("td").nth(3).inner_text())
            assert 0.09 < estimate < 0.13  # the canary's change against control's: +11 points
            test_lines = page.locator(".plot[data-test-gate='escalation_rate'] polyline.series")
            # estimate, its confidence bounds, the pass-side bound, the margin and the threshold over time
            assert test_lines.count() == 6
            title = page.locator(".plot[data-test-gate='escalation_rate']").inner_text()
            assert "evidence" in title, title
            assert "planned" in title, title
            for metric in ("escalation_rate", "p95_ms"):
                lines = page.locator(f".plot[data-rollout-metric='{metric}'] polyline.series")
                assert lines.count() == 2, metric  # wave and control
                # one look or more: the gate fails as soon as the regression is clear
                assert len((lines.first.get_attribute("points") or "").split()) >= 1
            shot = tmp_path / "dashboard.png"
            page.screenshot(path=str(shot), full_page=True)
            assert shot.stat().st_size > 20_000
            keep = os.environ.get("TIERKIT_DASHBOARD_SCREENSHOT")
            if keep:
                shutil.copy(shot, keep)
            page.goto("about:blank")  # a hash-only change would not reload the page
            page.goto(f"{proc.url}/#token=wrong")
            page.wait_for_function("document.getElementById('error').textContent.length > 0", timeout=15_000)
            assert "not known" in page.locator("#error").inner_text()
        finally:
            ctx.close()
