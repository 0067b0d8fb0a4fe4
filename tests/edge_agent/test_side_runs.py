"""The variants an agent is not serving with are timed now and then, so the controller prices them as they run.

Before, a variant not serving was priced by its benchmark at start times the serving variant's slowdown: on the
bench's energy phase the onnxruntime fp32 variant was priced at 10 % under the OpenVINO int8 one it was 30 % under,
and the budget's re-decision kept the dearer one (`edge_agent.side_runs`).
"""

from __future__ import annotations

import asyncio

import numpy as np

from compilers.variants import VariantSet
from edge_agent.adaptive import AdaptiveOptions
from edge_agent.agent import AgentOptions, EdgeAgent
from edge_agent.budget import Budget
from edge_agent.controller import Controller
from edge_agent.policy import Policy
from testkit import zoo
from testkit.score_stream import Clock, run_twins, twins
from testkit.waiting import until

Span = tuple[float, float, float]


def serve(ladder: VariantSet, x: np.ndarray, every: int) -> tuple[dict[str, int], dict[str, Span], str, int]:
    """120 requests through an edge-only agent with a controller: how many energy figures each variant's profile
    holds, the time its energy stands for at the busy power beside the range of its latency window, the
    serving variant and the side runs made."""
    opts = AgentOptions(adaptive=AdaptiveOptions(side_run_every=every))

    async def main() -> tuple[dict[str, int], dict[str, Span], str, int]:
        async with EdgeAgent(ladder.directory, policy=Policy("max_prob"), controller=True, options=opts,
                             budget=Budget(latency_ms=200)) as agent:
            ctl = agent.controller
            assert isinstance(ctl, Controller)
            for row in x[:120]:  # 100 a second: the housekeeping folds every 0.05 s, a side run or two each
                await agent.infer(row)
                await asyncio.sleep(0.01)
            if every:
                await until("a side run of every variant but the serving one, 8 times",
                            lambda: all(p.energy_observed for p in ctl.profiles), timeout=10)
            else:
                await asyncio.sleep(0.3)  # the housekeeping's folds are done (it wakes every 0.05 s)
            with agent._fold_lock:
                figures = {p.id: len(p._energies) for p in ctl.profiles}
                # the time each energy figure stands for, against the range of its latency window (benchmark, side runs)
                watts = {p.id: (p.energy_mj / agent.options.power.busy_watts, float(p.latency.samples().min()),
                                float(p.latency.samples().max())) for p in ctl.profiles if p.energy_observed}
            side = agent._side
            return figures, watts, ctl.current.variant, side.runs if side is not None else 0

    return asyncio.run(main())


def test_the_variant_not_serving_is_timed_beside_the_traffic(digits_ladder: VariantSet, digits: zoo.Split) -> None:
    figures, watts, serving, runs = serve(digits_ladder, digits.x_test, every=5)
    other = "cnn" if serving == "linear" else "linear"
    assert runs >= 8
    assert figures[other] == runs  # every side run timed the variant not serving, and only it
    assert figures[serving] == 64  # the served requests' own figures fill its window of 64
    # modeled at the device's busy power over the variant's own run time (not seconds, not the serving one's)
    implied_ms, fastest, slowest = watts[other]
    assert fastest <= implied_ms <= slowest


def test_no_side_runs_leaves_the_other_variant_priced_by_its_benchmark(digits_ladder: VariantSet,
                                                                         digits: zoo.Split) -> None:
    figures, _, serving, runs = serve(digits_ladder, digits.x_test, every=0)
    other = "cnn" if serving == "linear" else "linear"
    assert runs == 0
    assert figures[other] == 0


def test_a_budget_set_takes_the_variant_its_side_runs_show_cheaper() -> None:
    """The serving variant runs 5 times its benchmark under load (5 mJ an inference); the other one, benchmarked
    alike, is priced at 5 mJ too by that slowdown, where its side runs show 1.2 mJ. Priced by the slowdown, an
    energy budget keeps the serving one; with the side runs' figures it moves at once."""

    def run(side_figures: int) -> Controller:
        clock = Clock()
        c, _, cool = twins(clock)

        def side_run(i: int) -> None:  # what the agent's side runs hand the profile
            if i % 25 == 0 and i // 25 < side_figures:
                cool.observe_latency(1.2)
                cool.observe_energy(1.2, "modeled:test")

        run_twins(c, clock, edge_ms=5.0, edge_mj=5.0, each=side_run)
        assert c.current.variant == "hot", c.current.reason
        c.set_budget(Budget(latency_ms=60, energy_mj=1.2 * c.current.predicted_energy_mj))
        return c

    assert run(side_figures=0).current.variant == "hot"  # priced alike by the slowdown: nothing to gain
    moved = run(side_figures=10)
    assert moved.current.variant == "cool", moved.current.reason
    assert "as accurate, energy" in moved.current.reason
