"""The rule chooses the wire encoding with the variant and the threshold (synthetic measurements).

The stream and the edge model are `testkit.score_stream`'s (an 89 % edge model, a cloud right on 99.9 %). The
request is an MNIST-sized one: 3,200 bytes as fp32, 1,600 as fp16.
"""

from __future__ import annotations

import numpy as np
import pytest

from cloud_service.protocol import encode_request
from edge_agent.budget import Budget
from edge_agent.controller import Controller, ControllerConfig, choose
from edge_agent.encoding import EXACT, WireEncoder, WireOption
from edge_agent.fleet_sync import decision_summary
from edge_agent.link import DRIFT_SAMPLES
from edge_agent.profiles import LinkProfile
from testkit.score_stream import Clock, profile

FP32 = WireOption("fp32", 3200, 0.0, exact=True)
FP16 = WireOption("fp16", 1600, 0.05, exact=False)


def narrow_link(mbps: float = 1.0, base_ms: float = 2.0, **kw: float) -> LinkProfile:
    """A link whose round trips were measured with fp32 requests: `base_ms` plus 3,200 bytes at `mbps`."""
    trip_ms = base_ms + FP32.nbytes * 8e-3 / mbps
    args = {"rtt_ms": trip_ms, "rtt_high_ms": trip_ms * 1.05, "bytes_per_escalation": float(FP32.nbytes),
            "energy_per_byte_mj": 1e-3, "wait_power_w": 0.3, **kw}
    lp = LinkProfile(**args)  # type: ignore[arg-type]
    lp.link.observe_transfer(100, (base_ms + 100 * 8e-3 / mbps) / 1e3)  # a small message pays its bytes too
    for _ in range(3):
        lp.link.observe_transfer(FP32.nbytes, trip_ms / 1e3)
        lp.link.observe_answer(trip_ms)
    return lp


def test_a_smaller_encoding_that_lets_more_escalations_fit_the_latency_budget_is_chosen() -> None:
    """1 Mbit/s: fp32 escalations take ~27.6 ms, over a 25 ms p95 budget's target; fp16 ones take ~15 ms.
    Searched alone, (variant, threshold) can escalate only what the p95 hides; jointly, fp16 escalates
    far more and is more accurate."""
    lp = narrow_link()
    state = lp.state()
    assert state.bandwidth_bps == pytest.approx(1e6, rel=0.01)
    budget = Budget(latency_ms=25)
    alone = choose([profile()], state, budget, ControllerConfig(), wires=[FP32])
    joint = choose([profile()], state, budget, ControllerConfig(), wires=[FP32, FP16])
    assert alone.encoding == "fp32"
    assert alone.predicted_escalation_rate < 0.06
    assert joint.encoding == "fp16"
    assert joint.predicted_escalation_rate > 0.3
    assert joint.predicted_accuracy > alone.predicted_accuracy + 0.02
    assert joint.feasible
    assert joint.inputs["wire"]["encoding"] == "fp16"
    assert joint.inputs["wire"]["shift_ms"] == pytest.approx(-12.75, abs=0.2)  # 1,600 bytes fewer at 1 Mbit/s
    doc = joint.to_json()
    assert doc["encoding"] == "fp16"
    assert doc["binding"] in {"none", "latency"}


def test_on_a_fast_link_the_lossless_encoding_wins_a_tie() -> None:
    """At 100 Mbit/s the bytes cost nothing that matters: fp16 is no more accurate, so fp32 stays."""
    d = choose([profile()], narrow_link(mbps=100.0).state(), Budget(latency_ms=60), ControllerConfig(),
               wires=[FP16, FP32])
    assert d.encoding == "fp32"
    assert d.predicted_escalation_rate > 0.3


