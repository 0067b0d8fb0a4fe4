"""An int8 OpenVINO compile, run as a user runs it (outside pytest, a fresh home), sends no usage telemetry.

NNCF posts usage events through `openvino_telemetry` unless it was imported under pytest (so an in-process test
never sees it). Each event forks a process that posts over HTTPS; offline that process waits on DNS, and the
interpreter waits for the sender's threads at exit, so `tierkit compile --precision int8` hung after it was
done. The child here records every message the telemetry backend would post and every process it forks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

pytest.importorskip("nncf")
pytest.importorskip("openvino_telemetry")

ROOT = Path(__file__).resolve().parents[2]

_CHILD = textwrap.dedent("""
    import json, multiprocessing, sys
    from pathlib import Path
    import numpy as np
    from openvino_telemetry.backend import backend_ga4

    record = Path(sys.argv[2])
    def note(kind, what):
        with record.open("a") as f:
            f.write(json.dumps([kind, what]) + "\\n")
    backend_ga4.GA4Backend.send = lambda self, message: note("send", str(message)[:200])
    start = multiprocessing.Process.start
    def counted(self):
        note("fork", repr(self._target))
        start(self)
    multiprocessing.Process.start = counted

    assert "pytest" not in sys.modules
    from compilers import compile_model
    rng = np.random.default_rng(0)
    data = {"x": rng.normal(size=(32, 3, 8, 8)).astype(np.float32)}
    vs = compile_model(sys.argv[1], output=Path(sys.argv[3]), target="intel-openvino", precisions=("int8",),
                       calibration=data, validation=data, task="regression", min_cosine=0.5, max_slice_error=5.0,
                       repair_budget=1, progress=False, threads=1)
    note("built", [e.id for e in vs] + [str(r["id"]) for r in vs.rejected])
""")


def _conv_model(path: Path) -> Path:
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.normal(size=(4, 3, 3, 3)).astype(np.float32), "w")
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, 8, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4, 8, 8])
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]), helper.make_node("Relu", ["c"], ["y"])]
    model = helper.make_model(helper.make_graph(nodes, "conv", [x], [y], initializer=[w]),
                              opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(model, str(path))
    return path


def test_an_int8_openvino_compile_outside_pytest_posts_no_telemetry(tmp_path: Path) -> None:
    record = tmp_path / "record.jsonl"
    home = tmp_path / "home"  # no consent file: OpenVINO's telemetry counts that as consent for NNCF
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NNCF_", "PYTEST_"))}
    env |= {"HOME": str(home), "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(_conv_model(tmp_path / "conv.onnx")), str(record),
                           str(tmp_path / "out")], env=env, capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    events = [json.loads(line) for line in record.read_text().splitlines()]
    assert ["built", ["int8-ov"]] in events, events  # NNCF ran: the quantized rung was built
    assert [e for e in events if e[0] != "built"] == [], "telemetry was posted or a sender process forked"
