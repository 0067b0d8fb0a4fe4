"""Crash matrix: `kill -9` a real `tierkit agent` process at each swap state, restart it, and check that it
serves a working model and reports the right state, never none.

The device first commits release r1 (in-process, the same state directory), then a real agent process is
told (retained desired state on a real Mosquitto) to take r2 and stopped at a swap state by the test hook
`TIERKIT_TEST_SWAP_PAUSE_AT`, killed there, and started again without the hook. The default suite runs
three representative states; the slow marker runs them all.
"""

from __future__ import annotations

import asyncio
import json
import os
import queue
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from cloud_service.protocol import encode_request, get_parameters, inference_pb2_grpc, topics
from edge_agent.cli import PAUSE_ENV
from edge_agent.config import load_config
from edge_agent.daemon import AgentDaemon
from edge_agent.slots import RESTARTED
from testkit import waiting, zoo
from testkit.release_server import ReleaseServer
from testkit.releases import DEVICE, PASSWORD, USER, Kit, build_kit, device_config

pytestmark = pytest.mark.mqtt
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def kit(digits_linear_onnx: Path, digits: zoo.Split, tmp_path_factory: pytest.TempPathFactory) -> Kit:
    return build_kit(tmp_path_factory.mktemp("releases"), digits_linear_onnx, digits)


@pytest.fixture(scope="module")
def server(kit: Kit) -> Iterator[ReleaseServer]:
    with ReleaseServer({USER: PASSWORD}) as s:
        s.archives.update({kit.digests[k]: kit.archives[k] for k in ("r1", "r2")})
        yield s


def wait_for(what: str, check: Callable[[], Any], timeout: float = 30.0) -> Any:
    return waiting.wait_for(what, check, timeout, interval=0.05)


class Agent:
    """`tierkit agent` as a child process, its output in a log file."""

    def __init__(self, config: Path, log: Path, env: dict[str, str]) -> None:
        self.log_path = log
        self._log = log.open("ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "sdk.cli", "agent", "--config", str(config)],
                                     stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)

    def port(self) -> int:
        def found() -> int | None:
            assert self.proc.poll() is None, self.log_path.read_text()[-3000:]
            m = re.findall(r"serving .* on 127\.0\.0\.1:(\d+)", self.log_path.read_text())
            return int(m[-1]) if m else None

        return int(wait_for("the agent to serve", found, timeout=60))

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(20)
        finally:
            self._log.close()


def infer(port: int, x: Any, param: str = "tierkit.variant") -> str:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = inference_pb2_grpc.GRPCInferenceServiceStub(channel)  # type: ignore[no-untyped-call]
        reply = stub.ModelInfer(encode_request("digits", {"x": x}, request_id="crash"), timeout=10)
    return str(get_parameters(reply.parameters)[param])


def _commit_r1(config: Path, kit: Kit, x: Any) -> None:
    async def main() -> None:
        async with AgentDaemon(load_config(config)) as daemon:
            daemon.sync.on_desired("", json.dumps({"release": kit.digests["r1"], "soak": {"requests": 1}}).encode(),
                                   None)
            deadline = time.monotonic() + 30
            while daemon.slots is not None and (daemon.slots.state.swap or {}).get("state") != "committed":
                assert time.monotonic() < deadline, daemon.slots.state.swap
                if daemon.release is not None:
                    await daemon.agent.infer(x)
                await asyncio.sleep(0.02)  # pacing: the soak counts these requests

    asyncio.run(main())


