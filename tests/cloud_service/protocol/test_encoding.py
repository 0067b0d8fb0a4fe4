"""Declared wire encodings (fp16, zstd, raw frame + the package's preprocessing), on the codec and
through a real server."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from cloud_service.protocol import CodecError, decode_inputs, decode_outputs, encode_request
from cloud_service.protocol import inference_pb2 as pb
from cloud_service.protocol.encoding import ENCODINGS, PARAM_ENCODING, check_encoding, encode_input, frame_inputs
from cloud_service.protocol.preprocess import Preprocess
from compilers.manifest import Manifest
from compilers.package import write_package
from edge_agent.transports import open_transport
from testkit.cloud_helpers import DIGITS_INPUTS, DIGITS_OUTPUTS


def _wire(encoding: str, array: np.ndarray) -> tuple[pb.ModelInferRequest, int]:
    request = pb.ModelInferRequest(model_name="m")
    size = encode_input(request, "x", array, encoding)
    return pb.ModelInferRequest.FromString(request.SerializeToString()), size


def _image(seed: int = 0) -> np.ndarray:
    """A smooth 224x224 image-like tensor (a real photo compresses similarly; noise would not)."""
    rng = np.random.default_rng(seed)
    coarse = rng.random((1, 3, 28, 28), dtype=np.float32)
    return np.ascontiguousarray(np.repeat(np.repeat(coarse, 8, axis=2), 8, axis=3))


def test_fp16_and_zstd_round_trip_and_shrink_the_bytes() -> None:
    x = _image()
    sizes = {}
    for encoding in ("fp32", "fp16", "zstd", "fp16+zstd"):
        wire, sizes[encoding] = _wire(encoding, x)
        got = decode_inputs(wire)["x"]
        assert got.dtype == np.float32
        assert got.shape == x.shape
        if "fp16" in encoding:
            np.testing.assert_allclose(got, x, rtol=1e-3, atol=1e-3)
            assert not np.array_equal(got, x)  # it really went through fp16
        else:
            np.testing.assert_array_equal(got, x)
    assert sizes["fp32"] == x.nbytes
    assert sizes["fp16"] == x.nbytes // 2
    assert sizes["zstd"] < sizes["fp32"]
    assert sizes["fp16+zstd"] < sizes["fp16"]


def test_plain_request_carries_no_encoding_parameter() -> None:
    wire, _ = _wire("fp32", _image())
    assert PARAM_ENCODING not in wire.inputs[0].parameters
    assert frame_inputs(wire) == []


@pytest.mark.parametrize("encoding", ["gzip", "zstd+fp16", "fp16+fp16", "frame+fp16", "fp16+"])
def test_bad_encodings_are_refused_with_the_rule(encoding: str) -> None:
    with pytest.raises(CodecError, match="encoding"):
        check_encoding(encoding)


def test_every_listed_encoding_is_valid() -> None:
    for encoding in ENCODINGS:
        check_encoding(encoding)


def test_zstd_that_inflates_past_the_declared_shape_is_refused() -> None:
    import zstandard

    request = pb.ModelInferRequest(model_name="m")
    tensor = request.inputs.add(name="x", datatype="FP32", shape=[1, 4])
    tensor.parameters[PARAM_ENCODING].string_param = "zstd"
    request.raw_input_contents.append(zstandard.ZstdCompressor().compress(bytes(1 << 20)))  # 1 MiB of zeros
    with pytest.raises(CodecError, match="decompress"):
        decode_inputs(request)


def test_fp16_declared_on_an_fp32_datatype_is_refused() -> None:
    request = encode_request("m", {"x": np.ones((1, 4), np.float32)})
    request.inputs[0].parameters[PARAM_ENCODING].string_param = "fp16"
    with pytest.raises(CodecError, match="FP16"):
        decode_inputs(request)


def test_bilinear_preprocess_matches_torch_interpolate() -> None:
    frame = np.random.default_rng(1).integers(0, 256, (2, 37, 53, 3), dtype=np.uint8)
    pre = Preprocess.from_json({"size": [24, 20], "scale": 1 / 255, "mean": [0.485, 0.456, 0.406],
                                "std": [0.229, 0.224, 0.225]})
    got = pre.apply(frame)
    t = torch.from_numpy(frame.astype(np.float32)).permute(0, 3, 1, 2)
    want = torch.nn.functional.interpolate(t, size=(24, 20), mode="bilinear", align_corners=False).numpy()
    want = (want / 255 - np.array([0.485, 0.456, 0.406], np.float32)[:, None, None]) / np.array(
        [0.229, 0.224, 0.225], np.float32)[:, None, None]
    assert got.shape == (2, 3, 24, 20)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, want, atol=1e-4)


@pytest.mark.parametrize(("doc", "match"), [({"size": [0, 4]}, "size"), ({"layout": "CHW"}, "layout"),
                                            ({"std": [0.0]}, "std"), ({"colour": "rgb"}, "unknown")])
def test_bad_preprocess_is_refused(doc: dict[str, object], match: str) -> None:
    with pytest.raises(CodecError, match=match):
        Preprocess.from_json(doc)


def _digits_package(root: Path, onnx: Path, preprocess: dict[str, object]) -> Path:
    directory = root / "digits-v1"
    directory.mkdir(parents=True)
    shutil.copyfile(onnx, directory / "model.onnx")
    manifest = Manifest(name="digits", version="1", target="x86-avx512", precision="fp32", runtime="onnxruntime",
                        artifact="model.onnx", inputs=DIGITS_INPUTS, outputs=DIGITS_OUTPUTS, preprocess=preprocess)
    write_package(directory, manifest)
    assert json.loads((directory / "manifest.json").read_text())["preprocess"] == preprocess
    return root


def test_server_answers_every_encoding_as_it_answers_fp32(tmp_path: Path, digits_cnn_onnx: Path,
                                                          digits_x: np.ndarray, serve) -> None:  # type: ignore[no-untyped-def]
    # digits are 0..16 integers scaled by 1/16: the uint8 frame is exact; sent at twice the size,
    # nearest resizing gives the model's 8x8 back
    models = _digits_package(tmp_path / "models", digits_cnn_onnx,
                             {"size": [8, 8], "resize": "nearest", "scale": 0.0625, "layout": "NCHW"})
    server = serve(models)
    x = digits_x[:4]
    frames = np.round(x[:, 0, :, :, None] * 16).astype(np.uint8)
    frames = np.repeat(np.repeat(frames, 2, axis=1), 2, axis=2)  # (4, 16, 16, 1)

    async def ask(encoding: str, array: np.ndarray) -> np.ndarray:
        request = pb.ModelInferRequest(model_name="digits")
        encode_input(request, "x", array, encoding)
        async with open_transport(f"grpc://{server.grpc}/digits", device_id="cam-1") as cloud:
            return decode_outputs(await cloud.escalate(request, timeout_s=10))["logits"]

    async def main() -> None:
        plain = await ask("fp32", x)
        np.testing.assert_allclose(await ask("zstd", x), plain, rtol=0, atol=0)
        np.testing.assert_allclose(await ask("frame", frames), plain, atol=1e-5)
        np.testing.assert_allclose(await ask("frame+zstd", frames), plain, atol=1e-5)
        half = await ask("fp16+zstd", x)
        np.testing.assert_allclose(half, plain, atol=0.05)
        assert (half.argmax(1) == plain.argmax(1)).all()

    asyncio.run(main())


def test_model_without_preprocess_refuses_a_frame(models_dir: Path, serve) -> None:  # type: ignore[no-untyped-def]
    server = serve(models_dir)
    request = pb.ModelInferRequest(model_name="digits")
    encode_input(request, "x", np.zeros((1, 8, 8, 1), np.uint8), "frame")

    async def main() -> None:
        async with open_transport(f"grpc://{server.grpc}/digits", device_id="cam-1") as cloud:
            with pytest.raises(Exception, match="declares no preprocess") as info:
                await cloud.escalate(request, timeout_s=10)
        assert getattr(info.value, "code", "") == "INVALID_ARGUMENT"

    asyncio.run(main())


def test_zstd_without_a_stated_size_is_bounded_by_the_shape() -> None:
    import zstandard

    request = pb.ModelInferRequest(model_name="m")
    tensor = request.inputs.add(name="x", datatype="FP32", shape=[1, 4])
    tensor.parameters[PARAM_ENCODING].string_param = "zstd"
    unsized = zstandard.ZstdCompressor(write_content_size=False).compress(bytes(1 << 20))
    assert zstandard.frame_content_size(unsized) == -1
    request.raw_input_contents.append(unsized)
    with pytest.raises(CodecError, match="decompress"):
        decode_inputs(request)
