"""The cloud tier under overload: a real slow model (PP-OCRv4's text detector, ~14 ms a page on two idle
cores) behind `tierkit serve`, closed-loop callers at several times its capacity, each call with a
100 ms deadline.

Before admission by deadline, 8 such callers got 4 % of what one caller gets (every request waited in a
first-in, first-out queue, or in a batch that ended after its deadline) and every refusal took the
whole deadline. Now the excess is refused at once and the answers per second stay near capacity.
"""

from __future__ import annotations

import dataclasses
import math
import time
import urllib.request
from pathlib import Path

import pytest

from cloud_service.admission import RetryHints
from testkit.cloud_helpers import metric_value
from testkit.overload import HostStall, Load, Server, closed_loop, mqtt_closed_loop, ocr_det_package, request_bytes

DEADLINE_S = 0.1
CALLERS = 12  # each could keep the model busy alone: 12x its capacity offered
# a page is ~400 KB: through the broker twice, read by paho in Python; a loaded host's stalls would decide a
# 100 ms budget over MQTT, which is not what this measures (bench/bench_overload.py runs 100 ms)
MQTT_DEADLINE_S = 0.3
HOSTILE_S = 6.0  # honest and hostile callers side by side this long (hints of 1-5 s: a few hints each)
# the server's refusal histogram's bucket bounds (cloud_service.metrics)
_BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


@pytest.fixture(scope="module")
def ocr_models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, bytes]:
    from testkit.onnx_zoo import NotInstalled

    models = tmp_path_factory.mktemp("ocr-models")
    try:
        page = ocr_det_package(models)
    except NotInstalled as exc:
        pytest.skip(str(exc))
    return models, request_bytes("ocrdet", page)


def _lone(address: str, payload: bytes, seconds: float) -> Load:
    """One caller for `seconds`; measured three times as long when a loaded host answered it fewer than 10
    times in time (a lone page then takes most of its deadline)."""
    alone = closed_loop(address, payload, callers=1, seconds=seconds, deadline_s=DEADLINE_S)
    if alone.in_time < 10:
        alone = closed_loop(address, payload, callers=1, seconds=3 * seconds, deadline_s=DEADLINE_S)
    return alone


def caller_bounds_ms(deadline_s: float, stall_s: float) -> tuple[float, float]:
    """Caller-side refusal p50 and p75 bounds: at once, against the collapse's refusals at the whole deadline.

    0.6 and 0.8 of the deadline plus the host's measured scheduling delay (the p90 lateness of a 5 ms
    sleeper during the crowd: ~0 on a quiet host), the p50 never above 0.9 of the deadline: a median refusal
    that takes the whole deadline fails whatever the host. Measured on 2 cores at a load average of 6-22 from
    other runs (26 runs, half with two busy loops beside): gRPC p50 2-52 ms, p75 6-105 ms (105 at a stall p90
    of 76 ms) at a 100 ms deadline; MQTT p50 15-128 ms at 300 ms. The collapse: p50 104 ms at 100 ms.
    """
    return min(0.6 * deadline_s + stall_s, 0.9 * deadline_s) * 1000, (0.8 * deadline_s + stall_s) * 1000


