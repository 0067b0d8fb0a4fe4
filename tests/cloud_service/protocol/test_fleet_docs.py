"""The fleet's documents: one parser each, errors that name the field, round trips, the swap states."""

from __future__ import annotations

import json

import pytest

from cloud_service.protocol.fleet_docs import (
    DEFAULT_SOAK,
    FINAL,
    IN_PROGRESS,
    UNSET,
    SoakProgress,
    SwapState,
    parse_desired,
    parse_reported,
    parse_telemetry,
)
from runtimes.budget import Budget, BudgetOverride
from runtimes.errors import ConfigError

DIGEST = "sha256:" + "ab" * 32


def test_desired_round_trips_and_tells_null_from_absent() -> None:
    doc = {"version": 4, "budget": {"latency_ms": 25, "energy_mj": None}, "threshold": None, "release": DIGEST,
           "soak": {"seconds": 30}, "rollback": True, "telemetry_interval_s": 60}
    d = parse_desired(json.dumps(doc).encode())
    assert d.threshold is None
    assert d.release == DIGEST
    assert d.soak_or_default().seconds == 30
    assert parse_desired(d.to_json()) == d
    assert d.budget is not None
    assert d.budget.apply(Budget(latency_ms=9, energy_mj=3)) == Budget(latency_ms=25)
    bare = parse_desired({"version": 1})
    assert bare.threshold is UNSET
    assert bare.release is UNSET
    assert bare.soak_or_default() == DEFAULT_SOAK
    assert parse_desired({"release": None}).release is None  # back to the configured model


@pytest.mark.parametrize(("doc", "named"), [
    ({"soak": {"requests": -1}}, "soak"),
    ({"soak": {"minutes": 3}}, "minutes"),
    ({"release": "sha256:xyz"}, "desired document.release"),
    ({"threshold": 1.5}, "desired document.threshold"),
    ({"telemetry_interval_s": 0.5}, "desired document.telemetry_interval_s"),
    ({"budget": {"latency_ms": 0}}, "latency_ms"),
    ({"budget": {"latency": 10}}, "budget.latency"),
    ({"thresold": 0.5}, "thresold"),
    ({"version": "7"}, "desired document.version"),
])
def test_a_bad_desired_document_names_its_field(doc: dict[str, object], named: str) -> None:
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        parse_desired(doc)


def test_reported_round_trips_with_the_swap_journal() -> None:
    doc = {"device": "dev-1", "boot_id": "b", "desired_version": 3, "budget": {"latency_ms": 20,
           "energy_mj": None, "max_escalations_per_s": None}, "threshold": 0.8, "variant": "int8",
           "model_digest": "sha256:m", "release": DIGEST,
           "swap": {"state": "soaking", "target": DIGEST, "since": 1.0, "soak": {"requests": 3, "seconds": 0.5}},
           "slots": {"A": DIGEST, "B": None, "active": "A"}, "golden": {"ok": True, "max_rel_error": 0.0},
           "crashes": 1, "newer_field": {"x": 1}}
    r = parse_reported(doc)
    assert r.swap is not None
    assert r.swap.state is SwapState.SOAKING
    assert r.swap.soak == SoakProgress(3, 0.5)
    assert r.budget == Budget(latency_ms=20)
    assert r.slots is not None
    assert r.slots.active == "A"
    assert parse_reported(r.to_json()) == r
    long = parse_reported({**doc, "error": "e" * 10_000})  # an explanation is cut, not refused
    assert long.error is not None
    assert len(long.error) == 4096
    with pytest.raises(ConfigError, match=r"reported document\.swap\.state"):
        parse_reported({**doc, "swap": {"state": "sleeping", "target": None}})


def test_telemetry_window_parses_what_the_agent_sends_and_refuses_what_the_store_cannot_hold() -> None:
    doc = {"device": "d", "boot_id": "b", "seq": 2, "ts": 5.0, "requests": 10, "tiers": {"edge": 8, "cloud": 2},
           "latency_hist": {"bounds_ms": [1, 2], "counts": [3, 4, 3]}, "degraded_reasons": {"timeout": 1},
           "escalation_rate": 0.2, "audited": 0, "data_drift": False}
    w = parse_telemetry(doc)
    assert (w.edge, w.cloud, w.degraded_reasons) == (8, 2, {"timeout": 1})
    assert parse_telemetry(w.to_json()) == w
    for bad, named in (({"seq": -1}, "seq"), ({"device": "a\x00b"}, "device"), ({"escalation_rate": 2}, "rate"),
                       ({"ts": float("nan")}, "ts")):
        with pytest.raises(ConfigError, match=named):
            parse_telemetry({**doc, **bad})
    with pytest.raises(ConfigError, match="seq"):
        parse_telemetry({k: v for k, v in doc.items() if k != "seq"})


def test_swap_states_are_named_not_positioned() -> None:
    assert tuple(SwapState)[:6] == IN_PROGRESS
    assert set(IN_PROGRESS).isdisjoint(FINAL)
    assert all(s.pre_active for s in IN_PROGRESS[:4])
    assert SwapState.SOAKING.live
    assert SwapState.REFUSED.final
    assert SwapState("committed") == "committed"  # a plain string on the wire


def test_budget_override_uses_the_budgets_own_rules() -> None:
    with pytest.raises(ConfigError, match="energy_mj"):
        BudgetOverride.parse({"energy_mj": -1})
    assert BudgetOverride.parse({"latency_ms": 5}).merged(BudgetOverride.parse({"latency_ms": 7})).latency_ms == 7
