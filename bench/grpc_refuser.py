"""The gRPC transport's own floors: a bare server on loopback that refuses every ModelInfer at once, or answers it.

`bench_overload.py` drives it with the same load generator, payload and caller count as a row of
`tierkit serve`: whatever refusal time the callers see here (nothing parsed, no model, no queue) is what
the load generator, grpcio and the host's two cores cost on their own, and the difference to tierkit's
row is tierkit's. It is grpcio's thread-pool server as tierkit's is (`cloud_service.server`), with the
same number of threads; every call gets RESOURCE_EXHAUSTED with the retry hint given (the median hint
tierkit gave in the compared row, so callers that honour it come back at the same pace).

With `--echo BYTES` it answers every call at once instead, with one pre-encoded ModelInferResponse carrying
BYTES of output (the model's answer size): the same generator and callers against it show what the load
generator, grpcio and the host's two cores answer on their own as the callers grow, with no model and no queue.

    python bench/grpc_refuser.py HINT_MS   # prints `grpc 127.0.0.1:PORT` and `ready`, runs until stdin closes
    python bench/grpc_refuser.py --echo BYTES
"""

from __future__ import annotations

import sys
from concurrent import futures
from typing import Any

import grpc

SERVICE = "inference.GRPCInferenceService"
WORKERS = 128  # tierkit serve's --grpc-workers default


def _answer(size: int) -> bytes:
    """A ModelInferResponse with one FP32 output of `size` bytes, encoded once."""
    from cloud_service.protocol import inference_pb2 as pb

    response = pb.ModelInferResponse(model_name="ocrdet", model_version="1")
    response.outputs.add(name="out", datatype="FP32", shape=[1, size // 4])
    response.raw_output_contents.append(bytes(size))
    return response.SerializeToString()


def main(argv: list[str]) -> int:
    if argv[:1] == ["--echo"]:
        answer = _answer(int(argv[1]))

        def serve(request: bytes, context: Any) -> bytes:
            return answer
    else:
        hint = str(int(float(argv[0]))) if argv else "1"
        trailers = (("grpc-retry-pushback-ms", hint), ("retry-after-ms", hint))

        def serve(request: bytes, context: Any) -> bytes:
            context.set_trailing_metadata(trailers)
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "refused (floor)")
            raise AssertionError  # unreachable: abort raises

    handler = grpc.unary_unary_rpc_method_handler(serve)  # bytes in, nothing parsed
    server = grpc.server(futures.ThreadPoolExecutor(WORKERS), maximum_concurrent_rpcs=WORKERS)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {"ModelInfer": handler}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(f"grpc 127.0.0.1:{port}\nready", flush=True)
    sys.stdin.read()  # until the bench closes the pipe
    server.stop(1).wait(5)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
