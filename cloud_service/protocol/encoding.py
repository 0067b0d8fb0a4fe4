"""Declared wire encodings of input tensors: fewer bytes per escalation on a slow link.

An input tensor may carry the parameter `tierkit.encoding` (on the `InferInputTensor`): a `+`-joined
list of steps, applied in this order by the sender and undone in reverse by the receiver:

- `frame`: the tensor is the raw uint8 frame (`[N,] H, W, C`) the model's input is made from; the
  server applies the package's declared preprocessing (`Preprocess`, from the manifest's
  `preprocess` field). A quarter of the fp32 bytes for a 224x224 image, and less still when the
  camera frame is smaller than the model's input.
- `fp16`: the fp32 tensor is sent as FP16 (the datatype on the wire says FP16) and widened back.
- `zstd`: the raw contents are zstd-compressed; `datatype` and `shape` describe them uncompressed.

A request without the parameter is plain Open Inference Protocol, so stock clients are unaffected;
a stock server (Triton, KServe) does not know these encodings, so the agent uses them only with a
cloud whose `ServerMetadata` lists the `tierkit.encodings` extension (`ENCODINGS_EXTENSION`).
zstd needs the `zstandard` package (`pip install 'tierkit[zstd]'`).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from cloud_service.protocol import inference_pb2 as pb
from cloud_service.protocol.codec import CodecError, RawBytes, oip_datatype

__all__ = ["ENCODINGS", "ENCODINGS_EXTENSION", "PARAM_ENCODING", "check_encoding", "decode_tensor",
           "encode_input", "encoding_of", "frame_inputs"]

PARAM_ENCODING = "tierkit.encoding"
ENCODINGS_EXTENSION = "tierkit.encodings"
ENCODINGS = ("fp32", "fp16", "zstd", "fp16+zstd", "frame", "frame+zstd")  # "fp32": plain, no parameter
_STEPS = ("frame", "fp16", "zstd")
ZSTD_LEVEL = 3  # measured on image tensors: higher levels cost far more time for a few % of bytes


def check_encoding(encoding: str) -> tuple[str, ...]:
    """The steps of `encoding`, in canonical order; raises `CodecError` naming the bad part."""
    if encoding in ("", "fp32"):
        return ()
    steps = tuple(encoding.split("+"))
    if any(s not in _STEPS for s in steps) or len(set(steps)) != len(steps) or (
            "frame" in steps and "fp16" in steps):
        msg = (f"encoding {encoding!r} is not valid: join steps of {list(_STEPS)} with '+' in that order "
               "(frame and fp16 exclude each other), e.g. 'fp16+zstd'")
        raise CodecError(msg)
    ordered = tuple(s for s in _STEPS if s in steps)
    if ordered != steps:
        msg = f"encoding {encoding!r}: write its steps in the order {'+'.join(ordered)}"
        raise CodecError(msg)
    return steps


def _zstd() -> Any:
    try:
        import zstandard
    except ModuleNotFoundError:
        msg = "the zstd wire encoding needs the 'zstandard' package: pip install 'tierkit[zstd]'"
        raise CodecError(msg) from None
    return zstandard


def encode_input(request: pb.ModelInferRequest, name: str, array: np.ndarray, encoding: str = "") -> int:
    """Add input `name` to `request` in `encoding`; returns the bytes of its raw contents on the wire.

    With `frame`, `array` is the uint8 frame itself; with `fp16`, the fp32 input (narrowed here).
    """
    steps = check_encoding(encoding)
    array = np.asarray(array)
    if "frame" in steps and array.dtype != np.uint8:
        msg = f"input {name!r}: the frame encoding sends a uint8 frame, got {array.dtype.name}"
        raise CodecError(msg)
    if "fp16" in steps:
        if array.dtype != np.float32:
            msg = f"input {name!r}: the fp16 encoding narrows fp32 tensors, got {array.dtype.name}"
            raise CodecError(msg)
        array = array.astype(np.float16)
    data = np.ascontiguousarray(array.astype(array.dtype.newbyteorder("<"), copy=False)).tobytes()
    if "zstd" in steps:
        data = _zstd().ZstdCompressor(level=ZSTD_LEVEL).compress(data)
    tensor = request.inputs.add(name=name, datatype=oip_datatype(array), shape=array.shape)
    if steps:
        tensor.parameters[PARAM_ENCODING].string_param = "+".join(steps)
    request.raw_input_contents.append(data)
    return len(data)


def encoding_of(tensor: pb.ModelInferRequest.InferInputTensor) -> tuple[str, ...]:
    """The declared steps of an input tensor (empty: plain)."""
    param = tensor.parameters.get(PARAM_ENCODING)
    if param is None:
        return ()
    if param.WhichOneof("parameter_choice") != "string_param":
        msg = f"input {tensor.name!r}: parameter {PARAM_ENCODING} must be a string"
        raise CodecError(msg)
    return check_encoding(param.string_param)


def decode_tensor(tensor: pb.ModelInferRequest.InferInputTensor, raw: RawBytes, steps: tuple[str, ...],
                  dtype: np.dtype[Any], shape: tuple[int, ...]) -> np.ndarray:
    """Undo `zstd` and `fp16` (the frame stays a frame: preprocessing needs the model's manifest)."""
    expected = math.prod(shape) * dtype.itemsize
    if "zstd" in steps:
        zstd = _zstd()
        try:
            # Bounded by the declared size, so a small message cannot inflate into gigabytes. The
            # bound only holds for frames that do not state their size (zstandard then trusts the
            # header), so a stated size is checked first.
            stated = zstd.frame_content_size(raw)
            if stated not in (-1, expected):
                msg = (f"input {tensor.name!r}: zstd contents decompress to {stated} bytes, shape {list(shape)} "
                       f"of {dtype.name} needs {expected}")
                raise CodecError(msg)
            raw = zstd.ZstdDecompressor().decompress(raw, max_output_size=expected)
        except zstd.ZstdError as exc:
            msg = f"input {tensor.name!r}: zstd contents do not decompress to {expected} bytes ({exc})"
            raise CodecError(msg) from None
    given = raw.nbytes if isinstance(raw, np.ndarray | memoryview) else len(raw)
    if given != expected:
        msg = f"input {tensor.name!r}: {given} bytes given, shape {list(shape)} of {dtype.name} needs {expected}"
        raise CodecError(msg)
    array = np.frombuffer(raw, dtype=dtype).reshape(shape)
    if "fp16" in steps:
        if dtype != np.float16:
            msg = f"input {tensor.name!r}: encoding fp16 needs datatype FP16, got {tensor.datatype}"
            raise CodecError(msg)
        array = array.astype(np.float32)
    if "frame" in steps and dtype != np.uint8:
        msg = f"input {tensor.name!r}: encoding frame needs datatype UINT8, got {tensor.datatype}"
        raise CodecError(msg)
    return array



def frame_inputs(request: pb.ModelInferRequest) -> list[str]:
    """Names of the inputs sent as raw frames, for the server to preprocess."""
    return [t.name for t in request.inputs if t.parameters and "frame" in encoding_of(t)]
