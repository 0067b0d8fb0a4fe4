"""The per-caller hint ledger (`cloud_service.callers`): a call inside its caller's last retry hint is refused."""

from __future__ import annotations

import doctest

import pytest

from cloud_service import callers
from cloud_service.callers import DEVICE_METADATA_KEY, HintIgnored, HintLedger, caller_id
from cloud_service.protocol import inference_pb2 as pb
from cloud_service.protocol import topics


def test_doc_example_runs() -> None:
    assert doctest.testmod(callers).failed == 0


def test_a_call_inside_the_hint_is_refused_with_the_rest_of_it_and_other_callers_are_not() -> None:
    ledger = HintLedger(grace=0.8, penalty=0.25)
    ledger.refused("a", hint_ms=1000, now=0.0)  # asked to wait 1 s: calls before 0.8 s count as early
    early = ledger.refusal("a", now=0.3)
    assert isinstance(early, HintIgnored)
    assert early.retry_after_ms == 950  # the rest of the hint, lengthened by a quarter of it for calling inside it
    assert "retry hint" in str(early)
    assert ledger.refusal("b", now=0.3) is None  # another caller is untouched
    again = ledger.refusal("a", now=0.81)  # inside the lengthened window: early again, lengthened no more
    assert isinstance(again, HintIgnored)
    assert again.retry_after_ms == 440
    assert ledger.refusal("a", now=1.06) is None  # waited it out (within the grace)
    assert len(ledger) == 0  # and forgotten then
    ledger.refused("c", hint_ms=1000, now=0.0)
    assert ledger.refusal("c", now=0.8) is None  # an honest caller, never early, waits the hint alone


def test_the_ledger_is_bounded_and_checks_its_grace() -> None:
    ledger = HintLedger(max_tracked=3)
    for i in range(10):
        ledger.refused(f"c{i}", hint_ms=5000, now=0.0)
    assert len(ledger) == 3
    assert ledger.early("c9", now=1.0) is not None
    assert ledger.early("c0", now=1.0) is None  # the oldest were forgotten
    with pytest.raises(ValueError, match="grace"):
        HintLedger(grace=0.0)


def test_caller_id_prefers_the_device_id_then_metadata_and_leaves_anonymous_calls_untracked() -> None:
    request = pb.ModelInferRequest()
    assert caller_id(request.parameters, ()) is None  # one connection may carry many callers: no identity
    assert caller_id(request.parameters, ((DEVICE_METADATA_KEY, "m1"),)) == "device:m1"
    request.parameters[topics.PARAM_DEVICE].string_param = "d1"
    assert caller_id(request.parameters, ((DEVICE_METADATA_KEY, "m1"),)) == "device:d1"
