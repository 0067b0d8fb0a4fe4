"""The fleet's device list shows the data-drift flag of each device's latest telemetry window."""

from __future__ import annotations

import time
from pathlib import Path

from cloud_service.fleet.fleet import Fleet, FleetConfig
from edge_agent.fleet_sync import generate_key_and_csr
from testkit.windows import window_json


def _window(device: str, seq: int, *, drift: bool) -> bytes:
    return window_json(device, seq, requests=100, audited=2, agreement_est=0.9, agreement_low=0.8,
                       agreement_high=0.95, data_drift=drift)


def test_device_list_carries_the_latest_windows_data_drift_flag(tmp_path: Path) -> None:
    fleet = Fleet.open(FleetConfig(data_dir=tmp_path, db_url=f"sqlite:///{tmp_path / 'fleet.db'}"))
    try:
        reg = fleet.registry
        a, b, c = (reg.enroll(reg.create_token({}), generate_key_and_csr()[1], hardware={}, agent_version="t").device_id
                   for _ in range(3))
        now = time.time()
        res = fleet.telemetry.ingest([(a, _window(a, 1, drift=False), now), (a, _window(a, 2, drift=True), now + 1),
                                      (b, _window(b, 1, drift=True), now), (b, _window(b, 2, drift=False), now + 1)])
        assert res.stored == 4
        flags = {d["device_id"]: d["data_drift"] for d in fleet.devices()}
        assert flags == {a: True, b: False, c: False}  # the latest window decides; no window: no flag
        assert {w["device_id"] for w in fleet.telemetry.windows()} == {a, b}
    finally:
        fleet.store.close()
