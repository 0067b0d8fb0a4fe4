"""Triton Inference Server serving one ONNX model from Python, through PyTriton: the comparison
`bench/bench_cloud.py --pytriton-python` draws, and the upstream of tests/e2e/test_forward_triton.py. Run it
with a Python that has `nvidia-pytriton` (it pins numpy < 2, so it lives in a virtual environment of its own):

    python3.11 -m venv /tmp/pytriton-venv && /tmp/pytriton-venv/bin/pip install nvidia-pytriton onnxruntime
    /tmp/pytriton-venv/bin/python testkit/pytriton_server.py MODEL.onnx NAME [THREADS] [--reject-after-us N]

PyTriton starts the `tritonserver` binary its wheel ships (Triton's C++ gRPC front end and dynamic
batcher, its Python backend) and binds a Python callable to a model: here one onnxruntime run per
batch, with Triton's dynamic batching on (max batch 64, queue delay 0: what tierkit's batching-on
server runs with in the benchmark). Tensors travel between Triton and this process through
PyTriton's Base64 serializer (see `main`). HTTP, gRPC and metrics listen on 127.0.0.1 only. It prints
`grpc 127.0.0.1:PORT` and `ready` once Triton serves the model.
"""

from __future__ import annotations

import os
import socket
import sys
from typing import Any

# Run by path, this file's folder (testkit/) is first on sys.path, where testkit's modules would stand as
# top-level ones (`models`, `zoo`, ...) for whatever PyTriton imports: take the folder off before importing it.
sys.path[:] = [p for p in sys.path if os.path.realpath(p or ".") != os.path.dirname(os.path.realpath(__file__))]

import numpy as np  # noqa: E402
import onnxruntime as ort  # noqa: E402
from pytriton.decorators import batch  # noqa: E402
from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor  # noqa: E402
from pytriton.triton import Triton, TritonConfig  # noqa: E402

_DTYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(int64)": np.int64,
           "tensor(int32)": np.int32, "tensor(uint8)": np.uint8}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _tensors(args: Any) -> list[Tensor]:
    """Triton tensors without the batch axis (Triton's rule with max_batch_size > 0)."""
    return [Tensor(name=a.name, dtype=_DTYPES[a.type],
                   shape=tuple(d if isinstance(d, int) else -1 for d in a.shape[1:])) for a in args]


def _queue_policy(argv: list[str]) -> tuple[list[str], dict[str, Any]]:
    """`--reject-after-us N`: Triton's queue policy as its docs advise for overload: a request still queued
    after N µs (or after the `timeout` parameter it carries) is rejected, not run late."""
    if "--reject-after-us" not in argv:
        return argv, {}
    from pytriton.model_config import QueuePolicy, TimeoutAction

    i = argv.index("--reject-after-us")
    timeout_us = int(argv[i + 1])
    policy = QueuePolicy(timeout_action=TimeoutAction.REJECT, default_timeout_microseconds=timeout_us,
                         allow_timeout_override=True, max_queue_size=256)
    return argv[:i] + argv[i + 2:], {"default_queue_policy": policy}


def main(argv: list[str]) -> int:
    argv, policy = _queue_policy(argv)
    if len(argv) not in (2, 3):
        print(__doc__, file=sys.stderr)
        return 2
    onnx, name = argv[0], argv[1]
    options = ort.SessionOptions()
    options.intra_op_num_threads = int(argv[2]) if len(argv) == 3 else 0
    session = ort.InferenceSession(onnx, options, providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]

    @batch  # type: ignore[misc]
    def infer(**inputs: np.ndarray) -> dict[str, np.ndarray]:
        return dict(zip(names, session.run(names, inputs), strict=True))

    # PyTriton's shared-memory tensor store starts a multiprocessing manager inside Triton's Python
    # backend stub, which fails against this Python build (RLock._recursion_count); its Base64
    # serializer moves the tensors over the same local socket instead.
    os.environ.setdefault("PYTRITON_NO_TENSORSTORE", "1")
    grpc_port = _free_port()
    config = TritonConfig(grpc_address="127.0.0.1", grpc_port=grpc_port, http_address="127.0.0.1",
                          http_port=_free_port(), metrics_address="127.0.0.1", metrics_port=_free_port())
    with Triton(config=config) as triton:
        triton.bind(model_name=name, infer_func=infer, inputs=_tensors(session.get_inputs()),
                    outputs=_tensors(session.get_outputs()),
                    config=ModelConfig(max_batch_size=64,
                                       batcher=DynamicBatcher(max_queue_delay_microseconds=0, **policy)))
        triton.run()  # starts the server and waits until the model is ready
        # `tritonserver` writes its log to the same stdout, its last line often without a newline yet: the
        # marker starts on a line of its own, or the reader finds `ready` with no address before it
        print(f"\ngrpc 127.0.0.1:{grpc_port}\nready", flush=True)
        triton.serve()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