def test_two_exact_encodings_are_as_faithful_and_the_cheaper_wins() -> None:
    """zstd decodes to the very tensor fp32 does: on a 1 Mbit/s link its 1,200 fewer bytes save ~9.6 ms a
    round trip and the waiting energy, so it is chosen with no budget binding (fp32 was, as "more faithful",
    until a later move for energy); at 100 Mbit/s the bytes save less than its encode time, and fp32 stays."""
    zstd = WireOption("zstd", 2000, 0.1, exact=True)
    narrow = choose([profile()], narrow_link().state(), Budget(latency_ms=200), ControllerConfig(),
                    wires=[FP32, zstd, FP16])
    assert narrow.encoding == "zstd"
    fast = choose([profile()], narrow_link(mbps=100.0).state(), Budget(latency_ms=200), ControllerConfig(),
                  wires=[FP32, zstd, FP16])
    assert fast.encoding == "fp32"
    assert narrow.predicted_escalation_rate == pytest.approx(fast.predicted_escalation_rate, abs=0.02)


def test_an_energy_budget_prices_each_encodings_bytes() -> None:
    """1 uJ per byte: an fp32 escalation's radio costs 3.2 mJ, fp16's 1.6 mJ. Under an energy budget that
    binds, fp16 buys more escalations for the same energy, and the record says energy binds."""
    lp = narrow_link(mbps=100.0)
    budget = Budget(latency_ms=60, energy_mj=2.0)
    alone = choose([profile()], lp.state(), budget, ControllerConfig(), wires=[FP32])
    joint = choose([profile()], lp.state(), budget, ControllerConfig(), wires=[FP32, FP16])
    assert alone.binding == "energy"
    assert joint.encoding == "fp16"
    assert joint.predicted_escalation_rate > alone.predicted_escalation_rate * 1.5
    assert joint.predicted_energy_mj <= 2.0
    assert joint.binding == "energy"


def test_the_controller_plans_the_encoders_encoding_and_telemetry_names_it() -> None:
    """A real encoder measures each encoding on a real request; the controller chooses among them and
    sets the encoder's plan; a budget that loosens brings an exact encoding back (fp32, or zstd where its
    fewer bytes cost less)."""
    clock = Clock()
    lp = narrow_link()
    c = Controller([profile()], Budget(latency_ms=25), link=lp, clock=clock)
    assert c.current.encoding == ""  # no encoder: requests as built
    encoder = WireEncoder("auto", meter=lp.link)
    x = np.random.default_rng(0).random((1, 1, 28, 28), dtype=np.float32)
    encoder.prepare(encode_request("m", {"x": x}), timeout_s=1.0)
    c.attach_encoder(encoder)
    c.observe_request(escalated=False, agreed=None, total_latency_ms=1.0)
    clock.t += 1.0
    decision = c.maybe_redecide()
    assert decision is not None
    assert decision.encoding in {"fp16", "fp16+zstd"}  # random pixels: zstd gains little, fp16 halves
    assert encoder.planned == decision.encoding
    summary = decision_summary(decision.to_json())
    assert summary is not None
    assert summary["encoding"] == decision.encoding
    assert summary["binding"] == decision.binding
    clock.t += 1.0
    loose = c.set_budget(Budget(latency_ms=200))
    assert loose is not None
    assert loose.encoding in EXACT
    assert encoder.planned == loose.encoding


def test_a_cheaper_exact_encoding_is_taken_at_once_after_the_round_trip_moved() -> None:
    """A cold start onto a narrow link: the first decision sends fp32 (no bandwidth measured yet, so zstd's
    fewer bytes gain nothing known); the first transfers timed on the 1 Mbit/s link move the round trip
    (a "round trip slower" event) and price zstd's bytes. The move to zstd keeps every escalation, so the
    settle time after a move of the round trip (which keeps a loss burst from taking escalations away) does
    not hold it: it is made in that re-decision, not `link_settle_s` later."""
    clock = Clock()
    lp = LinkProfile(rtt_ms=2.0, bytes_per_escalation=float(FP32.nbytes), energy_per_byte_mj=1e-3,
                     wait_power_w=0.3, clock=clock)
    c = Controller([profile()], Budget(latency_ms=200), link=lp, clock=clock)
    encoder = WireEncoder("auto", meter=lp.link)
    x = np.zeros((1, 1, 28, 28), dtype=np.float32)  # a digit: a stroke on a blank page, which zstd shrinks
    x[0, 0, 8:20, 12:16] = np.random.default_rng(0).random((12, 4), dtype=np.float32)
    encoder.prepare(encode_request("m", {"x": x}), timeout_s=1.0)
    c.attach_encoder(encoder)
    c.observe_request(escalated=False, agreed=None, total_latency_ms=1.0)
    clock.t += 1.0
    first = c.maybe_redecide() or c.current
    assert first.encoding == "fp32"
    trip_ms = 2.0 + FP32.nbytes * 8e-3  # 1 Mbit/s
    lp.link.observe_transfer(100, 0.002)
    epoch = lp.link.epoch
    for _ in range(DRIFT_SAMPLES):
        lp.link.observe_transfer(FP32.nbytes, trip_ms / 1e3)
        lp.link.observe_answer(trip_ms)
        clock.t += 0.01
    assert lp.link.epoch > epoch
    assert lp.link.event == "slower"
    clock.t += ControllerConfig().redecide_gap_s
    moved = c.maybe_redecide()
    assert moved is not None, c.current.reason
    assert moved.encoding == "zstd", moved.reason
    assert "round trip slower" in moved.trigger
    assert moved.predicted_escalation_rate >= first.predicted_escalation_rate - 0.01


