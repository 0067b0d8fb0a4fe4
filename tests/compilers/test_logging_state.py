"""A compile leaves the process's logging as it found it: OpenVINO's converter sets the root logger to ERROR
(with a filter and a stderr handler of its own) and puts it back only when the conversion succeeds, so
after one failed conversion every warning of the process, the compiler's own included, was lost."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace
from typing import cast

import onnx
import pytest
from onnx import TensorProto, helper

from compilers.passes import PassContext
from compilers.passes.quantize_ov import export


def _unconvertible(path: Path) -> Path:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])
    node = helper.make_node("Frobnicate", ["x"], ["y"], domain="com.example.nowhere")
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.example.nowhere", 1)]
    model = helper.make_model(helper.make_graph([node], "frob", [x], [y]), opset_imports=opsets)
    onnx.save(model, str(path))
    return path


def test_a_failed_openvino_export_leaves_the_root_logger_as_it_was(tmp_path: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    root = logging.getLogger()
    before = (root.level, list(root.filters), list(root.handlers))
    ctx = cast(PassContext, SimpleNamespace(workdir=tmp_path))
    with pytest.raises(Exception, match="Frobnicate"):  # OpenVINO's OpConversionFailure
        export(_unconvertible(tmp_path / "frob.onnx"), ctx)
    assert (root.level, list(root.filters), list(root.handlers)) == before
    logging.getLogger("compilers.compile").warning("still heard")
    assert "still heard" in caplog.text


def test_an_openvino_export_sends_no_telemetry(tmp_path: Path) -> None:
    """OpenVINO's converter (and NNCF, and `import openvino`) post usage events through one sender, which runs
    each post on a thread that forks a process; offline, that process waits on DNS and the interpreter joins it
    at exit (a compile or a demo hung after it was done). After an export the sender posts nothing."""
    sender_module = pytest.importorskip("openvino_telemetry.utils.sender")
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])
    model = helper.make_model(helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "relu", [x], [y]),
                              opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(model, str(tmp_path / "relu.onnx"))
    export(tmp_path / "relu.onnx", cast(PassContext, SimpleNamespace(workdir=tmp_path)))
    posted: list[object] = []
    backend = SimpleNamespace(send=posted.append)  # stands for the HTTPS backend: what it would post
    sender = sender_module.TelemetrySender(max_workers=1)
    sender.send(backend, "an event")
    sender.executor.shutdown(wait=True)  # a post the sender let through has run by now
    assert posted == []
