"""A small wave's pre-swap audit phase, in-process on a simulated clock: six devices publish a window a second
(with audits at the share their effective desired document names) into the real telemetry store and the engine
steps once a second.

- Before the canary gets the release, it audits at the rollout's raised rate on the release it runs, until the
  whole-stream gate's baseline error is within a sixth of its margin (or `pre_swap_s`), then swaps; both ends
  are `pre_swap` decisions ("pre-swap audit phase: N audits in T s").
- At its cap it swaps with the baseline it has; a rollback asked during the phase gives the devices their own
  audit share again.
- The whole-stream gate weighs windows by their audits: minutes at 50 % narrow a baseline of an hour at 1 %.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cloud_service.fleet.gates import Arms, Evidence, Margins, baseline_errors
from cloud_service.fleet.rollout_engine import RolloutEngine
from cloud_service.fleet.rollouts import make_options
from cloud_service.fleet.store import FleetStore
from testkit.rollout_harness import rollout_states, two_releases

T0 = 1_800_000_000.0
BASELINE_S = 120
OWN_AUDIT_RATE = 0.05  # the devices' own share (the agent's default is 1 %; scaled with the 120 s baseline)


@pytest.fixture
def store(sqlite_store: FleetStore) -> FleetStore:
    """SQLite only: the engine's decisions do not depend on the database (test_rollout_engine.py runs both)."""
    return sqlite_store


class _Sim:
    """Six devices on `first`, each taking the release and the audit share its effective desired document names
    at once. Windows: 100 inferences, escalation 0.2, 1 % of confident answers answered otherwise by the cloud."""

    def __init__(self, store: FleetStore, tmp: Path, n: int = 6, own: float = OWN_AUDIT_RATE) -> None:
        self.own = own
        f = two_releases(store, tmp, n)
        self.reg, self.devices, self.desired, self.releases = f.reg, f.devices, f.desired, f.releases
        self.first, self.second = f.first, f.second
        self.store, self.tel, self.rollouts = store, f.tel, f.rollouts
        self.running = dict.fromkeys(self.devices, self.first)
        self.rate = dict.fromkeys(self.devices, own)
        self.rng, self.seq, self.now = np.random.default_rng(3), 0, T0
        self.windows: list[dict[str, Any]] = []
        for d in self.devices:
            self.desired.record_reported(d, {"release": self.first}, now=self.now)
        for _ in range(BASELINE_S):
            self.tick()

    def tick(self) -> None:
        self.now += 1.0
        self.seq += 1
        batch = []
        for d in self.devices:
            doc = (self.desired.effective(self.reg.device(d)) or {}).get("document", {})
            want = doc.get("release") or self.first
            if want != self.running[d]:
                self.running[d] = want
                self.desired.record_reported(d, {"release": want}, now=self.now)
            rate = doc.get("audit_rate")
            self.rate[d] = self.own if rate is None else float(rate)
            n = 100
            esc = int(self.rng.binomial(n, 0.2))
            audits = int(self.rng.binomial(n - esc, self.rate[d]))
            w = {"device": d, "boot_id": "b", "seq": self.seq, "ts": self.now, "window_s": 1.0, "requests": n,
                 "edge": n - esc, "cloud": esc, "compared": esc, "escalation_rate": esc / n, "agreement": 0.9,
                 "p95_ms": 5.0 * math.exp(float(self.rng.normal(0, 0.02))), "p50_ms": 2.5,
                 "energy_mj_per_request": 2.0, "audits": audits, "audit_rate": self.rate[d],
                 "audit_disagreed": int(self.rng.binomial(audits, 0.01)), "release": self.running[d]}
            self.windows.append(w)
            batch.append((d, json.dumps(w).encode(), self.now))
        assert self.tel.ingest(batch).stored == len(batch)

    def run(self, rid: int, engine: RolloutEngine, seconds: int, *, until: Any = None) -> dict[str, Any]:
        for _ in range(seconds):
            if self.rollouts.get(rid)["state"] != "running" or (until is not None and until()):
                break
            self.tick()
            engine.step(now=self.now)
        return self.rollouts.show(rid)

    def states(self, rid: int) -> dict[str, str]:
        return rollout_states(self.store, rid)


def _deploy(sim: _Sim, **options: Any) -> tuple[int, RolloutEngine]:
    opts = make_options(waves="1,50%,100%", soak="20", margins={"min_requests": 20},
                        evidence={"bucket_s": 1.0, "warmup_windows": 1, "warmup_s": 2.0, "plan": 0.2, "block_s": 12.0},
                        **options)
    rid = sim.rollouts.deploy(sim.second, {}, opts)
    return rid, RolloutEngine(sim.store, sim.desired, sim.releases, holder="e", online_after_s=30)


