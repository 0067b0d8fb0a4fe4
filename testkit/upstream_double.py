"""A scripted Open Inference Protocol upstream on loopback, for the forward backend's stream handling.

It answers `ModelInfer` and (unless `stream=False`) `ModelStreamInfer`, each answer echoing the
request's `model_name` and `model_version` (so a caller can tell which request an answer is for) and
the `id` it received. By model name: "slow" is answered after `SLOW_S`; "fail" gets an error (on the
stream: an error message that names no request, as some servers send; unary: INVALID_ARGUMENT).
Stream answers leave in request order, as Triton's do for a model that is not decoupled, or with
`ordered=False` as each is ready (a "slow" request is overtaken by the ones after it).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc

from cloud_service.protocol import inference_pb2 as pb

SLOW_S = 0.5
BUSY_HINT_MS = 300  # "busy" is refused RESOURCE_EXHAUSTED with this retry hint
_SERVICE = "inference.GRPCInferenceService"


class UpstreamDouble:
    def __init__(self, *, stream: bool = True, ordered: bool = True) -> None:
        self.ids: list[str] = []  # the ids requests arrived with
        self.ordered = ordered
        methods: dict[str, grpc.RpcMethodHandler] = {
            "ModelInfer": grpc.unary_unary_rpc_method_handler(
                self._unary, request_deserializer=pb.ModelInferRequest.FromString,
                response_serializer=pb.ModelInferResponse.SerializeToString),
            "ServerLive": grpc.unary_unary_rpc_method_handler(
                lambda request, context: pb.ServerLiveResponse(live=True),
                request_deserializer=pb.ServerLiveRequest.FromString,
                response_serializer=pb.ServerLiveResponse.SerializeToString),
        }
        if stream:
            methods["ModelStreamInfer"] = grpc.stream_stream_rpc_method_handler(
                self._stream, request_deserializer=pb.ModelInferRequest.FromString,
                response_serializer=pb.ModelStreamInferResponse.SerializeToString)
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(_SERVICE, methods),))
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self._server.start()

    @property
    def url(self) -> str:
        return f"grpc://127.0.0.1:{self.port}"

    def _answer(self, request: pb.ModelInferRequest) -> pb.ModelInferResponse:
        self.ids.append(request.id)
        if request.model_name == "slow":
            time.sleep(SLOW_S)
        return pb.ModelInferResponse(model_name=request.model_name, model_version=request.model_version,
                                     id=request.id)

    def _unary(self, request: pb.ModelInferRequest, context: Any) -> pb.ModelInferResponse:
        if request.model_name == "fail":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "this request always fails")
        if request.model_name == "busy":
            self.ids.append(request.id)
            context.set_trailing_metadata((("retry-after-ms", str(BUSY_HINT_MS)),))
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "overloaded; retry after the hinted delay")
        return self._answer(request)

    def _stream(self, requests: Iterator[pb.ModelInferRequest], context: Any) -> Iterator[pb.ModelStreamInferResponse]:
        if not self.ordered:
            yield from self._unordered(requests)
            return
        for request in requests:
            if request.model_name == "fail":
                self.ids.append(request.id)
                yield pb.ModelStreamInferResponse(error_message="this request always fails")
            else:
                yield pb.ModelStreamInferResponse(infer_response=self._answer(request))

    def _unordered(self, requests: Iterator[pb.ModelInferRequest]) -> Iterator[pb.ModelStreamInferResponse]:
        answers: queue.SimpleQueue[pb.ModelStreamInferResponse | None] = queue.SimpleQueue()
        threads: list[threading.Thread] = []

        def read() -> None:
            try:
                for request in requests:
                    thread = threading.Thread(target=lambda r=request: answers.put(
                        pb.ModelStreamInferResponse(infer_response=self._answer(r))))
                    thread.start()
                    threads.append(thread)
            except grpc.RpcError:  # the client cancelled the stream
                pass
            finally:
                for thread in threads:
                    thread.join()
                answers.put(None)

        reader = threading.Thread(target=read)
        reader.start()
        while (answer := answers.get()) is not None:
            yield answer
        reader.join()

    def stop(self) -> None:
        self._server.stop(None).wait(5)
