"""The dashboard shows the cloud's refusals beside the escalation rate (headless Chromium over a real fleet):
devices' windows of the last minutes carry how many of their escalations a busy cloud refused."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cloud_service.fleet.ca import FleetCA
from cloud_service.fleet.registry import Registry
from cloud_service.fleet.store import FleetStore
from cloud_service.fleet.telemetry import TelemetryLimits, TelemetryStore
from edge_agent.fleet_sync import generate_key_and_csr
from testkit.chromium import CHROMIUM, FLAGS
from testkit.fleet_process import FleetProcess


def _populate(data: Path, now: float) -> str:
    """Two devices, three recent windows each: 200 requests, a quarter escalated, 10 of those refused; and an
    hour-old window full of refusals that the last five minutes leave out."""
    store = FleetStore.open(f"sqlite:///{data / 'fleet.db'}")
    try:
        reg = Registry(store, FleetCA.load_or_create(data))
        devices = [reg.enroll(reg.create_token({"site": "berlin"}), generate_key_and_csr()[1], hardware={"cpu": "x86"},
                              agent_version="0.1.0").device_id for _ in range(2)]
        batch = []
        for dev in devices:
            for k, age in enumerate((3600, 90, 60, 30)):
                doc = {"device": dev, "boot_id": "b", "seq": k, "ts": now - age, "window_s": 30, "requests": 200,
                       "p95_ms": 9.0, "escalation_rate": 0.25, "cloud_refused": 50 if age == 3600 else 10,
                       "energy_mj_per_request": 1.0, "energy_label": "modeled", "degraded": 10, "variant": "int8"}
                batch.append((dev, json.dumps(doc).encode(), now - age))
        assert TelemetryStore(store, TelemetryLimits(daily_bytes=10**9)).ingest(batch).stored == 8
        return reg.create_operator_token("viewer", "read")
    finally:
        store.close()


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[tuple[FleetProcess, str]]:
    if not Path(CHROMIUM).exists():
        pytest.skip("chromium is not installed (make test installs it: apt-get install chromium)")
    pytest.importorskip("playwright.sync_api")
    data = tmp_path / "fleet-data"
    data.mkdir()
    token = _populate(data, time.time())
    proc = FleetProcess(data, None).start()
    try:
        yield proc, token
    finally:
        proc.stop()


def test_the_dashboard_shows_cloud_refusals_beside_the_escalation_rate(fleet: tuple[FleetProcess, str],
                                                                       tmp_path: Path) -> None:
    from playwright.sync_api import sync_playwright

    proc, token = fleet
    cloud = proc.call("GET", "/v1/stats", token=token)[1]["cloud"]
    # 6 recent windows: 1,200 requests, 300 escalations, 60 refused (the hour-old window is left out)
    assert (cloud["windows"], cloud["requests"], cloud["escalations"], cloud["cloud_refused"]) == (6, 1200, 300, 60)
    with sync_playwright() as pw:
        ctx = pw.chromium.launch_persistent_context(str(tmp_path / "profile"), executable_path=CHROMIUM,
                                                    headless=True, args=FLAGS)
        try:
            page = ctx.new_page()
            page.goto(f"{proc.url}/#token={token}")
            page.wait_for_selector("body[data-loaded='1']", timeout=30_000)
            rate = page.locator(".tile", has=page.locator("#n-escalation-rate"))
            refused = page.locator(".tile", has=page.locator("#n-cloud-refused"))
            assert page.locator("#n-escalation-rate").inner_text() == "25.0 %"
            assert page.locator("#n-cloud-refused").inner_text() == "60"
            assert "20.0 % of escalations" in refused.inner_text()
            assert "cloud refusals" in refused.inner_text()
            # beside each other: the refusals' tile follows the escalation rate's, on the same row
            a, b = rate.bounding_box(), refused.bounding_box()
            assert a is not None
            assert b is not None
            assert abs(a["y"] - b["y"]) < 5
            assert 0 < b["x"] - a["x"] < 400
        finally:
            ctx.close()