@pytest.mark.parametrize("batching", [[], ["--no-batching"]], ids=["batching", "no-batching"])
def test_goodput_holds_at_capacity_and_the_excess_is_refused_at_once(ocr_models: tuple[Path, bytes],
                                                                     batching: list[str]) -> None:
    models, payload = ocr_models
    with Server(models, "--metrics", "127.0.0.1:0", *batching) as server:
        closed_loop(server.address, payload, callers=1, seconds=0.5, deadline_s=DEADLINE_S)  # warm up
        alone = _lone(server.address, payload, 2.0)
        # a closed loop of N callers queues N requests: past two deadlines' worth of the measured
        # capacity it is overload whatever this host's speed (a fast, quiet host needs more than CALLERS)
        callers = min(48, max(CALLERS, math.ceil(2 * DEADLINE_S * alone.goodput)))
        with HostStall() as stall:  # what other runs loading the cores cost the callers' threads
            crowd = closed_loop(server.address, payload, callers=callers, seconds=4.0, deadline_s=DEADLINE_S)
        # the hints' stated recovery: once refusals stop for `RetryHints.quiet_s` (1.33 s), a refusal's hint is
        # one refusal's worth again (an elapsed time is the condition here, so a sleep)
        time.sleep(RetryHints().quiet_s)
        after = _lone(server.address, payload, 2.0)
        with urllib.request.urlopen(f"http://{server.metrics}/metrics", timeout=10) as reply:
            metrics = reply.read().decode()
    p50, p75 = caller_bounds_ms(DEADLINE_S, stall.p(90))
    summary = (f"alone {alone.goodput:.1f}/s; {callers} callers {crowd.goodput:.1f}/s in time, {crowd.refused} "
               f"refused (p50 {crowd.refusal_p(50):.1f} ms, p75 {crowd.refusal_p(75):.1f} ms, p90 "
               f"{crowd.refusal_p(90):.1f} ms; bounds {p50:.0f}/{p75:.0f} ms; server: "
               f"{_refused_within(metrics, 'grpc', 0.01):.2f} within 10 ms), {crowd.expired} past deadline, "
               f"{crowd.late} late, other {crowd.other}; after {after.goodput:.1f}/s ({after.refused} refused, "
               f"{after.expired} past deadline); host stall p90 {stall.p(90) * 1000:.1f} ms")
    print(summary)
    if alone.in_time < 10:
        pytest.skip(f"this host is too loaded to measure overload: a lone caller got {alone.in_time} answers in "
                    f"time in {alone.seconds:g} s ({summary})")
    # The crowd against a lone caller before it and after it (the smaller: a host loaded by other runs moves
    # both, and the collapse this guards against, 0.04x, left the server answering a lone caller at once).
    # Measured on 2 cores beside other runs (load average 6-21): 0.4-2.0x; a quiet host: 1.5-2x.
    reference = min(alone.goodput, after.goodput)
    assert crowd.goodput >= 0.3 * reference, summary
    # the excess was refused, not queued to expire (callers wait out each retry hint, sized so that they come
    # back at `RetryHints.share` of the capacity in all: refusals are about that share of the answers; the
    # collapse refused none)
    assert crowd.refused >= 0.5 * RetryHints().share * crowd.in_time, summary
    assert len(crowd.hints_ms) == crowd.refused, summary  # every refusal says when to retry (retry-after-ms)
    # At once, not at the deadline (the collapse refused at p50 104 ms, p99 up to 330 ms): `caller_bounds_ms`.
    # Inside the server, receipt to refusal, 0.82-1.00 within 10 ms in the same runs (no host term needed).
    assert crowd.refusal_p(50) <= p50, summary
    assert crowd.refusal_p(75) <= p75, summary
    assert _refused_within(metrics, "grpc", 0.01) >= 0.7, summary
    # admitted requests mostly made it (on a loaded host a run planned to fit sometimes does not; before: 30x)
    assert crowd.expired + crowd.late <= crowd.in_time, summary
    # no backlog, no stale estimate left behind: a lone caller is answered, not refused (each call of its that
    # expired leaves the model busy with it, and the next may be refused behind it on a host where a lone page
    # takes most of the deadline: measured 4-9 refusals after 8-20 expiries at a load average of 20)
    assert after.in_time >= 5, summary
    assert after.refused <= 1 + after.expired, summary
    assert metric_value(metrics, "tierkit_requests_refused_total", model="ocrdet", reason="deadline") > 0
    assert metric_value(metrics, "tierkit_queue_seconds_count", model="ocrdet") > 0


