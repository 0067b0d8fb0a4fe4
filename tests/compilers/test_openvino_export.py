"""OpenVINO's refusal to convert a graph becomes a short reason naming the op."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from runtimes.errors import CompileError

pytest.importorskip("openvino")


def _conv_of_unknown_rank(path: Path) -> Path:
    """A Conv inside an If branch whose input has no declared rank: OpenVINO's ONNX frontend cannot convert it
    (the same failure as Silero VAD's decoder)."""
    import onnx
    from onnx import TensorProto, helper

    w = helper.make_tensor("w", TensorProto.FLOAT, [1, 1, 3], np.ones(3, np.float32))
    unknown = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("x", "t", "e", "y")]
    then = helper.make_graph([helper.make_node("Conv", ["x", "w"], ["t"])], "then", [], [unknown[1]])
    other = helper.make_graph([helper.make_node("Identity", ["x"], ["e"])], "else", [], [unknown[2]])
    node = helper.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other, name="If_0")
    cond = helper.make_tensor_value_info("c", TensorProto.BOOL, [])
    graph = helper.make_graph([node], "g", [cond, unknown[0]], [unknown[3]], initializer=[w])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 16)]), str(path))
    return path


def test_an_op_openvino_cannot_convert_is_named_in_one_line(tmp_path: Path) -> None:
    from compilers.passes.quantize_ov import export

    model = _conv_of_unknown_rank(tmp_path / "vad-like.onnx")
    with pytest.raises(CompileError) as caught:
        export(model, SimpleNamespace(workdir=tmp_path))  # type: ignore[arg-type]
    reason = str(caught.value)
    assert reason.startswith("OpenVINO cannot convert ONNX Conv of vad-like.onnx (Conv: ")
    assert "rank" in reason
    assert "openvino 20" in reason
    assert "\n" not in reason
    assert "src/frontends" not in reason
    assert len(reason) < 200


def test_other_conversion_errors_keep_their_text_without_source_lines() -> None:
    from compilers.passes.quantize_ov import conversion_failure

    exc = RuntimeError("Exception from src/core/x.cpp:12:\nthe model file is truncated\n")
    assert conversion_failure(exc, "m.onnx").endswith("cannot convert m.onnx: the model file is truncated")


def test_an_op_without_a_conversion_rule_is_named(tmp_path: Path) -> None:
    import onnx
    from onnx import TensorProto, helper

    from compilers.passes.quantize_ov import export

    x, y = (helper.make_tensor_value_info(n, TensorProto.FLOAT, ["batch", 4]) for n in ("x", "y"))
    node = helper.make_node("Frobnicate", ["x"], ["y"], domain="com.example.nowhere")
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.example.nowhere", 1)]
    model = helper.make_model(helper.make_graph([node], "frob", [x], [y]), opset_imports=opsets)
    onnx.save(model, str(tmp_path / "frob.onnx"))
    with pytest.raises(CompileError) as caught:  # through export: it puts back the logging convert_model changes
        export(tmp_path / "frob.onnx", SimpleNamespace(workdir=tmp_path))  # type: ignore[arg-type]
    assert str(caught.value).startswith(
        "OpenVINO cannot convert ONNX com.example.nowhere.Frobnicate of frob.onnx (no conversion")
