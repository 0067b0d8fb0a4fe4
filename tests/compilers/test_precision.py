"""Precision that means what it says: pinned sessions, the fp32 bound, bf16 only where native, golden checks.

These hold on a CPU with avx512_bf16 (where OpenVINO's default inference precision is bf16) and on one
without: nothing here depends on the host's default.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from compilers import compile_model
from compilers.golden import GOLDEN_FILE, check_golden, read_golden
from compilers.manifest import MANIFEST_FILE, Manifest
from compilers.package import ModelPackage, write_package
from compilers.recipes import native_precisions, probe_host
from compilers.variants import VariantSet
from runtimes import SessionOptions, open_session
from runtimes.errors import PackageError
from testkit import zoo


@pytest.fixture(scope="module")
def linear_set(digits_linear_onnx: Path, digits: zoo.Split, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("precision") / "linear"
    compile_model(digits_linear_onnx, output=out, target="x86-avx512", precisions=("fp32", "bf16"),
                  calibration={"x": digits.x_train[:200]},
                  validation={"x": digits.x_test[:200], "labels": digits.y_test[:200]},
                  progress=False, threads=1)
    return out


def test_openvino_fp32_session_computes_fp32_whatever_the_cpu_default(digits_cnn_onnx: Path,
                                                                      digits: zoo.Split) -> None:
    x = digits.x_test[:64]
    with open_session(digits_cnn_onnx) as ort_session:
        expected = ort_session.run({"x": x})["logits"]
    with open_session(digits_cnn_onnx, backend="openvino", options=SessionOptions(precision="fp32")) as s:
        assert s.precision == "fp32"
        assert s.get_property("INFERENCE_PRECISION_HINT").get_type_name() == "f32"  # type: ignore[attr-defined]
        got = s.run({"x": x})["logits"]
    # the fp32 bound: bf16 arithmetic (OpenVINO's default on avx512_bf16 CPUs) misses it by 100x
    assert np.abs(got - expected).max() / np.abs(expected).max() < 1e-4


def test_bf16_rung_is_built_only_where_the_cpu_has_it(linear_set: Path) -> None:
    vs = VariantSet.load(linear_set)
    native = "bf16" in native_precisions("openvino", probe_host())
    ids = [e.id for e in vs.entries]
    rejected = {r["id"]: r for r in vs.rejected}
    if native:
        assert "bf16-ov" in ids or rejected["bf16-ov"]["stage"] == "guard"
        if "bf16-ov" in ids:
            assert vs.open("bf16-ov").manifest.build["executed_precision"] == "bf16"
    else:
        assert "bf16-ov" not in ids
        assert rejected["bf16-ov"]["stage"] == "unavailable"
        assert rejected["bf16-ov"]["reason"].startswith("no native bf16 on this CPU")


def test_native_precisions_follow_the_probe() -> None:
    intel = {"isa": ["avx512f", "avx512_vnni"]}
    epyc = {"isa": ["avx512f", "avx512_vnni", "avx512_bf16"]}
    assert "bf16" not in native_precisions("openvino", intel)
    assert "bf16" in native_precisions("openvino", epyc)
    turing = {"gpus": [{"compute_capability": "7.5"}]}
    ampere = {"gpus": [{"compute_capability": "8.6"}]}
    assert native_precisions("tensorrt", turing) == {"fp32", "fp16", "int8"}
    assert native_precisions("tensorrt", ampere) == {"fp32", "fp16", "bf16", "int8"}


def test_fp32_rungs_meet_the_numeric_bound_and_record_what_ran(linear_set: Path) -> None:
    vs = VariantSet.load(linear_set)
    fp32 = [e for e in vs.entries if e.precision == "fp32"]
    assert {e.id for e in fp32} == {"fp32-ort", "fp32-ov"}
    for entry in fp32:
        pkg = vs.open(entry.id)
        assert pkg.manifest.fidelity["max_rel_error"] < 1e-4
        assert pkg.manifest.build["executed_precision"] == "fp32"
        assert pkg.manifest.golden["tolerance"] == pytest.approx(1e-4)


def test_every_package_reproduces_its_golden_outputs_here(linear_set: Path) -> None:
    vs = VariantSet.load(linear_set)
    for entry in vs.entries:
        pkg = vs.open(entry.id)
        inputs, reference = read_golden(pkg.directory, pkg.manifest.golden)
        assert len(inputs["x"]) == 4
        assert set(reference) == {s.name for s in pkg.manifest.outputs}
        with pkg.open_session() as session:
            result = check_golden(pkg, session)
        assert result is not None
        assert result.passed, result.reason
        assert result.max_rel_error <= result.tolerance


def _skew_golden(pkg: ModelPackage, factor: float) -> None:
    """Make the package's recorded reference outputs disagree with what its model computes (re-hashed, unsigned)."""
    inputs, reference = read_golden(pkg.directory, pkg.manifest.golden)
    arrays = {f"in/{k}": v for k, v in inputs.items()} | {f"ref/{k}": v * factor for k, v in reference.items()}
    np.savez(pkg.directory / GOLDEN_FILE, **arrays)  # type: ignore[arg-type]
    write_package(pkg.directory, pkg.manifest)


def test_a_variant_that_does_not_reproduce_is_refused_and_the_agent_runs_the_next(linear_set: Path,
                                                                                   tmp_path: Path) -> None:
    from cloud_service.config import ModelOptions
    from cloud_service.models import open_model
    from edge_agent.agent import EdgeAgent

    work = tmp_path / "set"
    shutil.copytree(linear_set, work)
    vs = VariantSet.load(work)
    bad = vs.recommended.id
    _skew_golden(vs.open(bad), 1.5)
    pkg = VariantSet.load(work).open(bad)
    with pkg.open_session() as session:
        result = check_golden(pkg, session)
    assert result is not None
    assert not result.passed
    assert "golden outputs differ" in result.reason
    # the server refuses that version
    with pytest.raises(PackageError, match="golden check failed"):
        open_model(work / bad, "digits_linear", "1", ModelOptions())
    # the agent falls to the next rung and says why
    agent = EdgeAgent(work, cloud=None)
    try:
        assert agent.variant != bad
        assert bad in agent.refused
        assert "golden outputs differ" in agent.refused[bad]
    finally:
        agent._close_sessions()


def test_an_older_package_without_golden_inputs_still_opens(linear_set: Path, tmp_path: Path) -> None:
    work = tmp_path / "pkg"
    shutil.copytree(linear_set / "fp32-ort", work)
    doc = json.loads((work / MANIFEST_FILE).read_text())
    doc.pop("golden")
    (work / GOLDEN_FILE).unlink()
    write_package(work, Manifest.from_json(doc))
    pkg = ModelPackage.open(work)
    with pkg.open_session() as session:
        assert check_golden(pkg, session) is None


def test_compile_without_data_packages_fp32_checked_on_generated_inputs(digits_cnn_onnx: Path,
                                                                       tmp_path: Path) -> None:
    vs = compile_model(digits_cnn_onnx, output=tmp_path / "nodata", target="x86-avx512", precisions=("fp32", "int8"),
                       progress=False, threads=1)
    assert {e.precision for e in vs.entries} == {"fp32"}
    reasons = {r["id"]: r["reason"] for r in vs.rejected}
    assert all("needs calibration data" in reasons[i] for i in ("int8-ort-static", "int8-ov"))
    pkg = vs.open(vs.recommended.id)
    assert pkg.manifest.build["data"]["validation"]["origin"] == "generated"
    assert pkg.manifest.fidelity["max_rel_error"] < 1e-4
