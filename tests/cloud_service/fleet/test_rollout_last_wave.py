"""The last wave's control and the inconclusive policy, in-process on a simulated clock: six devices publish a
window a second into the real telemetry store and the engine steps once a second.

- The last wave is judged against the devices of the earlier waves (their release does not change during it),
  not against one device held back: it starts once their baselines on the release are long enough for its gates
  to pass (a baseline's error is an offset no soak removes: with some device orders the escalation gate stayed
  open for the whole run), and is decided as soon as the earlier waves' are.
- A wave that is still open at its maximum soak passes on the earlier waves' evidence under `promote` (stated
  in the decision record); a canary under `promote` is held (it has no earlier wave).
- A one-wave rollout keeps at least two devices back as its control.
"""

from __future__ import annotations

import json
import math
import random
import secrets
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cloud_service.fleet import registry
from cloud_service.fleet.rollout_engine import RolloutEngine
from cloud_service.fleet.rollouts import make_options, order_key
from cloud_service.fleet.store import FleetStore
from testkit.rollout_harness import rollout_states, two_releases

T0 = 1_800_000_000.0
BASELINE_S = 120


@pytest.fixture
def store(sqlite_store: FleetStore) -> FleetStore:
    """SQLite only: the engine's decisions do not depend on the database (test_rollout_engine.py runs both)."""
    return sqlite_store


class _Sim:
    """Six devices on `first`, each taking whatever release its effective desired document names at once.
    Windows: 50 inferences, escalation 0.2, p95 5 ms x a device level x noise; `noisy(wave)`: the p95 noise
    (log sd) while the rollout is at that wave."""

    def __init__(self, store: FleetStore, tmp: Path, n: int = 6) -> None:
        f = two_releases(store, tmp, n)
        self.reg, self.devices, self.desired, self.releases = f.reg, f.devices, f.desired, f.releases
        self.first, self.second = f.first, f.second
        self.store, self.tel, self.rollouts = store, f.tel, f.rollouts
        self.running = dict.fromkeys(self.devices, self.first)
        self.level = dict(zip(self.devices, np.exp(np.random.default_rng(1).normal(0, 0.2, n)).tolist(), strict=True))
        self.rng, self.seq, self.now = np.random.default_rng(7), 0, T0
        self.switched: dict[str, float] = {}
        self.quiet = 50  # inferences a window of the devices `run` singles out
        self.silent: set[str] = set()  # devices that send nothing (offline) for now
        for d in self.devices:
            self.desired.record_reported(d, {"release": self.first}, now=self.now)
        for _ in range(BASELINE_S):
            self.tick(0.02)

    def tick(self, sd: float, *, shift: float = 0.0, since: float = math.inf) -> None:
        """One window a device; those that took a release at `since` or later: `quiet` inferences, p95 noise `sd`,
        shifted by `shift` (log)."""
        self.now += 1.0
        self.seq += 1
        batch = []
        for d in self.devices:
            if d in self.silent:
                continue
            eff = self.desired.effective(self.reg.device(d))
            want = (eff or {}).get("document", {}).get("release") or self.first
            if want != self.running[d]:
                self.running[d], self.switched[d] = want, self.now
                self.desired.record_reported(d, {"release": want}, now=self.now)
            hit = self.switched.get(d, -math.inf) >= since
            p95 = 5.0 * self.level[d] * math.exp(float(self.rng.normal(shift if hit else 0.0, sd if hit else 0.02)))
            n = self.quiet if hit else 50
            esc = int(self.rng.binomial(n, 0.2))
            batch.append((d, json.dumps({
                "device": d, "boot_id": "b", "seq": self.seq, "ts": self.now, "window_s": 1.0, "requests": n,
                "edge": n - esc, "cloud": esc, "compared": esc, "escalation_rate": esc / n, "agreement": 0.9,
                "p95_ms": p95, "p50_ms": p95 / 2, "energy_mj_per_request": 2.0 * self.level[d],
                "release": self.running[d]}).encode(), self.now))
        assert self.tel.ingest(batch).stored == len(batch)

    def run(self, rid: int, engine: RolloutEngine, seconds: int, *, wave: int = -1, sd: float = 0.02,
            shift: float = 0.0) -> dict[str, Any]:
        """Step the engine once a simulated second; the devices of `wave` draw their p95 with noise `sd` (log)
        shifted by `shift` (the others with 0.02, unshifted)."""
        since = math.inf
        for _ in range(seconds):
            row = self.rollouts.get(rid)
            if row["state"] != "running":
                break
            if int(row["wave"]) == wave and since == math.inf:
                since = self.now
            self.tick(sd, shift=shift, since=since)
            engine.step(now=self.now)
        return self.rollouts.show(rid)

    def states(self, rid: int) -> dict[str, str]:
        return rollout_states(self.store, rid)


