"""numpy ⇄ Open Inference Protocol tensors, and request parameters.

Requests and responses carry tensor bytes in `raw_input_contents` / `raw_output_contents` (what
tritonclient sends and the only form it decodes); typed `contents` are accepted on input too.
Decoding is zero-copy: arrays are read-only views of the message's bytes.

This module is the wire contract shared by the cloud service and the edge agent: it imports only
the standard library, numpy, protobuf and the bottom layer's vocabulary (`runtimes.spec.DTYPES`, the
one dtype table, mapped here to wire names; `runtimes.errors.TierkitError`, the root of `CodecError`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, MutableMapping, Sequence
from typing import Any, ClassVar

import numpy as np

from cloud_service.protocol import inference_pb2 as pb
from runtimes.errors import TierkitError
from runtimes.spec import DTYPES

# numpy name -> wire name, for every dtype of the shared table the codec can carry (not bfloat16)
NP_TO_OIP: dict[str, str] = {d.name: d.oip for d in DTYPES.values() if d.wire}
OIP_TO_NP: dict[str, np.dtype[Any]] = {v: np.dtype(k) for k, v in NP_TO_OIP.items()}
# By dtype object: numpy computes `dtype.name` in Python, a few µs a call on the request path.
_DTYPE_TO_OIP: dict[np.dtype[Any], str] = {np.dtype(k): v for k, v in NP_TO_OIP.items()}

# typed `contents` field for each datatype (FP16 has none: raw only)
_TYPED_FIELD = {
    "BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents",
    "INT64": "int64_contents", "UINT8": "uint_contents", "UINT16": "uint_contents", "UINT32": "uint_contents",
    "UINT64": "uint64_contents", "FP32": "fp32_contents", "FP64": "fp64_contents",
}

Param = bool | int | float | str
RawBytes = bytes | bytearray | memoryview | np.ndarray  # a tensor's bytes, in or beside a message


class CodecError(TierkitError, ValueError):
    """A tensor or parameter on the wire is malformed. `grpc_status` names the status to answer."""

    grpc_status: ClassVar[str] = "INVALID_ARGUMENT"


def oip_datatype(array: np.ndarray) -> str:
    known = _DTYPE_TO_OIP.get(array.dtype)
    if known is not None:
        return known
    try:
        return NP_TO_OIP[array.dtype.name]
    except KeyError:
        msg = f"dtype {array.dtype.name} has no Open Inference Protocol datatype; use one of {sorted(NP_TO_OIP)}"
        raise CodecError(msg) from None


def _np_dtype(datatype: str, name: str) -> np.dtype[Any]:
    try:
        return OIP_TO_NP[datatype]
    except KeyError:
        msg = f"tensor {name!r}: datatype {datatype!r} is not supported; use one of {sorted(OIP_TO_NP)}"
        raise CodecError(msg) from None


MAX_DIMS = 32  # numpy allows 64; no model here takes more than a handful
MAX_ELEMENTS = 1 << 40  # of a shape with its zero dimensions counted as 1: numpy's sizes must fit an intp


def _shape(shape: Iterable[int], name: str) -> tuple[int, ...]:
    dims = tuple(shape)  # protobuf int64 fields hold ints
    if len(dims) > MAX_DIMS:
        msg = f"tensor {name[:64]!r}: shape has {len(dims)} dimensions, at most {MAX_DIMS} are accepted"
        raise CodecError(msg)
    if dims and min(dims) < 0:
        msg = f"tensor {name[:64]!r}: shape {list(dims)} has a negative dimension"
        raise CodecError(msg)
    if math.prod(max(d, 1) for d in dims) > MAX_ELEMENTS:
        msg = f"tensor {name[:64]!r}: shape {list(dims)} is too large (over {MAX_ELEMENTS} elements)"
        raise CodecError(msg)
    return dims


def _from_bytes(raw: RawBytes, dtype: np.dtype[Any], shape: tuple[int, ...], name: str) -> np.ndarray:
    expected = math.prod(shape) * dtype.itemsize
    given = raw.nbytes if isinstance(raw, np.ndarray | memoryview) else len(raw)
    if given != expected:
        msg = (f"tensor {name!r}: {given} bytes given, shape {list(shape)} of {dtype.name} needs {expected}")
        raise CodecError(msg)
    return np.frombuffer(raw, dtype=dtype).reshape(shape)


def _from_typed(contents: pb.InferTensorContents, datatype: str, dtype: np.dtype[Any],
                shape: tuple[int, ...], name: str) -> np.ndarray:
    field = _TYPED_FIELD.get(datatype)
    if field is None:
        msg = f"tensor {name!r}: datatype {datatype} must be sent in raw_input_contents"
        raise CodecError(msg)
    values = getattr(contents, field)
    count = math.prod(shape)
    if len(values) != count:
        msg = f"tensor {name!r}: {len(values)} values given, shape {list(shape)} needs {count}"
        raise CodecError(msg)
    return np.asarray(values, dtype=dtype).reshape(shape)


def _declares_encoding(tensor: pb.ModelInferRequest.InferInputTensor) -> bool:
    return "tierkit.encoding" in tensor.parameters  # protocol.encoding.PARAM_ENCODING (it imports this module)


def decode_inputs(request: pb.ModelInferRequest,
                  raw: Sequence[RawBytes] | None = None) -> dict[str, np.ndarray]:
    """The request's input tensors as numpy arrays (raw or typed contents).

    Inputs with a declared wire encoding (`protocol.encoding`) come back zstd-decompressed and fp16
    widened to fp32; a raw frame stays the uint8 frame it is (the server preprocesses it).

    Args:
        request: the message.
        raw: the tensor bytes when they travel beside the message (`protocol.wire.RawRequest`); the
            arrays are then read-only views of these buffers. None reads `request.raw_input_contents`.
    """
    if raw is None:
        raw = request.raw_input_contents
    if raw and len(raw) != len(request.inputs):
        msg = f"{len(raw)} raw_input_contents for {len(request.inputs)} inputs: send one per input, or none"
        raise CodecError(msg)
    out: dict[str, np.ndarray] = {}
    for i, tensor in enumerate(request.inputs):
        name = tensor.name
        if name in out:
            msg = f"input {name!r} is given twice"
            raise CodecError(msg)
        dtype = _np_dtype(tensor.datatype, name)
        shape = _shape(tensor.shape, name)
        if raw and tensor.parameters and _declares_encoding(tensor):
            from cloud_service.protocol.encoding import decode_tensor, encoding_of

            out[name] = decode_tensor(tensor, raw[i], encoding_of(tensor), dtype, shape)
        elif raw:
            out[name] = _from_bytes(raw[i], dtype, shape, name)
        else:
            out[name] = _from_typed(tensor.contents, tensor.datatype, dtype, shape, name)
    return out


def declared_rows(request: pb.ModelInferRequest) -> int:
    """The rows (first axis) the request's first input declares, at least 1, read without decoding a tensor:
    what a front end admits or refuses a request on before paying for its decoding."""
    shape = request.inputs[0].shape if request.inputs else ()
    return max(1, int(shape[0])) if shape else 1


def decode_outputs(response: pb.ModelInferResponse) -> dict[str, np.ndarray]:
    """The response's output tensors as numpy arrays (raw or typed contents)."""
    raw = response.raw_output_contents
    if raw and len(raw) != len(response.outputs):
        msg = f"{len(raw)} raw_output_contents for {len(response.outputs)} outputs"
        raise CodecError(msg)
    out: dict[str, np.ndarray] = {}
    for i, tensor in enumerate(response.outputs):
        dtype = _np_dtype(tensor.datatype, tensor.name)
        shape = _shape(tensor.shape, tensor.name)
        out[tensor.name] = (_from_bytes(raw[i], dtype, shape, tensor.name) if raw
                            else _from_typed(tensor.contents, tensor.datatype, dtype, shape, tensor.name))
    return out


