"""The real server on a loopback port, called with tritonclient and with raw stubs of our own proto."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cloud_service.config import BatchingConfig, ModelOptions
from cloud_service.protocol import decode_outputs, encode_request, get_parameters, topics
from cloud_service.protocol import inference_pb2 as pb
from cloud_service.protocol import inference_pb2_grpc as pbg
from compilers.package import ModelPackage
from testkit.cloud_helpers import ServerThread, make_fake_package, metric_value
from testkit.waiting import wait_for

grpcclient = pytest.importorskip("tritonclient.grpc")


def direct(models_dir: Path, x: np.ndarray) -> np.ndarray:
    with ModelPackage.open(models_dir / "digits-v1").open_session() as session:
        return session.run({"x": x})["logits"]


@pytest.fixture
def server(serve: Callable[..., ServerThread], models_dir: Path) -> ServerThread:
    return serve(models_dir, metrics_address="127.0.0.1:0")


@pytest.fixture
def stub(server: ServerThread):  # type: ignore[no-untyped-def]
    with grpc.insecure_channel(server.grpc) as channel:
        yield pbg.GRPCInferenceServiceStub(channel)


def test_tritonclient_readiness_metadata_and_config(server: ServerThread) -> None:
    client = grpcclient.InferenceServerClient(url=server.grpc)
    assert client.is_server_live()
    assert client.is_server_ready()
    assert client.is_model_ready("digits")
    assert client.is_model_ready("digits", "1")
    assert not client.is_model_ready("nope")
    meta = client.get_model_metadata("digits", as_json=True)
    assert meta["name"] == "digits"
    assert meta["versions"] == ["1"]
    assert meta["platform"] == "onnxruntime_onnx"
    assert meta["inputs"] == [{"name": "x", "datatype": "FP32", "shape": ["-1", "1", "8", "8"]}]
    assert meta["outputs"] == [{"name": "logits", "datatype": "FP32", "shape": ["-1", "10"]}]
    config = client.get_model_config("digits", as_json=True)["config"]
    assert config["max_batch_size"] == 32
    assert config["input"][0]["dims"] == ["1", "8", "8"]  # Triton: without the batch axis
    assert config["input"][0]["data_type"] == "TYPE_FP32"
    assert config["output"][0]["dims"] == ["10"]
    assert "dynamic_batching" in config
    server_meta = client.get_server_metadata(as_json=True)
    assert server_meta["name"] == "tierkit"
    client.close()


def test_tritonclient_infer_equals_direct_onnxruntime(server: ServerThread, models_dir: Path,
                                                      digits_x: np.ndarray) -> None:
    client = grpcclient.InferenceServerClient(url=server.grpc)
    expected = direct(models_dir, digits_x)

    def one(i: int) -> np.ndarray:
        x = digits_x[i:i + 1 + i % 3]
        inp = grpcclient.InferInput("x", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        result = client.infer("digits", [inp], outputs=[grpcclient.InferRequestedOutput("logits")])
        return result.as_numpy("logits")

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(48)))
    for i, got in enumerate(results):
        np.testing.assert_allclose(got, expected[i:i + 1 + i % 3], rtol=1e-5, atol=1e-5)
    text = server.metrics_text
    assert metric_value(text, "tierkit_requests_total", model="digits", protocol="grpc") == 48
    assert metric_value(text, "tierkit_batch_size_count", model="digits") >= 1
    client.close()


def test_own_stub_typed_contents_parameters_and_versions(stub: pbg.GRPCInferenceServiceStub, models_dir: Path,
                                                         digits_x: np.ndarray) -> None:
    x = digits_x[:3]
    request = pb.ModelInferRequest(model_name="digits", model_version="1", id="req-7")
    tensor = request.inputs.add(name="x", datatype="FP32", shape=list(x.shape))
    tensor.contents.fp32_contents.extend(x.ravel().tolist())
    request.parameters[topics.PARAM_TRACE].string_param = "trace-1"
    request.parameters[topics.PARAM_DEVICE].string_param = "cam-1"
    response = stub.ModelInfer(request)
    assert response.id == "req-7"
    assert response.model_version == "1"
    assert get_parameters(response.parameters)[topics.PARAM_TRACE] == "trace-1"
    np.testing.assert_allclose(decode_outputs(response)["logits"], direct(models_dir, x), rtol=1e-5, atol=1e-5)


def test_health_and_reflection(server: ServerThread) -> None:
    from google.protobuf import descriptor_pool
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    with grpc.insecure_channel(server.grpc) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "inference.GRPCInferenceService"):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service))
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        db = ProtoReflectionDescriptorDatabase(channel)
        assert set(db.get_services()) >= {"inference.GRPCInferenceService", "grpc.health.v1.Health"}
        service = descriptor_pool.DescriptorPool(db).FindServiceByName("inference.GRPCInferenceService")
        assert {"ModelInfer", "ModelMetadata", "ModelConfig", "ServerLive"} <= {m.name for m in service.methods}


def _bad(case: str, x: np.ndarray) -> pb.ModelInferRequest:
    if case == "unknown model":
        return encode_request("nope", {"x": x})
    if case == "unknown version":
        return encode_request("digits", {"x": x}, version="9")
    if case == "wrong datatype":
        return encode_request("digits", {"x": x.astype(np.float64)})
    if case == "unsupported datatype":
        request = encode_request("digits", {"x": x})
        request.inputs[0].datatype = "BYTES"
        return request
    if case == "wrong shape":
        return encode_request("digits", {"x": x.reshape(len(x), 1, 4, 16)})
    if case == "byte size":
        request = encode_request("digits", {"x": x})
        request.raw_input_contents[0] = request.raw_input_contents[0][:-4]
        return request
    if case == "missing input":
        return pb.ModelInferRequest(model_name="digits")
    if case == "unknown input":
        return encode_request("digits", {"x": x, "extra": x})
    if case == "nan":
        y = x.copy()
        y[0, 0, 0, 0] = np.nan
        return encode_request("digits", {"x": y})
    if case == "inf":
        y = x.copy()
        y[-1, 0, 1, 1] = -np.inf
        return encode_request("digits", {"x": y})
    if case == "unknown output":
        return encode_request("digits", {"x": x}, outputs=["probs"])
    raise AssertionError(case)


BAD = [
    ("unknown model", "NOT_FOUND", "not served"),
    ("unknown version", "NOT_FOUND", "no version '9'"),
    ("wrong datatype", "INVALID_ARGUMENT", "float64 given, float32 expected"),
    ("unsupported datatype", "INVALID_ARGUMENT", "'BYTES' is not supported"),
    ("wrong shape", "INVALID_ARGUMENT", "shape [2, 1, 4, 16] given"),
    ("byte size", "INVALID_ARGUMENT", "508 bytes given"),
    ("missing input", "INVALID_ARGUMENT", "missing input 'x'"),
    ("unknown input", "INVALID_ARGUMENT", "unknown input(s) ['extra']"),
    ("nan", "INVALID_ARGUMENT", "NaN or Inf"),
    ("inf", "INVALID_ARGUMENT", "NaN or Inf"),
    ("unknown output", "INVALID_ARGUMENT", "['probs'] are not outputs"),
]


def test_bad_requests_get_a_clear_status_are_counted_and_others_keep_working(
        server: ServerThread, stub: pbg.GRPCInferenceServiceStub, digits_x: np.ndarray) -> None:
    x = digits_x[:2]
    for case, code, words in BAD:
        with pytest.raises(grpc.RpcError) as info:
            stub.ModelInfer(_bad(case, x))
        assert info.value.code() == getattr(grpc.StatusCode, code), case
        assert words in info.value.details(), (case, info.value.details())
        assert stub.ModelInfer(encode_request("digits", {"x": x})).outputs[0].name == "logits"
    text = server.metrics_text
    invalid = sum(1 for _, code, _ in BAD if code == "INVALID_ARGUMENT")
    assert metric_value(text, "tierkit_request_failures_total", model="digits", code="INVALID_ARGUMENT") == invalid
    assert metric_value(text, "tierkit_request_failures_total", model="_unknown", code="NOT_FOUND") == 1
    assert metric_value(text, "tierkit_request_failures_total", model="digits", code="NOT_FOUND") == 1
    assert metric_value(text, "tierkit_requests_total", model="digits", protocol="grpc") == len(BAD) - 1 + len(BAD)


def test_metadata_of_unknown_model_is_not_found(stub: pbg.GRPCInferenceServiceStub) -> None:
    with pytest.raises(grpc.RpcError) as info:
        stub.ModelMetadata(pb.ModelMetadataRequest(name="nope"))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as info:
        stub.ModelConfig(pb.ModelConfigRequest(name="digits", version="7"))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


def test_oversize_request_is_refused_and_counted(serve: Callable[..., ServerThread], models_dir: Path) -> None:
    server = serve(models_dir, max_message_bytes=64 * 1024)
    x = np.zeros((32, 1, 8, 8), np.float32)
    with grpc.insecure_channel(server.grpc) as channel:
        stub = pbg.GRPCInferenceServiceStub(channel)
        stub.ModelInfer(encode_request("digits", {"x": x}))  # 8 KiB: fine
        big = encode_request("digits", {"x": np.zeros((300, 1, 8, 8), np.float32)})  # 77 KiB
        with pytest.raises(grpc.RpcError) as info:
            stub.ModelInfer(big)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "exceeds this server's limit of 65536 bytes" in info.value.details()
        stub.ModelInfer(encode_request("digits", {"x": x}))
    assert metric_value(server.metrics_text, "tierkit_request_failures_total", code="RESOURCE_EXHAUSTED") == 1


def test_full_queue_answers_resource_exhausted_with_pushback(serve: Callable[..., ServerThread],
                                                             tmp_path: Path) -> None:
    make_fake_package(tmp_path / "m" / "slow", delay_s=0.15)
    options = ModelOptions(batching=BatchingConfig(max_batch_size=1, max_queue_size=2))
    server = serve(tmp_path / "m", defaults=options)
    x = np.ones((1, 4), np.float32)
    with grpc.insecure_channel(server.grpc) as channel:
        stub = pbg.GRPCInferenceServiceStub(channel)
        futures = [stub.ModelInfer.future(encode_request("slow", {"x": x}), timeout=20) for _ in range(8)]
        ok, busy = 0, []
        for future in futures:
            try:
                future.result()
                ok += 1
            except grpc.RpcError as exc:
                busy.append(exc)
    assert ok >= 3  # one running plus two queued
    assert busy, "some requests must have been refused"
    for exc in busy:
        assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "queue full" in exc.details()
        trailers = dict(exc.trailing_metadata())
        assert int(trailers["grpc-retry-pushback-ms"]) >= 1


def test_requests_past_their_deadline_are_not_computed(serve: Callable[..., ServerThread], tmp_path: Path) -> None:
    make_fake_package(tmp_path / "m" / "slow", delay_s=0.3)
    server = serve(tmp_path / "m", defaults=ModelOptions(batching=BatchingConfig(max_batch_size=1)),
                   metrics_address="127.0.0.1:0")
    x = np.ones((1, 4), np.float32)
    with grpc.insecure_channel(server.grpc) as channel:
        stub = pbg.GRPCInferenceServiceStub(channel)
        first = stub.ModelInfer.future(encode_request("slow", {"x": x}), timeout=20)
        wait_for("the first request to be taken from the queue and run",  # received and no longer queued
                 lambda: metric_value(text := server.metrics_text, "tierkit_requests_total", model="slow") == 1
                 and metric_value(text, "tierkit_queue_depth", model="slow") == 0, timeout=5, interval=0.01)
        with pytest.raises(grpc.RpcError) as info:
            stub.ModelInfer(encode_request("slow", {"x": x}), timeout=0.1)
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        first.result()
        stub.ModelInfer(encode_request("slow", {"x": x}), timeout=20)
        with pytest.raises(grpc.RpcError) as info:  # this one starts at once, and outlives its deadline
            stub.ModelInfer(encode_request("slow", {"x": x}), timeout=0.1)
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        # it finishes its run; nobody is waiting for the answer any more
        text = wait_for("the third batch to finish", lambda: metric_value(t := server.metrics_text,
                        "tierkit_batch_size_count", model="slow") >= 3 and t, timeout=5, interval=0.05)
    assert metric_value(text, "tierkit_batch_size_count", model="slow") == 3
    # the answer ready after its deadline is dropped before send, and counted as such
    assert metric_value(text, "tierkit_answers_dropped_total", model="slow", protocol="grpc") >= 1
    assert metric_value(text, "tierkit_request_failures_total", model="slow", protocol="grpc",
                        code="DEADLINE_EXCEEDED") >= 1


def test_stream_infer_answers_each_request(stub: pbg.GRPCInferenceServiceStub, digits_x: np.ndarray) -> None:
    requests = [encode_request("digits", {"x": digits_x[:1]}, request_id="a"),
                encode_request("nope", {"x": digits_x[:1]}, request_id="b"),
                encode_request("digits", {"x": digits_x[:2]}, request_id="c")]
    replies = list(stub.ModelStreamInfer(iter(requests)))
    # an error answer names its request too (as Triton's do), so a client with many in flight knows which failed
    assert [r.infer_response.id for r in replies] == ["a", "b", "c"]
    assert replies[1].infer_response.model_name == "nope"
    assert replies[1].error_message.startswith("NOT_FOUND")


def test_a_streams_requests_are_batched_together_and_answered_in_order(
        serve: Callable[..., ServerThread], models_dir: Path, digits_x: np.ndarray) -> None:
    batching = BatchingConfig(max_batch_size=32, preferred_batch_sizes=(8,), max_queue_delay_us=200_000)
    server = serve(models_dir, defaults=ModelOptions(batching=batching))
    expected = direct(models_dir, digits_x[:24])
    requests = [encode_request("digits", {"x": digits_x[i:i + 1]}, request_id=f"r{i}") for i in range(24)]
    requests.insert(5, encode_request("digits", {"x": digits_x[:1, :, :4]}, request_id="bad"))
    with grpc.insecure_channel(server.grpc) as channel:
        stub = pbg.GRPCInferenceServiceStub(channel)
        started = time.monotonic()
        replies = list(stub.ModelStreamInfer(iter(requests), timeout=30))
        elapsed = time.monotonic() - started
        (stats,) = stub.ModelStatistics(pb.ModelStatisticsRequest(name="digits")).model_stats
    assert replies[5].error_message.startswith("INVALID_ARGUMENT")  # answered in its place
    del replies[5]
    assert [r.infer_response.id for r in replies] == [f"r{i}" for i in range(24)]
    for i, reply in enumerate(replies):
        np.testing.assert_allclose(decode_outputs(reply.infer_response)["logits"], expected[i:i + 1],
                                   rtol=1e-5, atol=1e-5)
    # one at a time, each request would wait out the 200 ms delay alone: 24 runs, ~5 s
    assert stats.execution_count <= 8, [(b.batch_size, b.compute_infer.count) for b in stats.batch_stats]
    assert elapsed < 4.0


def test_calls_beyond_the_worker_pool_are_refused_at_once(serve: Callable[..., ServerThread],
                                                          tmp_path: Path) -> None:
    make_fake_package(tmp_path / "m" / "slow", delay_s=0.3)
    server = serve(tmp_path / "m", grpc_workers=2,
                   defaults=ModelOptions(batching=BatchingConfig(max_batch_size=1, max_queue_size=64)))
    x = np.ones((1, 4), np.float32)
    with grpc.insecure_channel(server.grpc) as channel:
        stub = pbg.GRPCInferenceServiceStub(channel)
        stub.ModelInfer(encode_request("slow", {"x": x}), timeout=20)  # the channel is up
        started = time.monotonic()
        calls = [stub.ModelInfer.future(encode_request("slow", {"x": x}), timeout=20) for _ in range(5)]
        codes = []
        for call in calls:
            try:
                call.result()
                codes.append(grpc.StatusCode.OK)
            except grpc.RpcError as exc:
                codes.append(exc.code())
        elapsed = time.monotonic() - started
    assert codes.count(grpc.StatusCode.OK) == 2, codes  # one thread each
    assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) == 3, codes
    assert elapsed < 1.5  # the refused ones did not wait behind the running ones (2 x 0.3 s)


def test_a_resent_escalation_is_answered_from_the_duplicate_cache_over_grpc(
        server: ServerThread, stub: pbg.GRPCInferenceServiceStub, digits_x: np.ndarray) -> None:
    params = {topics.PARAM_DEVICE: "cam-1", topics.PARAM_BOOT: "boot-a", topics.PARAM_SEQ: 41}
    request = encode_request("digits", {"x": digits_x[:1]}, parameters=params)
    first, again = stub.ModelInfer(request, timeout=10), stub.ModelInfer(request, timeout=10)
    fresh = stub.ModelInfer(encode_request("digits", {"x": digits_x[:1]},
                                           parameters={**params, topics.PARAM_BOOT: "boot-b"}), timeout=10)
    plain = stub.ModelInfer(encode_request("digits", {"x": digits_x[:1]}), timeout=10)  # no seq: never cached
    assert topics.PARAM_CACHED not in first.parameters
    assert get_parameters(again.parameters)[topics.PARAM_CACHED] is True
    assert topics.PARAM_CACHED not in fresh.parameters
    assert topics.PARAM_CACHED not in plain.parameters
    np.testing.assert_array_equal(decode_outputs(first)["logits"], decode_outputs(again)["logits"])
    stats = server.service.repository.get("digits").stats.to_proto("digits", "1")
    assert stats.inference_stats.success.count == 3  # the resend never reached the model
