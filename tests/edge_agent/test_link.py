"""The one link model: time-decayed round trips, up/down with hysteresis, slow and fast events, busy refusals."""

from __future__ import annotations

import numpy as np
import pytest

from edge_agent.breaker import BreakerConfig, CircuitBreaker
from edge_agent.encoding import WireEncoder
from edge_agent.link import Link
from edge_agent.profiles import LinkProfile


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_slow_spell_ages_out_even_when_nothing_is_sent() -> None:
    clock = Clock()
    link = Link(rtt_ms=2.0, horizon_s=5.0, clock=clock)
    for _ in range(50):
        link.observe_answer(60.0)
        clock.now += 0.02
    assert link.quantile(0.5) >= 60.0
    assert link.view().rtt_high_ms == 60.0
    clock.now += 5.1  # nothing sent for a horizon: the prior (2 ms) is what the link is taken to be again
    view = link.view()
    assert view.recent == 0
    assert view.rtt_p50_ms == pytest.approx(2.0, rel=0.05)
    assert view.rtt_ms == pytest.approx(2.0, rel=0.05)
    assert link.quantile(0.9) < 3.0


def test_an_unusual_run_of_timeouts_is_slower_and_the_next_answer_faster() -> None:
    clock = Clock()
    link = Link(rtt_ms=2.0, clock=clock)
    for _ in range(100):
        link.observe_answer(2.0)
    epoch = link.epoch
    link.observe_timeout(8.0)
    link.observe_timeout(8.0)
    assert link.epoch == epoch  # two in a row on a link that answers: not yet unusual at 1 %
    link.observe_timeout(8.0)
    assert (link.epoch, link.event, link.slow) == (epoch + 1, "slower", True)
    assert int(np.isinf(link.view().rtt_samples).sum()) == 3  # the run joins the window of round trips
    link.observe_answer(2.5)  # answered again: "faster"; a run this short stays in the record, as what the link did
    assert (link.epoch, link.event, link.slow) == (epoch + 2, "faster", False)
    view = link.view()
    assert int(np.isinf(view.rtt_samples).sum()) == 3
    assert view.recent == 104
    assert view.rtt_high_ms < 4.0
    assert link.up


def test_a_run_of_timeouts_that_was_news_is_forgotten_when_the_link_answers_again() -> None:
    """A stall (20 timeouts in a row on a link that answers, 1e-4 by chance) describes the link no more once
    it answers again: its timeouts leave the record, the answers before it stay."""
    clock = Clock()
    link = Link(rtt_ms=2.0, clock=clock)
    for _ in range(100):
        clock.now += 0.01
        link.observe_answer(2.0)
    for _ in range(20):
        clock.now += 0.01
        link.observe_timeout(8.0)
    assert link.slow
    assert link.up  # not yet down: the run has lasted 0.2 s of the 0.5 s that takes
    clock.now += 0.01
    link.observe_answer(2.5)
    view = link.view()
    assert (link.event, link.slow) == ("faster", False)
    assert not np.isinf(view.rtt_samples).any()
    assert view.recent == 101


def test_on_a_link_that_misses_now_and_then_a_run_moves_the_answered_share_by_itself_only() -> None:
    """One escalation in four misses its deadline; then a run of timeouts unusual for that ("slower") and an
    answer ("faster"). The share answered in time that a plan reads stays near the link's during the run and
    after it (it read 0 during the run and 1 after it while a run replaced the window and its end wiped it).
    The run is not news (1e-4 by chance): it stays in the record."""
    clock = Clock()
    link = Link(rtt_ms=4.0, clock=clock)
    for i in range(80):
        clock.now += 0.01
        if i % 4 == 3:
            link.observe_timeout(5.0)
        else:
            link.observe_answer(4.0)
    epoch = link.epoch
    run = 0
    while link.epoch == epoch and run < 20:
        clock.now += 0.01
        link.observe_timeout(5.0)
        run += 1
    assert (link.event, link.slow) == ("slower", True)
    during = float(np.isfinite(link.view().rtt_samples).mean())
    assert 0.5 < during < 0.75, during  # 60 of 80 answered, then the run's timeouts
    clock.now += 0.01
    link.observe_answer(4.0)
    assert link.event == "faster"
    after = float(np.isfinite(link.view().rtt_samples).mean())
    assert after == pytest.approx(61 / (80 + run + 1), abs=1e-9)  # the run and the answer after it joined


def test_on_a_jittered_link_its_usual_misses_are_no_event() -> None:
    link = Link(rtt_ms=9.0)
    for i in range(400):  # three in four miss the deadline: runs of several are its usual luck
        if i % 4 == 3:
            link.observe_answer(9.0)
        else:
            link.observe_timeout(10.0)
    assert link.epoch == 0
    assert link.up


