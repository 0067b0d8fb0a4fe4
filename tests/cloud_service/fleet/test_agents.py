"""A fleet of real `tierkit agent` processes: enroll with tokens, report, take a label-scoped desired change.

The default suite runs 4 agents; the slow marker runs 20 (make test-all).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from compilers.package import ModelPackage
from edge_agent.fleet_sync import model_digest
from testkit import zoo
from testkit.broker import Broker
from testkit.fleet_process import ROOT, FleetProcess, cli
from testkit.packages import make_package
from testkit.waiting import wait_for

pytestmark = pytest.mark.mqtt


@pytest.fixture(scope="module")
def package(digits_linear_onnx: Path, digits: zoo.Split, tmp_path_factory: pytest.TempPathFactory) -> ModelPackage:
    return make_package(digits_linear_onnx, tmp_path_factory.mktemp("pkg") / "digits", name="digits",
                        x_val=digits.x_val, y_val=digits.y_val)


def _agents(n: int, stack: tuple[FleetProcess, Broker, Path, str], package: ModelPackage, tmp_path: Path) -> None:
    fleet, broker, data, db = stack
    admin = cli("operator", "create", "ops", "--role", "admin", data_dir=data, db=db).stdout.strip()
    wait_for("the fleet's broker connection", lambda: fleet.call("GET", "/v1/stats", token=admin)[1]["mqtt_connected"])
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    procs: list[subprocess.Popen[bytes]] = []
    logs = []
    try:
        for i in range(n):
            site = "berlin" if i % 2 == 0 else "paris"
            token = cli("token", "create", "--labels", f"site={site},kind=cam", "--expires", "10m",
                        data_dir=data, db=db).stdout.strip()
            d = tmp_path / f"agent{i}"
            d.mkdir()
            (d / "agent.yaml").write_text(
                f"model: {package.directory}\nlisten: 127.0.0.1:0\nbroker: mqtt://{broker.host}:{broker.port}\n"
                "telemetry_interval_s: 1\nthreads: 1\n")
            log = (d / "agent.log").open("wb")
            logs.append(log)
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "sdk.cli", "agent", "--config", str(d / "agent.yaml"), "--enroll", fleet.url,
                 "--token", token, "--fleet-state", str(d / "state")], stdout=log, stderr=subprocess.STDOUT, env=env))

        def devices() -> list[dict[str, Any]]:
            return list(fleet.call("GET", "/v1/devices", token=admin)[1])

        def all_online() -> bool:
            ds = devices()
            dead = [k for k, p in enumerate(procs) if p.poll() is not None]
            tails = {k: (tmp_path / f"agent{k}" / "agent.log").read_text(errors="replace")[-1500:] for k in dead}
            assert not dead, f"agents exited: {tails}"
            return len(ds) == n and all(d["online"] for d in ds)

        # bounds against a hang, not timing claims: at load average ~20 four agents did not all report in 76 s
        wait_for(f"{n} agents enrolled and reporting telemetry", all_online, timeout=120 + 15 * n)
        devs = devices()
        assert {d["labels"]["site"] for d in devs} == {"berlin", "paris"}
        assert all(d["hardware"].get("logical_cores") for d in devs)  # the `tierkit doctor` profile
        ids = {d["device_id"] for d in devs}

        def windows_from_all() -> bool:  # online comes with the first status; a window takes its interval more
            windows = fleet.call("GET", "/v1/telemetry?label=kind=cam", token=admin)[1]["windows"]
            return {w["device_id"] for w in windows} == ids

        wait_for("a telemetry window from every agent, and from no one else", windows_from_all, timeout=30)

        status, body = fleet.call("PUT", "/v1/desired", {"selector": "site=berlin",
                                                         "document": {"threshold": 0.61, "budget": {"latency_ms": 80}}},
                                  token=admin)
        assert status == 200
        berlin = {d["device_id"] for d in devs if d["labels"]["site"] == "berlin"}

        def applied() -> bool:
            ds = {d["device_id"]: d for d in devices()}
            return all(ds[b]["reported_version"] == body["version"] and ds[b]["threshold"] == 0.61 for b in berlin)

        wait_for("berlin agents to report the change applied", applied, timeout=60 + n)
        digest = model_digest(Path(package.directory))
        # every agent reports what it runs at its first connection, desired document or not
        wait_for("every agent's reported model", lambda: all(d["model_digest"] == digest for d in devices()),
                 timeout=60)
        for d in devices():
            if d["device_id"] not in berlin:
                assert d["reported_version"] is None  # no layer selects paris: nothing sent, nothing applied
        assert fleet.call("GET", "/v1/drift", token=admin)[1] == []
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        for p in procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        for log in logs:
            log.close()


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_small_fleet_of_agents(stack: tuple[FleetProcess, Broker, Path, str], package: ModelPackage,
                               tmp_path: Path) -> None:
    _agents(4, stack, package, tmp_path)


@pytest.mark.slow
def test_fleet_of_twenty_agents(stack: tuple[FleetProcess, Broker, Path, str], package: ModelPackage,
                                tmp_path: Path) -> None:
    _agents(20, stack, package, tmp_path)
