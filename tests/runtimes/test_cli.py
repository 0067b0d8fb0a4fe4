"""`tierkit doctor` through the real command-line entry point."""

from __future__ import annotations

import json

import pytest

from sdk.cli import main

KEYS = {"system", "machine", "python", "cpu_model", "isa", "logical_cores", "physical_cores", "usable_cores",
        "memory_bytes", "gpus", "gpu_note", "openvino_devices", "backends", "energy_sources", "energy_source", "notes",
        "power_profile"}


def test_doctor_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert set(doc) == KEYS
    assert doc["backends"]["onnxruntime"]
    assert set(doc["energy_sources"]) == {"rapl", "nvml", "jetson"}
    assert doc["energy_source"] in {"rapl", "nvml", "jetson", "modeled"}
    if doc["backends"]["openvino"]:
        assert any(d.startswith("CPU") for d in doc["openvino_devices"])


def test_doctor_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", "--no-openvino"]) == 0
    out = capsys.readouterr().out
    for key in ("cpu", "cores", "isa", "memory", "backend onnxruntime", "energy rapl", "energy figures"):
        assert any(line.startswith(key) for line in out.splitlines()), key