def test_refusals_mark_it_down_answers_up_and_a_busy_cloud_holds_escalations_back() -> None:
    clock = Clock()
    link = Link(rtt_ms=2.0, clock=clock)
    for _ in range(3):
        link.observe_refusal(0.3)
    assert (link.up, link.event) == (False, "down")
    assert link.view().availability == 0.0
    link.observe_answer(2.0)
    link.observe_answer(2.0)
    assert not link.up  # hysteresis: one or two answers on a flapping link are not the cloud back
    link.observe_answer(2.0)
    assert (link.up, link.event) == (True, "up")
    busy = Link(clock=clock)
    for _ in range(5):
        busy.observe_refusal(0.2, busy=True, retry_after_s=0.5)
    assert busy.up  # a busy cloud is there
    assert busy.hold_until == pytest.approx(clock.now + 0.5)
    assert busy.view().availability < 0.5


def test_the_breaker_profile_and_encoder_read_the_same_link() -> None:
    clock = Clock()
    link = Link(rtt_ms=2.0, clock=clock)
    breaker = CircuitBreaker(BreakerConfig(failure_threshold=2, reset_timeout_s=1.0), clock=clock, link=link)
    profile = LinkProfile(link=link)
    encoder = WireEncoder("auto", meter=link)
    for _ in range(2):  # the agent feeds the link, then tells the breaker
        link.observe_refusal(0.3)
        breaker.record_failure()
    assert breaker.state == "open"
    assert breaker.consecutive_failures == 2
    link.observe_transfer(100, 0.002)
    link.observe_transfer(400_000, 0.002 + 400_000 * 8 / 10e6)
    est = encoder.meter.estimate()
    assert est is not None
    assert est.bandwidth_bps == pytest.approx(10e6, rel=0.01)
    link.observe_answer(2.0)
    assert profile.state().rtt_samples.size >= 1
    assert profile.state().epoch == link.epoch


def test_a_loss_burst_is_slower_not_down_and_a_lasting_partition_is_down() -> None:
    """At 100 escalations a second, a 0.3-s stall is thirty timeouts in a row: news by count, but a burst.
    It used to mark the link down, which took the escalations away at once (the controller's settling
    time covers only "slower"), and brought them back only after three answers."""
    clock = Clock()
    link = Link(rtt_ms=20.0, clock=clock)
    for _ in range(200):
        link.observe_answer(20.0)
        clock.now += 0.01
    for _ in range(30):  # the burst
        link.observe_timeout(36.0)
        clock.now += 0.01
    assert link.slow
    assert link.up
    assert link.event == "slower"
    link.observe_answer(21.0)
    assert link.event == "faster"
    for _ in range(50):  # a partition: timeouts for half a second
        link.observe_timeout(36.0)
        clock.now += 0.01
    assert link.up
    link.observe_timeout(36.0)
    assert (link.up, link.event) == (False, "down")


def test_one_late_timer_does_not_set_the_margin_a_steady_lateness_does_and_it_ages_out() -> None:
    """The agent's timer margin is a quantile of recent latenesses: one stall of a loaded host (22 ms) among
    few samples is not the margin (it used to be, for ten seconds, cutting every deadline below the round
    trip on a tight budget); latenesses that recur are; all of them age out."""
    clock = Clock()
    link = Link(rtt_ms=2.0, timer_lateness_ms=1.0, clock=clock)
    for late in (0.5, 22.0, 0.8, 0.6, 1.2):
        link.observe_lateness(late)
    assert link.margin_ms() <= 1.2
    for _ in range(12):
        link.observe_lateness(9.0)
    assert link.margin_ms() == pytest.approx(9.0)
    clock.now += 11.0
    assert link.margin_ms() == pytest.approx(1.0)  # forgotten: the prior again


def test_a_cold_first_answer_does_not_hold_the_escalations_back() -> None:
    """A fresh connection's first call pays its setup (80 ms against a 4 ms link). Alone in the record
    it was every quantile the skip rule reads, so escalations waited for a probe; now the skip rule
    reads the prior until the next answer, which drops the cold one from the record. A link that is
    slow from its first answer on keeps it, and after a silence of a horizon the next first answer is
    judged so again."""
    clock = Clock()
    link = Link(rtt_ms=5.0, clock=clock)
    link.observe_answer(80.0)
    assert link.quantile(0.95) < 10.0  # the prior's: the next escalation is sent
    clock.now += 0.01
    link.observe_answer(4.0)
    view = link.view()
    assert 80.0 not in view.rtt_samples
    assert view.rtt_ms == 4.0
    assert link.quantile(0.95) == 4.0
    assert link.epoch == 0  # no "slower" for the cold one, no "faster" after it
    assert link.up
    clock.now += 5.1  # nothing sent for a horizon: the connection may be cold again
    link.observe_answer(70.0)
    assert link.quantile(0.5) < 10.0
    clock.now += 0.01
    link.observe_answer(60.0)  # slow from the first answer on: both describe the link
    assert link.quantile(0.5) >= 60.0
    assert link.view().recent == 2
    assert link.event == "slower"  # judged at the second answer, with both


