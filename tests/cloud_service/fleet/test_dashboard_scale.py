"""The fleet view over 10,000 devices and a day of windows on PostgreSQL: what a page load reads (query plans:
no scan of the windows or of the device-hours, a few rows of each), and the dashboard in headless Chromium
(bands drawn, the device table paged and filtered), first paint timed.

The 2 s first-paint target is bench/bench_dashboard.py's, measured alone; here the bound is loose, for a
host that runs other suites at the same time (measured so, load average 10-19 on 2 cores: 1.3-1.5 s).
Set TIERKIT_DASHBOARD_SCREENSHOT=PATH to keep the screenshot.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from cloud_service.fleet import bands, view
from cloud_service.fleet.fleet import Fleet, FleetConfig
from testkit.chromium import CHROMIUM, FLAGS
from testkit.fleet_process import FleetProcess
from testkit.fleet_seed import FleetShape, seed, touch

pytestmark = pytest.mark.slow
SHAPE = FleetShape(devices=10_000, sites=8, windows_per_hour=1)
PAINT_BOUND_S = 6.0  # loaded 2-core host (load average 10-19), a fresh browser: 1.3-1.5 s measured
WINDOW_TABLES = ("telemetry", "telemetry_hourly")


@pytest.fixture(scope="module")
def seeded(postgres: Any) -> Iterator[tuple[str, str]]:
    """A database on the session's PostgreSQL with the fleet, its stored bands computed (as `fleet serve`
    keeps them)."""
    admin = sa.create_engine(postgres.url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text("CREATE DATABASE fleet_scale"))
    admin.dispose()
    url = postgres.url.rsplit("/", 1)[0] + "/fleet_scale"
    with Fleet.open(FleetConfig(data_dir=Path(tempfile.mkdtemp(prefix="fleet-scale-")), db_url=url)) as fleet:
        token = seed(fleet.store, SHAPE)
        assert len(bands.refresh(fleet.store)) == SHAPE.hours + 1  # a day of windows spans 25 clock hours
    yield url, token
    admin = sa.create_engine(postgres.url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:  # 10,000 devices' day of windows: not left on the session's server
        conn.execute(sa.text("DROP DATABASE fleet_scale WITH (FORCE)"))
    admin.dispose()


def _plans(fleet: Fleet, call: Callable[[], Any]) -> list[dict[str, Any]]:
    """Every statement `call` runs, explained (ANALYZE: actual rows) after it ran."""
    seen: list[tuple[str, Any]] = []

    def capture(_conn: Any, _cursor: Any, statement: str, params: Any, _ctx: Any, _many: bool) -> None:
        seen.append((statement, params))

    sa.event.listen(fleet.store.engine, "before_cursor_execute", capture)
    try:
        call()
    finally:
        sa.event.remove(fleet.store.engine, "before_cursor_execute", capture)
    plans = []
    with fleet.store.engine.connect() as conn:
        for statement, params in seen:
            if statement.lstrip().upper().startswith("SELECT"):
                got = conn.exec_driver_sql("EXPLAIN (ANALYZE, FORMAT JSON) " + statement, params).scalar_one()
                plans.append({"sql": statement, "plan": (got if isinstance(got, list) else json.loads(got))[0]["Plan"]})
        conn.rollback()
    return plans


def _nodes(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield plan
    for child in plan.get("Plans", []):
        yield from _nodes(child)


def _reads(plans: list[dict[str, Any]], table: str) -> tuple[int, list[str]]:
    """Rows the plans read from `table` (actual rows and those its filter removed, x loops), and the kinds of
    scan that read them."""
    rows, kinds = 0, []
    for p in plans:
        for node in _nodes(p["plan"]):
            if node.get("Relation Name") == table:
                read = int(node["Actual Rows"]) + int(node.get("Rows Removed by Filter", 0))
                rows += read * int(node["Actual Loops"])
                kinds.append(node["Node Type"])
    return rows, kinds


def test_a_page_load_reads_stored_bands_and_index_ranges_never_the_windows(seeded: tuple[str, str],
                                                                          tmp_path: Path) -> None:
    url, _token = seeded
    with Fleet.open(FleetConfig(data_dir=tmp_path, db_url=url)) as fleet:
        def load() -> None:  # what the four first-paint requests run
            view.page(fleet.store, q="", data_drift=fleet.telemetry.data_drift)
            view.page(fleet.store, after="dev-05000", q="site=site3", state="online",
                      data_drift=fleet.telemetry.data_drift)
            bands.bands(fleet.store, by="label:site")
            fleet.stats()

        load()
        plans = _plans(fleet, load)
    for table in WINDOW_TABLES:
        rows, kinds = _reads(plans, table)
        assert "Seq Scan" not in kinds, (table, kinds)
        # the windows: each listed device's latest only (a probe reads 2-3 index rows, not its 25 windows)
        assert rows <= {"telemetry": 4 * 2 * 50, "telemetry_hourly": 0}[table], (table, rows)
    band_rows, _ = _reads(plans, "fleet_bands")
    assert band_rows <= 2 * 8 * (SHAPE.hours + 1)  # the stale check and the read: groups x hours
    minute_rows, _ = _reads(plans, "telemetry_minutes")  # a day's minutes: a scan of the table is the plan
    assert minute_rows <= 60 * (SHAPE.hours + 1) + 10  # the hours' stamps and the last 5 minutes
    pages = [p for p in plans if "FROM devices" in p["sql"] and "ORDER BY devices.device_id" in p["sql"]]
    assert len(pages) == 2
    for plan in pages:  # index ranges from the cursor: 50 rows, or the rows until 50 pass a 1-in-8 filter
        rows, kinds = _reads([plan], "devices")
        assert "Seq Scan" not in kinds, plan["sql"]
        assert rows <= (1000 if "device_labels" in plan["sql"] else 100), (rows, plan["sql"])


def _text(page: Any, selector: str) -> str:
    return str(page.locator(selector).inner_text())


def _wait_info(page: Any, text: str) -> None:
    page.wait_for_function(f"document.getElementById('page-info').textContent == {json.dumps(text)}",
                           timeout=60_000)


@pytest.mark.timeout(600)
def test_ten_thousand_devices_in_the_dashboard(seeded: tuple[str, str], tmp_path: Path) -> None:
    if not Path(CHROMIUM).exists():
        pytest.skip("chromium is not installed (apt-get install chromium)")
    pytest.importorskip("playwright.sync_api")
    from playwright.sync_api import sync_playwright

    url, token = seeded
    touch(url, SHAPE)  # the devices were last heard from just now (the module's first test ran before)
    data = tmp_path / "fleet-data"
    data.mkdir()
    proc = FleetProcess(data, url).start()
    try:
        with sync_playwright() as pw:
            ctx = pw.chromium.launch_persistent_context(str(tmp_path / "profile"), executable_path=CHROMIUM,
                                                        headless=True, args=FLAGS,
                                                        viewport={"width": 1400, "height": 1300})
            try:
                page = ctx.new_page()
                page.goto(f"{proc.url}/#token={token}")
                page.wait_for_function("performance.getEntriesByName('tierkit-first-paint').length > 0",
                                       timeout=60_000)
                paint_s = page.evaluate("performance.getEntriesByName('tierkit-first-paint')[0].startTime") / 1e3
                print(f"fleet view, {SHAPE.devices} devices, a day of windows (PostgreSQL): first paint "
                      f"{paint_s:.2f} s (bound here {PAINT_BOUND_S} s; the 2 s target: bench/bench_dashboard.py)")
                assert paint_s <= PAINT_BOUND_S
                assert _text(page, "#n-devices") == str(SHAPE.devices)
                assert _text(page, "#n-online") == str(SHAPE.devices - SHAPE.devices // SHAPE.offline_every)
                assert _text(page, "#n-drift") == str(SHAPE.devices // SHAPE.drift_every)
                assert page.locator("#drift tbody tr").count() == 51  # 50 listed, then "and 50 more"
                # bands: the fleet's p50 and p95 over every hour of the day, and the area between them
                lines = page.locator(".plot[data-metric='p95_ms'] polyline.series")
                assert lines.count() == 2
                assert len((lines.first.get_attribute("points") or "").split()) == SHAPE.hours + 1
                assert page.locator(".plot[data-metric='p95_ms'] polygon.band").count() == 1
                # the table: 50 rows a page, keyset pages forward and back
                assert page.locator("#devices tbody tr").count() == 50
                assert _text(page, "#page-info") == f"1–50 of {SHAPE.devices}"
                assert page.is_disabled("#prev")
                page.click("#next")
                _wait_info(page, f"51–100 of {SHAPE.devices}")
                assert page.locator("#devices tbody tr").first.get_attribute("data-device") == "dev-00050"
                page.click("#prev")
                _wait_info(page, f"1–50 of {SHAPE.devices}")
                assert page.locator("#devices tbody tr").first.get_attribute("data-device") == "dev-00000"
                # filters: a label, a state, an id prefix
                page.fill("#filter", "site=site3")
                page.dispatch_event("#filter", "change")
                _wait_info(page, f"1–50 of {SHAPE.devices // SHAPE.sites}")
                assert all("site=site3" in t for t in page.locator("#devices tbody td:nth-child(3)").all_inner_texts())
                page.fill("#filter", "")
                page.select_option("#state", "offline")
                _wait_info(page, f"1–50 of {SHAPE.devices // SHAPE.offline_every}")
                assert set(page.locator("#devices tbody td:nth-child(2)").all_inner_texts()) == {"offline"}
                page.select_option("#state", "")
                page.fill("#filter", "dev-0999")
                page.dispatch_event("#filter", "change")
                _wait_info(page, "1–10 of 10")
                assert page.is_disabled("#next")
                # bands by label: a band per site
                page.select_option("#group", "label:site")
                page.wait_for_function("document.querySelectorAll(\".plot[data-metric='p95_ms'] polygon.band\")"
                                       f".length == {SHAPE.sites}", timeout=60_000)
                assert page.locator(".plot[data-metric='p95_ms'] polyline.series").count() == 2 * SHAPE.sites
                keep = os.environ.get("TIERKIT_DASHBOARD_SCREENSHOT")
                if keep:
                    page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)
                    shutil.copy(tmp_path / "dashboard.png", keep)
            finally:
                ctx.close()
    finally:
        proc.stop()
