"""Rollouts end to end: a real fleet process, a real Mosquitto, simulated devices speaking the contract.

One fleet of eight devices serves every test, in this order: the bad releases and the manual
rollback leave it on release 1; then a good release; then the catch-up test.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from testkit.fleet_process import cli
from testkit.rollout_device import GOLDEN_FAILS, HEALTHY, MORE_ESCALATIONS, SLOW, Behaviour
from testkit.rollout_harness import RolloutFleet

pytestmark = pytest.mark.mqtt


def _done(fleet: RolloutFleet, rid: int, state: str) -> dict[str, Any] | None:
    shown = fleet.show(rid)
    return shown if shown["state"] == state else None


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RolloutFleet]:
    with RolloutFleet(tmp_path_factory.mktemp("rollouts"), 8, online_after="2s") as f:
        yield f


@pytest.mark.parametrize(("bad", "gate"), [(GOLDEN_FAILS, "device_verifies"), (MORE_ESCALATIONS, "escalation_rate"),
                                           (SLOW, "p95_vs_control")], ids=["golden", "escalation", "p95"])
def test_a_bad_release_is_stopped_at_the_canary_and_rolled_back(fleet: RolloutFleet, bad: Behaviour,
                                                                 gate: str) -> None:
    release = fleet.release(bad)
    rid = fleet.deploy(release, waves="1,50%,100%")
    shown = fleet.wait("the rollout to fail", lambda: _done(fleet, rid, "rolled_back"), timeout=60)
    fail = next(d for d in shown["decisions"] if d["kind"] == "fail")
    failed = {g["gate"] for g in fail["figures"]["gates"] if g["ok"] is False}
    assert gate in failed, fail
    ran = [d for d in fleet.devices if release in d.ran]
    assert len(ran) <= 2  # the canary plus one, at most
    assert len(ran) == (0 if bad is GOLDEN_FAILS else 1)
    fleet.wait("every device back on release 1", lambda: all(d.running == fleet.first for d in fleet.devices))
    shown = fleet.wait("the rollout to record the restore",
                       lambda: (s := fleet.show(rid))["states"].get("rollback") is None and s)
    assert shown["waves"][0]["state"] == "failed"
    assert shown["waves"][1]["state"] == "pending"
    assert set(shown["states"]) <= {"restored", "kept"}
    assert any(d["kind"] == "restored" for d in shown["decisions"]) or bad is GOLDEN_FAILS


def test_pause_resume_and_rollback_by_hand(fleet: RolloutFleet) -> None:
    good = fleet.release(HEALTHY)
    out = cli("deploy", good[:20], "--label", "kind=cam", "--waves", "1,100%", "--soak", "100000",  # never ends
              data_dir=fleet.data).stdout
    rid = int(out.split()[1].rstrip(":"))
    fleet.wait("the canary to take it", lambda: any(good in d.ran for d in fleet.devices))
    assert fleet.api("POST", f"/v1/rollouts/{rid}/pause")["state"] == "paused"
    status, body = fleet.fleet.call("POST", f"/v1/rollouts/{rid}/pause", token=fleet.admin)
    assert status == 409
    assert "paused" in body["error"]
    assert fleet.api("POST", f"/v1/rollouts/{rid}/resume")["state"] == "running"
    fleet.api("POST", f"/v1/rollouts/{rid}/rollback")
    shown = fleet.wait("the manual rollback", lambda: _done(fleet, rid, "rolled_back"))
    assert [d["kind"] for d in shown["decisions"] if d["kind"] != "observe"][-1] in ("rollback", "restored")
    fleet.wait("every device back on release 1", lambda: all(d.running == fleet.first for d in fleet.devices))
    reader = fleet.facade.registry.create_operator_token("viewer", "read")
    assert fleet.fleet.call("POST", f"/v1/rollouts/{rid}/resume", token=reader)[0] == 403


def test_a_good_release_rolls_through_every_wave(fleet: RolloutFleet) -> None:
    good = fleet.release(HEALTHY)
    rid = fleet.deploy(good)
    shown = fleet.wait("the rollout to succeed", lambda: _done(fleet, rid, "succeeded"), timeout=90,
                       rollout=rid)
    assert [w["state"] for w in shown["waves"]] == ["passed", "passed", "passed"]
    assert [w["size"] for w in shown["waves"]] == [1, 2, 8]
    assert shown["states"] == {"committed": 8}
    assert shown["previous"] == fleet.first
    kinds = [d["kind"] for d in shown["decisions"] if d["kind"] != "observe"]
    assert kinds == ["start", "pass", "pass", "pass", "done"]
    canary = shown["waves"][0]
    gates = {g["gate"]: g for g in canary["gates"]}
    assert canary["figures"]["control_kind"] == "cohort"  # seven devices still on release 1
    assert gates["escalation_rate"]["ok"] is True
    assert gates["escalation_rate"]["control"] == pytest.approx(0.15, abs=0.02)
    assert gates["escalation_rate"]["pass_upper"] < 0.05 or gates["escalation_rate"]["evidence"] >= 2500
    assert gates["p95_budget"]["limit"] == 25.0
    # the last wave is judged against the devices of the earlier waves (their release does not change during it)
    assert shown["waves"][2]["figures"]["control_kind"] == "earlier waves"
    fleet.wait("every device on the release", lambda: all(d.running == good for d in fleet.devices))
    text = cli("rollout", "show", str(rid), data_dir=fleet.data).stdout
    assert f"rollout {rid}: succeeded" in text
    assert "control: cohort" in text
    assert "escalation_rate" in text
    assert "FAIL" not in text
    assert f"{rid}  succeeded" in cli("rollouts", data_dir=fleet.data).stdout


def test_offline_devices_catch_up_when_they_return(fleet: RolloutFleet) -> None:
    away = fleet.devices[:2]
    before = away[0].running
    for d in away:
        d.stop()
    time.sleep(2.5)  # past --online-after: the fleet sees them offline
    good = fleet.release(HEALTHY)
    rid = fleet.deploy(good, waves="1,50%,100%")
    shown = fleet.wait("the rollout to succeed", lambda: _done(fleet, rid, "succeeded"), timeout=90,
                       rollout=rid)
    assert shown["states"] == {"committed": 6, "catch_up": 2}
    assert all(d.running == before for d in away)
    for d in away:
        d.start()
    fleet.wait("the returning devices to converge", lambda: all(d.running == good for d in fleet.devices))
    fleet.wait("the rollout to record them", lambda: fleet.show(rid)["states"] == {"committed": 8})


@pytest.mark.slow
@pytest.mark.parametrize("db_url", ["sqlite", "postgresql"], indirect=True)
def test_twenty_devices_every_wave_then_a_bad_release(tmp_path: Path, db_url: str) -> None:
    with RolloutFleet(tmp_path, 20, db_url=None if db_url.startswith("sqlite") else db_url) as fleet:
        good = fleet.release(HEALTHY)
        rid = fleet.deploy(good, waves="1,5%,25%,100%")
        shown = fleet.wait("the rollout to succeed", lambda: _done(fleet, rid, "succeeded"), timeout=180,
                           rollout=rid)
        assert [w["size"] for w in shown["waves"]] == [1, 2, 5, 20]  # each wave adds one device at least
        assert shown["states"] == {"committed": 20}
        for bad in (MORE_ESCALATIONS, SLOW, GOLDEN_FAILS):
            release = fleet.release(bad)
            rid = fleet.deploy(release, waves="1,5%,25%,100%")
            fleet.wait("the rollout to fail", lambda rid=rid: _done(fleet, rid, "rolled_back"), timeout=120)
            assert sum(release in d.ran for d in fleet.devices) <= 2
            fleet.wait("every device back", lambda: all(d.running == good for d in fleet.devices))
