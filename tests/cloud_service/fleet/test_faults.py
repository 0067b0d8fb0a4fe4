"""A database that is locked or gone for a while: clear errors, the batch is kept, nothing lost or duplicated."""

from __future__ import annotations

import sqlite3
import tempfile
import time
from pathlib import Path

import pytest

from cloud_service.fleet.ca import FleetCA
from cloud_service.fleet.desired import DesiredState
from cloud_service.fleet.errors import StoreUnavailable
from cloud_service.fleet.ingest import IngestOptions, MqttIngest
from cloud_service.fleet.registry import Registry
from cloud_service.fleet.store import FleetStore
from cloud_service.fleet.telemetry import TelemetryStore
from edge_agent.fleet_sync import generate_key_and_csr
from testkit.broker import Broker
from testkit.fleet_process import windows_accounted
from testkit.mqtt_device import Device
from testkit.postgres import Postgres
from testkit.waiting import wait_for
from testkit.windows import window_json


def _window(dev: str, seq: int) -> bytes:
    return window_json(dev, seq, requests=1)


def test_locked_sqlite_raises_store_unavailable_and_the_retry_stores_once(tmp_path: Path) -> None:
    path = tmp_path / "fleet.db"
    store = FleetStore.open(f"sqlite:///{path}", busy_timeout_s=0.2)
    try:
        reg = Registry(store, FleetCA.load_or_create(tmp_path))
        dev = reg.enroll(reg.create_token({}), generate_key_and_csr()[1]).device_id
        tel = TelemetryStore(store)
        tel.ingest([(dev, _window(dev, 1), time.time())])
        batch = [(dev, _window(dev, s), time.time()) for s in (2, 3)]
        other = sqlite3.connect(path)
        other.execute("BEGIN IMMEDIATE")  # another writer holds the lock
        with pytest.raises(StoreUnavailable, match="locked"):
            tel.ingest(batch)
        other.rollback()
        other.close()
        assert tel.ingest(batch).stored == 2
        assert [w["seq"] for w in tel.windows([dev])] == [1, 2, 3]
        # an SQL bug is not "unavailable"
        with pytest.raises(Exception, match="syntax") as bug, store.begin() as conn:
            conn.exec_driver_sql("SELEC 1")
        assert not isinstance(bug.value, StoreUnavailable)
    finally:
        store.close()


@pytest.mark.mqtt
def test_ingestion_rides_out_postgresql_going_away(tmp_path: Path) -> None:
    pg = Postgres(Path(tempfile.mkdtemp(prefix="tierkit-pg-"))).start()
    broker = Broker(tmp_path / "broker").start()
    store = FleetStore.open(pg.url)
    ingest = None
    try:
        reg = Registry(store, FleetCA.load_or_create(tmp_path))
        dev = reg.enroll(reg.create_token({}), generate_key_and_csr()[1]).device_id
        tel = TelemetryStore(store)
        ingest = MqttIngest(IngestOptions(port=broker.port, batch_wait_s=0.01), reg, DesiredState(store), tel).start()
        assert ingest.connected.wait(10)
        pub = Device(broker.host, broker.port, "device-under-test", "")
        assert not pub.connect().is_failure
        topic = f"tierkit/v1/{dev}/telemetry"
        for s in range(1, 6):
            pub.publish(topic, _window(dev, s))
        wait_for("the first windows", lambda: len(tel.windows([dev])) == 5)

        pg.stop(remove=False)  # the database goes away while devices keep publishing
        for s in range(6, 16):
            pub.publish(topic, _window(dev, s))
        pub.publish(topic, _window(dev, 3))  # and one redelivery of a stored window
        wait_for("a failed attempt", lambda: ingest is not None and ingest.stats["store_retries"] >= 1)
        pg.restart()
        # all 16 windows published (5, 10 during the outage, the redelivery) stored or dropped: none can come later
        wait_for("every window published accounted for after the database came back",
                 lambda: ingest is not None and windows_accounted(ingest.stats) >= 16, timeout=30)
        assert [w["seq"] for w in tel.windows([dev])] == list(range(1, 16))
        assert tel.drops()["replayed"] == 1
        pub.close()
    finally:
        if ingest is not None:
            ingest.stop()
        store.close()
        broker.stop()
        pg.stop()
