"""A move to another variant for accuracy must beat the two variants' own validation error.

Two variants with the same validation stream but for a few inputs the second gets right (2,000 inputs: one
is 0.05 points). Predicted accuracies of two variants come from their validation sets; a difference of a
few hundredths of a point is what sampling alone makes. Before, a move across variants had to beat only the
accuracy margin (0.05 points on a 99.7 % tiered point): on the bench it moved to another variant for a
predicted 0.06-0.07 points, late in a phase, and back.
"""

from __future__ import annotations

import numpy as np

from edge_agent.budget import Budget
from edge_agent.controller import Controller, evaluate
from edge_agent.profiles import LinkProfile, VariantProfile
from testkit.score_stream import Clock, N, profile, run_twins, stream, twins


def better(flips: int) -> VariantProfile:
    """The validation stream of `profile()` with its `flips` most confident wrong answers made right."""
    scores, correct = stream(0, N)
    correct = correct.copy()
    wrong = np.flatnonzero(~correct.astype(bool))
    correct[wrong[np.argsort(scores[wrong])[::-1][:flips]]] = True
    return VariantProfile("lr-b", scores, correct, np.full(16, 1.0), 1.0, "modeled:test")


def reason(flips: int, *, changed: bool = False) -> tuple[str, float]:
    """Why the controller would move from `profile()` to the better variant at the same threshold."""
    clock = Clock()
    a, b = profile(), better(flips)
    lp = LinkProfile(rtt_ms=4.0, cloud_accuracy=0.999, clock=clock)
    c = Controller([a, b], Budget(latency_ms=60), link=lp, clock=clock)
    t = c.current.threshold
    link, cond = lp.state(), c.conditions()
    cur = evaluate(a, t, link, c.budget, c.config, conditions=cond)
    cand = evaluate(b, t, link, c.budget, c.config, conditions=cond)
    return c._switch_reason(cur, cand, changed), cand.predicted_accuracy - cur.predicted_accuracy


def test_a_few_hundredths_of_a_point_from_another_variant_do_not_move_it() -> None:
    why, gain = reason(2)
    assert 0.0005 < gain < 0.0015, gain  # beyond the accuracy margin (0.05 points), within sampling noise
    assert why == "", why


def test_a_clear_gain_from_another_variant_moves_it() -> None:
    why, gain = reason(12)
    assert gain > 0.003, gain  # beyond the most the validation error holds (0.2 points) and the margin
    assert why.startswith("accuracy"), why


def test_after_a_change_the_noise_holds_nothing() -> None:
    """The first decision after a change of the budget or the link is the rule's own choice."""
    why, _ = reason(2, changed=True)
    assert why.startswith("accuracy"), why


def test_a_new_energy_budget_takes_the_cheaper_of_two_as_accurate_variants_at_once() -> None:
    """Two variants alike in accuracy; the one in use costs 1.7 mJ an inference (modeled: under load it runs
    slower), the other 1 mJ. Without an energy budget the controller keeps what it uses (modeled energies
    move no variant: their noise would move it back and forth). Once an energy budget is set, the point chosen
    without one has no claim to stand: the re-decision as it is set takes the cheaper variant. Before, it kept
    the dearer one, under the budget, until its estimate crept over it: on the bench's energy phase, 375
    requests later (int8-ov at 10.8 of 11.5 mJ where fp32-ort was as accurate at 8.6)."""
    clock = Clock()
    c, _, _ = twins(clock)
    assert c.current.variant == "hot"  # as cheap as the other so far: the first of a tie
    run_twins(c, clock, edge_ms=1.0, edge_mj=1.7)
    assert c.current.variant == "hot", c.current.reason  # modeled figures alone moved nothing
    spent = c.current.predicted_energy_mj
    c.set_budget(Budget(latency_ms=60, energy_mj=1.2 * spent))
    assert c.current.variant == "cool", c.current.reason
    assert c.current.predicted_energy_mj < 0.8 * spent
    assert c.current.predicted_accuracy >= c.decisions[-2].predicted_accuracy - 1e-3
