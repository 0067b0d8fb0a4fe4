"""The fleet HTTP API and `tierkit fleet` CLI, as processes, on SQLite and PostgreSQL."""

from __future__ import annotations

import argparse
import json
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cloud_service.fleet.cli import add_parser
from edge_agent.fleet_sync import EnrollmentError, enroll, load_identity
from testkit.broker import _free_port
from testkit.fleet_process import FleetProcess, cli


@pytest.fixture
def fleet(tmp_path: Path, db_url: str) -> Iterator[tuple[FleetProcess, Path, str]]:
    data = tmp_path / "fleet-data"
    proc = FleetProcess(data, db_url).start()
    try:
        yield proc, data, db_url
    finally:
        proc.stop()


# PostgreSQL runs the whole store suite by default (test_store.py); this end-to-end path on it is slow-marked
@pytest.mark.parametrize("db_url", ["sqlite", pytest.param("postgresql", marks=pytest.mark.slow)], indirect=True)
def test_enroll_operate_and_revoke(fleet: tuple[FleetProcess, Path, str], tmp_path: Path) -> None:
    proc, data, db = fleet
    admin = cli("operator", "create", "ops", "--role", "admin", data_dir=data, db=db).stdout.strip()
    viewer = cli("operator", "create", "viewer", data_dir=data, db=db).stdout.strip()
    token = cli("token", "create", "--labels", "site=berlin,kind=cam", "--expires", "1h",
                data_dir=data, db=db).stdout.strip()

    ident = enroll(proc.url, token, tmp_path / "dev1", hardware={"cpu": "test"}, agent_version="0.1.0")
    assert ident.device_id.startswith("dev-")
    assert ident.labels == {"site": "berlin", "kind": "cam"}
    assert load_identity(tmp_path / "dev1") == ident
    assert enroll(proc.url, token, tmp_path / "dev1") == ident  # a restart reuses the identity
    with pytest.raises(EnrollmentError, match="already used"):
        enroll(proc.url, token, tmp_path / "dev2")
    assert not (tmp_path / "dev2" / "fleet.json").exists()

    assert proc.call("GET", "/v1/devices")[0] == 401
    assert proc.call("GET", "/v1/devices", token="tko_admin_forged")[0] == 401
    status, devs = proc.call("GET", "/v1/devices?label=site=berlin", token=viewer)
    assert status == 200
    assert [d["device_id"] for d in devs] == [ident.device_id]
    assert devs[0]["hardware"] == {"cpu": "test"}
    assert proc.call("GET", "/v1/devices?label=site=paris", token=viewer) == (200, [])

    layer = {"selector": "site=berlin", "document": {"threshold": 0.7}}
    status, body = proc.call("PUT", "/v1/desired", layer, token=viewer)
    assert status == 403
    assert "read-only" in body["error"]
    status, body = proc.call("PUT", "/v1/desired", {"selector": "*", "document": {"threshold": 7}}, token=admin)
    assert status == 422
    assert "threshold" in body["error"]
    status, body = proc.call("PUT", "/v1/desired", layer, token=admin)
    assert status == 200
    status, shown = proc.call("GET", f"/v1/devices/{ident.device_id}", token=viewer)
    assert shown["desired"]["document"] == {"threshold": 0.7}
    assert shown["desired"]["version"] == body["version"]
    assert proc.call("GET", "/v1/devices/dev-nope", token=viewer)[0] == 404

    status, spec = proc.call("GET", "/openapi.json")
    assert status == 200
    assert {"/v1/enroll", "/v1/devices", "/v1/desired", "/v1/drift", "/v1/telemetry"} <= set(spec["paths"])

    # the CLI sees the same database
    listed = json.loads(cli("devices", "--label", "kind=cam", "--json", data_dir=data, db=db).stdout)
    assert [d["device_id"] for d in listed] == [ident.device_id]
    doc = tmp_path / "desired.yaml"
    doc.write_text("budget: {latency_ms: 40}\nthreshold: 0.6\n")
    out = cli("set", "--device", ident.device_id, str(doc), data_dir=data, db=db).stdout
    assert "version" in out
    shown = json.loads(cli("show", ident.device_id, data_dir=data, db=db).stdout)
    assert shown["desired"]["document"] == {"budget": {"latency_ms": 40}, "threshold": 0.6}
    doc.write_text("treshold: 0.6\n")
    bad = cli("set", "--all", str(doc), data_dir=data, db=db, check=False)
    assert bad.returncode == 1
    assert "treshold" in bad.stderr
    assert "no drift" in cli("drift", data_dir=data, db=db).stdout  # changed just now: not drift yet

    assert proc.call("POST", f"/v1/devices/{ident.device_id}/revoke", token=viewer)[0] == 403
    assert proc.call("POST", f"/v1/devices/{ident.device_id}/revoke", token=admin)[0] == 200
    status, shown = proc.call("GET", f"/v1/devices/{ident.device_id}", token=viewer)
    assert shown["device"]["revoked_at"] is not None
    assert "revoked" in cli("devices", data_dir=data, db=db).stdout
    bad = cli("revoke", "dev-nope", data_dir=data, db=db, check=False)
    assert bad.returncode == 1
    assert "no device 'dev-nope'" in bad.stderr


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_an_agent_that_starts_before_its_fleet_enrolls_once_the_fleet_is_up(db_url: str, tmp_path: Path) -> None:
    data = tmp_path / "fleet-data"
    token = cli("token", "create", "--expires", "1h", data_dir=data, db=db_url).stdout.strip()
    port = _free_port()
    got: dict[str, Any] = {}

    def agent() -> None:
        try:
            got["identity"] = enroll(f"http://127.0.0.1:{port}", token, tmp_path / "dev", retry_s=120)
        except EnrollmentError as exc:
            got["error"] = exc

    booting = threading.Thread(target=agent, daemon=True)
    booting.start()
    time.sleep(1.5)  # refused connections meanwhile: nothing listens on the port yet
    assert booting.is_alive(), got
    proc = FleetProcess(data, db_url, "--http", f"127.0.0.1:{port}").start()
    try:
        booting.join(120)
        assert "identity" in got, got
        assert load_identity(tmp_path / "dev") == got["identity"]
        t0 = time.monotonic()
        with pytest.raises(EnrollmentError, match="unknown"):  # a refusal is not asked again
            enroll(proc.url, "tke_not-a-token", tmp_path / "dev2", retry_s=120)
        assert time.monotonic() - t0 < 30
    finally:
        proc.stop()
    with pytest.raises(EnrollmentError, match=r"cannot reach the fleet at http://127\.0\.0\.1"):
        enroll(f"http://127.0.0.1:{_free_port()}", token, tmp_path / "dev3")  # no retry_s: at once
    t0 = time.monotonic()
    with pytest.raises(EnrollmentError, match=r"fleet URL 'fleet\.example:8080' cannot be used"):  # nor asked again
        enroll("fleet.example:8080", token, tmp_path / "dev4", retry_s=120)
    assert time.monotonic() - t0 < 30


def _serve_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    return parser.parse_args(["fleet", "serve", *argv])


def test_the_broker_account_option_has_one_spelling_and_the_old_one_still_works_with_a_warning() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the current spelling warns about nothing
        assert _serve_args("--mqtt-username", "tierkit-fleet").mqtt_username == "tierkit-fleet"
    with pytest.warns(FutureWarning, match="--mqtt-user is deprecated; use --mqtt-username"):
        assert _serve_args("--mqtt-user", "tierkit-fleet").mqtt_username == "tierkit-fleet"
