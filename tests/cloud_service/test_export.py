"""`tierkit export --triton/--kserve`: config.pbtxt parsed with Triton's own model-config schema."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml
from google.protobuf import text_format

from cloud_service.export import TritonExport, kserve_manifest, preferred_batch_sizes, write_triton_repository
from compilers.manifest import Manifest
from compilers.package import write_package
from runtimes.errors import ConfigError
from sdk.cli import main
from testkit.cloud_helpers import DIGITS_INPUTS, DIGITS_OUTPUTS

triton_schema = pytest.importorskip("tritonclient.grpc.model_config_pb2")  # Triton's model_config.proto

# a measured batch curve (p50 ms): per sample 0.30, 0.10, 0.043, 0.040, 0.041
CURVE = {"batch_1": {"p50": 0.30}, "batch_4": {"p50": 0.40}, "batch_16": {"p50": 0.69},
         "batch_32": {"p50": 1.28}, "batch_64": {"p50": 2.62}}


def _package(directory: Path, onnx: Path, **fields: object) -> Path:
    directory.mkdir(parents=True)
    shutil.copyfile(onnx, directory / "model.onnx")
    manifest = Manifest(name="digits", version="3", target="x86-avx512", precision="fp32", runtime="onnxruntime",
                        artifact="model.onnx", inputs=DIGITS_INPUTS, outputs=DIGITS_OUTPUTS, **fields)  # type: ignore[arg-type]
    write_package(directory, manifest)
    return directory


def _parse(path: Path):  # type: ignore[no-untyped-def]
    return text_format.Parse(path.read_text(), triton_schema.ModelConfig())


def test_preferred_sizes_come_from_the_batch_curve() -> None:
    manifest = Manifest(name="m", version="1", target="t", precision="fp32", runtime="onnxruntime",
                        artifact="model.onnx", inputs=DIGITS_INPUTS, outputs=DIGITS_OUTPUTS, latency_ms=CURVE)
    # best per-sample time at 32 (0.040 ms); 16 is within 10 % of it
    assert preferred_batch_sizes(manifest) == [16, 32]
    assert preferred_batch_sizes(manifest.replace(latency_ms={"batch_1": {"p50": 0.3}})) == []


def test_triton_repository_parses_with_tritons_schema(tmp_path: Path, digits_cnn_onnx: Path) -> None:
    package = _package(tmp_path / "pkg", digits_cnn_onnx, latency_ms=CURVE)
    model_dir = write_triton_repository(package, tmp_path / "repo", options=TritonExport(instances=2))
    config = _parse(model_dir / "config.pbtxt")
    assert model_dir == tmp_path / "repo" / "digits"
    assert config.name == "digits"
    assert config.platform == "onnxruntime_onnx"
    assert config.max_batch_size == 64
    assert [(i.name, i.data_type, list(i.dims)) for i in config.input] == [("x", triton_schema.TYPE_FP32, [1, 8, 8])]
    assert [(o.name, list(o.dims)) for o in config.output] == [("logits", [10])]
    assert list(config.dynamic_batching.preferred_batch_size) == [16, 32]
    assert config.dynamic_batching.max_queue_delay_microseconds == 100
    assert [(g.count, g.kind) for g in config.instance_group] == [(2, triton_schema.ModelInstanceGroup.KIND_CPU)]
    assert config.default_model_filename == "model.onnx"
    assert config.parameters["tierkit.version"].string_value == "3"
    assert (model_dir / "1" / "model.onnx").read_bytes() == (package / "model.onnx").read_bytes()


def test_unbatched_model_gets_full_dims_and_no_dynamic_batching(tmp_path: Path, digits_cnn_onnx: Path) -> None:
    package = _package(tmp_path / "pkg", digits_cnn_onnx)
    model_dir = write_triton_repository(package, tmp_path / "repo", options=TritonExport(max_batch_size=0))
    config = _parse(model_dir / "config.pbtxt")
    assert config.max_batch_size == 0
    assert list(config.input[0].dims) == [-1, 1, 8, 8]
    assert not config.HasField("dynamic_batching")


def test_cli_writes_repository_and_inference_service(tmp_path: Path, digits_cnn_onnx: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    package = _package(tmp_path / "pkg", digits_cnn_onnx, latency_ms=CURVE)
    isvc = tmp_path / "isvc.yaml"
    assert main(["export", str(package), "--triton", str(tmp_path / "repo"), "--name", "digits_cnn",
                 "--kserve", str(isvc), "--storage-uri", "s3://models/repo"]) == 0
    assert _parse(tmp_path / "repo" / "digits_cnn" / "config.pbtxt").name == "digits_cnn"
    doc = yaml.safe_load(isvc.read_text())
    assert doc["kind"] == "InferenceService"
    assert doc["metadata"]["name"] == "digits-cnn"
    model = doc["spec"]["predictor"]["model"]
    assert (model["runtime"], model["protocolVersion"], model["storageUri"]) == (
        "kserve-tritonserver", "v2", "s3://models/repo")
    assert "triton" in capsys.readouterr().out
    assert main(["export", str(package), "--triton", str(tmp_path / "r2"), "--kserve", str(isvc)]) == 1


def test_bad_inputs_say_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="neither a variant set"):
        write_triton_repository(tmp_path, tmp_path / "repo")
    with pytest.raises(ConfigError, match="Kubernetes name"):
        kserve_manifest("Digits CNN!", "s3://b/r")
    with pytest.raises(ConfigError, match="storage URI"):
        kserve_manifest("digits", "repo")
