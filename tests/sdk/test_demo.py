"""`tierkit demo`: the table and JSON it prints; the full run is slow and marked so."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from sdk.demo import KEYS, format_table, run_demo

FIGURES = {
    "dataset": "digits", "transport": "grpc", "edge_accuracy": 0.972, "cloud_accuracy": 0.994,
    "tiered_accuracy": 0.994, "escalation_rate": 0.21, "p50_ms": 0.05, "p95_ms": 1.9, "energy_mj_per_request": 1.2,
    "energy_label": "modeled:generic-cpu", "answered": 359, "requests": 359, "degraded": 40, "cloud_stopped_at": 179,
    "degraded_after_stop": 40, "wanted_cloud_after_stop": 40, "fault_accuracy": 0.98, "fault_p95_ms": 1.1,
    "budget_ms": 100.0, "edge_variant": "fp32-ort", "threshold": 0.9, "edge_model": "lr", "cloud_model": "cnn",
}


def test_table_shows_every_figure() -> None:
    table = format_table(FIGURES)
    for text in ("edge only", "cloud only", "tiered", "97.2%", "99.4%", "21.0%", "modeled:generic-cpu",
                 "359/359 answered", "40 degraded"):
        assert text in table


def test_cli_mounts_demo() -> None:
    out = subprocess.run([sys.executable, "-m", "sdk.cli", "demo", "--help"], capture_output=True, text=True,
                         check=True).stdout
    assert "--json" in out
    assert "--transport" in out


@pytest.mark.slow
def test_full_demo_on_digits_reports_every_key() -> None:
    result = run_demo(dataset="digits", quiet=True)
    assert set(KEYS) <= set(result)
    json.dumps(result)
    assert result["answered"] == result["requests"]
    assert result["escalation_rate"] <= 0.25
    assert result["tiered_accuracy"] >= result["cloud_accuracy"] - 0.005
    assert result["degraded_after_stop"] > 0
