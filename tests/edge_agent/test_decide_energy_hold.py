"""The energy budget's hysteresis in the rule (`decide.switch_reason`'s `energy_se`): the current point
stands while its energy estimate is within the band its own noise makes, and moves once it leaves it.

Before, a point was judged by the estimate of the moment against a fixed 5 % tolerance: a spell of
round-trip spikes put it 6 % over and it moved down, and the next spell under it moved it back up (the
bench's energy phase settled after 307 and 627 requests; `test_controller_settle` has the stream)."""

from __future__ import annotations

from edge_agent.decide import ControllerConfig, Decision, switch_reason

TARGET = 2.0  # mJ, the energy target both points were judged against


def point(threshold: float, energy_mj: float, accuracy: float, *, target: float = TARGET) -> Decision:
    over = energy_mj > target
    return Decision("lr", threshold, accuracy, 10.0, energy_mj, threshold / 2, not over, ("energy",) if over else (),
                    "test", inputs={"energy_target_mj": target, "latency_target_ms": 50.0},
                    shortfall=(energy_mj - target) / target if over else 0.0, binding="energy")


def test_a_point_over_the_target_within_two_standard_errors_of_its_estimate_stands() -> None:
    cur, cand = point(0.9, 1.07 * TARGET, 0.990), point(0.8, 0.97 * TARGET, 0.988)
    assert switch_reason(cur, cand, ControllerConfig()) == "current point violates the energy budget"
    assert switch_reason(cur, cand, ControllerConfig(), energy_se=0.04) == ""  # 7 % over, 2 x 4 % allowed
    assert switch_reason(cur, cand, ControllerConfig(), energy_se=0.03) == "current point violates the energy budget"


def test_a_point_under_the_target_by_noise_is_not_moved_up_and_one_clearly_under_is() -> None:
    config = ControllerConfig()
    cand = point(0.95, 0.98 * TARGET, 0.994)
    near = point(0.9, 0.90 * TARGET, 0.990)  # 10 % under: within 3 x 4 % of the estimate's noise
    assert switch_reason(near, cand, config).startswith("accuracy")  # the old rule follows the noise up
    assert switch_reason(near, cand, config, energy_se=0.04) == ""
    far = point(0.85, 0.80 * TARGET, 0.9935)  # 20 % under: the budget left unspent, more accurate at all
    assert switch_reason(far, cand, config, energy_se=0.04).startswith("the energy budget left unspent")
    assert switch_reason(far, cand, config) == ""  # the old rule: within the accuracy margin, the budget unspent