def _deploy(sim: _Sim, waves: str, **options: Any) -> tuple[int, RolloutEngine]:
    # a window a simulated second (agents send one every 10 s): buckets, warm-up and the variance's block (120 s)
    # are scaled alike
    opts = make_options(waves=waves, soak="20", margins={"min_requests": 20},
                        evidence={"bucket_s": 1.0, "warmup_windows": 1, "warmup_s": 2.0, "plan": 0.2, "block_s": 12.0},
                        **options)
    rid = sim.rollouts.deploy(sim.second, {}, opts)
    return rid, RolloutEngine(sim.store, sim.desired, sim.releases, holder="e", online_after_s=30)


def test_the_last_wave_is_judged_against_the_earlier_waves_and_decided(store: FleetStore, tmp_path: Path) -> None:
    sim = _Sim(store, tmp_path)
    rid, engine = _deploy(sim, "1,50%,100%")
    shown = sim.run(rid, engine, 600)
    assert shown["state"] == "succeeded", (shown["reason"], shown["waves"])
    last = shown["waves"][2]
    # its control is the three devices of the earlier waves; none held back on the previous release
    assert last["figures"]["control_kind"] == "earlier waves"
    assert not any(d["kind"] == "control_released" for d in shown["decisions"])
    passed = next(d for d in shown["decisions"] if d["wave"] == 2 and d["kind"] == "pass")
    assert passed["figures"]["control_devices"] == {"previous": 0, "earlier_waves": 3}
    assert passed["figures"]["promoted"] == []
    assert {g["gate"]: g["decision"] for g in passed["figures"]["gates"]}["p95_vs_control"] == "pass"
    # decided by its gates within a minute of soak, as the earlier waves were
    span = float(last["ended_at"]) - float(last["started_at"])
    assert span < 60, span


class _SeededIds:
    """`secrets` for the registry with device ids drawn from a seed: the ids set the rollout's order (`order_key`)."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def token_hex(self, n: int) -> str:
        return f"{self.rng.getrandbits(8 * n):0{2 * n}x}"

    def __getattr__(self, name: str) -> Any:
        return getattr(secrets, name)


def test_the_last_wave_in_an_order_whose_short_overlap_held_it_open(store: FleetStore, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Ids from seed 40: the canary, then two devices whose windows on the release before the last wave were ten,
    over which the last wave's devices happened to escalate 3.7 points less. The arms' levels are compared only
    over those windows, so the escalation gate's estimate stayed at +3.1 points with a 2.4-point standard error
    that no soak shrank, open for the whole run (4 of 150 seeded orders did so). The last wave now starts once
    the baselines' error is within a sixth of each margin."""
    monkeypatch.setattr(registry, "secrets", _SeededIds(40))
    sim = _Sim(store, tmp_path)
    rid, engine = _deploy(sim, "1,50%,100%")
    shown = sim.run(rid, engine, 200)
    assert shown["state"] == "succeeded", (shown["reason"], shown["waves"])
    waited = [d for d in shown["decisions"] if d["wave"] == 2 and "baseline" in d["figures"]]
    assert waited
    assert "waits for its control's baseline" in waited[0]["note"]
    last = shown["waves"][2]
    assert float(last["ended_at"]) - float(last["started_at"]) < 60


def test_a_wave_open_at_its_maximum_soak_is_promoted_on_the_earlier_waves(store: FleetStore,
                                                                          tmp_path: Path) -> None:
    sim = _Sim(store, tmp_path)
    rid, engine = _deploy(sim, "1,50%,100%", max_soak="40s", on_inconclusive="promote")
    # the last wave's devices serve 3 inferences a window, too few for a window's p95 (a quiet hour): its p95 gate
    # has no evidence: open until its maximum soak
    sim.quiet = 3
    shown = sim.run(rid, engine, 600, wave=2)
    assert shown["state"] == "succeeded", (shown["reason"], shown["waves"])
    last = shown["waves"][2]
    assert 40 <= float(last["ended_at"]) - float(last["started_at"]) < 50  # bounded by the maximum soak
    passed = next(d for d in shown["decisions"] if d["wave"] == 2 and d["kind"] == "pass")
    assert passed["figures"]["promoted"], passed  # the open gates, stated in the record
    assert "promoted at its maximum soak on the evidence of waves 0-1" in passed["note"]
    assert not [g for g in passed["figures"]["gates"] if g["ok"] is False]  # promoted, not over a failed gate
    assert all(not d["figures"].get("promoted") for d in shown["decisions"] if d["wave"] in (0, 1))


