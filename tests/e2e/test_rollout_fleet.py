"""Rollouts end to end with real agents: a real Mosquitto (the fleet's ACL and password file), a real
`tierkit fleet serve` (SQLite), a real `tierkit serve` as the cloud tier (the agents escalate to it over
gRPC), and N real `tierkit agent` processes enrolled with tokens, under load from real digits images.

Release 1 goes to every agent first (so there is a previous release); a good release 2 rolls through
every wave; bad releases are stopped at the canary and every agent that took one is back on release 2
within a bound measured here: (a) golden inputs that do not reproduce, (b) an edge model with lower
confidence (+20 points of escalations), (c) a model whose p95 latency is about three times the control's,
(d) a label-map bug on one confident answer in 20 (5 points of accuracy, the same confidence: seen by the
audits, and on escalations once the agent's learned escalation rule, taught by those audits, escalates that
input), (e) one on one escalation in four (the edge answers it otherwise than the cloud: the escalation rate
unchanged, agreement 5 points lower).
The slow version also stops a quarter of the fleet before a rollout and restarts it afterwards.

Every deployment uses the default margins and evidence (gates.py); the heavy release is sized at about 3.5x
the control's p95.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cloud_service.fleet.gates import Margins
from compilers.signing import load_private_key
from testkit import zoo
from testkit.cloud_helpers import ServeProcess
from testkit.packages import make_package
from testkit.releases import variant_set
from testkit.rollout_fleet import THRESHOLD, Agents, DigitsModels, LoadDriver, layer_ms
from testkit.rollout_harness import RolloutFleet

pytestmark = pytest.mark.mqtt

WAVES = "1,5%,25%,100%"
MARGINS = Margins()
RESTORE_BOUND_S = 20.0  # failed gate -> every agent that took the release back on the previous one
STOP_BOUND_S = 120.0  # the canary's swap -> a bad release stopped and every agent back on the previous one
PRE_SWAP_CAP_S = 300.0  # the rollout's default `--pre-swap`: the canary's audit phase before its swap at most
MAX_SOAK = "5m"  # a wave's longest soak before the inconclusive policy


@pytest.fixture(scope="module")
def models(digits_linear: Any, digits: zoo.Split) -> DigitsModels:
    layer = digits_linear[1]
    return DigitsModels(layer.weight.detach().numpy(), layer.bias.detach().numpy(), digits.x_test, digits.y_test)


@pytest.fixture(scope="module")
def cloud_models(digits_cnn_onnx: Path, digits: zoo.Split, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("cloud-models")
    make_package(digits_cnn_onnx, root / "digits-cloud", name="digits-cloud", x_val=digits.x_val, y_val=digits.y_val)
    return root


class _Run:
    """One fleet run: releases built from the models, deployed and watched."""

    def __init__(self, fleet: RolloutFleet, agents: Agents, load: LoadDriver, models: DigitsModels,
                 digits: zoo.Split, tmp: Path, *, soak: int) -> None:
        self.fleet, self.agents, self.load, self.models = fleet, agents, load, models
        self.digits, self.tmp, self.soak = digits, tmp, soak
        self.timings: dict[str, Any] = {}

    def release(self, kind: str, version: str, rollback_to: list[str], **model: Any) -> str:
        root = self.tmp / f"rel-{kind}-{version}"
        x, y = self.digits.x_val, self.digits.y_val
        if kind == "heavy":
            onnx = self.models.heavy(root / "model.onnx", model["layers"])
        elif kind == "swapped":
            onnx = self.models.swapped(root / "model.onnx", *model["swap"])
        else:
            onnx = self.models.linear(root / "model.onnx", scale=model.get("scale", 1.0))
        vs = variant_set(root / "vs", onnx, "lin", x, y, perturb=0.05 if kind == "golden" else 0.0)
        policy = root / "policy.json"
        policy.write_text(json.dumps({"name": "digits", "version": version, "threshold": THRESHOLD,
                                      "budget": {"latency_ms": 250}}))
        rel = self.fleet.facade.releases.create(vs, policy, sign_key=load_private_key(self.fleet.key),
                                                rollback_to=rollback_to)
        return str(rel["digest"])

    def deploy(self, release: str, waves: str) -> int:
        # the agents send a window a second; five agents at 20 requests/s each cannot gather the default planned
        # evidence (2,500 inferences a gate) in a test's time: a fifth of it (pass side only: alpha is the default)
        # a wave after the canary still open after MAX_SOAK passes on the evidence of the waves before it (the
        # explicit policy `promote`); how each wave was decided is recorded in the timings
        return self.fleet.deploy(release, waves=waves, soak=str(self.soak), margins={"min_requests": self.soak},
                                 evidence={"bucket_s": 1.0, "plan": 0.2}, max_soak=MAX_SOAK,
                                 on_inconclusive="promote")

    def until(self, rid: int, state: str, timeout: float) -> dict[str, Any]:
        def check() -> dict[str, Any] | None:
            shown = self.fleet.show(rid)
            if shown["state"] not in (state, "running"):
                msg = f"rollout {rid} ended {shown['state']}, not {state}: {shown['reason']} {shown['waves']}"
                raise AssertionError(msg)
            return shown if shown["state"] == state else None

        try:
            return dict(self.fleet.wait(f"rollout {rid} {state}", check, timeout=timeout))
        except AssertionError as exc:  # say where the evidence stood
            shown = self.fleet.show(rid)
            looks = [d for d in shown["decisions"] if d["figures"].get("gates")]
            tests = {g["gate"]: {k: g.get(k) for k in ("decision", "estimate", "lower", "upper", "pass_upper",
                                                       "evidence", "plan")}
                     for g in (looks[-1]["figures"]["gates"] if looks else []) if "estimate" in g}
            msg = f"{exc}: wave {shown['wave']}, {shown['states']}; last look: {json.dumps(tests)}"
            raise AssertionError(msg) from None

    def on(self, digest: str | None, indices: list[int] | None = None) -> bool:
        return all(self.agents.running(i) == digest for i in (range(self.agents.n) if indices is None else indices))

    def roll_out(self, release: str, waves: str, timeout: float) -> dict[str, Any]:
        started = time.monotonic()
        rid = self.deploy(release, waves)
        self.until(rid, "succeeded", timeout)
        shown = dict(self.fleet.api("GET", f"/v1/rollouts/{rid}?decisions=5000"))  # every wave's decisions
        self.timings.setdefault("rollout_s", {})[release[7:15]] = round(time.monotonic() - started, 1)
        self.timings.setdefault("waves", {})[release[7:15]] = [_decided(shown, w["idx"]) for w in shown["waves"]]
        return shown

    def stop_bad(self, kind: str, release: str, previous: str, gate: str | tuple[str, ...]) -> dict[str, Any]:
        """Deploy a bad release; it must fail `gate` (one of them) at the canary and every agent must end on
        `previous`."""
        rid = self.deploy(release, WAVES)
        fail_at, deployed, shown = None, time.time(), self.fleet.show(rid)
        while True:  # the rollout's failure first, then the agents' own journals back on the previous release
            # within STOP_BOUND_S of the canary's swap: its pre-swap audit phase (on the previous release, up to its
            # cap) comes first where the control's audits let the whole-stream gate use one
            began = shown["waves"][0]["started_at"]
            deadline = (float(began) if began is not None else deployed + PRE_SWAP_CAP_S) + STOP_BOUND_S
            assert time.time() < deadline, f"{kind}: not stopped and restored in time: {self.fleet.show(rid)}"
            if fail_at is None:
                shown = self.fleet.show(rid)
                assert shown["state"] != "succeeded", f"{kind}: the bad release passed every wave"
                fail = next((d for d in shown["decisions"] if d["kind"] == "fail"), None)
                fail_at = None if fail is None else float(fail["at"])
            if fail_at is not None and self.on(previous):
                back_s = time.time() - fail_at
                break
            time.sleep(0.1)
        assert fail is not None
        # on SQLite, one `show` is not one snapshot (its SELECTs run outside a transaction): it may list the
        # restore decision beside a device still in "rollback"; wait until both say so
        shown = self.fleet.wait("the fleet to record the restore", lambda: (
            s := self.fleet.show(rid))["state"] == "rolled_back" and "rollback" not in s["states"] and any(
            d["kind"] == "restored" for d in s["decisions"]) and s, timeout=30)
        restored_at = next(float(d["at"]) for d in shown["decisions"] if d["kind"] == "restored")
        failed = {g["gate"]: g for g in fail["figures"]["gates"] if g["ok"] is False}
        gate = next((g for g in ((gate,) if isinstance(gate, str) else gate) if g in failed), str(gate))
        assert gate in failed, fail["figures"]
        ran = [i for i in range(self.agents.n) if self.agents.ran(i, release)]
        assert len(ran) <= 2, ran  # the canary plus one, at most
        assert sum(bool(d["ran"]) for d in shown["device_list"]) <= 2
        assert shown["waves"][0]["state"] == "failed"
        assert shown["waves"][1]["state"] == "pending"
        assert set(shown["states"]) <= {"restored", "kept"}
        assert back_s <= RESTORE_BOUND_S, back_s
        self.timings.setdefault("restore_s", {})[kind] = {
            "agents_back_after_fail_s": round(back_s, 2),
            "fleet_restored_after_fail_s": round(restored_at - fail_at, 2), "ran": len(ran), "gate": failed[gate]}
        return shown


def _decided(shown: dict[str, Any], wave: int) -> dict[str, Any]:
    """How a wave was decided: by its gates ("evidence") or at its maximum soak on the waves before it
    ("promoted"), its control, and the seconds it took."""
    mine = [d for d in shown["decisions"] if d["wave"] == wave and d["kind"] in ("pass", "control_released")]
    promoted = any(d["figures"].get("promoted") for d in mine)
    w = shown["waves"][wave]
    looks = [d for d in mine if d["figures"].get("control_kind")]
    return {"decided": "promoted" if promoted else "evidence",
            "control": looks[0]["figures"]["control_kind"] if looks else None,
            "s": round(float(w["ended_at"]) - float(w["started_at"]), 1) if w.get("ended_at") else None}


def _fleet_run(tmp: Path, n: int, models: DigitsModels, cloud_models: Path, digits: zoo.Split, *,
               bad: tuple[str, ...], offline: bool, rate_rps: float, soak: int, max_s: float) -> dict[str, Any]:
    t0 = time.monotonic()
    with RolloutFleet(tmp, 0, online_after="3s") as fleet:
        cloud = ServeProcess("--models", str(cloud_models), "--grpc", "127.0.0.1:0")
        try:
            local = variant_set(tmp / "local", models.linear(tmp / "local.onnx"), "local", digits.x_val, digits.y_val)
            agents = Agents(tmp / "agents", n, fleet_url=fleet.fleet.url,
                            token=lambda: fleet.facade.registry.create_token({"kind": "cam"}), model=local,
                            broker=(fleet.broker.host, fleet.broker.port),
                            cloud=f"grpc://{cloud.addresses['grpc']}/digits-cloud", release_key=tmp / "ops.pub")
            try:
                agents.start()
                with LoadDriver(agents.ports, models.cycle, rate_rps=rate_rps, max_s=max_s) as load:
                    run = _Run(fleet, agents, load, models, digits, tmp, soak=soak)
                    _scenario(run, bad=bad, offline=offline)
                    assert sum(load.sent) > 0
                    assert not load.errors, load.errors  # no request failed, through every swap and rollback
                    run.timings["requests"] = {"sent": sum(load.sent), "failed": sum(load.failed),
                                               "errors": {f"{i}/{c}": m for (i, c), m in load.errors.items()}}
            finally:
                codes = agents.stop()
        finally:
            cloud.stop()
    assert codes == [0] * n, [agents.log_text(i)[-2000:] for i, c in enumerate(codes) if c != 0]
    run.timings["wall_s"] = round(time.monotonic() - t0, 1)
    (tmp / "timings.json").write_text(json.dumps(run.timings, indent=1, default=str))
    print("rollout fleet:", json.dumps(run.timings, default=str))
    return run.timings


def _transient(fleet: RolloutFleet, shown: dict[str, Any], span_s: float = 60.0, step_s: float = 5.0) -> list[Any]:
    """The canary's p95 over the median of the other devices' in the same second, by 5-s step after it was
    given the release: how long a swap's transient lasts here (what `Evidence.warmup_s` leaves out)."""
    canary = next(d for d in shown["device_list"] if d["wave"] == 0)
    t0 = float(canary["assigned_at"])
    by_s: dict[int, list[float]] = {}
    mine: list[tuple[float, float]] = []
    for w in fleet.facade.telemetry.windows(since=t0 - 1, until=t0 + span_s):
        if not w.get("p95_ms"):
            continue
        if w["device_id"] == canary["device_id"]:
            mine.append((w["server_ts"] - t0, float(w["p95_ms"])))
        else:
            by_s.setdefault(round(w["server_ts"]), []).append(float(w["p95_ms"]))
    steps: dict[int, list[float]] = {}
    for dt, p95 in mine:
        others = by_s.get(round(t0 + dt))
        if others:
            steps.setdefault(int(dt // step_s), []).append(p95 / float(np.median(others)))
    return [[k * step_s, round(float(np.median(v)), 2)] for k, v in sorted(steps.items())]


def _scenario(run: _Run, *, bad: tuple[str, ...], offline: bool) -> None:
    fleet, agents, n = run.fleet, run.agents, run.agents.n
    fleet.wait("the fleet to hear every agent", lambda: sum(
        d["online"] for d in fleet.api("GET", "/v1/devices")) == n, timeout=60)
    heard = time.time()  # a baseline for the first rollout: each agent's first windows are a cold start
    fleet.wait("windows on the configured model", lambda: len([
        w for w in fleet.api("GET", f"/v1/telemetry?since={heard}")["windows"] if w.get("requests")]) >= 15 * n,
        timeout=60)
    r1 = run.release("base", "10", [])
    # a canary, then every agent: the last wave has one device of an earlier wave, so it keeps two agents back as
    # its control until its gates pass (or, open at MAX_SOAK, passes on the canary's evidence). A one-wave rollout
    # has no earlier wave to promote on: open at its maximum soak it is held (measured here: 1 of 2 runs held
    # on energy, its estimate within a hair of half the margin under 0.24 of standard error)
    shown = run.roll_out(r1, "1,100%", 600)
    assert shown["states"] == {"committed": n}
    assert run.on(r1)
    # each device's baseline for the next rollout: windows on r1 (the held-back agents just took it; a wave
    # device with no baseline cannot be judged)
    done = time.time()
    fleet.wait("windows on r1", lambda: len([w for w in fleet.api("GET", f"/v1/telemetry?since={done}")["windows"]
                                            if w.get("requests")]) >= 15 * n, timeout=60)

    r2 = run.release("good", "11", [r1])
    # the last wave's control is the agents of the earlier waves (their release does not change during it), each
    # against its own windows on the release before the wave; at most MAX_SOAK a wave
    shown = run.roll_out(r2, WAVES, 900)
    sizes = [math.ceil(float(s[:-1]) / 100 * n) if s.endswith("%") else int(s) for s in WAVES.split(",")]
    assert [w["size"] for w in shown["waves"]] == [min(max(s, i + 1), n) for i, s in enumerate(sizes)]
    assert [w["state"] for w in shown["waves"]] == ["passed"] * 4
    assert shown["states"] == {"committed": n}
    assert shown["previous"] == r1
    canary = {g["gate"]: g for g in shown["waves"][0]["gates"]}
    assert shown["waves"][0]["figures"]["control_kind"] == "cohort"
    assert canary["escalation_rate"]["control"] == pytest.approx(run.models.base_rate, abs=0.04)
    assert shown["waves"][3]["figures"]["control_kind"] == "earlier waves"
    assert run.on(r2)
    run.timings["canary_transient"] = _transient(fleet, shown)
    layers = [la["document"] for la in fleet.facade.desired.layers() if la["selector"].startswith("rollout/")]
    assert len(layers) == n
    assert not any("audit_rate" in doc for doc in layers)  # the canary's raised audits ended with its wave
    # each device's baseline for the next rollout: some windows on r2 (the last to take it just did)
    done = time.time()
    fleet.wait("windows on r2", lambda: len([w for w in fleet.api("GET", f"/v1/telemetry?since={done}")["windows"]
                                            if w.get("requests")]) >= 15 * n, timeout=60)

    version = iter(range(12, 100))
    for kind in bad:
        if kind == "golden":
            release = run.release("golden", str(next(version)), [r2])
            run.stop_bad(kind, release, r2, "device_verifies")
            assert "golden" in run.timings["restore_s"][kind]["gate"]["note"]  # the canary's reason
        elif kind == "escalation":
            release = run.release("lowconf", str(next(version)), [r2], scale=0.6)
            run.stop_bad(kind, release, r2, "escalation_rate")
            g = run.timings["restore_s"][kind]["gate"]
            assert g["wave"] - g["control"] >= 0.10, g  # measured: the escalation rate rose by 10 points or more
            assert g["wave"] == pytest.approx(run.models.low_rate, abs=0.04)
        elif kind == "flip":  # a confident error: the audits see it, and the agent's learned escalation rule, which
            # learns from them, may escalate that image, where the escalations' agreement gate sees it too
            release = run.release("swapped", str(next(version)), [r2], swap=run.models.swap_target(escalated=False))
            run.stop_bad(kind, release, r2, ("audit_agreement", "agreement"))
            g = run.timings["restore_s"][kind]["gate"]
            assert g["estimate"] > 0, g  # more disagreement with the cloud on the release than on the previous
        elif kind == "disagree":  # the same confidence everywhere: the same escalations, exactly
            release = run.release("swapped", str(next(version)), [r2], swap=run.models.swap_target(escalated=True))
            shown = run.stop_bad(kind, release, r2, "agreement")
            g = run.timings["restore_s"][kind]["gate"]
            fail = next(d for d in shown["decisions"] if d["kind"] == "fail")
            gates = {x["gate"]: x for x in fail["figures"]["gates"]}
            assert gates["escalation_rate"]["ok"] is not False, gates["escalation_rate"]
            assert g["estimate"] > 0, g
        elif kind == "p95":
            since = time.time() - 10
            windows = [w for w in fleet.api("GET", f"/v1/telemetry?label=kind=cam&since={since}")["windows"]
                       if w.get("requests") and w.get("p95_ms")]
            control_ms = float(np.median([w["p95_ms"] for w in windows]))
            per_layer = layer_ms(run.models, run.tmp)
            layers = min(400, max(4, math.ceil(2.5 * control_ms / per_layer)))  # edge time ~2.5x: p95 ~3.5x
            release = run.release("heavy", str(next(version)), [r2], layers=layers)
            # its energy per inference (modeled from the inference's time) rises with its latency: either gate may
            # see it first
            run.stop_bad(kind, release, r2, ("p95_vs_control", "energy_per_request"))
            g = run.timings["restore_s"][kind]["gate"]
            g["ratio"] = round(g["wave"] / g["control"], 2)
            g["layers"], g["control_p95_before_ms"] = layers, round(control_ms, 2)
            margin = MARGINS.p95_ratio if g["gate"] == "p95_vs_control" else MARGINS.energy_ratio
            assert g["ratio"] >= 1 + margin, g
        assert run.on(r2)

    if offline:
        away = list(range(n - n // 4, n))
        run.load.pause(away)
        agents.stop(away)
        gone = {agents.device_ids[i] for i in away}
        fleet.wait("the fleet to see a quarter of the fleet offline", lambda: {
            d["device_id"] for d in fleet.api("GET", "/v1/devices") if not d["online"]} == gone, timeout=30)
        r3 = run.release("final", str(next(version)), [r2])
        rid = run.deploy(r3, WAVES)
        shown = run.until(rid, "succeeded", 180)
        assert shown["states"] == {"committed": n - len(away), "catch_up": len(away)}
        assert run.on(r3, [i for i in range(n) if i not in away])
        assert run.on(r2, away)
        agents.start(away)
        run.load.resume(away)
        started = time.monotonic()
        fleet.wait("the returning agents to converge", lambda: run.on(r3), timeout=120)
        fleet.wait("the rollout to record them", lambda: fleet.show(rid)["states"] == {"committed": n}, timeout=30)
        run.timings["offline_converge_s"] = round(time.monotonic() - started, 1)


@pytest.mark.slow  # five agents sharing two cores: the sequential gates need minutes of windows here
@pytest.mark.timeout(2000)
def test_a_small_fleet_of_agents_takes_a_good_release_and_stops_a_bad_one(
        tmp_path: Path, models: DigitsModels, cloud_models: Path, digits: zoo.Split) -> None:
    _fleet_run(tmp_path, 5, models, cloud_models, digits, bad=("escalation",), offline=False, rate_rps=20, soak=30,
               max_s=850)


@pytest.mark.slow
@pytest.mark.timeout(2000)
def test_a_small_fleet_stops_label_map_bugs_seen_by_audits_alone_and_on_escalations(
        tmp_path: Path, models: DigitsModels, cloud_models: Path, digits: zoo.Split) -> None:
    """(d) and (e) with real agents: each stopped at the canary by a gate that sees it; (e) with the escalation
    rate the same as the control's."""
    timings = _fleet_run(tmp_path, 5, models, cloud_models, digits, bad=("flip", "disagree"), offline=False,
                         rate_rps=20, soak=30, max_s=1300)
    assert set(timings["restore_s"]) == {"flip", "disagree"}


@pytest.mark.slow
@pytest.mark.timeout(2200)
def test_twenty_agents_every_wave_three_bad_releases_and_an_offline_quarter(
        tmp_path: Path, models: DigitsModels, cloud_models: Path, digits: zoo.Split) -> None:
    timings = _fleet_run(tmp_path, 20, models, cloud_models, digits, bad=("golden", "escalation", "p95"),
                         offline=True, rate_rps=12, soak=40, max_s=1200)
    assert set(timings["restore_s"]) == {"golden", "escalation", "p95"}


@pytest.mark.slow
@pytest.mark.timeout(2000)  # above the sum of its waits, so that a slow run says where its evidence stood
@pytest.mark.parametrize("run", range(10))
def test_the_small_fleet_again_no_false_rollback(run: int, tmp_path: Path, models: DigitsModels,
                                                 cloud_models: Path, digits: zoo.Split) -> None:
    """The default-margin scenario ten times: every good release passes every wave (no false rollback on
    this shared 2-core host, where the agents slow each other), the bad one is stopped at the canary."""
    _fleet_run(tmp_path, 5, models, cloud_models, digits, bad=("escalation",), offline=False, rate_rps=20, soak=30,
               max_s=850)
