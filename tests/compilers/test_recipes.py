"""Targets are data: the named ones, "auto" from a doctor probe, and targets loaded from files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from compilers.recipes import TARGETS, PassSpec, PruneConfig, Rung, Target, auto_target, get_target, target_names
from runtimes.errors import ConfigError


def test_required_targets_exist() -> None:
    assert {"x86-avx512", "x86-avx2", "arm64", "intel-openvino", "nvidia-tensorrt", "torch", "auto"} <= set(
        target_names())
    assert TARGETS["x86-avx512"].runtimes == ("onnxruntime", "openvino")
    assert TARGETS["arm64"].runtimes == ("onnxruntime",)
    assert TARGETS["intel-openvino"].devices == ("CPU", "GPU", "NPU")
    ids = [r.id for r in TARGETS["x86-avx512"].rungs_for(["fp32", "int8"])]
    assert ids == ["fp32-ort", "fp32-ov", "int8-ort-static", "int8-ort-dynamic", "int8-ov"]
    trt = TARGETS["nvidia-tensorrt"].rungs_for(["int8"])
    assert trt[0].passes[0] == PassSpec("tensorrt_engine", {"precision": "int8"})


@pytest.mark.parametrize(("probe", "expected"), [
    ({"machine": "x86_64", "isa": ["avx2", "avx512f"], "backends": {"onnxruntime": "1"}}, "x86-avx512"),
    ({"machine": "x86_64", "isa": ["avx2"], "backends": {"onnxruntime": "1"}}, "x86-avx2"),
    ({"machine": "aarch64", "isa": ["asimd"], "backends": {}}, "arm64"),
    ({"machine": "x86_64", "isa": [], "gpus": [{"name": "NVIDIA H100"}], "backends": {"tensorrt": "10.3"}},
     "nvidia-tensorrt"),
    ({"machine": "x86_64", "isa": [], "gpus": [{"name": "NVIDIA H100"}], "backends": {"tensorrt": None}},
     "x86-avx2"),
    ({"machine": "x86_64", "isa": ["avx512f"], "openvino_devices": ["CPU", "NPU"], "backends": {"openvino": "x"}},
     "intel-openvino"),
])
def test_auto_reads_the_probe(probe: dict, expected: str) -> None:
    assert auto_target(probe) == expected
    assert get_target("auto", probe=probe).name == expected


def test_auto_on_this_machine_is_a_cpu_target() -> None:
    assert get_target("auto").name in ("x86-avx512", "x86-avx2", "arm64", "intel-openvino", "nvidia-tensorrt")


def test_target_file_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "edge.json"
    path.write_text(json.dumps(TARGETS["x86-avx2"].to_json() | {"name": "my-edge"}))
    target = get_target(path)
    assert target.name == "my-edge"
    assert target.rungs == TARGETS["x86-avx2"].rungs
    yml = tmp_path / "t.yaml"
    yml.write_text("name: tiny\nruntimes: [onnxruntime]\nrungs:\n  - {precision: fp32, runtime: onnxruntime}\n")
    assert get_target(yml).rungs == (Rung("fp32", "onnxruntime"),)


def test_bad_definitions() -> None:
    with pytest.raises(ConfigError, match="pass 'magic' is not one of"):
        PassSpec("magic")
    with pytest.raises(ConfigError, match="runtime 'tflite' is not one of"):
        Rung("fp32", "tflite")
    with pytest.raises(ConfigError, match="duplicate rungs"):
        Target("t", ("onnxruntime",), ("fp32",), (Rung("fp32", "onnxruntime"), Rung("fp32", "onnxruntime")))
    with pytest.raises(ConfigError, match="missing or has a bad field"):
        Target.from_dict({"name": "x"})
    with pytest.raises(ConfigError, match="importance 'random'"):
        PruneConfig(0.3, importance="random")