def _pre_swap(shown: dict[str, Any], wave: int = 0) -> list[dict[str, Any]]:
    return [d for d in shown["decisions"] if d["kind"] == "pre_swap" and d["wave"] == wave]


def test_the_canary_audits_at_the_raised_rate_on_the_previous_release_before_its_swap(store: FleetStore,
                                                                                       tmp_path: Path) -> None:
    sim = _Sim(store, tmp_path)
    rid, engine = _deploy(sim, pre_swap_s=120)
    shown = sim.run(rid, engine, 400)
    assert shown["state"] == "succeeded", (shown["reason"], shown["waves"])
    start, end = _pre_swap(shown)
    assert (start["figures"]["phase"], end["figures"]["phase"]) == ("start", "end")
    (canary,) = start["figures"]["devices"]
    # the phase ended because the baseline was narrow enough, not at its cap
    (err,) = end["figures"]["baseline"]
    assert err["gate"] == "audit_agreement"
    assert err["ok"]
    assert err["se"] <= err["limit"]
    assert 0 < end["figures"]["seconds"] < 120
    assert end["note"] == f"pre-swap audit phase: {end['figures']['audits']} audits in {end['at'] - start['at']:.0f} s"
    # its raised audits ran the previous release, and every one of them is counted
    raised = [w for w in sim.windows if w["device"] == canary and w["audit_rate"] == 0.5]
    before = [w for w in raised if w["release"] == sim.first]
    assert all(start["at"] < w["ts"] <= end["at"] for w in before)
    # the count is what the decision saw: the windows up to the one arriving as it was taken
    assert sum(w["audits"] for w in before if w["ts"] < end["at"]) == end["figures"]["audits"] > 0
    # the swap came after the phase: the canary's first window on the release is past its end
    first_on = min(w["ts"] for w in sim.windows if w["device"] == canary and w["release"] == sim.second)
    assert first_on > end["at"]
    # no other device audited at the raised rate during the canary's phase; every device's own share is back
    assert all(w["audit_rate"] == OWN_AUDIT_RATE for w in sim.windows if w["device"] != canary and w["ts"] <= end["at"])
    sim.tick()  # the devices read the layers the last step left
    assert all(r == OWN_AUDIT_RATE for r in sim.rate.values())
    assert not [d for d in shown["decisions"] if d["kind"] == "pre_swap" and d["wave"] == 2]  # none for the last
    # the second wave (two devices, a small wave too: their two baselines at 5 % are narrow enough already) starts
    # at once, with no phase
    assert not _pre_swap(shown, 1)


def test_the_pre_swap_phase_ends_at_its_cap(store: FleetStore, tmp_path: Path) -> None:
    sim = _Sim(store, tmp_path)
    rid, engine = _deploy(sim, pre_swap_s=4)
    shown = sim.run(rid, engine, 400)
    assert shown["state"] == "succeeded", (shown["reason"], shown["waves"])
    start, end = _pre_swap(shown)
    assert 4 <= end["at"] - start["at"] <= 5
    assert "(at its cap; the baseline is as it is)" in end["note"]
    assert not end["figures"]["baseline"][0]["ok"]


def test_no_pre_swap_phase_where_the_controls_own_audits_leave_too_much(store: FleetStore, tmp_path: Path) -> None:
    """Five control devices auditing 0.5 % (about 50 audits each): their error alone is over three quarters of
    the limit, so no baseline of the canary's own brings the sum under it: it swaps at once, not after its cap."""
    sim = _Sim(store, tmp_path, own=0.005)
    rid, engine = _deploy(sim, pre_swap_s=120)
    t0 = sim.now
    shown = sim.run(rid, engine, 60, until=lambda: any(v != "pending" for v in sim.states(rid).values()))
    assert sim.now - t0 <= 2  # the canary was given the release at the first step
    assert not [d for d in shown["decisions"] if d["kind"] == "pre_swap"]
    assert all(w["audit_rate"] == 0.005 for w in sim.windows)


def test_no_pre_swap_phase_when_it_is_off(store: FleetStore, tmp_path: Path) -> None:
    sim = _Sim(store, tmp_path)
    rid, engine = _deploy(sim, pre_swap_s=0)
    shown = sim.run(rid, engine, 400)
    assert shown["state"] == "succeeded", (shown["reason"], shown["waves"])
    assert not [d for d in shown["decisions"] if d["kind"] == "pre_swap"]


