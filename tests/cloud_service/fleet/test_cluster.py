"""Two `tierkit fleet serve` processes on one PostgreSQL share MQTT ingestion through a shared subscription."""

from __future__ import annotations

import json
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from cloud_service.fleet.ca import FleetCA
from cloud_service.fleet.registry import Registry
from cloud_service.fleet.store import FleetStore
from cloud_service.fleet.telemetry import TelemetryStore
from edge_agent.fleet_sync import generate_key_and_csr
from testkit.broker import Broker
from testkit.fleet_process import FleetProcess, cli, windows_accounted
from testkit.mqtt_device import Device
from testkit.postgres import Postgres
from testkit.waiting import wait_for

pytestmark = pytest.mark.mqtt

DEVICES, WINDOWS = 12, 25  # 300 windows, and every device's first 5 published twice


def _fresh_database(pg: Postgres, name: str) -> str:
    """A new, empty (unmigrated) database on the session's PostgreSQL."""
    import sqlalchemy as sa

    admin = sa.create_engine(pg.url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f"CREATE DATABASE {name}"))
    admin.dispose()
    return pg.url.rsplit("/", 1)[0] + f"/{name}"


def test_two_fleet_processes_store_every_window_once(postgres: Postgres, tmp_path: Path) -> None:
    db = _fresh_database(postgres, f"fleet_cluster_{int(time.time() * 1000) % 10**9}")
    broker = Broker(tmp_path / "broker").start()
    ca_dir = tmp_path / "ca"
    FleetCA.load_or_create(ca_dir)  # one CA for the fleet: every process's data dir holds a copy
    fleets = []
    for i in range(2):
        data = tmp_path / f"fleet{i}"
        data.mkdir()
        for f in ("ca.key", "ca.pem"):
            shutil.copy(ca_dir / f, data / f)
        fleets.append(FleetProcess(data, db, "--mqtt", broker.url))
    try:
        # both start at once on the empty database: the migration runs once, the other process waits for it
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda f: f.start(), fleets))
        admin = cli("operator", "create", "ops", "--role", "admin", data_dir=fleets[0].data_dir, db=db).stdout.strip()
        for f in fleets:
            wait_for("the fleet's broker connection",
                     lambda f=f: f.call("GET", "/v1/stats", token=admin)[1]["mqtt_connected"])
        store = FleetStore.open(db)
        try:
            registry = Registry(store, FleetCA.load_or_create(ca_dir))
            devices = [registry.enroll(registry.create_token({"site": "s"}), generate_key_and_csr()[1]).device_id
                       for _ in range(DEVICES)]
            clients = []
            try:
                for d in devices:
                    c = Device(broker.host, broker.port, d, "")
                    assert not c.connect().is_failure
                    clients.append(c)
                sent = 0
                for seq in range(WINDOWS):
                    for d, c in zip(devices, clients, strict=True):
                        doc = {"device": d, "boot_id": "b", "seq": seq, "ts": time.time(), "window_s": 10,
                               "requests": 10, "agreement": 0.9}
                        for _ in range(2 if seq < 5 else 1):  # a redelivery, perhaps to the other process
                            assert not c.publish(f"tierkit/v1/{d}/telemetry", json.dumps(doc).encode()).is_failure
                            sent += 1
            finally:
                for c in clients:
                    c.close()
            tel = TelemetryStore(store)
            expected = DEVICES * WINDOWS
            # every message sent, duplicates included, stored or dropped by one of the processes: none can come
            # later to be stored twice
            def accounted() -> int:
                return sum(windows_accounted(f.call("GET", "/v1/stats", token=admin)[1]["ingest"]) for f in fleets)

            wait_for("every message sent accounted for by the two processes", lambda: accounted() >= sent,
                     timeout=60, interval=0.2)
            rows = tel.windows(devices)
            keys = [(r["device_id"], r["boot_id"], r["seq"]) for r in rows]
            assert len(keys) == len(set(keys)) == expected
            assert set(keys) == {(d, "b", s) for d in devices for s in range(WINDOWS)}
            stats = [f.call("GET", "/v1/stats", token=admin)[1]["ingest"] for f in fleets]
            stored = [s.get("stored", 0) for s in stats]
            assert all(n > 0 for n in stored), f"one process ingested nothing: {stored}"
            assert sum(stored) == expected
            assert sum(s.get("replayed", 0) for s in stats) == sent - expected
            assert tel.drops()["replayed"] == sent - expected
        finally:
            store.close()
    finally:
        for f in fleets:
            f.stop()
        broker.stop()


def test_fleet_processes_migrating_at_once_create_the_schema_once(postgres: Postgres) -> None:
    """Four stores opened at the same moment on an empty database: one migrates, the others wait and find it done."""
    import threading

    db = _fresh_database(postgres, f"fleet_migrate_{int(time.time() * 1000) % 10**9}")
    barrier = threading.Barrier(4)
    errors: list[Exception] = []
    stores: list[FleetStore] = []

    def open_store() -> None:
        barrier.wait(10)
        try:
            stores.append(FleetStore.open(db))
        except Exception as exc:  # collected and asserted on below
            errors.append(exc)

    threads = [threading.Thread(target=open_store) for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    try:
        assert errors == []
        assert len(stores) == 4
        import sqlalchemy as sa

        with stores[0].begin() as conn:
            assert conn.execute(sa.text("SELECT count(*) FROM alembic_version")).scalar() == 1
    finally:
        for s in stores:
            s.close()