def test_messages_as_fast_as_the_base_bound_the_bandwidth_and_an_outage_keeps_it() -> None:
    """A 20 ms, 10 Mbit/s link on a jittery host: requests of ~1 KB (zstd) and ~3.6 KB (fp32). Two of the
    last three large ones came back as fast as the fastest small one: the median of per-message ratios read
    that as 29 Gbit/s, so fp32's extra bytes looked free. Here each such message only bounds the bandwidth
    (its extra bytes over 0.1 ms), and a message barely larger than the base counts for nothing. After an
    outage longer than the transfers' memory the last estimate stands, what the link was last seen to carry."""
    from edge_agent.link import Bandwidth

    clock = Clock()
    meter = Bandwidth(clock=clock)
    meter.observe(1000, 0.020 + 1000 * 8 / 10e6)  # the fastest small one: 20.8 ms
    meter.observe(2100, 0.0205)  # barely larger, and as fast by jitter: no evidence of the bandwidth
    for elapsed in (0.0229, 0.0208, 0.0207):  # fp32: 20 ms + 2.9 ms, then two as fast as the base by jitter
        meter.observe(3600, elapsed)
    est = meter.estimate()
    assert est is not None
    assert est.bandwidth_bps <= 2600 * 8 / 1e-4 * 1.01  # 208 Mbit/s at most, not 29 Gbit/s
    meter.observe(3600, 0.0235)
    meter.observe(3600, 0.0231)
    est = meter.estimate()
    assert est is not None
    assert 5e6 <= est.bandwidth_bps <= 15e6
    assert est.rtt_s == pytest.approx(0.020, abs=0.001)
    clock.now += 40.0  # an outage: nothing timed for longer than `max_age_s`
    assert meter.estimate() == est


def test_after_the_jitter_grows_the_share_a_plan_reads_is_the_links_once_the_horizon_passed() -> None:
    """From answering every escalation in time to about 40 %: 32 escalations a second, 10 s before, 6 s after
    (past the 5-s horizon). The share answered in time a plan reads is the link's within 0.08. While every run
    of timeouts unusual at 1 % was dropped at the next answer, on such a link its usual luck, the share read
    stayed high long after the horizon: 0.57 on this one where 0.43 were answered (0.51 six seconds after a fall to
    0.38, averaged over 20 simulated links)."""
    clock = Clock()
    link = Link(rtt_ms=5.0, clock=clock)
    rng = np.random.default_rng(3)
    after = []
    for i in range(512):
        clock.now = i / 32
        answered = rng.random() < (1.0 if i < 320 else 0.4)
        after += [answered] if i >= 320 else []
        if answered:
            link.observe_answer(float(rng.uniform(5.0, 9.0)))
        else:
            link.observe_timeout(10.5)
    read = float(np.isfinite(link.view().rtt_samples).mean())
    assert read == pytest.approx(float(np.mean(after[-160:])), abs=0.08)


@pytest.mark.parametrize("probe", [False, True])
def test_a_link_that_answers_now_and_then_is_read_as_such_when_it_comes_up_again(probe: bool) -> None:
    """A link that answers one escalation in twenty-five in time: a long run of timeouts marks it down, and the
    answers among the timeouts that follow mark it up again. The share answered in time a plan reads when it
    comes up is that of the outcomes since the first of those answers, not that of the answers alone: keeping
    only them read 1.0, and the controller escalated as on a link back in full until timeouts refilled the record.
    So also where the answers are probes' (sent although the view said they would not fit), whose answer in
    time wipes the record of a link that is up."""
    clock = Clock()
    link = Link(rtt_ms=5.0, clock=clock)
    rng = np.random.default_rng(5)
    for _ in range(100):  # in time at first
        link.observe_answer(5.0)
        clock.now += 0.01
    for _ in range(100):  # then nothing answers for a second: a partition
        link.observe_timeout(10.0)
        clock.now += 0.01
    assert not link.up
    outcomes: list[bool] = []
    while not link.up and len(outcomes) < 1000:
        clock.now += 0.02
        outcomes.append(bool(rng.random() < 0.04))
        if outcomes[-1]:
            link.observe_answer(4.0, probe=probe)
        else:
            link.observe_timeout(10.0)
    assert link.up, "three answers with no refusal between them mark the link up"
    since = outcomes[outcomes.index(True):]
    assert len(since) > 10  # the draw has timeouts between the answers (else the test proves nothing)
    read = float(np.isfinite(link.view().rtt_samples).mean())
    assert read == pytest.approx(3 / len(since))
