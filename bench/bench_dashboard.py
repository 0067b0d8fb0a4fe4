"""The fleet dashboard over 10,000 devices and a day of windows (PostgreSQL), in headless Chromium.

Seeds a PostgreSQL started here (loopback) with the fleet (`testkit.fleet_seed`: 8 sites, 3 releases, every
20th device offline, every 100th drifting, `--windows-per-hour` windows a device for 24 hours), computes the
stored bands once (the one-time cost after a day of windows arrived with no fleet process running; `fleet
serve` keeps them fresh after that), starts `tierkit fleet serve` on it and loads the dashboard `--loads`
times. Measured in the same run:

(first paint) navigation start to the frame that draws bands, tiles and the first device page (the page's
              own `tierkit-first-paint` mark); target <= 2 s
(full load)   to the rollouts panel loaded as well
(floor)       the same page with a wrong token: HTML, script and four refused API calls, no data
(API)         the four requests first paint waits for (device page, bands, drift, stats), sent at once from
              Python: the server's share
(next page, filter, group) an interaction: click or change until the table or the plots show the result

Ratios: first paint / floor and first paint / API.

    python bench/bench_dashboard.py [--devices 10000] [--windows-per-hour 4] [--loads 15]
                                    [--screenshot docs/dashboard-10k.png] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cloud_service.fleet import bands  # noqa: E402
from cloud_service.fleet.store import FleetStore  # noqa: E402
from testkit import postgres  # noqa: E402
from testkit.chromium import CHROMIUM, FLAGS  # noqa: E402
from testkit.fleet_process import FleetProcess  # noqa: E402
from testkit.fleet_seed import FleetShape, seed, touch  # noqa: E402

TARGET_S = 2.0
FIRST_PAINT = "performance.getEntriesByName('tierkit-first-paint').length > 0"


def _get(url: str, token: str) -> float:
    t0 = time.perf_counter()
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        resp.read()
    return time.perf_counter() - t0


def api_times(base: str, token: str, loads: int) -> dict[str, Any]:
    """The first paint's four requests at once, `loads` times: wall time of each set, and each endpoint's."""
    paths = {"devices": "/v1/fleet/devices?limit=50&q=&state=", "bands": "/v1/fleet/bands?by=fleet&hours=24",
             "drift": "/v1/drift?limit=50", "stats": "/v1/stats"}
    walls: list[float] = []
    each: dict[str, list[float]] = {k: [] for k in paths}
    with ThreadPoolExecutor(len(paths)) as pool:
        for _ in range(loads):
            t0 = time.perf_counter()
            got = dict(zip(paths, pool.map(lambda p: _get(base + p, token), paths.values()), strict=True))
            walls.append(time.perf_counter() - t0)
            for k, v in got.items():
                each[k].append(v)
    return {"wall_s": walls, **{f"{k}_s": v for k, v in each.items()}}


def _load(ctx: Any, url: str, *, ready: str) -> dict[str, float]:
    page = ctx.new_page()
    try:
        t0 = time.perf_counter()
        page.goto(url)
        page.wait_for_function(ready, timeout=60_000)
        out = {"wall_s": time.perf_counter() - t0}
        if ready == FIRST_PAINT:
            out["paint_s"] = page.evaluate("performance.getEntriesByName('tierkit-first-paint')[0].startTime") / 1e3
            page.wait_for_selector("body[data-rollouts='1']", state="attached", timeout=60_000)
            out["full_s"] = page.evaluate("performance.now()") / 1e3
        else:
            out["paint_s"] = page.evaluate("performance.now()") / 1e3
        return out
    finally:
        page.close()


def _timed(page: Any, act: Any, done: str) -> float:
    t0 = time.perf_counter()
    act()
    page.wait_for_function(done, timeout=60_000)
    return time.perf_counter() - t0


def interactions(ctx: Any, base: str, token: str, devices: int, sites: int,
                 screenshot: Path | None) -> dict[str, list[float]]:
    page = ctx.new_page()
    out: dict[str, list[float]] = {"next_page_s": [], "filter_s": [], "group_s": []}
    try:
        page.goto(f"{base}/#token={token}")
        page.wait_for_function(FIRST_PAINT, timeout=60_000)
        for k in range(1, 6):
            out["next_page_s"].append(_timed(page, lambda: page.click("#next"),
                                             f"document.getElementById('page-info').textContent"
                                             f".startsWith('{50 * k + 1}–')"))
        per_site = len([i for i in range(devices) if i % sites == 3])
        out["filter_s"].append(_timed(page, lambda: (page.fill("#filter", "site=site3"),
                                                     page.dispatch_event("#filter", "change")),
                                      f"document.getElementById('page-info').textContent == '1–50 of {per_site}'"))
        lines = "document.querySelectorAll(\".plot[data-metric='p95_ms'] polyline\").length"
        out["group_s"].append(_timed(page, lambda: page.select_option("#group", "release"), f"{lines} == 6"))
        if screenshot is not None:
            page.fill("#filter", "")
            page.dispatch_event("#filter", "change")
            page.wait_for_function(f"document.getElementById('page-info').textContent == '1–50 of {devices}'")
            page.screenshot(path=str(screenshot), full_page=True)
        return out
    finally:
        page.close()


def browser_runs(base: str, token: str, args: argparse.Namespace, shape: FleetShape) -> dict[str, Any]:
    from playwright.sync_api import sync_playwright

    runs: dict[str, list[dict[str, float]]] = {"dashboard": [], "floor": []}
    with tempfile.TemporaryDirectory(prefix="bench-dash-profile-") as profile, sync_playwright() as pw:
        ctx = pw.chromium.launch_persistent_context(profile, executable_path=CHROMIUM, headless=True, args=FLAGS,
                                                    viewport={"width": 1400, "height": 1300})
        try:
            _load(ctx, f"{base}/#token={token}", ready=FIRST_PAINT)  # the browser's own warm-up, not counted
            for _ in range(args.loads):  # interleaved, so that load on the host weighs on both alike
                runs["dashboard"].append(_load(ctx, f"{base}/#token={token}", ready=FIRST_PAINT))
                runs["floor"].append(_load(ctx, f"{base}/#token=wrong",
                                           ready="document.getElementById('error').textContent != ''"))
            inter = interactions(ctx, base, token, shape.devices, shape.sites, args.screenshot)
        finally:
            ctx.close()
    return {"dashboard": runs["dashboard"], "floor": runs["floor"], **inter}


def _q(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def report(res: dict[str, Any]) -> None:
    dash, floor, api = res["dashboard"], res["floor"], res["api"]
    paint = [r["paint_s"] for r in dash]
    full = [r["full_s"] for r in dash]
    floor_s = [r["paint_s"] for r in floor]
    print(f"fleet: {res['devices']:,} devices, {res['windows']:,} windows over 24 h "
          f"({res['windows_per_hour']} a device an hour), PostgreSQL; seeded in {res['seed_s']:.0f} s; "
          f"stored bands computed once in {res['bands_once_s']:.1f} s ({res['hours']} hours)")
    print(f"{'measure (s)':<34}{'median':>9}{'p95':>9}{'max':>9}")
    rows = [("first paint", paint), ("full load (rollouts panel too)", full), ("floor: page, no data", floor_s),
            ("API: the 4 first-paint requests", api["wall_s"]), ("  device page", api["devices_s"]),
            ("  bands", api["bands_s"]), ("  drift", api["drift_s"]), ("  stats", api["stats_s"]),
            ("next page (click to table)", res["next_page_s"]), ("label filter (change to table)", res["filter_s"]),
            ("group by release (to plots)", res["group_s"])]
    for name, v in rows:
        print(f"{name:<34}{statistics.median(v):>9.3f}{_q(v, 0.95):>9.3f}{max(v):>9.3f}")
    med = statistics.median(paint)
    print(f"first paint / floor: {med / statistics.median(floor_s):.2f}x; "
          f"first paint / API: {med / statistics.median(api['wall_s']):.2f}x")
    verdict = "met" if _q(paint, 0.95) <= TARGET_S else "NOT met"
    print(f"target: first paint <= {TARGET_S} s on every load (p95 {_q(paint, 0.95):.3f} s, "
          f"{len(paint)} loads): {verdict}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=10_000)
    parser.add_argument("--windows-per-hour", type=int, default=4,
                        help="windows a device sends an hour (the agent's default interval, 10 s, is 360)")
    parser.add_argument("--loads", type=int, default=15, help="page loads measured (and as many floor loads)")
    parser.add_argument("--screenshot", type=Path, help="save the dashboard (grouped by release) as this PNG")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if not Path(CHROMIUM).exists() or not postgres.available():
        print("needs /usr/bin/chromium and PostgreSQL (apt-get install chromium postgresql)", file=sys.stderr)
        return 2
    shape = FleetShape(devices=args.devices, windows_per_hour=args.windows_per_hour)
    pg = postgres.Postgres(Path(tempfile.mkdtemp(prefix="bench-dash-pg-"))).start()
    res: dict[str, Any] = {"devices": shape.devices, "windows_per_hour": shape.windows_per_hour,
                           "windows": shape.devices * shape.hours * shape.windows_per_hour}
    try:
        store = FleetStore.open(pg.url)
        try:
            t0 = time.perf_counter()
            token = seed(store, shape)
            res["seed_s"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            res["hours"] = len(bands.refresh(store))
            res["bands_once_s"] = time.perf_counter() - t0
        finally:
            store.close()
        with tempfile.TemporaryDirectory(prefix="bench-dash-") as data:
            proc = FleetProcess(Path(data), pg.url).start()
            try:
                touch(pg.url, shape)  # the devices heard from just now, whatever the seeding took
                res["api"] = api_times(proc.url, token, args.loads)
                res.update(browser_runs(proc.url, token, args, shape))
            finally:
                proc.stop()
    finally:
        pg.stop()
    if args.json:
        print(json.dumps(res, indent=1))
    else:
        report(res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
