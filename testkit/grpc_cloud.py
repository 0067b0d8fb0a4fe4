"""A real gRPC (Open Inference Protocol) cloud on loopback for agent tests: it answers class 3 for every
row, records (boot id, seq) of each request, and can hang (answer only once released) or refuse."""

from __future__ import annotations

import threading
from concurrent import futures
from typing import Any

import grpc
import numpy as np

from cloud_service.protocol import decode_inputs, encode_response, get_parameters, inference_pb2_grpc, topics


class RecordingCloud(inference_pb2_grpc.GRPCInferenceServiceServicer):
    """Answers `model` with class 3; `hang.clear()` makes new requests wait until `hang.set()`."""

    def __init__(self, model: str = "digits") -> None:
        self.model = model
        self.go = threading.Event()
        self.go.set()
        self.arrived = threading.Event()  # set when a request arrives
        self.seen: list[tuple[str, int]] = []
        self._lock = threading.Lock()

    def ModelInfer(self, request: Any, context: Any) -> Any:
        params = get_parameters(request.parameters)
        self.arrived.set()
        self.go.wait(30)
        with self._lock:
            self.seen.append((str(params.get(topics.PARAM_BOOT)), int(params.get(topics.PARAM_SEQ, -1))))
        logits = np.zeros((len(decode_inputs(request)["x"]), 10), np.float32)
        logits[:, 3] = 7.0
        return encode_response(self.model, {"logits": logits})


class GrpcCloud:
    """`RecordingCloud` served on 127.0.0.1 (a fixed `port` lets a test start it after the agent)."""

    def __init__(self, model: str = "digits", port: int = 0) -> None:
        self.servicer = RecordingCloud(model)
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
        inference_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(self.servicer, self.server)
        self.port = self.server.add_insecure_port(f"127.0.0.1:{port}")
        self.server.start()

    def url(self, model: str = "digits") -> str:
        return f"grpc://127.0.0.1:{self.port}/{model}"

    def stop(self) -> None:
        self.servicer.go.set()
        self.server.stop(0).wait(5)
