"""Choosing the wire encoding from the link (pure), and the link meter on synthetic round trips."""

from __future__ import annotations

import numpy as np
import pytest

from cloud_service.protocol import decode_inputs, encode_request
from cloud_service.protocol.encoding import encoding_of
from edge_agent.encoding import HEADROOM, Choice, LinkEstimate, LinkMeter, WireEncoder, choose_encoding
from runtimes.errors import ConfigError

IMAGE = 602_112  # 1x3x224x224 fp32
SIZES = {"fp32": IMAGE, "zstd": IMAGE * 6 // 10, "fp16": IMAGE // 2, "fp16+zstd": IMAGE * 3 // 10}


def test_most_faithful_encoding_that_fits_wins() -> None:
    fast = LinkEstimate(bandwidth_bps=200e6, rtt_s=0.005)
    assert choose_encoding(SIZES, fast, 0.150).encoding == "fp32"
    # 50 Mbit/s, 30 ms: fp32 takes 126 ms, over 80 % of 150 ms; lossless zstd takes 88 ms
    expected = Choice("zstd", SIZES["zstd"], pytest.approx(0.03 + SIZES["zstd"] * 8 / 50e6), True)
    assert choose_encoding(SIZES, LinkEstimate(50e6, 0.03), 0.150) == expected
    # 5 Mbit/s: only fp16+zstd (about 320 ms) comes close; nothing fits, so the fastest, flagged
    slow = choose_encoding(SIZES, LinkEstimate(5e6, 0.03), 0.150)
    assert slow.encoding == "fp16+zstd"
    assert not slow.fits


def test_compression_time_and_energy_count() -> None:
    link = LinkEstimate(50e6, 0.03)
    assert choose_encoding(SIZES, link, 0.150, cpu_s={"zstd": 0.05}).encoding == "fp16"
    # radio energy: 1 µJ per byte and at most 0.35 J per escalation rules out fp32 (0.60 J) and zstd (0.36 J)
    fast = LinkEstimate(1e9, 0.001)
    assert choose_encoding(SIZES, fast, 1.0, joules_per_byte=1e-6, energy_budget_j=0.35).encoding == "fp16"


def test_choose_needs_candidates_and_a_sane_link() -> None:
    with pytest.raises(ConfigError, match="candidate"):
        choose_encoding({}, LinkEstimate(1e6, 0.0), 1.0)
    with pytest.raises(ConfigError, match="bandwidth"):
        LinkEstimate(0.0, 0.01)


def _trip(link: LinkEstimate, nbytes: int) -> float:
    return link.seconds(nbytes)


def test_meter_recovers_rtt_and_bandwidth_from_two_sizes() -> None:
    true = LinkEstimate(10e6, 0.030)
    meter = LinkMeter()
    assert meter.estimate() is None
    for nbytes in (IMAGE, IMAGE, IMAGE // 2, IMAGE // 2, IMAGE):
        meter.observe(nbytes, _trip(true, nbytes))
    est = meter.estimate()
    assert est is not None
    assert est.rtt_s == pytest.approx(0.030, rel=0.01)
    assert est.bandwidth_bps == pytest.approx(10e6, rel=0.01)


def test_meter_follows_a_rate_step_within_three_escalations() -> None:
    meter = LinkMeter()
    meter.observe(100, 0.030)  # a small round trip: the RTT
    for _ in range(8):
        meter.observe(IMAGE, _trip(LinkEstimate(50e6, 0.03), IMAGE))
    budget = 0.150
    assert choose_encoding(SIZES, meter.estimate() or LinkEstimate(1, 0), budget).encoding == "zstd"
    switched_after = None
    for i in range(1, 8):
        meter.observe(SIZES["zstd"], _trip(LinkEstimate(5e6, 0.03), SIZES["zstd"]))
        est = meter.estimate()
        assert est is not None
        if choose_encoding(SIZES, est, budget).encoding == "fp16+zstd":
            switched_after = i
            break
    assert switched_after is not None
    assert switched_after <= 3


def test_wire_encoder_reencodes_fp32_and_measures_each_encoding() -> None:
    x = np.repeat(np.repeat(np.random.default_rng(0).random((1, 3, 28, 28), dtype=np.float32), 8, 2), 8, 3)
    request = encode_request("m", {"x": x}, parameters={"tierkit.seq": 7})
    fixed = WireEncoder("fp16+zstd").prepare(request, timeout_s=1.0)
    assert encoding_of(fixed.inputs[0]) == ("fp16", "zstd")
    assert fixed.parameters["tierkit.seq"].int64_param == 7
    np.testing.assert_allclose(decode_inputs(fixed)["x"], x, atol=1e-3)

    auto = WireEncoder("auto")
    assert auto.options() == ()
    assert auto.prepare(request, timeout_s=0.15) is request  # no estimate yet: plain, to measure the link
    options = {o.encoding: o for o in auto.options()}  # measured on that first request
    assert list(options) == ["fp32", "zstd", "fp16", "fp16+zstd"]
    assert options["fp32"].nbytes == request.ByteSize()
    assert options["fp16"].nbytes < request.ByteSize() * 0.51
    assert options["zstd"].nbytes < request.ByteSize() * 0.5  # an upsampled image compresses well
    assert options["fp16+zstd"].nbytes < options["zstd"].nbytes
    assert options["zstd"].exact
    assert not options["fp16"].exact
    assert options["zstd"].encode_ms > 0
    auto.observe(100, 0.03)
    auto.observe(request.ByteSize(), _trip(LinkEstimate(5e6, 0.03), request.ByteSize()))
    sent = auto.prepare(request, timeout_s=0.15)
    assert encoding_of(sent.inputs[0]) == ("zstd",)  # lossless and within the time left at 5 Mbit/s
    assert sent.ByteSize() < request.ByteSize() * HEADROOM / 2
    auto.planned = "fp16"  # a controller's plan wins over the per-request choice
    sent = auto.prepare(request, timeout_s=0.15)
    assert encoding_of(sent.inputs[0]) == ("fp16",)
    assert auto.sent_bytes(request.ByteSize()) == pytest.approx(sent.ByteSize(), rel=0.02)  # what radio costs
    assert [o.encoding for o in WireEncoder("fp16").options()] == []
    fixed_encoder = WireEncoder("fp16")
    fixed_encoder.prepare(request, timeout_s=1.0)
    assert [o.encoding for o in fixed_encoder.options()] == ["fp16"]


def test_wire_encoder_refuses_unknown_encodings() -> None:
    with pytest.raises(ConfigError, match="wire_encoding"):
        WireEncoder("frame")
    with pytest.raises(Exception, match="encoding"):
        WireEncoder("gzip")


def test_timeouts_alone_move_the_estimate_down() -> None:
    meter = LinkMeter()
    meter.observe(100, 0.030)
    for _ in range(4):
        meter.observe(IMAGE, _trip(LinkEstimate(50e6, 0.03), IMAGE))
    before = meter.estimate()
    assert before is not None
    meter.observe_timeout(SIZES["zstd"], 0.150)
    meter.observe_timeout(SIZES["zstd"], 0.150)
    after = meter.estimate()
    assert after is not None
    # no reply came within 150 ms, so the link moves zstd's 361 KB at under 24 Mbit/s; the estimate is half that
    assert after.bandwidth_bps <= SIZES["zstd"] * 8 / 0.120 / 2 * 1.01
    assert choose_encoding(SIZES, after, 0.150).encoding == "fp16+zstd"
