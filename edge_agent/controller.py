"""The controller: which variant to run and which escalation threshold to use, as conditions change.

The decision rule is `edge_agent.decide` (read its docstring): maximize expected accuracy subject to
the latency budget (p95, per 1-s window) and the energy budget (the mean), with hysteresis. This
module feeds that rule with measurements and says when to apply it.

`Controller` learns the device's speed and energy, the live score distribution, the cloud's accuracy
(from edge/cloud agreement) and the budgets' observed windows; the link is the agent's one
`link.Link`, seen through `profiles.LinkProfile`. With a wire encoder that may choose
(`attach_encoder`), it chooses the escalations' encoding together with the variant and threshold
from the encodings the encoder measured, and sets the encoder's `planned` encoding. It re-decides
when one of these drifts or the round trip moves by half (at most every `redecide_gap_s`), at once
when the link goes down or comes up (the link's `epoch`) or a budget changes, and at least every
`redecide_interval_s`. It calibrates the energy plan on every request, with or without an energy
budget: the inference's energy against the model's inference term, and what an escalation added to
its request against what the model charges that escalation (its bytes, its round trip), so that a
budget set later starts calibrated. What a measured difference must exceed to move it (the energy
calibrations and the estimates' noise) is `edge_agent.evidence`.

Thread ownership: one thread owns a controller's state, the one that calls `observe_*`,
`maybe_redecide` and `set_budget` (the agent folds observations in a worker thread under its fold
lock). Others read only `current`, an immutable `Decision` replaced whole, and `deadline_scale()`,
a float published with it.

Example:
    >>> controller = Controller(profiles, Budget(latency_ms=20), link=LinkProfile(rtt_ms=5))
    >>> controller.current.variant, controller.current.threshold
    >>> controller.observe_inference("int8", latency_ms=1.2, energy_mj=0.4)
    >>> controller.observe_request(escalated=False, agreed=None, total_latency_ms=1.9)
    >>> if (decision := controller.maybe_redecide()) is not None:
    ...     apply(decision)
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import replace

import numpy as np

from edge_agent.budget import Budget, BudgetWindows
from edge_agent.decide import (
    ControllerConfig,
    Decision,
    accuracy_margin,
    candidate_thresholds,
    choose,
    encoding_move,
    evaluate,
    probe_floor,
    spare,
    switch_reason,
)
from edge_agent.encoding import WireEncoder, WireOption
from edge_agent.evidence import (
    EnergyParts,
    cloud_noise,
    energy_evidence,
    energy_hold,
    energy_noise,
    gain_stderr,
    measured,
    outside,
    variant_stderr,
)
from edge_agent.plan import Conditions
from edge_agent.profiles import LinkProfile, LinkState, VariantProfile
from runtimes.errors import ConfigError

__all__ = ["Conditions", "Controller", "ControllerConfig", "Decision", "accuracy_margin", "candidate_thresholds",
           "choose", "evaluate"]

log = logging.getLogger(__name__)

# pending reasons that are a change of the budget or the link (`_link_event`'s events, "link settled")
_CHANGES = ("budget", "cloud ", "round trip ", "link ")
KEEP_ESCALATIONS = 0.01  # a move escalating at most this share less keeps the escalations (one grid step)
_EVENTS = {"down": "cloud down", "up": "cloud up", "faster": "round trip faster", "slower": "round trip slower"}


class Controller:
    """Keeps the most accurate (variant, threshold) inside the budgets as measurements arrive.

    Args:
        profiles: one profile per variant of the ladder.
        budget: the budgets to keep; change them with `set_budget`.
        link: the link to the cloud, or None for an edge-only device.
        config: the rule's headroom, hysteresis and drift checks.
        clock: monotonic seconds (injectable for tests).
        deadline_margin_ms: set by an agent whose own timer ends every escalation this long (plus the
            link's measured timer lateness) before the budget: the plan prices escalations so.

    Example:
        >>> c = Controller(profiles, Budget(latency_ms=20), link=LinkProfile(rtt_ms=5))
        >>> c.observe_escalation(rtt_ms=61.0, ok=True, bytes_sent=300)
        >>> c.maybe_redecide()      # a Decision when the operating point changed, else None
    """

    def __init__(self, profiles: Sequence[VariantProfile], budget: Budget, *, link: LinkProfile | None = None,
                 config: ControllerConfig | None = None, clock: Callable[[], float] = time.monotonic,
                 deadline_margin_ms: float | None = None) -> None:
        self.profiles = tuple(profiles)
        self._by_id = {p.id: p for p in self.profiles}
        if not self.profiles or len(self._by_id) != len(self.profiles):
            msg = f"Controller needs at least one profile and unique variant ids, got {[p.id for p in profiles]}"
            raise ConfigError(msg)
        self.config = config or ControllerConfig()
        self.budget, self.link, self._clock = budget, link, clock
        self.deadline_margin_ms = deadline_margin_ms
        self.decisions: deque[Decision] = deque(maxlen=self.config.history)
        self._pending: dict[str, None] = {}
        self._ratios: deque[float] = deque(maxlen=32)
        self._overheads: deque[float] = deque(maxlen=64)
        self._arrivals: deque[float] = deque(maxlen=256)
        # observed over modeled energy of an inference and of what an escalation adds, fed on every request
        # with or without an energy budget: they scale the plan's two terms (`plan.Conditions`)
        self._energy = EnergyParts()
        self._last_inference_ms: float | None = None
        self._redecided_at, self.redecisions = -math.inf, 0
        self._new_budget = False  # the re-decision under way follows a change of the budget
        self._epoch = link.link.epoch if link is not None else 0
        self._epoch_at = -math.inf  # when the link last changed state
        self._settle_at = math.inf  # then: when to re-decide once it has settled
        self._excused_until = -math.inf  # windows closing before this do not tighten the latency target
        self._cut: tuple[float, float] | None = None  # the last tightening: when, and the scale before it
        self.latency_windows = BudgetWindows("p95", window_s=self.config.window_s, calm=20)
        self._deadline_scale = 1.0
        self.encoder: WireEncoder | None = None
        self._wires: tuple[WireOption, ...] = ()
        self._audit_rate: Callable[[], float] = lambda: 0.0
        self._audits_planned = 0.0
        self.current = self._commit(self._choose(), "initial")

    def attach_encoder(self, encoder: WireEncoder | None) -> None:
        """The transport's wire encoder: its measured encodings join the decision, and each decision's
        encoding becomes its `planned` one (the agent attaches its transport's)."""
        self.encoder = encoder
        self._flag("wire encodings")

    def attach_audits(self, rate: Callable[[], float]) -> None:
        """The audit share in force (the agent's `Auditor.rate`, raised during drift or a rollout's
        wave): audits count against the escalation cap and the energy budget in every plan."""
        self._audit_rate = rate
        if len(self.decisions) == 1 and self.current.trigger == "initial" and self._n == 0:
            self.decisions.clear()  # attached as the agent starts: the first decision plans with them
            self.current = self._commit(self._choose(), "initial")
        # later, a share other than the planned one re-decides (`maybe_redecide`)

    # -- measurements ----------------------------------------------------------------------------
    def observe_inference(self, variant: str, latency_ms: float, energy_mj: float | None = None, *,
                          energy_label: str | None = None) -> None:
        """One edge inference of `variant`: its latency and energy (labelled measured or modeled)."""
        p = self._by_id.get(variant)
        if p is None:
            return
        p.observe_latency(latency_ms)
        if energy_mj is not None and not math.isfinite(energy_mj):
            energy_mj = None
        if energy_mj is not None:
            p.observe_energy(energy_mj, energy_label)
        self._energy.inferred(variant, energy_mj)
        self._last_inference_ms = latency_ms
        if variant != self.current.variant:
            return
        # device speed: this variant's latency against its baseline (the prior or the warm-up benchmark)
        self._ratios.append(latency_ms / max(p.baseline_p50_ms, 1e-9))
        if len(self._ratios) < min(self._ratios.maxlen or 1, self.config.min_observations):
            return
        speed = statistics.median(self._ratios)
        if math.isnan(self._ref["slowdown"]):  # first samples after a switch of variant set the reference
            self._ref["slowdown"] = speed
        elif (abs(speed / self._ref["slowdown"] - 1) > self.config.latency_drift
              and abs(speed - self._ref["slowdown"]) * p.baseline_p50_ms > self.config.latency_drift_abs_ms):
            self._flag("device speed")
            p.latency.rebase(len(self._ratios))
        # a modeled figure is the measured latency times a fixed power: the latency checks cover it,
        # and its noise is no evidence that the energy moved
        if (measured(p.energy_label)
                and abs(p.energy_mj / max(self._ref["energy"], 1e-12) - 1) > self.config.energy_drift):
            self._flag("inference energy")

    def observe_escalation(self, rtt_ms: float | None, ok: bool, bytes_sent: int = 0, *,
                           elapsed_ms: float | None = None, attempted: bool | None = None,
                           timeout: bool = False, fed: bool = False) -> None:
        """One escalation: its round trip (None when it failed or timed out) and request size.

        Args:
            rtt_ms: the round trip of an answered escalation; None for a failure or timeout.
            ok: the cloud answered in time.
            bytes_sent: request size.
            elapsed_ms: how long a failed escalation made the edge wait.
            attempted: False when the agent did not send it (breaker open, no time left, rate cap):
                that says nothing new about the link. By default a failure with no round trip, no
                wait and no bytes counts as not sent.
            timeout: the failure was the deadline passing (a slow link), not the cloud refusing.
            fed: the link was told already (an agent feeds its link as each escalation ends): only
                the request size is taken here.
        """
        self._energy.charged(None)
        if self.link is None:
            return
        if attempted is None:
            attempted = ok or rtt_ms is not None or elapsed_ms is not None or bytes_sent > 0
        if not attempted:
            return
        # the energy model's charge for this very escalation (its bytes, its wait): observed against it, the
        # energy it added calibrates the model's power, not the round trip the plan expects
        waited = rtt_ms if rtt_ms is not None else elapsed_ms
        self._energy.charged(bytes_sent * self.link.energy_per_byte_mj
                             + max(waited or 0.0, 0.0) * self.link.wait_power_w)
        if fed:
            self.link.observe_bytes(bytes_sent)
        else:
            self.link.observe(rtt_ms, ok, bytes_sent, elapsed_ms, timeout=timeout)

    def observe_request(self, escalated: bool, agreed: bool | None, total_latency_ms: float, *,
                        score: float | None = None, variant: str | None = None,
                        energy_mj: float | None = None) -> None:
        """One finished request.

        Args:
            escalated: the policy asked for the cloud (whether or not the cloud answered).
            agreed: on an answered escalation, whether the cloud's answer equals the edge's.
            total_latency_ms: end-to-end latency of the request.
            score: the policy's score of the edge output (lets the escalation curve follow drift).
            variant: the variant that answered (default: the current one). A request of another known
                variant (run before a switch, reported after it) credits its score to that variant
                and is left out of the checks of the current operating point.
            energy_mj: the request's energy (inference, radio, waiting), for the per-window budget.
        """
        now = self._clock()
        self._arrivals.append(now)
        # every request counts for the windows, whichever variant answered: that is what the device spent
        before = self.latency_windows.scale
        if self.latency_windows.add(now, total_latency_ms, self.budget.latency_ms):
            if self.latency_windows.scale < before and now < self._excused_until:
                self.latency_windows.scale = before  # a stall of the link spoiled it, not the plan (see `_link_event`)
            else:
                self._cut = (now, before) if self.latency_windows.scale < before else None
                self._flag("observed p95 over budget" if self.latency_windows.scale < self._deadline_scale
                           else "observed p95 back under budget")
        owner = variant if variant is not None and variant in self._by_id else self.current.variant
        p = self._by_id[self.current.variant]
        # the model's inference term for a running variant is its live median (`plan._inference_mj`)
        if owner != p.id or energy_mj is None or not math.isfinite(energy_mj):
            self._energy.forget()
        elif (self._energy.add(energy_mj, escalated, p.id, p.energy_mj, measured=p.energy_observed)
              and self.budget.energy_mj is not None):
            self._flag("observed energy vs plan")
        if not escalated and self._last_inference_ms is not None:
            self._overheads.append(max(0.0, total_latency_ms - self._last_inference_ms))
        if score is not None:
            self._by_id[owner].observe_score(score)
        if owner != self.current.variant:
            return
        self._n += 1
        self._n_esc += bool(escalated)
        if escalated and agreed is not None and self.link is not None:
            # the edge's validation accuracy at this input's score, where known: what agreement is compared with
            edge = (self._by_id[owner].accuracy_at(score) if score is not None
                    else self.current.edge_accuracy_escalated)
            self.link.observe_agreement(agreed, edge)
            self._n_agree += 1
            self._k_agree += bool(agreed)
        m, z = self.config.min_observations, self.config.escalation_z
        if self._n >= m and outside(self._n_esc, self._n, self.current.predicted_escalation_rate, z):
            self._flag("escalation rate")
        if self._n_agree >= m and outside(self._k_agree, self._n_agree, self._ref["agreement"], z):
            self._flag("agreement")

    # -- decisions -------------------------------------------------------------------------------
    def set_budget(self, budget: Budget) -> Decision | None:
        """Change the budgets now; returns the new decision when the operating point changed."""
        if self.link is not None and budget.latency_ms > self.budget.latency_ms:
            self.link.forget_unanswered()  # cut at the old deadline: no evidence against the new one
        self.budget = budget
        self.latency_windows.reset()  # what windows taught was about the old budget
        self.latency_windows.scale = 1.0
        self._flag("budget")
        return self._redecide()

    def maybe_redecide(self) -> Decision | None:
        """Re-decide if a drift was flagged, the link changed state or the interval passed; the new
        decision if it changed."""
        now = self._clock()
        if self.link is not None and (epoch := self.link.link.epoch) != self._epoch:
            self._epoch = epoch
            self._link_event(now)
        if now >= self._settle_at:  # a move that only saves energy waited for it: make it now, not periodically
            self._settle_at = math.inf
            self._flag("link settled")
        if self.encoder is not None and self.encoder.options() is not self._wires:
            self._flag("wire encodings")
        if abs(self._audit_rate() - self._audits_planned) > 1e-9:  # raised during drift or a rollout's wave
            self._flag("audit rate")
        if self._pending:
            # the cloud going or coming back re-decides at once; a round trip that moved waits the gap like
            # any drift (on a link at the edge of the deadline it moves every few requests, and each
            # re-decision is CPU the agent's timer competes with)
            urgent = any(r.startswith("cloud ") for r in self._pending)
            if not urgent and now - self._redecided_at < self.config.redecide_gap_s:
                return None
        elif self._n == 0 or now - self.current.at < self.config.redecide_interval_s:
            return None
        return self._redecide()

    def _link_event(self, now: float) -> None:
        """The link changed state: re-decide at once. A link that got worse (a run of timeouts, a loss
        burst, an outage, round trips that moved up) is no evidence about the plan, which was made for
        the link before: the 1-s windows the change spoiled (the one that closed within a window
        before, and the one open now) do not tighten the latency target, and a move that only saves
        energy waits `link_settle_s`, so that a burst shorter than that does not take the escalations
        away and give them back (each return costs the time to notice the link again). A link marked
        down is no burst (a run of timeouts that is news, or refusals): that move is made at once."""
        link = self.link.link if self.link is not None else None
        if link is None:
            return
        self._epoch_at = now if link.up else -math.inf
        self._settle_at = now + self.config.link_settle_s if link.up else math.inf
        if not link.up or link.slow or link.event == "slower":
            self._excused_until = now + self.config.window_s
            if self._cut is not None and now - self._cut[0] <= self.config.window_s:
                self.latency_windows.scale = self._cut[1]
            self._cut = None
        self._flag(_EVENTS.get(link.event, f"link {link.event}"))

    def conditions(self) -> Conditions:
        """The measured request rate, agent overhead, device slowdown and audit share in force now."""
        span = self._arrivals[-1] - self._arrivals[0] if len(self._arrivals) > 1 else 0.0
        enough = len(self._arrivals) >= self.config.min_observations
        rate = (len(self._arrivals) - 1) / span if enough and span > 0 else None
        overhead = float(np.mean(self._overheads)) if self._overheads else 0.0
        slowdown = statistics.median(self._ratios) if len(self._ratios) >= 5 else 1.0
        current = getattr(self, "current", None)
        shift = 1.0
        if current is not None and (p := self._by_id[current.variant]).live_scores:
            live = float(p.curve(np.array([-np.inf]))[1][0])  # reweighted accuracy, nothing escalated
            shift = min(max((1 - live) / max(1 - p.accuracy, 1e-6), 0.25), 4.0)
        ref = self._wire(current.encoding if current is not None else "")
        return Conditions(request_rate=rate, edge_overhead_ms=overhead, slowdown=slowdown,
                          current_variant=current.variant if current is not None else None,
                          shift_error_scale=shift, latency_scale=self.latency_windows.scale,
                          deadline_guard_ms=self.deadline_guard_ms(),
                          inference_energy_scale=self._energy.inference.scale,
                          escalation_energy_scale=self._energy.escalation.scale,
                          wire_ref_bytes=None if ref is None else ref.nbytes,
                          wire_ref_encode_ms=0.0 if ref is None else ref.encode_ms,
                          audit_rate=min(max(float(self._audit_rate()), 0.0), 1.0))

    def _wire(self, encoding: str) -> WireOption | None:
        """The option of `encoding` among those measured; unplanned (""), the one the encoder last
        chose per request, else plain fp32; None before any was measured."""
        if not self._wires:
            return None
        if not encoding and self.encoder is not None and self.encoder.last is not None:
            encoding = self.encoder.last.encoding
        by_name = {w.encoding: w for w in self._wires}
        return by_name.get(encoding) or by_name.get("fp32") or self._wires[0]

    def deadline_guard_ms(self) -> float | None:
        """How long before the (scaled) budget the agent's timer ends an escalation, as the agent
        computes it: its margin plus the link's timer lateness, capped at a quarter of the budget."""
        if self.deadline_margin_ms is None:
            return None
        late = self.link.link.margin_ms() if self.link is not None else 0.0
        return self.deadline_margin_ms + min(late, self.budget.latency_ms / 4)

    def deadline_scale(self) -> float:
        """The share of the latency budget the agent's escalation deadline is cut from: below 1 after
        observed windows went over the budget (the plan and the timer tighten together)."""
        return self._deadline_scale

    def _flag(self, reason: str) -> None:
        self._pending.setdefault(reason, None)

    def _choose(self) -> Decision:
        link = self.link.state() if self.link is not None else None
        cond = self.conditions()
        self._audits_planned = cond.audit_rate  # what a decision planned with: another share re-decides
        return choose(self.profiles, link, self.budget, self.config, conditions=cond, wires=self._wires)

    def _redecide(self) -> Decision | None:
        self._redecided_at, self.redecisions = self._clock(), self.redecisions + 1
        trigger = ", ".join(self._pending) or "periodic"
        # after a change of the budget or the link the current point was chosen for other conditions:
        # it has no claim to stand, so the gain's evidence does not hold it (`decide.switch_reason`)
        changed_conditions = any(r.startswith(_CHANGES) for r in self._pending)
        # no tolerance for a point over a new energy budget (`decide.switch_reason`'s `tolerance`)
        self._new_budget = "budget" in self._pending
        self._pending.clear()
        if self.encoder is not None:
            self._wires = self.encoder.options()  # one tuple, replaced whole by the encoder
        link = self.link.state() if self.link is not None else None
        cond = self.conditions()
        self._audits_planned = cond.audit_rate
        # the plan keeps the energy estimate's noise below the target; the current point is judged
        # against the target itself: a band of that width, so the estimate's noise moves nothing
        plan = replace(cond, energy_scale=cond.energy_scale * (1 - self._energy_noise(link)))
        cand = choose(self.profiles, link, self.budget, self.config, conditions=plan, wires=self._wires)
        cur = evaluate(self._by_id[self.current.variant], self.current.threshold, link, self.budget, self.config,
                       conditions=cond, wire=self._wire(self.current.encoding))
        why = self._switch_reason(cur, cand, changed_conditions)
        if not why and cand.feasible and cand.key != cur.key and not spare(cand, self.config):
            # the rule's choice is too close to a budget to move to for accuracy: the best point that
            # leaves the spare room may still beat the current one
            tight = replace(plan, latency_scale=cond.latency_scale * (1 - self.config.switch_headroom),
                            energy_scale=plan.energy_scale * (1 - self.config.energy_switch_headroom))
            alt = choose(self.profiles, link, self.budget, self.config, conditions=tight, wires=self._wires)
            alt = replace(evaluate(self._by_id[alt.variant], alt.threshold, link, self.budget, self.config,
                                   conditions=cond, wire=self._wire(alt.encoding)), binding=cand.binding)
            if alt.feasible and (alt_why := self._switch_reason(cur, alt, changed_conditions)):
                cand, why = replace(alt, reason=f"the best point with room to spare (the best, "
                                                f"{cand.variant}@{cand.threshold:.4g}, is closer)"), alt_why
        if cand.encoding and cur.encoding and cand.encoding != cur.encoding:  # the encoding's own hysteresis
            cand, why = encoding_move(cur, cand, why, lambda d, e: evaluate(
                self._by_id[d.variant], d.threshold, link, self.budget, self.config, conditions=cond,
                wire=self._wire(e)), lambda a, b: self._switch_reason(a, b, changed_conditions), self.config)
        if why:
            chosen = replace(cand, reason=f"{why}; {cand.reason}")
            log.info("controller: %s@%.4g/%s -> %s@%.4g/%s (%s: %s)", cur.variant, cur.threshold, cur.encoding,
                     chosen.variant, chosen.threshold, chosen.encoding, trigger, why)
        else:
            chosen = replace(cur, binding=cand.binding, reason=f"kept: {cur.reason}; the rule's choice "
                             f"{cand.variant}@{cand.threshold:.4g}/{cand.encoding or 'as built'} "
                             f"acc {cand.predicted_accuracy:.4f}, {cand.predicted_energy_mj:.3g} mJ")
        changed = chosen.point != self.current.point
        self._commit(chosen, trigger, record=changed or trigger != "periodic")
        return self.current if changed else None

    def _switch_reason(self, cur: Decision, cand: Decision, changed_conditions: bool = False) -> str:
        """`decide.switch_reason` with this controller's estimates of the noise; `changed_conditions`: the
        budget or the link changed since the current point was chosen (no hold on the gain's evidence)."""
        link = self.link.state() if self.link is not None else None
        settled = self._clock() - self._epoch_at >= self.config.link_settle_s
        # a slow spell raises the floor once it has lasted (a loss burst moves nothing)
        floor = probe_floor(link if settled or link is None else replace(link, slow=False), self.config)
        # while the link is down the breaker skips the escalations, whatever share is wanted: what the plan
        # says they would cost then is no reason to move (the floor still is)
        up = link is None or link.up
        stderr = gain_stderr(self._by_id[cur.variant], cur, cand)
        # across variants, the two points' own validation error: a gain of a few hundredths of a point from
        # another variant is noise (it moved the controller between variants and back late in a phase)
        across = variant_stderr(self._by_id[cur.variant], self._by_id[cand.variant], cur, cand)
        evidence = energy_evidence(self._by_id[cur.variant], self._by_id[cand.variant], self.config.energy_z,
                                   budget_set=self._new_budget and self.budget.energy_mj is not None)
        # the settle time keeps a burst from taking the escalations away: a move that keeps them (a smaller
        # wire encoding, a point escalating as much) is no such move, and waits for nothing
        keeps = cand.predicted_escalation_rate >= cur.predicted_escalation_rate - KEEP_ESCALATIONS
        return switch_reason(cur, cand, self.config, noise=self._cloud_noise(cur, cand),
                             gain_noise=0.0 if changed_conditions else self.config.gain_z * max(stderr, across),
                             energy_evidence=(settled or keeps) and up and evidence,
                             floor=floor, tie=self.config.tie_z * stderr,
                             tolerance=0.0 if self._new_budget and "energy" in cur.violated else None,
                             energy_se=0.0 if self._new_budget else self._energy_noise(link, hold=True))

    def _energy_noise(self, link: LinkState | None, *, hold: bool = False) -> float:
        """The share of the energy target the plan keeps free for the estimate's noise (`evidence.energy_noise`),
        or, with `hold`, one standard error of the current point's (`evidence.energy_hold`); 0 without a budget."""
        if self.budget.energy_mj is None:
            return 0.0
        parts, p = {"inference": self._energy.inference, "escalation": self._energy.escalation}, self.current
        return (energy_hold(p, link, self._by_id[p.variant], 1.0, **parts) if hold
                else energy_noise(p, link, self.config.energy_noise_z, **parts))

    def _cloud_noise(self, cur: Decision, cand: Decision) -> float:
        """How much two points of one variant may differ in predicted accuracy by the fitted cloud
        accuracy's uncertainty alone (`evidence.cloud_noise`); 0 for an edge-only device."""
        if self.link is None:
            return 0.0
        return cloud_noise(cur, cand, self._by_id[cand.variant], self.link.cloud_prior_strength,
                           self.config.accuracy_z)

    def _commit(self, decision: Decision, trigger: str, *, record: bool = True) -> Decision:
        decision = replace(decision, trigger=trigger, at=self._clock())
        if self.decisions and decision.variant != self.current.variant:
            self._ratios.clear()  # ratios of another variant are not comparable (fixed per-request costs)
            self._by_id[self.current.variant].live_scores.clear()  # they will be stale when it runs again
        self._deadline_scale = self.latency_windows.scale
        self.current = decision  # one reference replaced whole: what other threads read
        if self.encoder is not None and decision.encoding:
            self.encoder.planned = decision.encoding  # one string replaced whole: what the event loop reads
        if record:
            self.decisions.append(decision)
        self._n = self._n_esc = self._n_agree = self._k_agree = 0
        link = decision.inputs.get("link") or {}
        p = self._by_id[decision.variant]
        self._ref = {"slowdown": (statistics.median(self._ratios) if len(self._ratios) >= 5
                                  else 1.0 if trigger == "initial" else math.nan),
                     "energy": p.energy_mj,
                     "agreement": float(link.get("cloud_accuracy") or 1.0)
                     * (1 - (1 - decision.edge_accuracy_escalated) * float(link.get("edge_error_scale") or 1))}
        return decision