def test_a_rollback_during_the_pre_swap_phase_gives_the_devices_their_own_audit_share(store: FleetStore,
                                                                                       tmp_path: Path) -> None:
    sim = _Sim(store, tmp_path)
    rid, engine = _deploy(sim, pre_swap_s=120)
    shown = sim.run(rid, engine, 30, until=lambda: any(sim.rate[d] == 0.5 for d in sim.devices))
    (start,) = _pre_swap(shown)
    (canary,) = start["figures"]["devices"]
    assert (sim.rate[canary], sim.running[canary]) == (0.5, sim.first)
    sim.rollouts.request_rollback(rid)
    for _ in range(3):
        sim.tick()
        engine.step(now=sim.now)
    assert sim.rollouts.get(rid)["state"] == "rolled_back"
    assert (sim.rate[canary], sim.running[canary]) == (OWN_AUDIT_RATE, sim.first)


def _audit_windows(rng: np.random.Generator, device: str, rate: float, count: int, t0: float) -> list[dict[str, Any]]:
    out = []
    for k in range(count):
        audits = int(rng.binomial(80, rate))
        out.append({"device_id": device, "server_ts": t0 + k, "requests": 100, "escalation_rate": 0.2,
                    "compared": 20, "agreement": 0.9, "audits": audits, "audit_rate": rate,
                    "audit_disagreed": int(rng.binomial(audits, 0.01))})
    return out


def test_the_audit_baseline_weighs_windows_by_their_audits() -> None:
    """A baseline of 300 windows at 1 % (about 240 audits) and the same with 20 windows at 50 % on top (about 800
    audits): weighed by audits, they narrow the whole-stream gate's baseline error by a third or more (weighed by
    inferences, 20 windows beside 300 would move it by a few percent). A wave that does not audit at the raised rate
    is not held by that gate at all."""
    rng = np.random.default_rng(5)
    # the control over the raised windows too: the arms' levels are told apart only where both have windows (net
    # of each bucket's shared move), and a bucket that the raised device dominates tells little of its level
    control = [x for d in range(100) for x in _audit_windows(rng, f"c{d}", 0.01, 320, 0.0)]
    hour = _audit_windows(rng, "w", 0.01, 300, 0.0)
    minute = _audit_windows(rng, "w", 0.5, 20, 300.0)
    ev, m = Evidence(bucket_s=10.0), Margins()

    def se(pre_wave: list[dict[str, Any]]) -> float:
        (g,) = baseline_errors(Arms(pre_wave, [], control, []), margins=m, evidence=ev, audited=True,
                               only=("audit_agreement",))
        return float(g["se"])

    assert se(hour + minute) < 0.75 * se(hour)
    assert not [g for g in baseline_errors(Arms(hour, [], control, []), margins=m, evidence=ev)
                if g["gate"] == "audit_agreement"]


def test_a_control_too_sparse_in_audits_does_not_hold_the_canary_on_the_whole_stream_gate(store: FleetStore,
                                                                                          tmp_path: Path) -> None:
    """Five control devices auditing 0.5 %: the whole-stream gate could never pass the canary (the control's
    audits alone leave its baseline error over the limit), so it does not hold the wave open until its maximum
    soak: the good release passes the canary on the other gates, and the gate's record says it does not hold.
    Held at the canary, the rollout would end paused ("wave 0 inconclusive at its maximum soak: audit_agreement
    open")."""
    sim = _Sim(store, tmp_path, own=0.005)
    # the last wave's control is the earlier waves' devices, which audited at the raised rate before their swap:
    # there the gate can pass and may hold the wave, as it should where it can decide (2 of 30 orders of the
    # devices: 234 of its 250 planned evidence at 150 s, passed soon after; an order is random, the devices'
    # ids are; one such wave in a full suite run stayed open to its maximum soak), so the rollout either
    # succeeds or is held at a later wave, never at the canary
    rid, engine = _deploy(sim, pre_swap_s=120, max_soak="300s")
    shown = sim.run(rid, engine, 900)
    assert shown["state"] == "succeeded" or (shown["state"] == "paused" and not shown["reason"].startswith(
        "wave 0")), (shown["reason"], shown["waves"][0]["gates"])
    canary = shown["waves"][0]
    assert canary["ended_at"] is not None, shown["reason"]
    assert canary["ended_at"] - canary["started_at"] < 150  # passed long before its maximum soak, not at it
    audit = [g for d in shown["decisions"] if d["wave"] == 0 for g in (d["figures"].get("gates") or [])
             if g["gate"] == "audit_agreement" and g["decision"] == "open"]
    assert audit
    assert all(g["holds"] is False for g in audit)
