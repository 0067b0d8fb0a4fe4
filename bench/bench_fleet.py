"""Fleet telemetry ingest: sustained rate and lag from publish to queryable, on SQLite and PostgreSQL.

For each database:
(raw)    the same telemetry rows inserted by a bare loop of SQLAlchemy `executemany` in batches of 1,000:
         the ceiling the database itself allows for these rows
(store)  `TelemetryStore.ingest` on batches of 1,000 serialized windows: validation, dedup check, byte
         caps, last-seen and usage updates, in one transaction per batch (no MQTT)
(mqtt)   simulated devices publish windows (QoS 1) through a local Mosquitto, paced at the offered
         rate, from a separate process; `MqttIngest` takes them through the shared subscription and
         stores them. Lag = commit time minus the window's publish time (one clock: same host).

Target: 1,000 windows/s (10,000 devices every 10 s) with p99 lag <= 2 s. Ratios are against (raw)
measured in the same run.

    python bench/bench_fleet.py [--quick] [--json] [--rate 1000] [--seconds 20] [--devices 10000]
                                [--db both|sqlite|postgresql]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bench_escalation import start_mosquitto as start_broker  # noqa: E402
from cloud_service.fleet import schema as t  # noqa: E402
from cloud_service.fleet.ca import FleetCA  # noqa: E402
from cloud_service.fleet.desired import DesiredState  # noqa: E402
from cloud_service.fleet.ingest import IngestOptions, MqttIngest  # noqa: E402
from cloud_service.fleet.registry import Registry  # noqa: E402
from cloud_service.fleet.store import FleetStore  # noqa: E402
from cloud_service.fleet.telemetry import IngestResult, TelemetryLimits, TelemetryStore  # noqa: E402

TARGET_RATE, TARGET_P99_S = 1000.0, 2.0


def start_mosquitto(workdir: Path) -> tuple[subprocess.Popen[bytes], int] | None:
    return start_broker(workdir, "max_queued_messages 100000\nmax_inflight_messages 1000\n")


def window(device: str, seq: int, ts: float) -> bytes:
    return json.dumps({"device": device, "boot_id": "bench", "seq": seq, "ts": ts, "window_s": 10,
                       "requests": 120, "tiers": {"edge": 100, "cloud": 20}, "p50_ms": 3.2, "p95_ms": 11.5,
                       "escalation_rate": 0.17, "agreement": 0.96, "energy_mj_per_request": 2.1,
                       "energy_label": "modeled:cpu", "degraded": 1, "degraded_reasons": {"timeout": 1},
                       "variant": "int8", "threshold": 0.8, "model_digest": "sha256:" + "ab" * 32}).encode()


def register(store: FleetStore, n: int) -> list[str]:
    names = [f"dev-{i:06d}" for i in range(n)]
    with store.begin() as conn:
        conn.execute(t.devices.insert(), [{"device_id": d, "labels": "{}", "hardware": "{}", "agent_version": "",
                                           "cert_serial": "", "mqtt_password_hash": "", "enrolled_at": 0.0,
                                           "model_digest": "", "variant": ""} for d in names])
    return names


def bench_raw(store: FleetStore, tel: TelemetryStore, devices: list[str], n: int) -> float:
    now = time.time()
    rows = [tel._row(_parse(window(devices[i % len(devices)], 10**6 + i, now)), 400, now, "{}") for i in range(n)]
    t0 = time.perf_counter()
    for k in range(0, n, 1000):
        with store.begin() as conn:
            conn.execute(t.telemetry.insert(), rows[k:k + 1000])
    return n / (time.perf_counter() - t0)


def _parse(payload: bytes) -> Any:
    from cloud_service.protocol.fleet_docs import parse_telemetry

    return parse_telemetry(payload)


def bench_store(tel: TelemetryStore, devices: list[str], n: int) -> float:
    now = time.time()
    batch = [(devices[i % len(devices)], window(devices[i % len(devices)], 2 * 10**6 + i, now), now) for i in range(n)]
    t0 = time.perf_counter()
    stored = 0
    for k in range(0, n, 1000):
        stored += tel.ingest(batch[k:k + 1000]).stored
    assert stored == n, f"stored {stored} of {n}"
    return n / (time.perf_counter() - t0)


def publish(port: int, devices: list[str], rate: float, seconds: float, seq0: int, done: Any) -> None:
    """The simulated fleet: one paho connection, windows for the devices in turn, paced at `rate`."""
    import paho.mqtt.client as paho
    from paho.mqtt.enums import CallbackAPIVersion

    c = paho.Client(CallbackAPIVersion.VERSION2, client_id=f"bench-pub-{seq0}", protocol=paho.MQTTv5)
    c.max_inflight_messages_set(1000)
    c.max_queued_messages_set(0)
    c.connect("127.0.0.1", port)
    c.loop_start()
    total = int(rate * seconds)
    t0 = time.time()
    for i in range(total):
        due = t0 + i / rate
        wait = due - time.time()
        if wait > 0:
            time.sleep(wait)
        dev = devices[i % len(devices)]
        c.publish(f"tierkit/v1/{dev}/telemetry", window(dev, seq0 + i, time.time()), qos=1)
    c.loop_stop()
    c.disconnect()
    c._reset_sockets()  # paho leaves its socket pair (and a late connection) to gc
    done.put(total)


class TimedTelemetry(TelemetryStore):
    """Records, for every stored window, commit time minus publish time (the window's `ts`)."""

    lags: list[float]
    first_publish = float("inf")
    last_commit = 0.0

    def ingest(self, batch: list[tuple[str, bytes, float]]) -> IngestResult:
        res = super().ingest(batch)
        now = self.last_commit = time.time()
        for _d, payload, _s in batch:  # the bench sends no duplicates or bad windows: every one is stored
            i = payload.find(b'"ts": ')
            ts = float(payload[i + 6:payload.index(b",", i)])
            self.first_publish = min(self.first_publish, ts)
            self.lags.append(now - ts)
        return res


def bench_mqtt(store: FleetStore, port: int, devices: list[str], rate: float, seconds: float) -> dict[str, float]:
    tel = TimedTelemetry(store, TelemetryLimits(daily_bytes=10**12, max_skew_s=10**9))
    tel.lags = []
    ingest = MqttIngest(IngestOptions(port=port, group="bench", client_id=f"bench-fleet-{time.monotonic_ns()}",
                                      session_expiry_s=0), Registry(store), DesiredState(store), tel).start()
    try:
        if not ingest.connected.wait(10):
            msg = "the ingest client did not connect"
            raise RuntimeError(msg)
        time.sleep(0.3)
        ctx = mp.get_context("spawn")
        done = ctx.Queue()
        pub = ctx.Process(target=publish, args=(port, devices, rate, seconds, 3 * 10**6, done))
        pub.start()
        total = done.get(timeout=seconds * 5 + 60)
        pub.join(10)
        deadline = time.time() + 30
        while ingest.stats["stored"] + sum(ingest.stats[k] for k in ("replayed", "malformed")) < total:
            if time.time() > deadline:
                break
            time.sleep(0.05)
        elapsed = max(tel.last_commit - tel.first_publish, 1e-9)
        lags = np.array(tel.lags) if tel.lags else np.array([float("nan")])
        return {"offered_per_s": rate, "published": total, "stored": ingest.stats["stored"],
                "rate_per_s": ingest.stats["stored"] / elapsed, "lag_p50_s": float(np.percentile(lags, 50)),
                "lag_p99_s": float(np.percentile(lags, 99)), "queue_full": ingest.stats["queue_full"]}
    finally:
        ingest.stop()


def run_db(name: str, url: str, port: int | None, args: argparse.Namespace) -> dict[str, Any]:
    store = FleetStore.open(url)
    FleetCA.load_or_create(Path(tempfile.mkdtemp(prefix="bench-fleet-ca-")))
    try:
        devices = register(store, args.devices)
        tel = TelemetryStore(store, TelemetryLimits(daily_bytes=10**12, max_skew_s=10**9))
        n = 2000 if args.quick else 20_000
        out: dict[str, Any] = {"db": name, "raw_per_s": bench_raw(store, tel, devices, n),
                               "store_per_s": bench_store(tel, devices, n)}
        if port is not None:
            out["mqtt"] = bench_mqtt(store, port, devices, args.rate, args.seconds)
        return out
    finally:
        store.close()


def report(results: list[dict[str, Any]]) -> None:
    print(f"{'db':<11} {'raw rows/s':>11} {'store win/s':>12} {'store/raw':>9} {'mqtt win/s':>11} {'mqtt/raw':>9} "
          f"{'offered':>8} {'lag p50':>8} {'lag p99':>8}  verdict")
    for r in results:
        m = r.get("mqtt")
        line = (f"{r['db']:<11} {r['raw_per_s']:>11.0f} {r['store_per_s']:>12.0f} "
                f"{r['store_per_s'] / r['raw_per_s']:>8.2f}x")
        if m:
            ok = m["rate_per_s"] >= 0.9 * min(TARGET_RATE, m["offered_per_s"]) and m["lag_p99_s"] <= TARGET_P99_S
            verdict = "ok" if ok and m["offered_per_s"] >= TARGET_RATE else ("ok at the offered rate" if ok
                                                                              else "BELOW TARGET")
            line += (f" {m['rate_per_s']:>11.0f} {m['rate_per_s'] / r['raw_per_s']:>8.2f}x {m['offered_per_s']:>8.0f} "
                     f"{m['lag_p50_s']:>7.2f}s {m['lag_p99_s']:>7.2f}s  {verdict}")
        print(line)
    print(f"target: {TARGET_RATE:.0f} windows/s sustained with p99 publish-to-queryable lag <= {TARGET_P99_S} s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short, slow run: checks that the bench runs")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--rate", type=float, default=TARGET_RATE, help="offered windows per second")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--devices", type=int, default=10_000)
    parser.add_argument("--db", choices=("both", "sqlite", "postgresql"), default="both", help="which databases")
    args = parser.parse_args()
    if args.quick:
        args.rate, args.seconds, args.devices = min(args.rate, 300.0), 3.0, 500
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-fleet-") as tmp:
        broker = start_mosquitto(Path(tmp))
        if broker is None:
            print("mosquitto not found: the MQTT column is skipped (apt-get install mosquitto)", file=sys.stderr)
        try:
            if args.db in ("both", "sqlite"):
                results.append(run_db("sqlite", f"sqlite:///{tmp}/fleet.db", broker and broker[1], args))
            from testkit.postgres import Postgres, available

            if args.db == "sqlite":
                pass
            elif available():
                pg = Postgres(Path(tempfile.mkdtemp(prefix="bench-pg-")))
                pg.start()
                try:
                    results.append(run_db("postgresql", pg.url, broker and broker[1], args))
                finally:
                    pg.stop()
            else:
                print("PostgreSQL not found: its row is skipped (apt-get install postgresql)", file=sys.stderr)
        finally:
            if broker is not None:
                broker[0].terminate()
                broker[0].wait(5)
    if args.json:
        print(json.dumps({"quick": args.quick, "results": results}, indent=2))
    else:
        report(results)
    return 0


if __name__ == "__main__":
    threading.current_thread().name = "bench"
    sys.exit(main())
