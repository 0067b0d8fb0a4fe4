"""One inference, shared by the gRPC servicer (blocking) and the MQTT bridge (async): decode, check,
batch, encode.

Also the one place that turns an exception into a status name (`status_of`): every tierkit error
and the codec's error carry a `grpc_status`; anything else is an internal error whose details stay
in the server log.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping, Sequence

import numpy as np

from cloud_service.batcher import BatcherClosed, DynamicBatcher
from cloud_service.metrics import UNKNOWN_MODEL
from cloud_service.models import ServedModel
from cloud_service.protocol import CodecError, declared_rows, decode_inputs, encode_response, get_parameters, topics
from cloud_service.protocol import inference_pb2 as pb
from cloud_service.protocol.codec import RawBytes
from cloud_service.protocol.encoding import frame_inputs
from cloud_service.protocol.preprocess import Preprocess
from cloud_service.protocol.wire import RawRequest, RawResponse, raw_response
from cloud_service.repository import ModelRepository
from runtimes.errors import BackendUnavailable

log = logging.getLogger(__name__)
MAX_ERROR_CHARS = 1024  # an error message echoes request content (names, shapes): bounded, always


def clip(text: str, limit: int = MAX_ERROR_CHARS) -> str:
    """`text` cut to `limit` characters, saying how much was cut."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}… ({len(text) - limit} more characters)"


def status_of(exc: BaseException) -> tuple[str, str]:
    """(gRPC status name, message for the caller) of an exception raised while answering."""
    code = getattr(exc, "grpc_status", None)
    if isinstance(code, str):
        return code, clip(str(exc))
    if isinstance(exc, asyncio.CancelledError):
        return "CANCELLED", "the request was cancelled"
    log.error("internal error while answering a request", exc_info=exc)
    return "INTERNAL", f"internal server error ({type(exc).__name__}); the server log has the details"


async def infer(repository: ModelRepository, request: pb.ModelInferRequest, *,
                deadline: float | None = None) -> pb.ModelInferResponse:
    """Answer one `ModelInferRequest` from a coroutine (the MQTT bridge).

    Args:
        repository: where the model is looked up.
        request: the decoded message.
        deadline: absolute `loop.time()` after which the request is dropped before compute.

    Raises:
        ModelNotFound, InputError, CodecError, ServerBusy, CloudTimeout, InferenceError.
    """
    started = time.perf_counter()
    # No await between get() and submit(): a hot swap cannot slip in between, so the request runs
    # on the version it was checked against, and that version drains before it is closed.
    model = repository.get(request.model_name, request.model_version)
    try:
        arrays, names = _check(model, request)
        outputs = await _batcher(model).submit(arrays, deadline=deadline)
        response = _respond(model, request, outputs, names)
    except BaseException:
        model.stats.request_done(time.perf_counter() - started, ok=False)
        raise
    model.stats.request_done(time.perf_counter() - started, ok=True)
    return response


_LOOKUPS = 3  # lookups of a model that a hot swap keeps retiring under a blocking call


def infer_blocking(repository: ModelRepository, request: RawRequest, *,
                   timeout: float | None = None) -> RawResponse:
    """Answer one `ModelInferRequest` in the calling thread (the gRPC handlers).

    The tensors travel beside the message both ways (`protocol.wire`): the inputs are views of the
    received bytes, and the outputs are serialized straight from the model's arrays.

    A hot swap can retire the looked-up version between the lookup and the queueing (the swap
    installs the new version first, then closes the old): the request is then looked up again.

    Args:
        repository: where the model is looked up.
        request: the decoded message and its tensor bytes.
        timeout: seconds after which the request is dropped before compute (None: never).
    """
    started = time.perf_counter()
    # The deadline is fixed now, when the caller's remaining time was read: each step below asks what is
    # left of it. Passing `timeout` on as is restarted the clock at each step, so decoding and checking
    # under load (tens of ms with a hundred handler threads) were time the batcher did not know was spent.
    due = None if timeout is None else time.monotonic() + timeout
    message = request.message
    for attempt in range(_LOOKUPS):
        model = repository.get(message.model_name, message.model_version)
        try:
            _admit_before_decoding(model, message, _left(due))
            arrays, names = _check(model, message, request.raw or None)
            outputs = _batcher(model).run(arrays, timeout=_left(due))
            response = raw_response(model.name, {n: outputs[n] for n in names}, version=model.version,
                                    request_id=message.id, parameters=_reply_parameters(model, message))
        except BaseException as exc:
            if isinstance(exc, BatcherClosed) and attempt < _LOOKUPS - 1:
                continue
            model.stats.request_done(time.perf_counter() - started, ok=False)
            raise
        model.stats.request_done(time.perf_counter() - started, ok=True)
        return response
    raise AssertionError  # unreachable: the loop returns or raises


def _left(due: float | None) -> float | None:
    """Seconds left before the monotonic deadline `due` (None: no deadline)."""
    return None if due is None else due - time.monotonic()


def _check(model: ServedModel, request: pb.ModelInferRequest, raw: Sequence[RawBytes] | None = None
           ) -> tuple[dict[str, np.ndarray], list[str]]:
    """The request's inputs, checked against `model`, and the outputs it asks for."""
    arrays = decode_inputs(request, raw)
    for name in frame_inputs(request):
        arrays[name] = _preprocess(model).apply(arrays[name])
    model.validate(arrays)
    return arrays, model.output_names(o.name for o in request.outputs)


def _preprocess(model: ServedModel) -> Preprocess:
    """The model's declared frame preprocessing; a model without one refuses frames."""
    declared = model.manifest.preprocess
    if not declared:
        msg = (f"model {model.name!r} declares no preprocess in its manifest, so it cannot take a raw frame; "
               "send the model input instead")
        raise CodecError(msg)
    return Preprocess.from_json(declared)


def _admit_before_decoding(model: ServedModel, message: pb.ModelInferRequest, timeout: float | None) -> None:
    """Refuse, from the message's declared shape alone, a request the model's queue cannot answer in time:
    under overload most calls are refused, and a refusal should cost no tensor decoding, preprocessing or
    validation. What passes is admitted again when it is queued (`DynamicBatcher.run`)."""
    if model.batcher is not None and (refusal := model.batcher.admissible(declared_rows(message), timeout)):
        raise refusal


def _batcher(model: ServedModel) -> DynamicBatcher:
    if model.batcher is None:
        msg = f"model {model.name!r} is loading; retry"
        raise BackendUnavailable(msg)
    return model.batcher


def _respond(model: ServedModel, request: pb.ModelInferRequest, outputs: Mapping[str, np.ndarray],
             names: list[str]) -> pb.ModelInferResponse:
    return encode_response(model.name, {n: outputs[n] for n in names}, version=model.version,
                           request_id=request.id, parameters=_reply_parameters(model, request))


def _reply_parameters(model: ServedModel, request: pb.ModelInferRequest) -> dict[str, str | int | float | bool]:
    params: dict[str, str | int | float | bool] = {}
    if request.parameters:
        sent = get_parameters(request.parameters)
        for key in (topics.PARAM_TRACE, topics.PARAM_SEQ):
            if key in sent:
                params[key] = sent[key]
    return params


def model_label(repository: ModelRepository, name: str) -> str:
    """The metrics label for a requested model name (unknown names share one label)."""
    return name if name in repository else UNKNOWN_MODEL
