"""An fp32-only compile imports only what its rungs use: the OpenVINO export does not bring in NNCF (whose
import loads torch, seconds on a 2-core host); an int8 compile does."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from testkit.fleet_process import ROOT

SCRIPT = """
import json, sys
import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from compilers import compile_model

rng = np.random.default_rng(0)
graph = helper.make_graph(
    [helper.make_node("Flatten", ["x"], ["xf"]), helper.make_node("MatMul", ["xf", "W"], ["logits"])], "linear",
    [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 1, 8, 8])],
    [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 10])],
    [numpy_helper.from_array(rng.normal(size=(64, 10)).astype(np.float32), "W")])
onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9), sys.argv[1])
x = rng.normal(size=(64, 1, 8, 8)).astype(np.float32)
data = {"x": x, "labels": rng.integers(0, 10, 64)}
vs = compile_model(sys.argv[1], output=sys.argv[2], target="x86-avx512", precisions=tuple(sys.argv[3].split(",")),
                   calibration=data, validation=data, progress=False, threads=1)
print(json.dumps({"kept": [e.id for e in vs.entries], "rejected": [r["id"] for r in vs.rejected],
                  "loaded": sorted(m for m in ("torch", "nncf") if m in sys.modules)}))
"""


def _compile(tmp_path: Path, precisions: str) -> dict[str, list[str]]:
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "m.onnx"), str(tmp_path / precisions),
                          precisions], check=False, capture_output=True, text=True, cwd=ROOT, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def test_an_fp32_compile_with_an_openvino_rung_does_not_import_nncf_or_torch(tmp_path: Path) -> None:
    got = _compile(tmp_path, "fp32")
    assert "fp32-ov" in got["kept"], got
    assert got["loaded"] == [], got


@pytest.mark.slow
def test_an_int8_compile_imports_nncf_for_its_openvino_rung(tmp_path: Path) -> None:
    got = _compile(tmp_path, "fp32,int8")
    assert "int8-ov" in set(got["kept"]) | set(got["rejected"]), got
    assert "nncf" in got["loaded"], got