def test_callers_ignoring_their_retry_hints_do_not_take_the_honest_callers_share(
        ocr_models: tuple[Path, bytes]) -> None:
    """Half the callers call again at once after a refusal: each caller, by its device id, is refused at once
    while inside its last hint, which calling inside lengthens (`cloud_service.callers`), so the hostile half
    cannot poll its way into the room each batch frees, and the honest half keeps a share of the answers near
    its share of the callers."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    models, payload = ocr_models
    with Server(models, "--metrics", "127.0.0.1:0") as server:
        closed_loop(server.address, payload, callers=1, seconds=0.5, deadline_s=DEADLINE_S)  # warm up
        alone = _lone(server.address, payload, 2.0)
        if alone.in_time < 10:
            pytest.skip(f"this host is too loaded to measure overload: a lone caller got {alone.in_time} answers "
                        f"in time in {alone.seconds:g} s")
        half = min(24, max(CALLERS // 2, math.ceil(DEADLINE_S * alone.goodput)))
        # each half in a process of its own: in one interpreter the hostile half's threads, spinning through
        # refusals, held the interpreter lock while the honest callers' threads waited to wake from their hints
        with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn")) as pool:
            for started in [pool.submit(closed_loop, server.address, payload, callers=1, seconds=0.2,
                                        deadline_s=DEADLINE_S) for _ in range(2)]:  # both processes up first
                started.result(timeout=60)
            honest_run = pool.submit(closed_loop, server.address, payload, callers=half, seconds=HOSTILE_S,
                                     deadline_s=DEADLINE_S, prefix="honest")
            hostile_run = pool.submit(closed_loop, server.address, payload, callers=half, seconds=HOSTILE_S,
                                      deadline_s=DEADLINE_S, honour_hints=False, prefix="hostile")
            honest, hostile = honest_run.result(timeout=60), hostile_run.result(timeout=60)
        with urllib.request.urlopen(f"http://{server.metrics}/metrics", timeout=10) as reply:
            metrics = reply.read().decode()
    ignored = metric_value(metrics, "tierkit_requests_refused_total", model="ocrdet", reason="ignored_hint")
    summary = (f"alone {alone.goodput:.1f}/s; {half} honest callers {honest.goodput:.1f}/s in time ({honest.refused} "
               f"refused), {half} hostile {hostile.goodput:.1f}/s ({hostile.refused} refused, {ignored:.0f} of them "
               f"inside their hint); expired {honest.expired}+{hostile.expired}")
    print(summary)
    assert ignored > 0, summary
    # Without the ledger the hostile half, polling, took the answers: honest 0.0-0.2/s against hostile 16/s (two
    # runs, 2 cores at a load average of 20), at most 0.013 of theirs. With it each caller is admitted at most once
    # a hint, and a poller's hint is lengthened (`callers.EARLY_PENALTY`). Each caller waits out only a few hints
    # of 1-5 s in the run, so the halves' answers vary run to run: honest against hostile 0.41-3.3 (median 1.1;
    # 10 runs, 2 cores at a load average of 6-7 with a busy loop beside). Before the lengthening, with a 0.95
    # grace, and both halves in one process: 0.09-3.3, under 0.4 in 5 runs of 10.
    assert honest.in_time >= 0.25 * hostile.in_time, summary
    assert honest.in_time > 0, summary


def _scrape(address: str) -> str:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as reply:
        text: str = reply.read().decode()
    return text


@dataclasses.dataclass(frozen=True)
class _ServerSide:
    """What the server counted over MQTT between two scrapes: where the callers' requests went."""

    received: float
    answered: float
    refused_on_arrival: float
    refused_queued: float
    expired_in_queue: float
    answers_dropped: float

    @classmethod
    def between(cls, before: str, after: str) -> _ServerSide:
        def delta(name: str, **labels: str) -> float:
            return metric_value(after, name, **labels) - metric_value(before, name, **labels)

        received = delta("tierkit_requests_total", model="ocrdet", protocol="mqtt")
        failed = delta("tierkit_request_failures_total", model="ocrdet", protocol="mqtt")
        return cls(received, received - failed,
                   delta("tierkit_refusal_seconds_count", model="ocrdet", protocol="mqtt", stage="admission"),
                   delta("tierkit_refusal_seconds_count", model="ocrdet", protocol="mqtt", stage="queued"),
                   delta("tierkit_requests_expired_total", model="ocrdet"),
                   delta("tierkit_answers_dropped_total", model="ocrdet", protocol="mqtt"))

    def __str__(self) -> str:
        return (f"received {self.received:.0f}, answered {self.answered:.0f}, refused {self.refused_on_arrival:.0f} "
                f"on arrival and {self.refused_queued:.0f} queued, {self.expired_in_queue:.0f} expired in its queue, "
                f"{self.answers_dropped:.0f} answers dropped past their deadline")


