"""KServe's Python model server for one ONNX model: the comparison `bench_cloud.py --kserve-python`
draws. Run it with a Python that has `kserve` (its protobuf < 7 pin conflicts with tierkit's, so it
lives in a virtual environment of its own):

    python3.11 -m venv /tmp/kserve-venv && /tmp/kserve-venv/bin/pip install kserve onnxruntime
    /tmp/kserve-venv/bin/python bench/kserve_server.py MODEL.onnx NAME [THREADS]

The model is a custom `kserve.Model` as KServe's custom-model documentation writes one: `load()`
opens an onnxruntime session, a synchronous `predict()` takes the `InferRequest`'s inputs as numpy
arrays and returns an `InferResponse`. Requests go through KServe's own gRPC servicer, data plane and
interceptors, set up as `kserve.protocol.grpc.server.GRPCServer.start` does (4 threads, KServe's
default), except for the address: `ModelServer` listens on every interface, which a benchmark
here must not, so this binds 127.0.0.1 on a free port. It prints `grpc 127.0.0.1:PORT` and `ready`.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from concurrent import futures

import onnxruntime as ort
from grpc import aio
from kserve import InferOutput, InferRequest, InferResponse, Model
from kserve.model_repository import ModelRepository
from kserve.protocol.dataplane import DataPlane
from kserve.protocol.grpc import grpc_predict_v2_pb2_grpc
from kserve.protocol.grpc.interceptors import ExceptionToStatusInterceptor, LoggingInterceptor
from kserve.protocol.grpc.servicer import InferenceServicer
from kserve.protocol.model_repository_extension import ModelRepositoryExtension
from kserve.utils.utils import from_np_dtype

KSERVE_GRPC_THREADS = 4  # ModelServer's --max_threads default


class OnnxModel(Model):  # type: ignore[misc]
    def __init__(self, name: str, path: str, threads: int) -> None:
        super().__init__(name)
        self.path, self.threads = path, threads
        self.load()

    def load(self) -> bool:
        options = ort.SessionOptions()
        options.intra_op_num_threads = self.threads
        self.session = ort.InferenceSession(self.path, options, providers=["CPUExecutionProvider"])
        self.outputs = [o.name for o in self.session.get_outputs()]
        self.ready = True
        return True

    def predict(self, payload: InferRequest, headers: dict[str, str] | None = None) -> InferResponse:
        feed = {i.name: i.as_numpy() for i in payload.inputs}
        values = self.session.run(self.outputs, feed)
        outputs = []
        for name, value in zip(self.outputs, values, strict=True):
            output = InferOutput(name=name, shape=list(value.shape), datatype=from_np_dtype(value.dtype))
            output.set_data_from_numpy(value, binary_data=True)  # raw contents, as the raw inputs came
            outputs.append(output)
        return InferResponse(response_id=payload.id, model_name=self.name, infer_outputs=outputs,
                             use_binary_outputs=payload.use_binary_outputs)


async def serve(model: OnnxModel) -> None:
    repository = ModelRepository()
    repository.update(model)
    servicer = InferenceServicer(DataPlane(model_registry=repository),
                                 ModelRepositoryExtension(model_registry=repository))
    server = aio.server(futures.ThreadPoolExecutor(max_workers=KSERVE_GRPC_THREADS),
                        interceptors=(LoggingInterceptor(), ExceptionToStatusInterceptor()))
    grpc_predict_v2_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(f"grpc 127.0.0.1:{port}\nready", flush=True)
    await server.wait_for_termination()


def main(argv: list[str]) -> int:
    if len(argv) not in (2, 3):
        print(__doc__, file=sys.stderr)
        return 2
    model = OnnxModel(argv[1], argv[0], int(argv[2]) if len(argv) == 3 else 0)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(model))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
