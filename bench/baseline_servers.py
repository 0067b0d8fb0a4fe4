"""The baseline gRPC servers bench_cloud.py measures tierkit against, each run as its own process.

    python bench/baseline_servers.py echo-aio
    python bench/baseline_servers.py echo-threads
    python bench/baseline_servers.py minimal MODEL.onnx [THREADS]

- echo-aio / echo-threads: answer /echo.Echo/Echo with the request bytes, on grpc.aio and on grpcio's
  thread-pool server (the kind `tierkit serve` runs): the cost of a Python gRPC round trip alone;
  echo-threads also answers each message of a /echo.Echo/Stream stream with itself.
- minimal: answers /inference.GRPCInferenceService/ModelInfer for one ONNX model on the thread-pool
  server with the least Python there can be: raw input contents to numpy, one onnxruntime run, raw
  output contents back. No checks, no batching, no metrics, no errors handled: a floor for any Python
  server of this protocol on grpcio, not a server to use.

Each prints `grpc HOST:PORT` and `ready` when it listens (loopback only), and serves until killed.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

OPTIONS = [("grpc.max_receive_message_length", 64 << 20), ("grpc.so_reuseport", 0)]
_generic = grpc.method_handlers_generic_handler


def _listening(port: int) -> None:
    print(f"grpc 127.0.0.1:{port}\nready", flush=True)


def serve_threads(service: str, handlers: dict[str, grpc.RpcMethodHandler]) -> None:
    server = grpc.server(ThreadPoolExecutor(max_workers=128), options=OPTIONS)
    server.add_generic_rpc_handlers((_generic(service, handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    _listening(port)
    with contextlib.suppress(KeyboardInterrupt):
        server.wait_for_termination()


def serve_echo_aio() -> None:
    async def echo(request: bytes, context: Any) -> bytes:
        return request

    async def main() -> None:
        server = grpc.aio.server(options=OPTIONS)
        server.add_generic_rpc_handlers((_generic("echo.Echo", {"Echo": grpc.unary_unary_rpc_method_handler(echo)}),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        _listening(port)
        await server.wait_for_termination()

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(main())


def serve_minimal(onnx: str, threads: int) -> None:
    import numpy as np
    import onnxruntime as ort

    from cloud_service.protocol import inference_pb2 as pb

    dtypes = {"FP32": np.float32, "FP16": np.float16, "INT64": np.int64, "INT32": np.int32, "UINT8": np.uint8}
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    session = ort.InferenceSession(onnx, options, providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    datatypes = {np.dtype(v): k for k, v in dtypes.items()}

    def infer(request: Any, context: Any) -> Any:
        feed = {t.name: np.frombuffer(raw, dtypes[t.datatype]).reshape(tuple(t.shape))
                for t, raw in zip(request.inputs, request.raw_input_contents, strict=True)}
        response = pb.ModelInferResponse(model_name=request.model_name, id=request.id)
        for name, value in zip(names, session.run(names, feed), strict=True):
            response.outputs.add(name=name, datatype=datatypes[value.dtype], shape=value.shape)
            response.raw_output_contents.append(value.tobytes())
        return response

    handler = grpc.unary_unary_rpc_method_handler(infer, request_deserializer=pb.ModelInferRequest.FromString,
                                                  response_serializer=pb.ModelInferResponse.SerializeToString)
    serve_threads("inference.GRPCInferenceService", {"ModelInfer": handler})


def main(argv: list[str]) -> int:
    kind = argv[0] if argv else ""
    if kind == "echo-aio":
        serve_echo_aio()
    elif kind == "echo-threads":
        unary = grpc.unary_unary_rpc_method_handler(lambda request, context: request)
        stream = grpc.stream_stream_rpc_method_handler(lambda requests, context: requests)
        serve_threads("echo.Echo", {"Echo": unary, "Stream": stream})
    elif kind == "minimal" and len(argv) in (2, 3):
        serve_minimal(argv[1], int(argv[2]) if len(argv) == 3 else 0)
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
