"""How many instances a model gets, and how many threads each: what the options say, else from the CPUs."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import grpc
import numpy as np
import pytest

from cloud_service.config import (
    AUTO_MAX_INSTANCES,
    MULTI_INSTANCE_MIN_S,
    ModelOptions,
    instance_layout,
)
from cloud_service.protocol import decode_outputs, encode_request
from cloud_service.protocol import inference_pb2 as pb
from cloud_service.protocol import inference_pb2_grpc as pbg
from runtimes.errors import ConfigError
from testkit.cloud_helpers import ServerThread, make_package


@pytest.mark.parametrize(("cpus", "expected"), [(1, (1, 1)), (2, (2, 1)), (3, (3, 1)), (8, (4, 2)), (16, (4, 4))])
def test_automatic_instances_share_the_cpus_one_per_cpu_up_to_the_cap(cpus: int, expected: tuple[int, int]) -> None:
    assert instance_layout(ModelOptions(), "onnxruntime", cpus) == expected
    assert instance_layout(ModelOptions(), "openvino", cpus) == expected


def test_a_model_that_computes_briefly_keeps_one_instance_with_the_backends_threads() -> None:
    assert instance_layout(ModelOptions(), "onnxruntime", 2, run_s=MULTI_INSTANCE_MIN_S / 2) == (1, 0)
    assert instance_layout(ModelOptions(), "onnxruntime", 2, run_s=MULTI_INSTANCE_MIN_S * 2) == (2, 1)
    assert instance_layout(ModelOptions(instances=2), "onnxruntime", 2, run_s=0.0) == (2, 0)


def test_given_threads_set_how_many_instances_the_cpus_hold() -> None:
    assert instance_layout(ModelOptions(intra_op_threads=2), "onnxruntime", 2) == (1, 2)
    assert instance_layout(ModelOptions(intra_op_threads=2), "onnxruntime", 8) == (4, 2)
    assert instance_layout(ModelOptions(intra_op_threads=4), "onnxruntime", 2) == (1, 4)


def test_given_instances_are_kept_and_runtimes_off_the_host_cpus_get_one() -> None:
    assert instance_layout(ModelOptions(instances=3), "onnxruntime", 2) == (3, 0)
    assert instance_layout(ModelOptions(instances=1, intra_op_threads=2), "onnxruntime", 16) == (1, 2)
    assert instance_layout(ModelOptions(), "tensorrt", 16) == (1, 0)
    assert instance_layout(ModelOptions(), "torch", 16) == (1, 0)
    with pytest.raises(ConfigError, match="instances must be"):
        ModelOptions(instances=-1)


def test_the_cpus_counted_are_the_processs_own_not_the_machines() -> None:
    if len(os.sched_getaffinity(0)) == 1:
        pytest.skip("one usable CPU: no affinity narrower than this process's to set")
    code = ("import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); "
            "from cloud_service.config import ModelOptions, instance_layout; "
            "print(*instance_layout(ModelOptions(), 'onnxruntime'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.split() == ["1", "1"], out.stdout
    assert instance_layout(ModelOptions(), "onnxruntime")[0] == min(len(os.sched_getaffinity(0)), AUTO_MAX_INSTANCES)


def test_a_served_model_opens_several_instances_only_when_it_computes_long_and_reports_them(
        serve: Callable[..., ServerThread], tmp_path: Path, digits_cnn_onnx: Path, digits_x: np.ndarray) -> None:
    from testkit.onnx_zoo import NotInstalled
    from testkit.overload import ocr_det_package

    try:  # PP-OCRv4's detector on 128x256 pages: about 12 ms a request on one CPU
        page = ocr_det_package(tmp_path / "auto", name="ocrdet")
    except NotInstalled as exc:
        pytest.skip(str(exc))
    make_package(tmp_path / "auto" / "digits", digits_cnn_onnx)  # well under a millisecond
    shutil.copytree(tmp_path / "auto" / "ocrdet", tmp_path / "one" / "ocrdet")
    auto = serve(tmp_path / "auto")
    one = serve(tmp_path / "one", defaults=ModelOptions(instances=1))
    several, _ = instance_layout(ModelOptions(), "onnxruntime")
    answers = []
    for server, model, count in ((auto, "ocrdet", several), (auto, "digits", 1), (one, "ocrdet", 1)):
        assert len(server.service.repository.get(model).sessions) == count, (model, count)
        with grpc.insecure_channel(server.grpc) as channel:
            stub = pbg.GRPCInferenceServiceStub(channel)
            config = stub.ModelConfig(pb.ModelConfigRequest(name=model)).config
            if model == "ocrdet":
                answers.append(decode_outputs(stub.ModelInfer(encode_request(model, {"x": page})))["sigmoid_0.tmp_0"])
        assert [g.count for g in config.instance_group] == [count]
    np.testing.assert_allclose(answers[0], answers[1], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(("spin", "entry"), [(None, "0"), (True, "1"), (False, "0")])
def test_a_served_models_compute_threads_spin_only_when_asked(tmp_path: Path, digits_cnn_onnx: Path,
                                                             spin: bool | None, entry: str) -> None:
    """A brief model keeps one instance with the backend's threads (`test_a_model_that_computes_briefly_...`):
    those threads do not busy-wait between runs unless the model's options ask for it (`config.SERVED_SPIN`),
    and every session the server opens follows the same options, whatever the layout."""
    from cloud_service.models import open_model

    make_package(tmp_path / "digits", digits_cnn_onnx)
    for options in (ModelOptions(spin=spin), ModelOptions(spin=spin, instances=2)):
        model = open_model(tmp_path / "digits", "digits", "1", options)
        try:
            assert len(model.sessions) == (options.instances or 1)
            for session in model.sessions:
                config = session.session_options  # type: ignore[attr-defined]
                for pool in ("intra_op", "inter_op"):
                    assert config.get_session_config_entry(f"session.{pool}.allow_spinning") == entry, (options, pool)
        finally:
            asyncio.run(model.aclose())
