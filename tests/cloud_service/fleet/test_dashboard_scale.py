"""The fleet view over 10,000 devices and a day of windows on PostgreSQL, in headless Chromium: percentile
bands and one page of devices, aggregated server-side (the hourly sums filled at ingest), first paint timed.

Set TIERKIT_DASHBOARD_SCREENSHOT=PATH to keep the screenshot (docs/fleet-dashboard.png was made so).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest
import sqlalchemy as sa

from cloud_service.fleet import schema as t
from cloud_service.fleet.store import FleetStore
from cloud_service.fleet.telemetry import TelemetryLimits, TelemetryStore
from testkit.fleet_process import FleetProcess
from tests.cloud_service.fleet.test_dashboard import CHROMIUM, FLAGS

pytestmark = pytest.mark.slow
DEVICES = 10_000
HOURS = 24
FIRST_PAINT_S = 2.0  # the benchmark figure; asserted loosely on a shared host (PAINT_BOUND_S)
PAINT_BOUND_S = 10.0


def _populate(url: str, now: float) -> str:
    """10,000 devices on 4 sites and 3 releases (rows written directly: enrollment signs certificates), and
    a window an hour each for a day, through the real ingest (so the hourly sums come from it)."""
    store = FleetStore.open(url)
    try:
        from cloud_service.fleet.registry import Registry

        ids = [f"dev-{i:05d}" for i in range(DEVICES)]
        releases = [f"sha256:{k:064x}" for k in (1, 2, 3)]
        with store.begin() as conn:
            conn.execute(t.devices.insert(), [
                {"device_id": d, "labels": json.dumps({"site": f"site{i % 4}", "kind": "cam"}), "hardware": "{}",
                 "agent_version": "0.1.0", "cert_serial": f"{i:x}", "mqtt_password_hash": "", "enrolled_at": now,
                 "last_seen": now - (0 if i % 10 else 600), "model_digest": "sha256:0123", "variant": "int8",
                 "threshold": 0.8} for i, d in enumerate(ids)])
            conn.execute(t.reported.insert(), [
                {"device_id": d, "version": None, "received_at": now,
                 "document": json.dumps({"release": releases[i % 3]})} for i, d in enumerate(ids)])
        tel = TelemetryStore(store, TelemetryLimits(daily_bytes=10**9, max_skew_s=10**9))
        for h in range(HOURS):
            ts = now - (HOURS - h) * 3600 + 60
            batch = [(d, json.dumps({
                "device": d, "boot_id": "b", "seq": h, "ts": ts, "window_s": 3600, "requests": 100 + i % 50,
                "p95_ms": 5 + (i % 7) + (h % 5), "escalation_rate": 0.1 + 0.01 * (i % 10), "agreement": 0.95,
                "energy_mj_per_request": 2.0 + 0.1 * (i % 3), "energy_label": "modeled", "degraded": i % 3,
                "variant": "int8", "threshold": 0.8}).encode(), ts) for i, d in enumerate(ids)]
            for k in range(0, len(batch), 2500):
                assert tel.ingest(batch[k:k + 2500]).stored == len(batch[k:k + 2500])
        with store.begin() as conn:
            assert conn.execute(sa.select(sa.func.count()).select_from(t.telemetry)).scalar_one() == DEVICES * HOURS
        return Registry(store).create_operator_token("viewer", "read")
    finally:
        store.close()


@pytest.mark.timeout(900)
@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_ten_thousand_devices_first_paint(db_url: str, tmp_path: Path) -> None:
    if not Path(CHROMIUM).exists():
        pytest.skip("chromium is not installed (apt-get install chromium)")
    pytest.importorskip("playwright.sync_api")
    from playwright.sync_api import sync_playwright

    token = _populate(db_url, time.time())
    data = tmp_path / "fleet-data"
    data.mkdir()
    proc = FleetProcess(data, db_url).start()
    try:
        status, bands = proc.call("GET", "/v1/fleet/bands?by=label:site", token=token)
        assert status == 200
        assert sorted(bands["groups"]) == [f"site={s}" for s in ("site0", "site1", "site2", "site3")]
        assert bands["groups"]["site=site0"]["devices"] == DEVICES // 4
        with sync_playwright() as pw:
            ctx = pw.chromium.launch_persistent_context(str(tmp_path / "profile"), executable_path=CHROMIUM,
                                                        headless=True, args=FLAGS,
                                                        viewport={"width": 1400, "height": 1300})
            try:
                page = ctx.new_page()
                page.goto("about:blank")
                started = time.monotonic()
                page.goto(f"{proc.url}/#token={token}")
                page.wait_for_selector("body[data-loaded='1']", timeout=60_000)
                first_paint_s = time.monotonic() - started
                print(f"fleet view, {DEVICES} devices, {HOURS} h of windows (PostgreSQL): first paint "
                      f"{first_paint_s:.2f} s (benchmark figure: {FIRST_PAINT_S} s)")
                assert first_paint_s <= PAINT_BOUND_S
                assert page.locator("#devices tbody tr").count() == 50
                assert page.locator("#page-info").inner_text() == f"1–50 of {DEVICES}"
                assert page.locator("#n-devices").inner_text() == str(DEVICES)
                lines = page.locator(".plot[data-metric='p95_ms'] polyline.series")
                assert lines.count() == 2
                assert len((lines.first.get_attribute("points") or "").split()) >= HOURS - 1
                page.select_option("#group", "label:site")
                page.wait_for_function(
                    "document.querySelectorAll(\".plot[data-metric='p95_ms'] polyline\").length == 8", timeout=60_000)
                shot = tmp_path / "dashboard.png"
                page.screenshot(path=str(shot), full_page=True)
                keep = os.environ.get("TIERKIT_DASHBOARD_SCREENSHOT")
                if keep:
                    shutil.copy(shot, keep)
            finally:
                ctx.close()
    finally:
        proc.stop()
