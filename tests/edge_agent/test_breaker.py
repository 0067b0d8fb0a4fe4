"""Circuit breaker state machine, driven by a fake clock."""

from __future__ import annotations

import pytest

from edge_agent.breaker import BreakerConfig, CircuitBreaker
from runtimes.errors import ConfigError
from testkit.clock import ManualClock


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


def test_opens_after_n_consecutive_failures(clock: ManualClock) -> None:
    breaker = CircuitBreaker(BreakerConfig(failure_threshold=3, reset_timeout_s=2.0), clock=clock)
    for _ in range(2):
        assert breaker.allow()
        breaker.record_failure()
    assert breaker.state == "closed"
    breaker.record_success()  # resets the count: failures must be consecutive
    for _ in range(2):
        breaker.record_failure()
    assert breaker.state == "closed"
    breaker.record_failure()
    assert breaker.state == "open"
    assert not breaker.allow()
    assert breaker.retry_after_s() == pytest.approx(2.0)
    assert breaker.times_opened == 1


def test_half_open_probe_success_closes(clock: ManualClock) -> None:
    breaker = CircuitBreaker(BreakerConfig(failure_threshold=1, reset_timeout_s=2.0), clock=clock)
    breaker.record_failure()
    clock.now += 1.9
    assert not breaker.allow()
    clock.now += 0.1
    assert breaker.state == "half_open"
    assert breaker.allow()        # the probe
    assert not breaker.allow()    # only one probe at a time
    breaker.record_success()
    assert breaker.state == "closed"
    assert breaker.allow()
    assert breaker.consecutive_failures == 0


def test_half_open_probe_failure_reopens_for_a_full_timeout(clock: ManualClock) -> None:
    breaker = CircuitBreaker(BreakerConfig(failure_threshold=2, reset_timeout_s=1.0), clock=clock)
    breaker.record_failure()
    breaker.record_failure()
    clock.now += 1.0
    assert breaker.allow()
    breaker.record_failure()
    assert breaker.state == "open"
    clock.now += 0.99
    assert not breaker.allow()
    clock.now += 0.01
    assert breaker.allow()
    assert breaker.times_opened == 2


def test_half_open_allows_configured_number_of_probes(clock: ManualClock) -> None:
    breaker = CircuitBreaker(BreakerConfig(failure_threshold=1, reset_timeout_s=1.0, half_open_max_calls=3),
                             clock=clock)
    breaker.record_failure()
    clock.now += 1.0
    assert [breaker.allow() for _ in range(4)] == [True, True, True, False]


def test_lost_probe_does_not_wedge_half_open(clock: ManualClock) -> None:
    breaker = CircuitBreaker(BreakerConfig(failure_threshold=1, reset_timeout_s=1.0), clock=clock)
    breaker.record_failure()
    clock.now += 1.0
    assert breaker.allow()        # this probe's caller is cancelled and never reports
    assert not breaker.allow()
    clock.now += 1.0
    assert breaker.allow()


def test_late_outcomes_while_open_change_nothing(clock: ManualClock) -> None:
    breaker = CircuitBreaker(BreakerConfig(failure_threshold=1, reset_timeout_s=1.0), clock=clock)
    breaker.record_failure()
    clock.now += 0.5
    breaker.record_failure()      # a call sent before the breaker opened
    breaker.record_success()
    assert breaker.state == "open"
    clock.now += 0.5
    assert breaker.state == "half_open"


@pytest.mark.parametrize("kwargs", [{"failure_threshold": 0}, {"reset_timeout_s": 0.0},
                                    {"reset_timeout_s": float("nan")}, {"half_open_max_calls": 0}])
def test_bad_config_is_rejected(kwargs: dict[str, float]) -> None:
    with pytest.raises(ConfigError):
        BreakerConfig(**kwargs)  # type: ignore[arg-type]


def test_deadline_timeouts_open_it_only_when_they_persist(clock: ManualClock) -> None:
    breaker = CircuitBreaker(BreakerConfig(failure_threshold=3, timeout_threshold=8), clock=clock)
    for _ in range(7):  # a jittered link under a tight budget: misses in a row, but not a dead cloud
        breaker.record_failure(timeout=True)
    assert breaker.state == "closed"
    breaker.record_failure(timeout=True)  # the 8th in a row: a partition
    assert breaker.state == "open"
    mixed = CircuitBreaker(BreakerConfig(failure_threshold=3, timeout_threshold=8), clock=clock)
    for timeout in (False, True, False, False):  # a timeout between refusals breaks their run...
        mixed.record_failure(timeout=timeout)
    assert mixed.state == "closed"
    mixed.record_failure()  # ...and three refusals in a row open it as before
    assert mixed.state == "open"
    # a threshold below failure_threshold does not make timeouts open it sooner than refusals
    low = CircuitBreaker(BreakerConfig(failure_threshold=5, timeout_threshold=2), clock=clock)
    for _ in range(4):
        low.record_failure(timeout=True)
    assert low.state == "closed"
    with pytest.raises(ConfigError, match="timeout_threshold"):
        BreakerConfig(timeout_threshold=0)
    with pytest.raises(ConfigError, match="timeout_odds"):
        BreakerConfig(timeout_odds=1.0)


def test_a_run_of_timeouts_is_judged_against_the_links_usual_misses(clock: ManualClock) -> None:
    jittered = CircuitBreaker(BreakerConfig(failure_threshold=3), clock=clock)
    for i in range(200):  # a jittered link under a tight budget: one call in four answered in time
        if i % 4 == 3:
            jittered.record_success()
        else:
            jittered.record_failure(timeout=True)
    for _ in range(25):  # 25 misses in a row come by chance on such a link about once in 1,300 calls
        jittered.record_failure(timeout=True)
    assert jittered.state == "closed"
    for _ in range(15):  # 40 in a row (odds 1e-5): a partition
        jittered.record_failure(timeout=True)
    assert jittered.state == "open"
    healthy = CircuitBreaker(BreakerConfig(failure_threshold=3), clock=clock)
    for _ in range(200):
        healthy.record_success()
    for _ in range(19):  # a burst of load makes several late
        healthy.record_failure(timeout=True)
    assert healthy.state == "closed"
    healthy.record_failure(timeout=True)  # the 20th: where nearly everything was answered, news
    assert healthy.state == "open"