def _digit_encoder(link: LinkProfile) -> WireEncoder:
    """A real encoder that measured each encoding on an MNIST-like request (a stroke on a blank page: zstd
    sends well under half of fp32's bytes, and costs its encode time)."""
    encoder = WireEncoder("auto", meter=link.link)
    x = np.zeros((1, 1, 28, 28), dtype=np.float32)
    x[0, 0, 8:20, 12:16] = np.random.default_rng(0).random((12, 4), dtype=np.float32)
    encoder.prepare(encode_request("m", {"x": x}), timeout_s=1.0)
    return encoder


def _serve_wire(c: Controller, lp: LinkProfile, clock: Clock, rng: np.random.Generator, *, mbps: float,
                n: int, base_ms: float = 20.0, jitter_ms: float = 0.0) -> list[str]:
    """`n` requests at 100/s on a link of `base_ms` plus each request's bytes in the planned encoding at
    `mbps` (plus up to `jitter_ms`); the encoding planned at each request."""
    sizes = {w.encoding: w.nbytes for w in c.encoder.options()} if c.encoder is not None else {}
    planned = []
    sure = rng.random(n) < 0.55  # the stream of `testkit.score_stream`
    for score in np.where(sure, 0.99 + 0.01 * rng.random(n), 0.99 * rng.beta(3.0, 1.0, n)).tolist():
        planned.append(c.current.encoding)
        escalated = score < c.current.threshold
        c.observe_inference("lr", 1.0, 1.0, energy_label="modeled:test")
        trip = 0.0
        if escalated:
            nbytes = sizes.get(c.current.encoding, FP32.nbytes) + 60  # the answer's bytes too
            trip = base_ms + nbytes * 8e-3 / mbps + jitter_ms * float(rng.random())
            lp.link.observe_transfer(nbytes, trip / 1e3)
            c.observe_escalation(trip, ok=True, bytes_sent=nbytes)
        c.observe_request(escalated, True if escalated else None, 1.0 + trip, score=score, energy_mj=1.0)
        c.maybe_redecide()
        clock.t += 0.01
    return planned


