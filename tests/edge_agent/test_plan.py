"""`tierkit plan`: the chosen point, the Pareto frontier, the table and the PNG."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from compilers.variants import VariantEntry, VariantSet
from edge_agent.budget import Budget
from edge_agent.decide import ControllerConfig
from edge_agent.plan import pareto_front, what_if
from edge_agent.plan_cli import load_profiles
from edge_agent.policy import Policy
from edge_agent.profiles import LinkProfile
from sdk.cli import main
from testkit import zoo
from testkit.packages import profiled_package


@pytest.fixture(scope="module")
def variants(tmp_path_factory: pytest.TempPathFactory, digits_cnn_onnx: Path, digits_linear_onnx: Path,
             digits: zoo.Split) -> Path:
    """A two-rung ladder: the linear model (fast, less accurate) and the CNN (slow, accurate)."""
    root = tmp_path_factory.mktemp("ladder")
    entries = []
    for vid, onnx, p50, mj in (("linear", digits_linear_onnx, 0.5, 0.5), ("cnn", digits_cnn_onnx, 4.0, 6.0)):
        pkg = profiled_package(root / vid, onnx, digits, p50_ms=p50, energy_mj=mj)
        m = pkg.manifest
        entries.append(VariantEntry(vid, vid, m.precision, m.runtime, [], {}, m.latency_ms, m.size_bytes, m.energy))
    VariantSet(root, "digits", "x86", tuple(entries)).write()
    return root


def test_plan_json_and_png(variants: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    png = tmp_path / "plan.png"
    rc = main(["plan", str(variants), "--rtt-ms", "5", "--latency-ms", "8", "--json", "--png", str(png)])
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    d = doc["decision"]
    assert d["feasible"] is True
    assert d["predicted_p95_ms"] <= 8 * 0.9
    assert d["energy_label"] == "modeled:test-cpu + radio modeled:default-radio"
    assert doc["frontier"]
    assert {p["variant"] for p in doc["frontier"]} <= {"linear", "cnn"}
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert doc["png"] == str(png)


def test_plan_table_and_infeasible_budget(variants: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["plan", str(variants), "--rtt-ms", "5", "--latency-ms", "0.5", "--energy-mj", "0.1", "--no-png"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "VIOLATES the latency and energy budget" in out
    assert "Pareto frontier" in out
    assert "modeled:test-cpu" in out


def test_what_if_frontier_is_not_dominated(variants: Path) -> None:
    profiles = load_profiles(variants, Policy("max_prob"))
    report = what_if(profiles, LinkProfile(rtt_ms=10).state(), Budget(latency_ms=30))
    front = report.frontier

    def key(p: dict[str, float]) -> tuple[float, float, float]:
        return p["accuracy"], -p["p95_ms"], -p["energy_mj"]

    def dominated(p: dict[str, float]) -> bool:
        return any(all(a >= b for a, b in zip(key(q), key(p), strict=True)) and key(q) != key(p)
                   for q in report.points)

    assert front
    assert not any(dominated(p) for p in front)
    # complete: every point left out is dominated, or the same figures as a point kept
    kept = {key(p) for p in front}
    assert all(dominated(p) or key(p) in kept for p in report.points)
    chosen = report.decision
    assert chosen.feasible
    # ties judged exactly: the chosen point is as accurate as any feasible point that escalates enough to
    # keep the link measured
    feasible = [p for p in report.points if p["p95_ms"] <= 27 + 1e-9 and p["escalation_rate"] >= 0.03 - 1e-9]
    best = max(feasible, key=lambda p: p["accuracy"])
    exact = what_if(profiles, LinkProfile(rtt_ms=10).state(), Budget(latency_ms=30),
                    config=ControllerConfig(tie_z=0.0)).decision
    assert exact.predicted_accuracy >= best["accuracy"] - 1e-3
    # by default (`decide.tied`): cheaper, and within one standard error of what escalating the band between
    # them gains (estimated on the validation inputs of that band)
    assert chosen.predicted_energy_mj <= exact.predicted_energy_mj + 1e-9
    assert chosen.variant == exact.variant
    profile = next(p for p in profiles if p.id == chosen.variant)
    var = profile.escalated_variance(np.array([chosen.threshold, exact.threshold]))
    se = float(np.sqrt(abs(var[1] - var[0])))
    assert exact.predicted_accuracy - 3e-4 - se <= chosen.predicted_accuracy <= exact.predicted_accuracy + 1e-9


def test_pareto_front_of_a_hand_checked_set() -> None:
    def point(name: str, acc: float, p95: float, mj: float) -> dict[str, Any]:
        return {"name": name, "accuracy": acc, "p95_ms": p95, "energy_mj": mj}

    points = [point("a", 0.90, 10, 5), point("b", 0.90, 12, 5),   # b: a is as accurate and faster
              point("c", 0.95, 20, 6), point("d", 0.80, 5, 1),     # c: most accurate; d: fastest, cheapest
              point("e", 0.80, 6, 1), point("a2", 0.90, 10, 5),    # e: beaten by d; a2: a's twin
              point("f", 0.85, 11, 0.5)]                           # f: cheapest energy, not beaten
    assert [p["name"] for p in pareto_front(points)] == ["c", "a", "f", "d"]
