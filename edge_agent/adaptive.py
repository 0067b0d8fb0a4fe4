"""The controller an agent builds for itself: `EdgeAgent(..., controller=True)`, `sdk.load(..., controller=True)`.

Everything comes from what the agent already holds, with no session opened twice:

- one `VariantProfile` per variant: the package's validation outputs scored by the agent's own
  bound policy (the scores it compares with the threshold), latency from a short self-benchmark on
  the agent's open session, energy modeled from the agent's power profile until measurements come;
- a `LinkProfile` when a cloud is configured: waiting power (`idle_watts`) and radio energy per byte
  (`joules_per_byte_sent`) from the same power profile and under its label, and the operator's
  priors on the round trip and on the cloud's accuracy (`AdaptiveOptions`);
- the agent's budget (later changes reach the controller through `EdgeAgent.set_budget`).

Example:
    >>> opts = AgentOptions(adaptive=AdaptiveOptions(cloud_accuracy=0.995))
    >>> with sdk.load("variants/", cloud="grpc://127.0.0.1:8001/cnn", budget=sdk.Budget(latency_ms=20),
    ...               controller=True, options=opts) as model:
    ...     model.decision.variant, model.decision.threshold, model.decision.reason
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

from edge_agent.budget import Budget
from edge_agent.controller import Controller, ControllerConfig
from edge_agent.link import Link
from edge_agent.profiles import DEFAULT_CLOUD_ACCURACY, DEFAULT_RTT_MS, LinkProfile, VariantProfile
from edge_agent.variants import Variant, zero_feed
from runtimes.energy import PowerProfile
from runtimes.errors import ConfigError

__all__ = ["AdaptiveOptions", "build_controller", "link_profile", "variant_profile"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AdaptiveOptions:
    """How an agent builds its own controller.

    Args:
        cloud_accuracy: prior accuracy of the cloud on the inputs escalated to it (e.g. the cloud
            model's validation accuracy); edge/cloud agreement refines it.
        cloud_accuracy_weight: how many escalations' agreement the prior counts as. Agreement alone
            cannot tell a cloud error from an edge error, so a weak prior gets the blame when the edge
            errs more live than on validation (a 0.998 cloud read as 0.97-0.98 with 30), and the
            controller then stops escalating where it would pay. A prior measured on labelled data
            (the compiler's validation accuracy over n samples) deserves a weight of that order.
        rtt_ms: prior median round trip to the cloud, until escalations measure it.
        benchmark_repeats: timed batch-1 inferences per variant when the agent starts.
        side_run_every: one request in this many, the agent also times one variant it is not serving with,
            round robin (`edge_agent.side_runs`): the controller then prices each variant at the load of now,
            not by the serving one's slowdown. 0: never.
        config: the controller's grid, headroom and hysteresis (None: `ControllerConfig()`).
    """

    cloud_accuracy: float = DEFAULT_CLOUD_ACCURACY
    cloud_accuracy_weight: float = 30.0
    rtt_ms: float = DEFAULT_RTT_MS
    benchmark_repeats: int = 20
    side_run_every: int = 50
    config: ControllerConfig | None = None

    def __post_init__(self) -> None:
        if not (0 < self.cloud_accuracy <= 1 and self.rtt_ms > 0 and self.benchmark_repeats >= 1
                and self.cloud_accuracy_weight >= 0):
            msg = (f"AdaptiveOptions: need 0 < cloud_accuracy <= 1, cloud_accuracy_weight >= 0, rtt_ms > 0 and "
                   f"benchmark_repeats >= 1; got {self.cloud_accuracy!r}, {self.cloud_accuracy_weight!r}, "
                   f"{self.rtt_ms!r}, {self.benchmark_repeats!r}")
            raise ConfigError(msg)
        if not (isinstance(self.side_run_every, int) and self.side_run_every >= 0):
            msg = f"AdaptiveOptions.side_run_every must be an integer >= 0 (0: none), got {self.side_run_every!r}"
            raise ConfigError(msg)


def variant_profile(variant: Variant, power: PowerProfile, *, repeats: int = 20) -> VariantProfile:
    """The profile of one open variant, benchmarked on its own session.

    Raises:
        PackageError: the package has no validation outputs to build the escalation curve from.
    """
    profile = VariantProfile.from_package(variant.package, variant.policy, variant_id=variant.id,
                                          energy_mj=power.busy_watts * variant.p50_ms, energy_label=power.label)
    session, feed = variant.session, zero_feed(variant.session)
    # the session was warmed when the agent opened it: every run here is timed
    profile.self_benchmark(lambda: session.run(feed), repeats=repeats, warmup=0)
    # modeled as the agent models it (power x time), on the time measured here rather than the manifest's
    profile.energy_mj = power.busy_watts * profile.baseline_p50_ms
    return profile


def link_profile(power: PowerProfile, options: AdaptiveOptions, link: Link | None = None) -> LinkProfile:
    """The controller's view of `link` (the agent's): waiting and radio energy from the device's power
    profile, priors from `options`."""
    return LinkProfile(rtt_ms=options.rtt_ms, cloud_accuracy=options.cloud_accuracy,
                       cloud_prior_strength=options.cloud_accuracy_weight, wait_power_w=power.idle_watts,
                       energy_per_byte_mj=power.joules_per_byte_sent * 1e3, energy_label=power.label, link=link)


def build_controller(variants: Mapping[str, Variant], budget: Budget, *, power: PowerProfile, cloud: bool,
                     options: AdaptiveOptions | None = None, link: Link | None = None) -> Controller:
    """A controller over the agent's open variants.

    Args:
        variants: the agent's variants by id, cheapest first.
        budget: the budgets to keep.
        power: the device power profile the agent models energy with.
        cloud: whether a cloud is configured (without one, only "never escalate" is considered).
        options: priors and benchmark length (default: `AdaptiveOptions()`).
        link: the agent's link, which the controller then reads (default: a new one).

    Raises:
        PackageError: a variant's package has no validation outputs.
    """
    options = options or AdaptiveOptions()
    profiles = [variant_profile(v, power, repeats=options.benchmark_repeats) for v in variants.values()]
    controller = Controller(profiles, budget, link=link_profile(power, options, link) if cloud else None,
                            config=options.config)
    d = controller.current
    logger.info("controller: %s@%.4g (%s)", d.variant, d.threshold, d.reason)
    return controller