def test_an_exact_encoding_with_fewer_bytes_is_taken_once_the_bandwidth_says_so() -> None:
    """The link back after an outage: the plan kept fp32 from a spell when the bytes cost nothing measurable
    (the bandwidth read as huge), and the first requests at 10 Mbit/s price zstd's fewer bytes at ~2 ms a round
    trip. zstd is as exact and as accurate; the energy it saves (a few % of a request) is no move by the
    energy rule, and the rule's choice may differ in its threshold by less than the gain's evidence: the
    encoding is taken on its own, within a second (it came only with a later threshold move, 692 requests
    into the bench's "back, loss bursts" phase)."""
    clock = Clock()
    lp = LinkProfile(rtt_ms=20.0, bytes_per_escalation=float(FP32.nbytes), energy_per_byte_mj=5e-5,
                     wait_power_w=0.01, clock=clock)
    lp.link.observe_transfer(100, 0.020)
    for _ in range(3):  # the spell before: 10 Gbit/s, where zstd's bytes save less than its encode time
        lp.link.observe_transfer(FP32.nbytes, 0.020 + FP32.nbytes * 8 / 10e9)
    c = Controller([profile()], Budget(latency_ms=200), link=lp, clock=clock)
    c.attach_encoder(_digit_encoder(lp))
    c.observe_request(escalated=False, agreed=None, total_latency_ms=1.0)
    clock.t += 1.0
    rng = np.random.default_rng(3)
    fast = _serve_wire(c, lp, clock, rng, mbps=10_000.0, n=500)  # the threshold settles, fp32
    assert set(fast[-300:]) == {"fp32"}, c.current.reason
    planned = _serve_wire(c, lp, clock, rng, mbps=10.0, n=500, jitter_ms=2.0)
    assert "zstd" in planned, c.current.reason
    taken = planned.index("zstd")
    assert taken <= 100
    assert set(planned[taken:]) == {"zstd"}


def test_near_the_bandwidth_where_two_exact_encodings_tie_the_encoding_does_not_flip() -> None:
    """Where zstd's fewer bytes save about its encode time, the noisy bandwidth estimate puts either ahead by a
    little: the encoding moves at most once over 20 s."""
    clock = Clock()
    lp = LinkProfile(rtt_ms=20.0, bytes_per_escalation=float(FP32.nbytes), energy_per_byte_mj=5e-5,
                     wait_power_w=0.3, clock=clock)
    c = Controller([profile()], Budget(latency_ms=200), link=lp, clock=clock)
    encoder = _digit_encoder(lp)
    c.attach_encoder(encoder)
    zstd = {w.encoding: w for w in encoder.options()}["zstd"]
    saved_bits = (FP32.nbytes - zstd.nbytes) * 8
    tie_mbps = saved_bits / (max(zstd.encode_ms, 0.01) * 1e3)  # where the bytes saved take the encode time
    planned = _serve_wire(c, lp, clock, np.random.default_rng(5), mbps=tie_mbps, n=2000, jitter_ms=2.0)
    flips = sum(a != b for a, b in zip(planned[1:], planned[:-1], strict=False) if a and b)
    assert flips <= 1


def test_a_move_of_the_threshold_does_not_carry_a_flip_between_exact_encodings_that_tie() -> None:
    """zstd planned on a link where its fewer bytes now save about its encode time (1 Gbit/s): the rule's
    choice is fp32, by a few hundredths of a millisecond. A budget change moves the threshold; the encoding
    does not flip to fp32 (each move of the threshold flipped it with the bandwidth estimate's noise). Under a
    p95 that only a few escalations fit, a lossy encoding faster by the encode times this host measures may win
    on its own merit (fp16+zstd, seen on a loaded host): that is no flip between the exact ones."""
    clock = Clock()
    lp = LinkProfile(rtt_ms=20.0, bytes_per_escalation=float(FP32.nbytes), energy_per_byte_mj=5e-5,
                     wait_power_w=0.01, clock=clock)
    lp.link.observe_transfer(100, 0.020)
    for _ in range(3):  # 1 Mbit/s: zstd clearly ahead
        lp.link.observe_transfer(FP32.nbytes, 0.020 + FP32.nbytes * 8 / 1e6)
    c = Controller([profile()], Budget(latency_ms=200), link=lp, clock=clock)
    c.attach_encoder(_digit_encoder(lp))
    c.observe_request(escalated=False, agreed=None, total_latency_ms=1.0)
    clock.t += 1.0
    assert (c.maybe_redecide() or c.current).encoding == "zstd"
    for _ in range(3):  # now 1 Gbit/s: the bytes zstd saves take about its encode time
        lp.link.observe_transfer(FP32.nbytes, 0.020 + FP32.nbytes * 8 / 1e9)
    before = c.current
    moved = c.set_budget(Budget(latency_ms=24))  # a p95 that only a few escalations fit
    assert moved is not None
    assert moved.key != before.key
    assert moved.encoding != "fp32", moved.reason  # zstd kept, or a lossy one on its merit
