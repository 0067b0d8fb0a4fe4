"""Rollouts with real `tierkit agent` processes: the fleet's release, downloaded with the device's MQTT
credentials, verified with the operators' key, committed after the soak, and rolled back by hand (the
device goes back to its configured model). A real fleet process and a real Mosquitto with the fleet's ACL.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import grpc
import numpy as np
import pytest

from cloud_service.protocol import encode_request, get_parameters, inference_pb2_grpc
from edge_agent.fleet_sync import enroll
from testkit.fleet_process import ROOT
from testkit.rollout_harness import RolloutFleet

pytestmark = pytest.mark.mqtt


def _variant(port: int) -> str:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = inference_pb2_grpc.GRPCInferenceServiceStub(channel)  # type: ignore[no-untyped-call]
        reply = stub.ModelInfer(encode_request("digits", {"x": np.zeros((1, 64), np.float32)}), timeout=10)
    return str(get_parameters(reply.parameters)["tierkit.variant"])


def test_a_real_agent_takes_a_release_and_is_rolled_back_by_hand(tmp_path: Path) -> None:
    with RolloutFleet(tmp_path, 0, online_after="5s") as fleet:
        state = tmp_path / "agent-state"
        enroll(fleet.fleet.url, fleet.facade.registry.create_token({"kind": "cam"}), state)
        (tmp_path / "agent.yaml").write_text(
            f"model: {fleet.variants}\nlisten: 127.0.0.1:0\nbroker: mqtt://{fleet.broker.host}:{fleet.broker.port}\n"
            f"telemetry_interval_s: 1\nthreads: 1\n"
            f"fleet: {{url: '{fleet.fleet.url}', state_dir: '{state}', release_keys: ['{tmp_path / 'ops.pub'}']}}\n")
        env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        with (tmp_path / "agent.log").open("wb") as log:
            argv = [sys.executable, "-m", "sdk.cli", "agent", "--config", str(tmp_path / "agent.yaml")]
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
            try:
                found = fleet.wait("the agent to serve", lambda: proc.poll() is None and re.findall(
                    r"serving .* on 127\.0\.0\.1:(\d+)", (tmp_path / "agent.log").read_text()))
                port = int(found[-1])
                fleet.wait("the fleet to hear the agent", lambda: any(
                    d["online"] for d in fleet.api("GET", "/v1/devices")), timeout=30)
                rid = fleet.deploy(fleet.first, waves="100%", soak="2s")
                fleet.wait("the agent to commit the release", lambda: fleet.show(rid)["states"] == {"committed": 1})
                journal = json.loads((state / "swap.json").read_text())
                assert (journal["slots"]["A"], journal["active"], journal["committed"]) == (fleet.first, "A", "A")
                assert _variant(port) == "fp32"
                fleet.api("POST", f"/v1/rollouts/{rid}/rollback")
                shown = fleet.wait("the agent back on its configured model",
                                   lambda: (s := fleet.show(rid))["states"] == {"restored": 1} and s)
                assert shown["state"] == "rolled_back"
                assert _variant(port) == "fp32"  # it serves throughout
                journal = json.loads((state / "swap.json").read_text())
                assert (journal["active"], journal["committed"]) == (None, None)  # its configured model again
                assert journal["slots"]["A"] == fleet.first  # kept for a later pointer flip
            finally:
                proc.terminate()
                rc = proc.wait(20)
        assert rc == 0, (tmp_path / "agent.log").read_text()[-3000:]
        assert not (state / "running").exists()
