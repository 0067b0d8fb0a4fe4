"""The statistics extension (ModelStatistics) on the real server, read with tritonclient and our stub."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import pytest

from cloud_service.protocol import encode_request
from cloud_service.protocol import inference_pb2 as pb
from cloud_service.protocol import inference_pb2_grpc as pbg
from cloud_service.statistics import ModelStats
from testkit.cloud_helpers import ServerThread, make_package

grpcclient = pytest.importorskip("tritonclient.grpc")


def test_tritonclient_reads_statistics_that_add_up(serve: Callable[..., ServerThread], models_dir: Path,
                                                    digits_x: np.ndarray) -> None:
    server = serve(models_dir)
    client = grpcclient.InferenceServerClient(url=server.grpc)
    assert "statistics" in client.get_server_metadata(as_json=True)["extensions"]
    sizes = [1 + i % 3 for i in range(30)]

    def one(i: int) -> None:
        x = digits_x[:sizes[i]]
        inp = grpcclient.InferInput("x", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        client.infer("digits", [inp])

    before_ms = time.time() * 1000
    with ThreadPoolExecutor(6) as pool:
        list(pool.map(one, range(len(sizes))))
    response = client.get_inference_statistics("digits")
    client.close()

    (stats,) = response.model_stats
    assert (stats.name, stats.version) == ("digits", "1")
    assert stats.inference_count == sum(sizes)
    assert 1 <= stats.execution_count <= len(sizes)
    assert before_ms - 1000 <= stats.last_inference <= time.time() * 1000 + 1000
    infer = stats.inference_stats
    assert infer.success.count == len(sizes)
    assert infer.fail.count == 0
    assert infer.queue.count == infer.compute_infer.count == len(sizes)
    assert infer.compute_infer.ns > 0
    # every request's time in the server contains its batch's run (1 ns of rounding each)
    assert infer.success.ns >= infer.compute_infer.ns - len(sizes)
    assert sum(b.compute_infer.count for b in stats.batch_stats) == stats.execution_count
    assert sum(b.batch_size * b.compute_infer.count for b in stats.batch_stats) == sum(sizes)


def test_failures_count_against_their_version_and_unknown_models_are_not_found(
        serve: Callable[..., ServerThread], models_dir: Path, digits_cnn_onnx: Path, digits_x: np.ndarray) -> None:
    make_package(models_dir / "digits-v2", digits_cnn_onnx, version="2")
    server = serve(models_dir)
    with grpc.insecure_channel(server.grpc) as channel:
        stub = pbg.GRPCInferenceServiceStub(channel)
        stub.ModelInfer(encode_request("digits", {"x": digits_x[:2]}, version="1"))
        wrong = encode_request("digits", {"x": digits_x[:2, :, :4]}, version="2")
        with pytest.raises(grpc.RpcError) as bad:
            stub.ModelInfer(wrong)
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.RpcError):
            stub.ModelInfer(encode_request("nope", {"x": digits_x[:1]}))

        every = stub.ModelStatistics(pb.ModelStatisticsRequest())
        by_version = {s.version: s for s in every.model_stats}
        assert sorted(by_version) == ["1", "2"]
        assert by_version["1"].inference_stats.success.count == 1
        assert by_version["1"].inference_count == 2
        assert by_version["2"].inference_stats.fail.count == 1
        assert by_version["2"].inference_stats.success.count == 0
        assert by_version["2"].execution_count == 0  # refused before the model ran
        assert len(stub.ModelStatistics(pb.ModelStatisticsRequest(name="digits")).model_stats) == 2
        (one,) = stub.ModelStatistics(pb.ModelStatisticsRequest(name="digits", version="2")).model_stats
        assert one.version == "2"
        for request in (pb.ModelStatisticsRequest(name="nope"), pb.ModelStatisticsRequest(name="digits", version="9")):
            with pytest.raises(grpc.RpcError) as missing:
                stub.ModelStatistics(request)
            assert missing.value.code() == grpc.StatusCode.NOT_FOUND
            assert "not served" in (missing.value.details() or "") or "no version" in (missing.value.details() or "")


def test_stats_forward_every_batcher_measurement_to_the_metrics_observer() -> None:
    seen: list[tuple[str, tuple[object, ...]]] = []

    class Recorder:
        def on_queue(self, depth: int) -> None:
            seen.append(("queue", (depth,)))

        def on_batch(self, rows: int, requests: int, seconds: float, queued: float) -> None:
            seen.append(("batch", (rows, requests, seconds, queued)))

        def on_expired(self, count: int) -> None:
            seen.append(("expired", (count,)))

    stats = ModelStats(Recorder())
    stats.on_queue(3)
    stats.on_batch(8, 3, 0.002, 0.0015)
    stats.on_batch(1, 1, 0.001, 0.0)
    stats.on_expired(2)
    assert seen == [("queue", (3,)), ("batch", (8, 3, 0.002, 0.0015)), ("batch", (1, 1, 0.001, 0.0)),
                    ("expired", (2,))]
    proto = stats.to_proto("m", "1")
    assert proto.inference_stats.compute_infer.count == 4
    assert proto.inference_stats.compute_infer.ns == 3 * 2_000_000 + 1_000_000
    assert proto.inference_stats.queue.ns == 1_500_000
    assert [(b.batch_size, b.compute_infer.count) for b in proto.batch_stats] == [(1, 1), (8, 1)]
