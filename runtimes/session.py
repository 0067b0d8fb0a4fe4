"""The one interface every backend implements: a loaded model that runs named arrays.

Also the shared conventions backends follow: how unnamed dynamic axes are named, and the
`<artifact>.io.json` sidecar that carries tensor names, dtypes and shapes for formats that do
not keep them (TorchScript, torch.export outputs).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

import numpy as np

from runtimes.errors import ConfigError, PackageError
from runtimes.spec import Precision, TensorSpec, check_inputs

IO_SIDECAR_SUFFIX = ".io.json"


def axis_name(index: int) -> str:
    """Name of a dynamic axis the model file leaves unnamed: "batch" for axis 0, else "dim<i>"."""
    return "batch" if index == 0 else f"dim{index}"


def io_sidecar_path(artifact: str | Path) -> Path:
    """Where the tensor-spec sidecar of `artifact` lives: `model.pt2` -> `model.pt2.io.json`."""
    artifact = Path(artifact)
    return artifact.with_name(artifact.name + IO_SIDECAR_SUFFIX)


def write_io_sidecar(artifact: str | Path, inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec]) -> Path:
    """Write `<artifact>.io.json` holding the input and output specs, in call order."""
    path = io_sidecar_path(artifact)
    doc = {"inputs": [s.to_json() for s in inputs], "outputs": [s.to_json() for s in outputs]}
    path.write_text(json.dumps(doc, indent=2) + "\n")
    return path


def read_io_sidecar(artifact: str | Path) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]] | None:
    """Read `<artifact>.io.json`; None when there is none. Raises `PackageError` when it is malformed."""
    path = io_sidecar_path(artifact)
    if not path.is_file():
        return None
    try:
        doc = json.loads(path.read_text())
        return (tuple(TensorSpec.from_json(s) for s in doc["inputs"]),
                tuple(TensorSpec.from_json(s) for s in doc["outputs"]))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        msg = (f"tensor-spec sidecar {str(path)!r} is unreadable ({exc}); it must be JSON "
               '{"inputs": [{"name", "dtype", "shape"}, ...], "outputs": [...]}')
        raise PackageError(msg) from None


@dataclass(frozen=True, slots=True)
class SessionOptions:
    """How to run a model.

    Args:
        intra_op_threads: threads inside one operator (0 = the backend's default).
        inter_op_threads: threads across operators (0 = the backend's default).
        device: "cpu", "gpu", "cuda:N", or an OpenVINO device name ("CPU", "GPU", "NPU", "AUTO").
        providers: onnxruntime execution providers in order of preference; empty picks the best
            available (TensorRT, CUDA, OpenVINO, CPU).
        performance_hint: OpenVINO "LATENCY" or "THROUGHPUT".
        precision: the precision the variant declares ("fp32", "fp16", "bf16", "int8"). Backends
            that choose their own arithmetic pin it (OpenVINO's inference precision hint: f32 for
            fp32 and int8, bf16 for bf16, f16 for fp16), so that a variant computes the same on a
            CPU whose default is bf16 as on one without; onnxruntime and torch run the graph as it is.
        max_batch: the largest batch a GPU engine's shape profile covers (onnxruntime's TensorRT provider).
        static_shapes: OpenVINO, for a model with dynamic dimensions: how many distinct input shapes get
            a model compiled at that fixed shape, on the first call with each (0 = always run the dynamic
            model). A fixed-shape model runs at `benchmark_app`'s speed; the dynamic one was 10-25 %
            slower on CNNs here. Each costs one compile (tenths of a second) on its first call, and memory.
        cpu_pinning: OpenVINO on CPU: pin inference threads to cores (`ENABLE_CPU_PINNING`). None: not pinned
            with the LATENCY hint, OpenVINO's default with THROUGHPUT. OpenVINO's own default with LATENCY
            on Linux (`benchmark_app` runs that way) pins them, and a synchronous request then sets the calling
            thread's affinity on entry and back on exit. Not pinned costs less per call and waits for no
            particular core: on a 2-core AMD EPYC, a request of a two-op model took 9.7 us against 12.4 us
            pinned; the PP-OCR direction classifier's bare request 0.561 ms against 0.569 ms alone, and
            0.75 ms against 1.0-3.2 ms on a host whose cores other work shares (pinned threads wait for
            their own core); the PP-OCR detector and recognizer and YOLOv8n ran within 1 % either way alone.
        spin: onnxruntime: whether the intra-op threads busy-wait for the next operator's work
            (`session.intra_op.allow_spinning`); None keeps onnxruntime's default (they spin). Spinning saves
            microseconds a call to one caller, and takes the cores from every other thread of the process:
            a server's gRPC, admission and batching threads wait behind spinning compute threads.
    """

    intra_op_threads: int = 0
    inter_op_threads: int = 0
    device: str = "cpu"
    providers: tuple[str, ...] = field(default_factory=tuple)
    performance_hint: str = "LATENCY"
    precision: str = "fp32"
    max_batch: int = 64
    static_shapes: int = 4
    cpu_pinning: bool | None = None
    spin: bool | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "precision", Precision.parse(self.precision).value)
        if self.intra_op_threads < 0 or self.inter_op_threads < 0:
            msg = f"thread counts must be >= 0, got {self.intra_op_threads}/{self.inter_op_threads}"
            raise ConfigError(msg)
        if self.static_shapes < 0:
            msg = f"static_shapes must be >= 0 (0 = run the dynamic model), got {self.static_shapes}"
            raise ConfigError(msg)
        if self.performance_hint not in ("LATENCY", "THROUGHPUT"):
            msg = f"performance_hint {self.performance_hint!r} is not LATENCY or THROUGHPUT"
            raise ConfigError(msg)


class Session:
    """A loaded model. Use as a context manager or call `close()`.

    Subclasses set `inputs`, `outputs` and `backend`, and implement `run` and `_close`.

    Example:
        >>> with runtimes.open_session("model.onnx") as s:
        ...     y = s.run({"x": x})["logits"]
    """

    backend: str = ""
    # What the runtime reports it executes (OpenVINO: its inference precision); the declared one otherwise.
    precision: str = "fp32"
    inputs: tuple[TensorSpec, ...] = ()
    outputs: tuple[TensorSpec, ...] = ()
    _closed: bool = False

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def run_checked(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Validate names, dtypes and shapes against `inputs` specs, then `run`.

        `run` keeps its hot path lean and leaves most checks to the backend; use this where inputs
        come from outside (a network request, a user file).
        """
        check_inputs(self.inputs, inputs)
        return self.run(inputs)

    def _close(self) -> None:
        pass

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._close()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def __repr__(self) -> str:
        ins = ", ".join(f"{s.name}:{s.dtype}{list(s.shape)}" for s in self.inputs)
        return f"<{type(self).__name__} backend={self.backend} inputs=[{ins}]>"
