"""torch backend: `torch.export` programs (`.pt2`) and TorchScript (`.pt`, `.ts`).

Tensor names. ONNX and OpenVINO files name their tensors; torch files do not, or not usefully.
The exporter therefore writes a sidecar next to the artifact, `<artifact>.io.json` (see
`runtimes.session.write_io_sidecar`), holding the input and output `TensorSpec`s in call order:

    {"inputs": [{"name": "x", "dtype": "float32", "shape": ["batch", 1, 8, 8]}],
     "outputs": [{"name": "logits", "dtype": "float32", "shape": ["batch", 10]}]}

Without a sidecar:
- a `.pt2` program still describes itself: inputs take the names of the exported `forward`'s
  parameters, in the program's signature order, with dtypes and shapes from the example inputs
  (symbolic sizes become named axes); outputs are named y0, y1, ...
- TorchScript keeps neither dtypes nor shapes once saved, so it cannot be loaded without a
  sidecar; the error says what to write.

fp32 on CUDA: cuDNN runs fp32 convolutions in TF32 by default (10 bits of mantissa; on an H200 the
digits CNN's logits move by 3e-3 against the CPU's, 6e-6 with TF32 off), so a CUDA session pins fp32
convolutions and matrix products to IEEE fp32 for the length of each call and restores the process's
setting afterwards: the same variant computes the same numbers on the CPU and on the GPU. A traced
TorchScript file carries the flag in each `aten::_convolution` call as a constant (True unless it was
traced with TF32 off), so a TorchScript module loaded for CUDA is frozen and those constants cleared.

Threads: `torch.set_num_threads` and `torch.set_num_interop_threads` are process-wide in torch,
so `SessionOptions` thread counts apply to every torch session in the process.

Example:
    >>> write_io_sidecar("digits.pt2", [TensorSpec("x", "float32", ("batch", 1, 8, 8))],
    ...                  [TensorSpec("logits", "float32", ("batch", 10))])
    >>> with TorchBackend().load(Path("digits.pt2"), SessionOptions()) as s:
    ...     logits = s.run({"x": x})["logits"]
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

from runtimes.errors import (
    BackendUnavailable,
    ConfigError,
    InferenceError,
    InputError,
    PackageError,
    TierkitError,
)
from runtimes.session import Session, SessionOptions, axis_name, io_sidecar_path, read_io_sidecar
from runtimes.spec import TensorSpec, input_error

logger = logging.getLogger(__name__)

_TORCHSCRIPT = (".pt", ".ts")


def torch_device(device: str) -> torch.device:
    """The torch device for a `SessionOptions.device` value; raise when CUDA is asked for but absent."""
    low = device.lower()
    if low == "cpu":
        return torch.device("cpu")
    if low == "gpu" or low.startswith("cuda"):
        if not torch.cuda.is_available():
            msg = f"device {device!r}: this torch build sees no CUDA device; use device='cpu'"
            raise BackendUnavailable(msg)
        return torch.device("cuda:0" if low in ("gpu", "cuda") else low)
    msg = f"device {device!r} is not 'cpu', 'gpu' or 'cuda:N' (the torch backend runs on those)"
    raise ConfigError(msg)


_PRECISION_LOCK = threading.Lock()
_exact_calls = 0
_saved_precision: tuple[Any, ...] = ()


def _fp32_knobs() -> tuple[Any, ...]:
    """The objects holding cuBLAS's and cuDNN's fp32 precision (torch >= 2.9 names it `fp32_precision`)."""
    conv = getattr(torch.backends.cudnn, "conv", None)
    if conv is not None and hasattr(conv, "fp32_precision"):
        return torch.backends.cuda.matmul, conv
    return ()


def _read_precision() -> tuple[Any, ...]:
    knobs = _fp32_knobs()
    if knobs:
        return tuple(k.fp32_precision for k in knobs)
    return torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32


def _write_precision(values: tuple[Any, ...] | None) -> None:
    """Set the saved `values`, or IEEE fp32 everywhere for None."""
    knobs = _fp32_knobs()
    if knobs:
        for knob, value in zip(knobs, values or ("ieee",) * len(knobs), strict=True):
            knob.fp32_precision = value
        return
    matmul, conv = values or (False, False)
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, conv


@contextmanager
def _ieee_fp32() -> Iterator[None]:
    """IEEE fp32 for cuBLAS and cuDNN while any CUDA session runs; the process's setting back after the last.

    The flags are process-wide, so calls overlapping in several threads share one save and restore.
    """
    global _exact_calls, _saved_precision
    with _PRECISION_LOCK:
        if _exact_calls == 0:
            _saved_precision = _read_precision()
            _write_precision(None)
        _exact_calls += 1
    try:
        yield
    finally:
        with _PRECISION_LOCK:
            _exact_calls -= 1
            if _exact_calls == 0:
                _write_precision(_saved_precision)


def _exact_convolutions(module: Any) -> Any:
    """`module` frozen, with the TF32 flag traced into its convolutions cleared; `module` itself if it cannot be
    frozen (then its convolutions keep the flag they were traced with, and a warning says so)."""
    try:
        frozen = torch.jit.freeze(module)
    except Exception as exc:  # freezing refuses modules that mutate attributes in forward, among others
        logger.warning("TorchScript module not frozen (%s): its convolutions keep the TF32 flag they were traced "
                       "with; export with torch.export (.pt2) for exact fp32 on CUDA", exc)
        return module
    graph = frozen.graph
    for node in graph.findAllNodes("aten::_convolution"):
        args = list(node.inputs())
        flag = args[-1]
        if flag.node().kind() == "prim::Constant" and flag.toIValue() is True:
            cleared = graph.insertConstant(False)
            cleared.node().moveBefore(node)
            node.replaceInput(len(args) - 1, cleared)
    return frozen


def _set_threads(options: SessionOptions) -> None:
    if options.intra_op_threads and torch.get_num_threads() != options.intra_op_threads:
        torch.set_num_threads(options.intra_op_threads)
    if options.inter_op_threads and torch.get_num_interop_threads() != options.inter_op_threads:
        try:
            torch.set_num_interop_threads(options.inter_op_threads)
        except RuntimeError:  # torch allows it once, before any inter-op work has started
            logger.warning("torch already runs %d inter-op threads; %d can only be set before the first model "
                           "runs in this process", torch.get_num_interop_threads(), options.inter_op_threads)


def _meta_spec(name: str, node: Any) -> TensorSpec:
    val = node.meta["val"]
    shape = tuple(d if isinstance(d, int) else axis_name(i) for i, d in enumerate(val.shape))
    return TensorSpec(name, str(val.dtype).removeprefix("torch."), shape)


def _load_program(artifact: Path, device: torch.device) -> tuple[Callable[..., Any], tuple[TensorSpec, ...],
                                                                     tuple[TensorSpec, ...]]:
    program = torch.export.load(str(artifact))
    nodes = {n.name: n for n in program.graph.nodes}
    user_inputs = program.graph_signature.user_inputs
    inputs = tuple(_meta_spec(str(name), nodes[str(name)]) for name in user_inputs)
    output_node = next(n for n in program.graph.nodes if n.op == "output")
    returned = output_node.args[0]
    returned = returned if isinstance(returned, tuple | list) else (returned,)
    outputs = tuple(_meta_spec(f"y{i}", node) for i, node in enumerate(returned))
    return program.module().to(device), inputs, outputs


def _tensor(array: np.ndarray) -> torch.Tensor:
    # torch.from_numpy warns on read-only memory (np.frombuffer of a request body, say) because a
    # tensor could write to it; inference never does, but a copy keeps the warning away.
    return torch.from_numpy(array if array.flags.writeable else array.copy())


class TorchSession(Session):
    """A torch model run under `torch.inference_mode()`. Build it with `TorchBackend().load(...)`."""

    backend = "torch"

    def __init__(self, artifact: Path, options: SessionOptions) -> None:
        self.device = torch_device(options.device)
        _set_threads(options)
        sidecar = read_io_sidecar(artifact)
        suffix = artifact.suffix.lower()
        try:
            if suffix == ".pt2":
                self._module, inputs, outputs = _load_program(artifact, self.device)
            elif suffix in _TORCHSCRIPT:
                if sidecar is None:
                    msg = (f"TorchScript file {artifact.name!r} keeps no tensor names, dtypes or shapes: write "
                           f"{io_sidecar_path(artifact).name!r} with runtimes.session.write_io_sidecar")
                    raise PackageError(msg)
                self._module = torch.jit.load(str(artifact), map_location=self.device).eval()
                if self.device.type == "cuda":
                    self._module = _exact_convolutions(self._module)
                inputs, outputs = sidecar
            else:
                msg = f"the torch backend reads .pt2 (torch.export) and .pt/.ts (TorchScript), not {artifact.name!r}"
                raise ConfigError(msg)
        except TierkitError:
            raise
        except Exception as exc:  # torch raises RuntimeError, zipfile and pickle errors for a bad file
            msg = f"torch cannot load {str(artifact)!r}: {exc}"
            raise PackageError(msg) from exc
        if sidecar is not None and suffix == ".pt2":
            if (len(sidecar[0]), len(sidecar[1])) != (len(inputs), len(outputs)):
                msg = (f"{io_sidecar_path(artifact).name!r} lists {len(sidecar[0])} inputs / {len(sidecar[1])} "
                       f"outputs; the program has {len(inputs)} / {len(outputs)}")
                raise PackageError(msg)
            inputs, outputs = sidecar
        self.inputs, self.outputs = inputs, outputs
        self.precision = options.precision
        self._output_names = [s.name for s in outputs]
        self._on_cpu = self.device.type == "cpu"

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        # torch checks little by itself (a TorchScript CNN may take any image size), so every call
        # checks names, dtypes and fixed axes against the specs: about a microsecond per input.
        specs = self.inputs
        if len(inputs) != len(specs):
            raise self._input_error(inputs, None)
        args = []
        for spec in specs:
            array = inputs.get(spec.name)
            if not isinstance(array, np.ndarray) or not spec.matches(array):
                raise self._input_error(inputs, None)
            args.append(_tensor(array))
        try:
            if self._on_cpu:
                with torch.inference_mode():
                    result = self._module(*args)
            else:
                args = [a.to(self.device) for a in args]
                with _ieee_fp32(), torch.inference_mode():
                    result = self._module(*args)
        except Exception as exc:  # guards raise AssertionError, kernels RuntimeError: sort them out below
            raise self._input_error(inputs, exc) from exc
        results = result if isinstance(result, tuple | list) else (result,)
        if self._on_cpu:
            return {n: t.numpy() for n, t in zip(self._output_names, results, strict=True)}
        return {n: t.cpu().numpy() for n, t in zip(self._output_names, results, strict=True)}

    def _input_error(self, inputs: Mapping[str, np.ndarray], exc: Exception | None) -> InferenceError:
        precise = input_error(self.inputs, inputs)
        if precise is not None:
            return precise
        if exc is None:
            msg = f"inputs must be numpy arrays named {[s.name for s in self.inputs]}"
            return InputError(msg)
        if isinstance(exc, AssertionError):  # a shape guard of the exported program
            return InputError(f"torch rejected the inputs: {exc}; the model takes {list(self.inputs)}")
        return InferenceError(f"torch failed while running: {exc}")

    def _close(self) -> None:
        del self._module


class TorchBackend:
    """Loads torch.export programs and TorchScript modules."""

    name = "torch"

    def load(self, artifact: Path, options: SessionOptions) -> TorchSession:
        return TorchSession(Path(artifact), options)