def _refused_within(metrics: str, protocol: str, seconds: float, **stage: str) -> float:
    """The share of the server's refusals (of one `stage=` when given) that took at most `seconds` from receipt
    (its histogram: the first bucket bound at or above `seconds`)."""
    count = metric_value(metrics, "tierkit_refusal_seconds_count", model="ocrdet", protocol=protocol, **stage)
    bound = min((b for b in _BUCKETS if b >= seconds - 1e-9), default=_BUCKETS[-1])
    within = metric_value(metrics, "tierkit_refusal_seconds_bucket", model="ocrdet", protocol=protocol, le=str(bound),
                          **stage)
    return within / count if count else 0.0


def test_mqtt_escalations_past_capacity_are_refused_on_arrival(ocr_models: tuple[Path, bytes], broker) -> None:  # type: ignore[no-untyped-def]
    """Over MQTT, ~400 KB pages: the bridge refuses on arrival (paho's thread, before decoding) what the model's
    queue cannot answer in time, so answers keep coming and refusals come back before the deadline."""
    models, payload = ocr_models
    url = f"{broker.url}/ocrdet"
    deadline_s = MQTT_DEADLINE_S
    with Server(models, "--metrics", "127.0.0.1:0", "--mqtt", broker.url) as server:
        mqtt_closed_loop(url, payload, callers=1, seconds=0.5, deadline_s=deadline_s)  # warm up
        alone = mqtt_closed_loop(url, payload, callers=1, seconds=2.0, deadline_s=deadline_s)
        if alone.in_time < 5:  # a host so loaded that a lone page takes most of its deadline: measure longer
            alone = mqtt_closed_loop(url, payload, callers=1, seconds=6.0, deadline_s=deadline_s)
        # batching serves a crowd about three times a lone caller's rate (70/s against 25/s in one run): callers for
        # twice the lone rate were once not past capacity (9 % refused), so the crowd is sized for four times it, at
        # most 32 paho clients; where a fast host answered those nearly all in time (204/s in time, 34 refused, at a
        # lone rate of 104/s on an AVX-512 EPYC), the crowd was not past capacity, and it runs again twice as large
        first = min(32, max(8, math.ceil(4 * deadline_s * alone.goodput)))
        for callers in (first, 2 * first):
            before = _scrape(server.metrics)
            with HostStall() as stall:  # what other runs loading the cores cost every thread here
                crowd = mqtt_closed_loop(url, payload, callers=callers, seconds=4.0, deadline_s=deadline_s)
            served = _ServerSide.between(before, _scrape(server.metrics))
            if crowd.refused >= 0.1 * crowd.in_time or crowd.expired + crowd.late > crowd.refused:
                break  # past capacity, or expiring rather than refused: judged below
        after = mqtt_closed_loop(url, payload, callers=1, seconds=2.0, deadline_s=deadline_s)
        with urllib.request.urlopen(f"http://{server.metrics}/metrics", timeout=10) as reply:
            metrics = reply.read().decode()
    # Timing bounds add the host's measured scheduling delay (p90 of a 5 ms sleeper's lateness during the crowd):
    # ~0 on a quiet host, where the bounds are the stated ones. Measured in 8 runs with two busy loops beside
    # other test runs (load average 15-23 on 2 cores): stall p90 10-50 ms (p99 23-204 ms); lone rate 1.5-9/s;
    # crowd refusal p50 12-129 ms; server: 0.94-1.00 of refusals within (10 ms + stall). 7 passed; one failed
    # before the crowd, its lone phase answering 3 pages in 2 s (now measured longer). Without the stall
    # term, 1 of 4 such runs failed on time (0.72 of refusals within 100 ms); another on expiries (11 against 7
    # answered, at a lone rate of 3/s), which the stall does not excuse and this test still checks.
    slack = stall.p(90)
    summary = (f"alone {alone.goodput:.1f}/s, after {after.goodput:.1f}/s; {callers} callers {crowd.goodput:.1f}/s "
               f"in time, {crowd.refused} refused (p50 {crowd.refusal_p(50):.1f} ms, "
               f"p90 {crowd.refusal_p(90):.1f} ms), "
               f"{crowd.expired} past deadline, {crowd.late} late, other {crowd.other}; server: "
               f"{_refused_within(metrics, 'mqtt', 0.01 + slack):.2f} of refusals within 10 ms + stall, "
               f"{_refused_within(metrics, 'mqtt', 0.1 + slack):.2f} within 100 ms + stall, "
               f"{_refused_within(metrics, 'mqtt', 0.2):.2f} within 200 ms (on arrival: "
               f"{_refused_within(metrics, 'mqtt', 0.1 + slack, stage='admission'):.2f} within 100 ms + stall; "
               f"queued: {_refused_within(metrics, 'mqtt', 0.1 + slack, stage='queued'):.2f}); host stall p50/p90/p99 "
               f"{stall.p(50) * 1000:.1f}/{slack * 1000:.1f}/{stall.p(99) * 1000:.1f} ms; in the crowd the server "
               f"{served}")
    print(summary)
    if alone.in_time < 5:
        pytest.skip(f"this host is too loaded to measure overload: a lone caller got {alone.in_time} answers in "
                    f"time in {alone.seconds:g} s ({summary})")
    # against a lone caller before and after the crowd (the smaller: other runs loading the host move both; the
    # collapse left the server answering a lone caller at once). One run at a load average of 21 with the lone
    # rate 2.2/s before measured 0.5/s in the crowd against the lone rate alone.
    assert crowd.goodput >= 0.3 * min(alone.goodput, after.goodput), summary
    assert crowd.refused >= 0.1 * crowd.in_time, summary
    assert crowd.expired + crowd.late <= crowd.in_time + crowd.refused // 4, summary
    # well before the deadline, through a broker: 0.75 of it plus the host's stall, never above 0.9 of it (the collapse
    # refuses at the whole deadline). The callers' side adds 32 paho clients in one process that the stall's sleeper
    # does not see: p50 up to 209 ms at a stall p90 of 11 ms in 15 runs (load average 15-23 and quiet), while the
    # server refused 0.86 of them within 10 ms + stall
    assert crowd.refusal_p(50) <= min(0.75 * deadline_s + slack, 0.9 * deadline_s) * 1000, summary
    # from paho's thread to the refusal's publish: most at once (refused on arrival, before decoding; 0.55-0.94 of all
    # refusals in those 15 runs); the rest were admitted and refused once queued
    assert _refused_within(metrics, "mqtt", 0.01 + slack) >= 0.4, summary
    # refused on arrival: at most 5 % or two slower than 100 ms (plus the host's stall); every one was, in 4 runs
    arrival = metric_value(metrics, "tierkit_refusal_seconds_count", model="ocrdet", protocol="mqtt", stage="admission")
    late_on_arrival = 1 - _refused_within(metrics, "mqtt", 0.1 + slack, stage="admission")
    assert late_on_arrival * arrival <= max(2.0, 0.05 * arrival), summary
    # refused once queued (a run ahead took longer than planned): such a request waited for its turn, so some take
    # most of the deadline (5-16 % of all refusals took over 200 ms in 7 runs at 16-32 callers, every one of them
    # queued); the collapse refuses nearly all at the whole deadline: at most a quarter (or two) past 2/3 of it
    count = metric_value(metrics, "tierkit_refusal_seconds_count", model="ocrdet", protocol="mqtt")
    assert (1 - _refused_within(metrics, "mqtt", 2 / 3 * deadline_s)) * count <= max(2.0, 0.25 * count), summary
    refused = metric_value(metrics, "tierkit_requests_refused_total", model="ocrdet")
    assert refused > 0, summary


def test_serve_refuses_a_models_directory_with_nothing_to_serve(tmp_path: Path) -> None:
    import subprocess
    import sys

    missing = tmp_path / "nonexistent"
    wrong = tmp_path / "wrong"
    wrong.mkdir()
    (wrong / "notes.txt").write_text("not a package")
    (wrong / "model").mkdir()  # no manifest.json
    for models, expected in ((missing, "does not exist"), (wrong, "holds nothing servable")):
        done = subprocess.run([sys.executable, "-m", "sdk.cli", "serve", "--models", str(models), "--grpc",
                               "127.0.0.1:0"], check=False, capture_output=True, text=True, timeout=60)
        assert done.returncode == 1, done
        for part in (str(models), expected, "manifest.json", "variants.json"):
            assert part in done.stderr, done.stderr
        assert "ready" not in done.stdout
