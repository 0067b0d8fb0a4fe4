"""One dtype vocabulary: the shared table in `runtimes.spec`, read by the backends, the codec and the server."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from cloud_service import server
from cloud_service.protocol import CodecError, decode_inputs, encode_request
from cloud_service.protocol.codec import NP_TO_OIP
from runtimes import ort_backend
from runtimes.errors import TierkitError
from runtimes.spec import DTYPES, TensorSpec
from testkit.cloud_helpers import ServerThread, make_package


def test_the_server_advertises_only_what_the_codec_decodes() -> None:
    assert server._OIP == NP_TO_OIP
    assert set(server._DATA_TYPES) == set(NP_TO_OIP)
    assert "bfloat16" not in NP_TO_OIP  # numpy has no bfloat16: no tensor of it can be decoded


@pytest.mark.parametrize("name", sorted(NP_TO_OIP))
def test_every_wire_dtype_of_the_table_round_trips(name: str) -> None:
    x = np.arange(6).reshape(2, 3).astype(name)
    back = decode_inputs(encode_request("m", {"x": x}))["x"]
    assert back.dtype == x.dtype
    np.testing.assert_array_equal(back, x)


def test_backends_read_the_same_table() -> None:
    assert set(ort_backend._ORT_TYPES.values()) == set(DTYPES)
    assert ort_backend._ORT_TYPES["tensor(float)"] == "float32"


def test_codec_errors_are_tierkit_errors() -> None:
    with pytest.raises(TierkitError) as info:
        encode_request("m", {"x": np.zeros(2, np.complex64)})
    assert isinstance(info.value, CodecError)
    assert isinstance(info.value, ValueError)


def _bf16_model(path: Path) -> Path:
    x = helper.make_tensor_value_info("x", TensorProto.BFLOAT16, ["batch", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])
    graph = helper.make_graph([helper.make_node("Cast", ["x"], ["y"], to=TensorProto.FLOAT)], "bf16", [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(model, path)
    return path


def test_a_model_with_a_tensor_the_codec_cannot_carry_is_refused(serve: Callable[..., ServerThread],
                                                                 models_dir: Path, tmp_path: Path) -> None:
    server_thread = serve(models_dir)
    make_package(models_dir / "half-v1", _bf16_model(tmp_path / "bf16.onnx"), name="half",
                 inputs=(TensorSpec("x", "bfloat16", ("batch", 4)),),
                 outputs=(TensorSpec("y", "float32", ("batch", 4)),))
    report = server_thread.call(server_thread.service.reload())
    assert "wire codec cannot carry" in report.refused["half:1"]
    assert "x (bfloat16)" in report.refused["half:1"]
    assert "half" not in server_thread.service.repository