def _crash_at(state: str, kit: Kit, server: ReleaseServer, broker: Any, digits: zoo.Split, tmp_path: Path) -> None:
    import paho.mqtt.client as mqtt

    x = digits.x_test[:1]
    config = device_config(tmp_path, kit.local, server.url, [kit.pub], broker=broker.url)
    _commit_r1(config, kit, x)
    journal = tmp_path / "state" / "swap.json"
    reports: queue.Queue[dict[str, Any]] = queue.Queue()
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="operator", protocol=mqtt.MQTTv5)
    windows: queue.Queue[dict[str, Any]] = queue.Queue()
    client.on_message = lambda c, u, m: (windows if m.topic.endswith("/telemetry") else reports).put(
        json.loads(m.payload))
    client.connect(broker.host, broker.port)
    client.subscribe([(topics.reported_topic(DEVICE), 1), (topics.telemetry_topic(DEVICE), 1)])
    client.loop_start()
    desired = {"release": kit.digests["r2"], "soak": {"requests": 3}, "version": 2}
    client.publish(topics.desired_topic(DEVICE), json.dumps(desired), qos=1, retain=True).wait_for_publish(5)
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    try:
        first = Agent(config, tmp_path / "agent.log", {**env, PAUSE_ENV: state})
        try:
            port = first.port()

            def at_state() -> bool:
                swap = json.loads(journal.read_text()).get("swap") or {}
                if state == "committed":
                    infer(port, x)  # the soak counts requests
                return swap.get("state") == state and swap.get("target") == kit.digests["r2"]

            wait_for(f"the swap to stop at {state}", at_state)
        finally:
            first.stop(signal.SIGKILL)
        for q in (reports, windows):
            while not q.empty():
                q.get()
        second = Agent(config, tmp_path / "agent2.log", env)
        try:
            port = second.port()
            variant = infer(port, x)  # a working model at once
            assert variant in ("lin", "lin2")
            if state in ("active", "soaking"):
                expect = {"release": kit.digests["r1"], "state": "rolled_back"}
            else:  # before active: the staging is redone and the soak finishes; after commit: it runs
                expect = {"release": kit.digests["r2"], "state": "committed"}
            seen: list[dict[str, Any]] = []

            def reported() -> bool:
                while not reports.empty():
                    seen.append(reports.get())
                last = seen[-1] if seen else {}
                done = (last.get("release") == expect["release"]
                        and (last.get("swap") or {}).get("state") == expect["state"])
                if not done and expect["state"] == "committed":
                    infer(port, x)  # drives the redone swap's soak
                return done

            wait_for(f"the report after a kill at {state}: {expect}", reported)
            assert all(r["release"] in (kit.digests["r1"], kit.digests["r2"]) for r in seen), seen  # never none
            assert seen[-1]["crashes"] == 1
            assert seen[-1]["slots"]["A"] == kit.digests["r1"]
            assert (seen[-1]["golden"] or {}).get("ok") is True, seen[-1]  # re-run after the restart
            assert infer(port, x, "tierkit.release") == expect["release"]  # answers name the release that ran
            if state in ("active", "soaking"):
                assert seen[-1]["swap"]["error"] == RESTARTED
                assert seen[-1]["swap"]["target"] == kit.digests["r2"]
                assert infer(port, x) == "lin"
                # the rolled-back report can come before the retained desired document arrives: wait until a
                # report says the restarted agent applied it, then leave it room to take r2 again (it must not)
                wait_for("the restarted agent to apply the retained desired document (version 2)",
                         lambda: reported() and any(r.get("desired_version") == desired["version"] for r in seen))
                time.sleep(0.5)  # room for a swap to start (nothing to wait for: it must not come)
                reported()
                assert seen[-1]["release"] == kit.digests["r1"], seen[-1]
                assert (seen[-1]["swap"] or {}).get("state") == "rolled_back", seen[-1]
                assert json.loads(journal.read_text())["active"] == "A"
            else:
                assert infer(port, x) == "lin2"
            # the window that counts the kill may come after others (the killed agent's last one, still in
            # flight at the drain above): on a loaded host the first window taken counted none. Take windows
            # until the restarted agent's first one has counted it.
            got: list[dict[str, Any]] = []

            def kill_counted() -> bool:
                while not windows.empty():
                    got.append(windows.get())
                return any(w["crashes"] for w in got)

            wait_for("the restarted agent's telemetry window counting the kill", kill_counted)
            assert sum(w["crashes"] for w in got) == 1  # the restart's first window counts the kill
            assert {w["release"] for w in got} <= {kit.digests["r1"], kit.digests["r2"]}
        finally:
            rc = second.stop()
        assert rc == 0, (tmp_path / "agent2.log").read_text()[-3000:]
        assert not (tmp_path / "state" / "running").exists()  # a clean stop
    finally:
        client.loop_stop()
        client.disconnect()
        client._reset_sockets()  # paho leaves its socket pair (and a late connection) to gc


@pytest.mark.parametrize("state", ["staged", "soaking", "committed"])
def test_kill_9_at_a_swap_state_ends_on_a_working_model(state: str, kit: Kit, server: ReleaseServer, broker: Any,
                                                         digits: zoo.Split, tmp_path: Path) -> None:
    _crash_at(state, kit, server, broker, digits, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("state", ["downloading", "verifying", "golden", "active"])
def test_kill_9_at_every_other_swap_state(state: str, kit: Kit, server: ReleaseServer, broker: Any,
                                          digits: zoo.Split, tmp_path: Path) -> None:
    _crash_at(state, kit, server, broker, digits, tmp_path)