def test_a_canary_open_at_its_maximum_soak_is_held_under_promote(store: FleetStore, tmp_path: Path) -> None:
    sim = _Sim(store, tmp_path)
    rid, engine = _deploy(sim, "1,50%,100%", max_soak="30s", on_inconclusive="promote")
    sim.quiet = 3
    shown = sim.run(rid, engine, 100, wave=0)
    assert shown["state"] == "paused", (shown["reason"], shown["waves"])
    assert "wave 0 inconclusive at its maximum soak" in shown["reason"]
    assert shown["waves"][0]["state"] == "soaking"


def test_a_one_wave_rollout_keeps_two_devices_back_until_its_gates_pass(store: FleetStore, tmp_path: Path) -> None:
    sim = _Sim(store, tmp_path)
    rid, engine = _deploy(sim, "100%")
    for _ in range(3):
        sim.tick(0.02)
        engine.step(now=sim.now)
    assert sorted(sim.states(rid).values()).count("control") == 2  # one held-back device is too few
    shown = sim.run(rid, engine, 600)
    assert shown["state"] == "succeeded", (shown["reason"], shown["waves"])
    assert any(d["kind"] == "control_released" for d in shown["decisions"])
    assert shown["states"] == {"committed": 6}


def test_a_last_wave_whose_earlier_waves_have_no_baseline_keeps_two_devices_back(store: FleetStore,
                                                                                 tmp_path: Path) -> None:
    """The earlier waves' devices count as the last wave's control only where they have a baseline: here the
    second wave's serve 3 inferences a window (too few for a window's p95), so only the canary could be one, and
    a last wave judged against one device's swings is a false rollback waiting (bench/bench_gates.py): two
    devices still on the first release stay back until the wave's gates are decided."""
    sim = _Sim(store, tmp_path)
    rid, engine = _deploy(sim, "1,50%,100%", max_soak="40s", on_inconclusive="promote")
    sim.quiet = 3
    since = math.inf
    for _ in range(300):
        row = sim.rollouts.get(rid)
        if int(row["wave"]) == 1 and since == math.inf:
            since = sim.now
        if int(row["wave"]) == 2:
            break
        sim.tick(0.02, since=since)
        engine.step(now=sim.now)
    for _ in range(2):
        sim.tick(0.02, since=since)
        engine.step(now=sim.now)
    states = sorted(sim.states(rid).values())
    assert states.count("control") == 2, states  # counted as online, the second wave's two made it look enough
    shown = sim.run(rid, engine, 600)
    assert shown["state"] == "succeeded", (shown["reason"], shown["waves"])
    assert any(d["kind"] == "control_released" and d["wave"] == 2 for d in shown["decisions"])
    assert shown["states"] == {"committed": 6}


def test_an_engine_that_keeps_its_windows_between_steps_decides_as_one_that_reads_them_anew(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine keeps the windows it read, and a wave's baselines with what the gates computed from them, from
    one step to the next (`window_cache`, `_Kept`). The same rollout over the same telemetry, stepped by one engine
    and by a new engine every step (each reading everything anew), takes the same decisions at the same times on
    the same figures: every wave, the last one against the earlier waves, a baseline read again once settled, and
    a control that changes during a wave (a device offline for a while, then back)."""
    runs = []
    for name in ("kept", "anew"):
        monkeypatch.setattr(registry, "secrets", _SeededIds(40))  # the same device ids, so the same order
        store = FleetStore.open(f"sqlite:///{tmp_path / name}.db")
        try:
            sim = _Sim(store, tmp_path / name)
            rid, _ = _deploy(sim, "1,50%,100%")
            engine = RolloutEngine(sim.store, sim.desired, sim.releases, holder="e", online_after_s=5)
            # the last device in the rollout's order is offline when the canary starts, and back while it soaks:
            # the canary's control gains a device
            sim.silent = {max(sim.devices, key=lambda d: order_key(rid, d))}
            for _ in range(7):
                sim.tick(0.02)
            for i in range(300):
                if sim.rollouts.get(rid)["state"] != "running":
                    break
                sim.silent = set() if i == 4 else sim.silent
                sim.tick(0.02)
                if name == "anew":
                    engine = RolloutEngine(sim.store, sim.desired, sim.releases, holder="e", online_after_s=5)
                engine.step(now=sim.now)
            shown = sim.rollouts.show(rid)
        finally:
            store.close()
        runs.append([(d["kind"], d["wave"], d["at"] if d["kind"] != "start" else None,  # deploy: wall clock
                      d["figures"].get("control_devices"), sorted(
            (g["gate"], g["decision"], g.get("estimate"), g.get("evidence"), g.get("holds"))
            for g in d["figures"].get("gates", []))) for d in shown["decisions"]])
        assert shown["state"] == "succeeded", (name, shown["reason"])
    kept, anew = runs
    assert len(kept) > 3
    # the canary's control had the quiet device back while the canary soaked
    assert {(c or {}).get("previous") for _, wave, _, c, _ in kept if wave == 0} >= {4, 5}
    assert any(gates for *_, gates in kept)
    assert kept == anew
