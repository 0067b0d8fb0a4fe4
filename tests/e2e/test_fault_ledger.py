"""The fault suite as figures: kept escalations through broker restarts, an agent `kill -9`, a network cut.

Each scenario issues N kept escalations (`predict(keep=True)`, every one escalates) from a device to a
real cloud (`CloudService` with its MQTT bridge) through a real Mosquitto with persistence on: 10
answered live, then the fault, then the other N - 10 (journaled), then the broker or link is back.
Then the journal must drain, and the cloud's ledger must equal the set the device issued with nothing
computed twice:

- ledger: the (device, boot, seq) keys the cloud computed (its duplicate cache holds one per computed
  escalation), and the count it computed (requests - failures - duplicates answered from the cache, with
  the answers computed too late and dropped counted back: those were computed, and cached);
- `keys == issued` and `computed == len(issued)`.

Each prints one line of figures (`-s` shows them): time from the broker (or link) back to the first
journaled escalation answered, and to the journal empty. N = 100 in the default suite; 1,000 (and a
60 s cut) under `make test-all` (marker `slow`). Commands: docs/RELIABILITY.md, "## Faults".
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import sdk
from cloud_service.config import MqttConfig, ServerConfig
from compilers.package import ModelPackage
from edge_agent.agent import AgentOptions
from edge_agent.breaker import BreakerConfig
from edge_agent.policy import Policy
from edge_agent.transports.base import TransportOptions
from testkit import zoo
from testkit.broker import Broker
from testkit.cloud_helpers import ServerThread
from testkit.cloud_helpers import make_package as make_cloud_package
from testkit.delay_proxy import DelayProxy
from testkit.packages import make_package

pytestmark = pytest.mark.mqtt

ALWAYS = Policy("max_prob", threshold=2.0, keep=True)  # every request escalates, and is kept
BUDGET = sdk.Budget(latency_ms=200)
SMALL, LARGE = 100, 1000
RECOVERY_S = 4.0
DEVICE = "ledger-dev"
DRIVER = Path(__file__).resolve().parents[2] / "testkit" / "fault_driver.py"


@pytest.fixture(scope="module")
def edge(digits_linear_onnx: Path, digits: zoo.Split, tmp_path_factory: pytest.TempPathFactory) -> ModelPackage:
    return make_package(digits_linear_onnx, tmp_path_factory.mktemp("edge") / "digits", name="digits",
                        x_val=digits.x_val, y_val=digits.y_val)


@pytest.fixture
def rig(tmp_path: Path, digits_cnn_onnx: Path) -> Iterator[Rig]:
    r = Rig(tmp_path, digits_cnn_onnx)
    try:
        yield r
    finally:
        r.close()


class Rig:
    """Mosquitto (persistence on) and the cloud service bridged to it; the device may go through a proxy."""

    def __init__(self, tmp: Path, cloud_onnx: Path) -> None:
        make_cloud_package(tmp / "models" / "cloud-v1", cloud_onnx, name="cloud")
        self.tmp = tmp
        self.broker = Broker(tmp / "broker").start()
        self.proxy: DelayProxy | None = None
        mqtt = MqttConfig(url=self.broker.url, client_id="ledger-cloud", dedupe_ttl_s=3600,
                          dedupe_max_entries=100_000)
        self.cloud = ServerThread(ServerConfig(models_dir=tmp / "models", grpc_address=None, mqtt=mqtt,
                                               drain_timeout_s=1.0)).start()

    def device_url(self, *, via_proxy: bool = False) -> str:
        if via_proxy:
            self.proxy = DelayProxy(("127.0.0.1", self.broker.port)).start()
            return f"mqtt://127.0.0.1:{self.proxy.port}/cloud"
        return f"{self.broker.url}/cloud"

    def ledger(self) -> tuple[set[tuple[str, str, int]], int]:
        """(keys computed, how many computations) as the cloud counts them."""
        bridge = self.cloud.service._bridge
        assert bridge is not None
        keys = set(self.cloud.call(_keys(bridge)))
        text = self.cloud.metrics_text
        requests = _sum(text, "tierkit_requests_total", 'protocol="mqtt"')
        failures = _sum(text, "tierkit_request_failures_total", 'protocol="mqtt"')
        duplicates = _sum(text, "tierkit_mqtt_duplicates_total", "")
        # An answer computed after its caller's deadline is dropped and counted as a failure
        # (DEADLINE_EXCEEDED), yet it was computed and cached: the device's resend is answered from the cache.
        late = _sum(text, "tierkit_answers_dropped_total", 'protocol="mqtt"')
        return keys, int(requests - (failures - late) - duplicates)

    def close(self) -> None:
        self.cloud.stop()
        if self.proxy is not None:
            self.proxy.stop()
        self.broker.stop()


async def _keys(bridge: Any) -> list[tuple[str, str, int]]:
    return list(bridge._cache._items)


def _sum(text: str, name: str, label: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and label in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def _options(tmp: Path) -> AgentOptions:
    return AgentOptions(device_id=DEVICE, journal_path=tmp / "journal.db", drain_interval_s=0.2,
                        breaker=BreakerConfig(failure_threshold=3, reset_timeout_s=0.5),
                        transport=TransportOptions(reconnect_min_s=0.05, reconnect_max_s=2.0, connect_timeout_s=2.0,
                                                   keepalive_s=10))


def _through_fault(model: sdk.TieredModel, digits: zoo.Split, n: int, fault: Fault,
                   settle_s: float) -> tuple[set[tuple[str, str, int]], float, float]:
    """Issue 10 escalations answered live, take the broker or link down, issue the other n - 10 (each one
    journaled), bring it back after at least `fault.down_s`, then wait for the journal to empty.
    Returns (issued keys, s from back to the first replay answered, s from back to the journal empty)."""
    agent = model.agent
    boot = agent.options.boot_id
    issued: set[tuple[str, str, int]] = set()

    def issue(i: int) -> sdk.Prediction:
        pred = model.predict(digits.x_test[i % len(digits.x_test)], keep=True)
        issued.add((DEVICE, boot, pred.seq))
        return pred

    live = [issue(i) for i in range(10)]
    # On a loaded host a live escalation can miss its 200 ms budget (the process not scheduled): it is then
    # journaled and replayed like the ones during the fault, and the ledger still counts it once.
    missed = sum(p.degraded for p in live)
    assert missed < len(live), [p.reason for p in live]
    fault.down()
    went = time.monotonic()
    assert all(issue(i).degraded for i in range(10, n))
    time.sleep(max(0.0, went + fault.down_s - time.monotonic()))  # the fault lasts down_s: the behaviour under test
    journal = agent.journal
    assert journal is not None
    assert n - 10 <= journal.count() <= n - 10 + missed
    replies_before = agent.stats.late_replies
    fault.up()
    back = time.monotonic()
    first: float | None = None
    empty = float("nan")
    while time.monotonic() < back + settle_s:
        now = time.monotonic()
        if first is None and agent.stats.late_replies > replies_before:
            first = now - back
        if not journal.count():
            empty = now - back
            break
        time.sleep(0.005)  # a poll that times the replay (first answer, journal empty), bounded by settle_s
    assert not journal.count(), f"{journal.count()} escalations still journaled {settle_s} s after the fault"
    return issued, float("nan") if first is None else first, empty


def _check(rig: Rig, issued: set[tuple[str, str, int]], name: str, first: float, empty: float) -> None:
    time.sleep(0.5)  # room for a duplicate to show up (nothing to wait for: it must not come)
    keys, computed = rig.ledger()
    print(f"\nfault={name} issued={len(issued)} computed={computed} "
          f"first_replay_answered_s={first:.2f} journal_empty_s={empty:.2f}")
    assert keys == issued, (sorted(issued - keys)[:5], sorted(keys - issued)[:5])
    assert computed == len(issued), "an escalation was computed twice"
    # The bounds, from measurement (100 escalations; docs/RELIABILITY.md has the runs alone). First replay
    # answered: 0.06-1.23 s alone; the 3 s network cut 1.24-1.45 s in three runs at load average 15-18 on 2 cores
    # (another test run beside it); 5.7-7.3 s before the agent's reconnect and drain were fixed (paho's
    # doubling backoff, no bridge session, a 5 s drain timeout behind an open breaker). The bound sits
    # between: RECOVERY_S.
    assert first < RECOVERY_S, f"the first journaled escalation was answered {first:.1f} s after the fault ended"
    # Journal empty: 0.19-1.38 s alone; the network cut 4.93-5.09 s in three runs at load average 15-18. The drain is
    # paced (AgentOptions.drain_rate_per_s, so that a reconnecting fleet does not flood the cloud): the
    # bound is RECOVERY_S plus the paced drain of everything issued (9 s at 100). Tight figures:
    # docs/RELIABILITY.md's runs alone.
    drain_s = len(issued) / AgentOptions(device_id=DEVICE).drain_rate_per_s
    assert empty < RECOVERY_S + drain_s, f"the journal emptied {empty:.1f} s after the fault ended"


def _run(rig: Rig, edge: ModelPackage, digits: zoo.Split, n: int, name: str, fault: Fault, *,
         via_proxy: bool = False, settle_s: float = 60.0) -> None:
    with sdk.load(edge.directory, cloud=rig.device_url(via_proxy=via_proxy), budget=BUDGET, policy=ALWAYS,
                  options=_options(rig.tmp)) as model:
        issued, first, empty = _through_fault(model, digits, n, fault, settle_s)
    _check(rig, issued, name, first, empty)


@dataclass(frozen=True)
class Fault:
    down: Callable[[], None]
    up: Callable[[], None]
    down_s: float = 0.5


def _graceful(rig: Rig) -> Fault:
    return Fault(rig.broker.stop, rig.broker.start)  # SIGTERM: Mosquitto saves its persistence file


def _kill_9(rig: Rig) -> Fault:
    def kill() -> None:
        proc = rig.broker.proc
        assert proc is not None
        proc.kill()
        proc.wait(5)
        if proc.stderr is not None:
            proc.stderr.close()
        rig.broker.proc = None

    return Fault(kill, rig.broker.start)


def _cut(rig: Rig, seconds: float) -> Fault:
    def mode(m: str) -> Callable[[], None]:
        def apply() -> None:
            assert rig.proxy is not None
            rig.proxy.set(mode=m)  # blackhole: connections reset, new ones accepted and never answered
        return apply

    return Fault(mode("blackhole"), mode("up"), down_s=seconds)


@pytest.mark.parametrize("n", [SMALL, pytest.param(LARGE, marks=pytest.mark.slow)])
def test_graceful_broker_restart(rig: Rig, edge: ModelPackage, digits: zoo.Split, n: int) -> None:
    _run(rig, edge, digits, n, f"graceful-restart-{n}", _graceful(rig))


@pytest.mark.parametrize("n", [SMALL, pytest.param(LARGE, marks=pytest.mark.slow)])
def test_broker_kill_9_with_persistence(rig: Rig, edge: ModelPackage, digits: zoo.Split, n: int) -> None:
    _run(rig, edge, digits, n, f"broker-kill-9-{n}", _kill_9(rig))


@pytest.mark.parametrize(("n", "cut_s"), [(SMALL, 3.0), pytest.param(LARGE, 60.0, marks=pytest.mark.slow)])
def test_network_cut(rig: Rig, edge: ModelPackage, digits: zoo.Split, n: int, cut_s: float) -> None:
    _run(rig, edge, digits, n, f"network-cut-{cut_s:.0f}s-{n}", _cut(rig, cut_s), via_proxy=True,
         settle_s=60.0 + cut_s)


# -- the agent killed with kill -9 at a random instant ------------------------------------------------------


def _driver(rig: Rig, edge: ModelPackage, start: int, count: int, *, finish: bool) -> subprocess.Popen[str]:
    spec = {"model": str(edge.directory), "cloud": rig.device_url(), "journal": str(rig.tmp / "journal.db"),
            "device": DEVICE, "start": start, "count": count, "finish": finish}
    return subprocess.Popen([sys.executable, str(DRIVER), json.dumps(spec)], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def _read(proc: subprocess.Popen[str], acked: set[tuple[str, str, int]], until: Callable[[int], bool]) -> str:
    """Collect `ok BOOT SEQ` lines until `until(lines seen)` or the process ends; returns its boot id."""
    assert proc.stdout is not None
    boot, seen = "", 0
    for line in proc.stdout:
        words = line.split()
        if words[:1] == ["boot"]:
            boot = words[1]
        elif words[:1] == ["ok"]:
            acked.add((DEVICE, words[1], int(words[2])))
            seen += 1
            if until(seen):
                break
        elif words[:1] == ["drained"]:
            break
    return boot


@pytest.mark.parametrize(("n", "kills"), [(SMALL, 3), pytest.param(LARGE, 10, marks=pytest.mark.slow)])
def test_agent_kill_9_at_random_instants(rig: Rig, edge: ModelPackage, n: int, kills: int) -> None:
    rng = random.Random(15)
    acked: set[tuple[str, str, int]] = set()
    boots: list[str] = []
    per = n // (kills + 1)
    for k in range(kills):
        proc = _driver(rig, edge, k * per, per, finish=False)
        stop_at = rng.randint(1, per - 1)
        boots.append(_read(proc, acked, lambda seen, s=stop_at: seen >= s))
        time.sleep(rng.uniform(0.0, 0.02))  # a random instant: between two requests or inside one
        proc.kill()
        proc.wait(10)
        _read(proc, acked, lambda seen: False)  # answers it printed before it died, still in the pipe
        assert proc.stdout is not None
        proc.stdout.close()
    # the last run issues the rest (those the killed runs never reached), drains the journal and exits
    proc = _driver(rig, edge, kills * per, n - len(acked), finish=True)
    boots.append(_read(proc, acked, lambda seen: False))
    assert proc.wait(120) == 0
    assert proc.stdout is not None
    proc.stdout.close()
    time.sleep(0.5)  # room for a duplicate to show up (nothing to wait for: it must not come)
    keys, computed = rig.ledger()
    print(f"\nfault=agent-kill-9-x{kills} acked={len(acked)} computed={computed} in_flight_at_kill={len(keys - acked)}")
    assert acked <= keys, sorted(acked - keys)[:5]  # every answer the app got was computed by the cloud
    # beyond those, at most the one request in flight at each kill (journaled ahead, delivered after restart)
    extra = keys - acked
    assert len(extra) <= kills
    assert len({boot for _, boot, _ in extra}) == len(extra)
    assert {boot for _, boot, _ in extra} <= set(boots)
    assert computed == len(keys), "an escalation was computed twice"