def _le_bytes(array: np.ndarray) -> bytes:
    if array.dtype.byteorder == ">":
        array = array.astype(array.dtype.newbyteorder("<"))
    return np.ascontiguousarray(array).tobytes()


def encode_request(model: str, inputs: Mapping[str, np.ndarray], *, version: str = "", request_id: str = "",
                   parameters: Mapping[str, Param] | None = None,
                   outputs: Iterable[str] = ()) -> pb.ModelInferRequest:
    """A `ModelInferRequest` with every input in `raw_input_contents`."""
    request = pb.ModelInferRequest(model_name=model, model_version=version, id=request_id)
    for name, value in inputs.items():
        array = np.asarray(value)
        request.inputs.add(name=name, datatype=oip_datatype(array), shape=array.shape)
        request.raw_input_contents.append(_le_bytes(array))
    for name in outputs:
        request.outputs.add(name=name)
    if parameters:
        set_parameters(request.parameters, parameters)
    return request


def encode_response(model: str, outputs: Mapping[str, np.ndarray], *, version: str = "", request_id: str = "",
                    parameters: Mapping[str, Param] | None = None) -> pb.ModelInferResponse:
    """A `ModelInferResponse` with every output in `raw_output_contents`."""
    response = pb.ModelInferResponse(model_name=model, model_version=version, id=request_id)
    for name, value in outputs.items():
        array = np.asarray(value)
        response.outputs.add(name=name, datatype=oip_datatype(array), shape=array.shape)
        response.raw_output_contents.append(_le_bytes(array))
    if parameters:
        set_parameters(response.parameters, parameters)
    return response


def set_parameters(target: MutableMapping[str, pb.InferParameter], values: Mapping[str, Param]) -> None:
    for key, value in values.items():
        param = target[key]
        if isinstance(value, bool):
            param.bool_param = value
        elif isinstance(value, int):
            param.int64_param = value
        elif isinstance(value, float):
            param.double_param = value
        elif isinstance(value, str):
            param.string_param = value
        else:
            msg = f"parameter {key!r}: {type(value).__name__} is not bool, int, float or str"
            raise CodecError(msg)


def get_parameters(source: Mapping[str, pb.InferParameter]) -> dict[str, Param]:
    out: dict[str, Param] = {}
    for key, param in source.items():
        which = param.WhichOneof("parameter_choice")
        if which is not None:
            out[key] = getattr(param, which)
    return out
