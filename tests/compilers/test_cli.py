"""`tierkit compile` through the root CLI (sdk.cli.main)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from compilers import VariantSet
from sdk.cli import main


@pytest.fixture
def npz_files(tmp_path: Path, digits_calibration: dict[str, np.ndarray],
              digits_validation: dict[str, np.ndarray]) -> tuple[Path, Path]:
    calib, val = tmp_path / "calib.npz", tmp_path / "val.npz"
    np.savez(calib, **digits_calibration)
    np.savez(val, **digits_validation)
    return calib, val


def test_compile_json(digits_cnn_onnx: Path, npz_files: tuple[Path, Path], tmp_path: Path,
                      capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "vs"
    calib, val = npz_files
    rc = main(["compile", str(digits_cnn_onnx), "-o", str(out), "--target", "x86-avx2", "--precision", "fp32,int8",
               "--calibration", str(calib), "--validation", str(val), "--max-drop", "1.0", "--batch-sizes", "1,8",
               "--json", "--no-progress"])
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["target"] == "x86-avx2"
    assert doc["batch_sizes"] == [1, 8]
    vs = VariantSet.load(out)
    assert doc["recommended"] == vs.recommended.id
    kept = [v for v in doc["variants"] if v["status"] in ("kept", "recommended")]
    assert {v["id"] for v in kept} == {e.id for e in vs}
    for v in kept:
        assert set(v["speedup_vs_fp32"]) == {"batch_1", "batch_8"}
        assert v["fidelity"]["drop_points"] <= 1.0
        assert v["size_bytes"] > 0
    static = next(p for p in vs.open("int8-ort-static").manifest.passes if p["name"] == "quantize_ort")
    assert static["reduce_range"] is True  # x86-avx2 has no VNNI


def test_compile_table_and_errors(digits_cnn_onnx: Path, npz_files: tuple[Path, Path], tmp_path: Path,
                                  capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture) -> None:
    calib, _ = npz_files
    rc = main(["compile", str(digits_cnn_onnx), "-o", str(tmp_path / "t"), "--target", "arm64", "--precision", "fp32",
               "--calibration", str(calib), "--no-progress"])
    captured = capsys.readouterr()
    assert rc == 0
    assert "fp32-ort" in captured.out
    assert "recommended: fp32-ort" in captured.out
    assert "holding out 20%" in caplog.text
    rc = main(["compile", str(digits_cnn_onnx), "-o", str(tmp_path / "u"), "--target", "vax",
               "--calibration", str(calib)])
    assert rc == 1
    assert "unknown target 'vax'" in capsys.readouterr().err


def test_max_drop_and_min_cosine_exclude_each_other(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["compile", "m.onnx", "-o", "x", "--max-drop", "1", "--min-cosine", "0.99"])
    assert "not allowed with argument" in capsys.readouterr().err


def test_compile_a_torch_factory(npz_files: tuple[Path, Path], tmp_path: Path,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    calib, val = npz_files
    rc = main(["compile", "testkit.zoo:linear_classifier", "-o", str(tmp_path / "f"), "--target", "x86-avx512",
               "--precision", "fp32", "--calibration", str(calib), "--validation", str(val), "--json",
               "--no-progress", "--name", "linear"])
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["name"] == "linear"
    manifest = VariantSet.load(tmp_path / "f").open("fp32-ort").manifest
    assert [s.name for s in manifest.inputs] == ["x"]  # named after the data, not forward()'s parameter
    assert next(p for p in manifest.passes if p["name"] == "export_onnx")["kind"] == "torch"
