"""The rollout engine: one `step()` moves every open rollout on; `tierkit fleet serve` runs it every second.

Only the process holding the `rollouts` row lease acts (leases.py); every write transaction is
fenced by it. A step, for each running rollout:

1. reads the reported documents of its devices: their swap state for the release, whether they ran
   it, refusals, golden checks and crashes;
2. starts the current wave if needed and fills it: the next devices in the rollout's order, those
   offline go to the catch-up set (they neither block nor count), the others get the release through
   their rollout layer (`{"release", "soak"}` in their effective desired document);
3. moves assigned devices that show no progress for `stall_after_s` to the catch-up set;
4. fails the wave at once on a device failure (refused, golden inputs not reproduced, a device-side
   rollback, a crash); otherwise, once every device of the wave soaked on the release, compares the
   wave's telemetry on the release with a control over the same window (devices not yet in a wave, and
   the devices of earlier waves, whose release does not change during this one; a last wave with fewer
   than `holdback` of the fleet (at least 2) of those with a baseline keeps that many back) and passes
   or fails it (gates.py); a wave still open at its maximum soak follows `on_inconclusive` (hold, extend,
   rollback, promote). A failure rolls every device that was given the release back to the release it
   ran before (`{"release": previous, "rollback": true}`) in the same transaction.

For every rollout it also gives returning catch-up devices the rollout's current outcome, and marks
rolled-back devices restored once they report the previous release again.

Each telemetry window is read and parsed once and kept from one step to the next (`window_cache.py`), and a
wave's baselines with what the gates computed from them while its devices and control stay the same (`_Kept`):
a step over a 200-device control with an hour of baseline takes about 0.15 s on two cores, where reading and
judging every window again took 4 s (bench/RESULTS.md).
"""

from __future__ import annotations

import json
import logging
import math
import os
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from cloud_service.fleet import schema as t
from cloud_service.fleet.desired import DesiredState, stored_reported
from cloud_service.fleet.errors import FleetError
from cloud_service.fleet.gates import (
    HARD_GATES,
    MIN_BASELINE_WINDOWS,
    MIN_WINDOW_REQUESTS,
    STAT_GATES,
    Arms,
    baseline_errors,
    cohort,
    control_futile,
    evaluate,
    failed,
    open_gates,
)
from cloud_service.fleet.leases import Lease, LeaseLost
from cloud_service.fleet.releases import ReleaseRegistry
from cloud_service.fleet.rollouts import (
    ACTIVE,
    MOVING_STATES,
    OPEN_STATES,
    RAN_STATES,
    RolloutOptions,
    order_key,
    record,
)
from cloud_service.fleet.store import FleetStore
from cloud_service.fleet.window_cache import SETTLE_S, WindowCache
from cloud_service.protocol.fleet_docs import Desired, Reported, Soak, SoakProgress, SwapState
from runtimes.budget import BudgetOverride

logger = logging.getLogger(__name__)
LEASE = "rollouts"
_NOTHING = (Reported(), 0.0)  # a device that has not reported
RATE_LOOKBACK_S = 300.0


@dataclass
class _Ctx:
    """One rollout during one step."""

    row: Any
    opts: RolloutOptions
    devs: dict[str, dict[str, Any]]
    reported: dict[str, tuple[Reported, float]]
    seen: dict[str, float | None]
    now: float


@dataclass(frozen=True)
class _Kept:
    """A wave's baselines (its devices' and its control's windows before it started) and what the gates computed
    from them (`gates.evaluate`'s cache, keyed by these lists): the same from one step to the next while `key`
    (the rollout, the wave, its start, its devices and its control) is."""

    key: tuple[Any, ...]
    pre_wave: list[dict[str, Any]]
    pre_control: list[dict[str, Any]]
    cache: dict[Any, Any]


class RolloutEngine:
    """Args: store; desired: where rollout layers go; releases: the registry (latency budgets);
    online_after_s: a device heard from within this is online; cloud_capacity_rps: the capacity gate's figure
    for rollouts that give none; holder: this process's name in the lease."""

    def __init__(self, store: FleetStore, desired: DesiredState, releases: ReleaseRegistry, *,
                 online_after_s: float = 120.0, cloud_capacity_rps: float | None = None, holder: str | None = None,
                 lease_ttl_s: float = 10.0) -> None:
        self.store, self.desired, self.releases = store, desired, releases
        self.online_after_s, self.cloud_capacity_rps = online_after_s, cloud_capacity_rps
        self.holder = holder or f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"
        self.lease = Lease(store, LEASE, holder=self.holder, ttl_s=lease_ttl_s)
        self.cache = WindowCache(store)  # the windows steps read, each read and parsed once
        # rollout -> its wave's baselines, kept while the wave, its devices and its control stay the same
        self._kept: dict[int, _Kept] = {}

    def step(self, *, now: float | None = None) -> bool:
        """One pass over open rollouts; False when another process holds the lease (nothing done)."""
        if not self.lease.acquire(now=now):
            return False
        try:
            rids = self._open()
            self._kept = {rid: k for rid, k in self._kept.items() if rid in rids}
            for rid in rids:
                try:
                    self._step(rid, time.time() if now is None else now)
                except LeaseLost:
                    return False
        finally:  # keep the windows this pass read (the next one reads them again), drop the rest
            self.cache.end_step()
        return True

    def _open(self) -> list[int]:
        r, d = t.rollouts.c, t.rollout_devices.c
        with self.store.begin() as conn:
            busy = sa.select(d.rollout_id).where(d.state.in_(OPEN_STATES)).distinct()
            return [int(x) for x in conn.execute(sa.select(r.id).where(sa.or_(
                r.state.in_((*ACTIVE, "rollback_asked")), r.id.in_(busy))).order_by(r.id)).scalars()]

    # -- one rollout ---------------------------------------------------------------------------

    def _load(self, rid: int, now: float) -> _Ctx:
        with self.store.begin() as conn:
            row = conn.execute(sa.select(t.rollouts).where(t.rollouts.c.id == rid)).one()
            devs = {r.device_id: dict(r._mapping) for r in conn.execute(
                sa.select(t.rollout_devices).where(t.rollout_devices.c.rollout_id == rid))}
            ids = sorted(devs)
            reported = {r.device_id: (stored_reported(r.document), float(r.received_at)) for r in conn.execute(
                sa.select(t.reported).where(t.reported.c.device_id.in_(ids)))}
            seen = {r.device_id: r.last_seen for r in conn.execute(
                sa.select(t.devices.c.device_id, t.devices.c.last_seen, t.devices.c.revoked_at)
                .where(t.devices.c.device_id.in_(ids))) if r.revoked_at is None}
        return _Ctx(row, RolloutOptions.from_json(row.options), devs, reported, seen, now)

    def _online(self, ctx: _Ctx, device: str, *, since: float = 0.0) -> bool:
        seen = ctx.seen.get(device)
        return seen is not None and seen > since and ctx.now - seen <= self.online_after_s

    def _step(self, rid: int, now: float) -> None:
        ctx = self._load(rid, now)
        changes = self._track(ctx)
        state = ctx.row.state
        if state == "rollback_asked":
            self._roll_back(ctx, changes, "rollback", {}, ctx.row.reason or "rollback asked")
            return
        if state == "running":
            self._run(ctx, changes)
        else:
            self._catch_up(ctx, changes, assign=state == "succeeded")
            self._commit(ctx, changes)

    def _track(self, ctx: _Ctx) -> dict[str, dict[str, Any]]:
        """New device states from their reported documents; returns the changed rows (device -> values)."""
        changes: dict[str, dict[str, Any]] = {}
        release = ctx.row.release
        for dev, d in ctx.devs.items():
            if d["assigned_at"] is None or d["state"] in ("restored", "kept", "superseded", "catch_up"):
                continue
            doc, at = ctx.reported.get(dev, _NOTHING)
            if at < d["assigned_at"]:
                continue  # nothing reported since it was given the release (or sent back)
            running, swap = doc.release, doc.swap
            new = d["state"]
            if d["state"] == "rollback":
                if running == (d["previous"] or ctx.row.previous):
                    new = "restored"
            elif swap is not None and swap.target == release:
                new = swap.state.value
            elif running == release:
                new = SwapState.COMMITTED if swap is None else SwapState.ACTIVE
            ran = bool(d["ran"]) or new in RAN_STATES or running == release
            detail = (swap.error or "")[:500] if swap is not None and swap.target == release else d["detail"]
            if (new, ran, detail) != (d["state"], bool(d["ran"]), d["detail"]):
                changes[dev] = {"state": new, "ran": ran, "detail": detail, "updated_at": ctx.now}
                d.update(changes[dev])
        return changes

    def _failures(self, ctx: _Ctx, devices: list[str]) -> tuple[dict[str, str], int]:
        fails: dict[str, str] = {}
        crashes = 0
        for dev in devices:
            d = ctx.devs[dev]
            doc, at = ctx.reported.get(dev, _NOTHING)
            if d["state"] in (SwapState.REFUSED, SwapState.ROLLED_BACK):
                fails[dev] = f"{d['state']}: {d['detail'] or 'no reason given'}"
            golden = doc.golden
            if (at >= (d["assigned_at"] or 0) and doc.release == ctx.row.release and golden is not None
                    and not golden.ok):
                fails[dev] = f"golden inputs do not reproduce (max rel. error {golden.max_rel_error})"
            if at >= (d["assigned_at"] or 0) and dev in ctx.reported:
                crashes += max(0, doc.crashes - int(d["crashes0"]))
        return fails, crashes

    def _run(self, ctx: _Ctx, changes: dict[str, dict[str, Any]]) -> None:
        row, opts, now = ctx.row, ctx.opts, ctx.now
        with self.store.begin() as conn:
            waves = [dict(w._mapping) for w in conn.execute(sa.select(t.rollout_waves).where(
                t.rollout_waves.c.rollout_id == row.id).order_by(t.rollout_waves.c.idx))]
            extended = conn.execute(sa.select(sa.func.max(t.rollout_decisions.c.at)).where(
                t.rollout_decisions.c.rollout_id == row.id, t.rollout_decisions.c.wave == row.wave,
                t.rollout_decisions.c.kind.in_(("resume", "inconclusive")))).scalar()
            released = _decided(conn, row.id, row.wave, "control_released")
        w = waves[row.wave]
        wave_updates: dict[str, Any] = {}
        settle = self._settle(ctx, waves, w)
        if w["state"] == "pending" and not settle["wait"]:
            wave_updates = {"state": "soaking", "started_at": now}
            w.update(wave_updates)
        self._stall(ctx, changes, opts)
        self._catch_up(ctx, changes, assign=True)
        assign = {} if settle["wait"] else self._fill(ctx, changes, w, audit=self._audited(ctx, waves, w))
        members = [d for d, v in ctx.devs.items() if v["wave"] is not None and v["wave"] <= w["idx"]
                   and v["assigned_at"] is not None and v["state"] != "catch_up"]
        current = [d for d in members if ctx.devs[d]["wave"] == w["idx"]]
        fails, crashes = self._failures(ctx, members)
        # once the held-back control took the release, the wave was judged: its soak alone finishes it
        figures = self._figures(ctx, w, current, judged=bool(released), keep=True)
        audited = self._audited(ctx, waves, w)
        gates = self._gates(ctx, len(waves), w["idx"], figures, fails, crashes, audited=audited)
        record_figures = {"wave": figures["wave"].as_dict(), "control": figures["control"].as_dict(),
                          "control_kind": figures["control_kind"], "request_rate": figures["request_rate"],
                          "control_devices": figures["control_devices"],
                          "alpha": opts.evidence.alpha, "alpha_gate": opts.evidence.alpha_gate(len(waves), w["idx"]),
                          "gates": gates}
        hard = failed(gates, HARD_GATES)
        stat = failed(gates, STAT_GATES)
        if hard or stat:  # a regression is clear (or a device failed): no need to wait for the soak
            self._roll_back(ctx, changes, "fail", record_figures,
                            f"wave {w['idx']} failed: {', '.join(hard + stat)}",
                            wave_updates={**wave_updates, "state": "failed", "ended_at": now}, assign=assign)
            return
        soaked = all(self._soaked(ctx, d, opts) for d in current) and not assign
        # a wave left with no device of its own to judge (the rest offline, or none left) does not hold the
        # rollout up, once some earlier wave was judged; with no device judged at all, it waits
        enough = (figures["wave"].requests >= opts.margins.min_requests if current
                  else bool(members) and not any(v["state"] in ("pending", "control") for v in ctx.devs.values()))
        still = open_gates(gates, audited=audited)
        controls = [d for d, v in ctx.devs.items() if v["state"] == "control"]
        with self.store.begin() as conn:
            self.lease.fence(conn, now=ctx.now)
            if not still and controls and enough:  # the held-back control takes the release now
                for dev in controls:
                    values = {"state": "pending", "detail": "control released", "updated_at": now}
                    changes.setdefault(dev, {}).update(values)
                record(conn, row.id, w["idx"], "control_released", record_figures,
                       f"wave {w['idx']}: every statistical gate passed against {len(controls)} held-back device(s), "
                       "which take the release now", self.holder, now=now)
            elif soaked and enough and not still and (bad := failed(gates)):  # budget or capacity
                self._write(conn, ctx, changes, assign, w["idx"], {**wave_updates, "state": "failed", "ended_at": now})
                self._roll_back_in(conn, ctx, "fail", record_figures,
                                   f"wave {w['idx']} failed after its soak: {', '.join(bad)}", w["idx"])
                return
            elif soaked and enough and not still:
                self._pass(conn, ctx, w, len(waves), current, record_figures, audit=self._audited(ctx, waves, w))
                wave_updates = {**wave_updates, "state": "passed", "ended_at": now}
            elif still and self._past_max_soak(ctx, w, figures["wave"].requests / max(1, len(current)), extended):
                verdict = self._inconclusive(conn, ctx, w, record_figures, still)
                if verdict == "promote":
                    wave_updates = {**wave_updates, **self._promote(conn, ctx, w, waves, current, controls, changes,
                                                                    record_figures, still)}
                elif verdict == "rollback":
                    self._write(conn, ctx, changes, assign, w["idx"],
                                {**wave_updates, "state": "failed", "ended_at": now})
                    self._roll_back_in(conn, ctx, "inconclusive", record_figures,
                                       f"wave {w['idx']} inconclusive at its maximum soak: {', '.join(still)}",
                                       w["idx"])
                    return
            elif self._observe_due(conn, row.id, now, opts.observe_every_s):
                self._observe(conn, ctx, w, settle if settle["wait"] else None, record_figures, current,
                              still)
            self._write(conn, ctx, changes, assign, w["idx"], wave_updates)

    def _observe(self, conn: Any, ctx: _Ctx, w: dict[str, Any], waiting: dict[str, Any] | None,
                 figures: dict[str, Any], current: list[str], still: list[str]) -> None:
        """The record of a wave still open: what it waits for before it starts (`waiting`: `_settle`'s baseline
        errors) or, once it has windows on the release, its figures (the dashboard's plots)."""
        if waiting:
            errors = waiting["baseline"]
            worst = max(errors, key=lambda g: math.inf if g["se"] is None else g["se"] / g["limit"], default=None)
            why = (f"{worst['gate']} standard error {worst['se']} over {worst['limit']}, a sixth of its margin"
                   if worst else "no baseline yet")
            what = ("its devices' audit baseline (auditing at the raised rate on the previous release)"
                    if waiting.get("pre_swap") else
                    "its control's baseline (the earlier waves' devices on the release)")
            record(conn, ctx.row.id, w["idx"], "observe", {"baseline": errors},
                   f"wave {w['idx']} waits for {what}: {why}", self.holder, now=ctx.now)
        elif figures["wave"]["requests"]:
            record(conn, ctx.row.id, w["idx"], "observe", figures,
                   f"soaking: {sum(self._soaked(ctx, d, ctx.opts) for d in current)}/{len(current)} device(s); "
                   f"open: {', '.join(still) or 'none'}", self.holder, now=ctx.now)

    def _promote(self, conn: Any, ctx: _Ctx, w: dict[str, Any], waves: list[dict[str, Any]], current: list[str],
                 controls: list[str], changes: dict[str, dict[str, Any]], figures: dict[str, Any],
                 still: list[str]) -> dict[str, Any]:
        """A wave open at its maximum soak under `promote`: it passes on the earlier waves' evidence (a held-back
        control takes the release first, and the wave's soak finishes it). Returns the wave's updates."""
        if not controls:
            self._pass(conn, ctx, w, len(waves), current, figures, audit=self._audited(ctx, waves, w), promoted=still)
            return {"state": "passed", "ended_at": ctx.now}
        for dev in controls:
            changes.setdefault(dev, {}).update({"state": "pending", "detail": "control released",
                                                "updated_at": ctx.now})
        record(conn, ctx.row.id, w["idx"], "control_released", {**figures, "promoted": still},
               f"wave {w['idx']}: promoted at its maximum soak on the evidence of the waves before it "
               f"({', '.join(still)} open, none failed); {len(controls)} held-back device(s) take the release now",
               self.holder, now=ctx.now)
        return {}

    def _pass(self, conn: Any, ctx: _Ctx, w: dict[str, Any], n_waves: int, current: list[str],
              figures: dict[str, Any], *, audit: bool = False, promoted: list[str] | None = None) -> None:
        row, now = ctx.row, ctx.now
        last = w["idx"] == n_waves - 1
        conn.execute(t.rollouts.update().where(t.rollouts.c.id == row.id).values(
            wave=w["idx"] if last else w["idx"] + 1, state="succeeded" if last else "running", updated_at=now))
        note = (f"wave {w['idx']} ({w['spec']}) passed: {len(current)} device(s) soaked" if current else
                f"wave {w['idx']} ({w['spec']}) passed: no device of its own online to judge")
        if promoted:
            note += (f"; promoted at its maximum soak on the evidence of waves 0-{w['idx'] - 1}, which passed "
                     f"(open here, none failed: {', '.join(promoted)})")
        if audit and current:  # decided: its devices audit at their own rate again (a layer without "audit_rate")
            self.desired.assign({d: self._layer(ctx, audit=False) for d in current}, conn=conn)
        record(conn, row.id, w["idx"], "pass", {**figures, "promoted": promoted or []}, note, self.holder, now=now)
        if last:
            record(conn, row.id, w["idx"], "done", {}, "every wave passed", self.holder, now=now)

    def _past_max_soak(self, ctx: _Ctx, w: dict[str, Any], per_device: float, extended: float | None) -> bool:
        cap = ctx.opts.max_soak
        since = max(float(w["started_at"] or ctx.now), float(extended or 0.0))
        return bool(("seconds" in cap and ctx.now - since >= cap["seconds"])
                    or ("requests" in cap and per_device >= cap["requests"] and extended is None))

    def _inconclusive(self, conn: Any, ctx: _Ctx, w: dict[str, Any], figures: dict[str, Any],
                      still: list[str]) -> str | None:
        """The policy for a wave still open at its maximum soak (no gate failed): "rollback", "promote" (the
        caller passes the wave), or None (held, or soaking on; recorded here).

        `promote` passes a wave after the canary on the evidence of the waves before it, which passed on the
        same gates: it adds no false rollback, and it gives up only what this wave alone would have shown (a
        regression too small for the earlier waves to tell). A canary has no earlier wave: it is held."""
        policy = ctx.opts.on_inconclusive
        if policy == "rollback":
            return "rollback"
        if policy == "promote" and w["idx"] > 0:
            return "promote"
        note = f"wave {w['idx']} inconclusive at its maximum soak {ctx.opts.max_soak}: {', '.join(still)} open"
        held = policy in {"hold", "promote"}
        if held:
            conn.execute(t.rollouts.update().where(t.rollouts.c.id == ctx.row.id).values(
                state="paused", reason=note + "; held for the operator (resume to soak on)", updated_at=ctx.now))
        record(conn, ctx.row.id, w["idx"], "inconclusive", figures,
               note + ("; held" if held else "; soaking on"), self.holder, now=ctx.now)
        return None

    def _soaked(self, ctx: _Ctx, device: str, opts: RolloutOptions) -> bool:
        d = ctx.devs[device]
        if d["state"] == SwapState.COMMITTED:
            return True
        if d["state"] not in (SwapState.ACTIVE, SwapState.SOAKING):
            return False
        swap = ctx.reported.get(device, _NOTHING)[0].swap
        done = swap.soak if swap is not None and swap.soak is not None else SoakProgress()
        return Soak.parse(opts.soak, where="the rollout's soak").reached(done)

    def _gates(self, ctx: _Ctx, waves: int, wave: int, figures: dict[str, Any], fails: dict[str, str], crashes: int,
               *, audited: bool) -> list[dict[str, Any]]:
        """Every gate of the wave on `_figures`' arms, with what the wave's earlier steps computed (`_Kept`)."""
        opts = ctx.opts
        return evaluate(figures["arms"], margins=opts.margins, evidence=opts.evidence, waves=waves, wave=wave,
                        budget_ms=self._budget(ctx.row.release), device_failures=fails, crashes=crashes,
                        fleet_request_rate=figures["request_rate"],
                        cloud_capacity_rps=opts.cloud_capacity_rps or self.cloud_capacity_rps,
                        cache=figures["cache"], memo=self.cache.memo, audited=audited)

    @staticmethod
    def _audited(ctx: _Ctx, waves: list[dict[str, Any]], w: dict[str, Any]) -> bool:
        """A small wave's devices audit at the rollout's raised rate while it soaks."""
        own = w["size"] - (waves[w["idx"] - 1]["size"] if w["idx"] else 0)
        return ctx.opts.audit_rate > 0 and own <= ctx.opts.audit_devices

    def _layer(self, ctx: _Ctx, *, audit: bool) -> Desired:
        """A wave device's rollout layer: the release, its soak and, in a small wave, the raised audit rate."""
        return Desired(release=ctx.row.release, soak=Soak.parse(ctx.opts.soak),
                       audit_rate=ctx.opts.audit_rate if audit else None)

    def _settle(self, ctx: _Ctx, waves: list[dict[str, Any]], w: dict[str, Any]) -> dict[str, Any]:
        """Whether a last wave not started yet waits for its control: where the devices of earlier waves would be
        its control (enough of them have a baseline, `_holdback`), their baselines are a few windows on the release,
        and a baseline's error is an offset that no soak of the wave shrinks: a wave started on one whose standard
        error is near a gate's margin soaks to its maximum for nothing. It waits until each statistical gate's error
        from the baselines alone is within a sixth of its margin (`gates.baseline_errors`), for at most
        `max_soak` after the wave before it ended; past that it starts as it is (its gates then end open ones by
        `on_inconclusive`). A small wave before the last first runs its pre-swap audit phase (`_pre_swap`).
        Returns {"wait", "baseline": the errors}."""
        idle: dict[str, Any] = {"wait": False, "baseline": []}
        last = len(waves) - 1
        if (w["state"] == "pending" and self._audited(ctx, waves, w) and ctx.opts.pre_swap_s > 0
                and (w["idx"] < last or last == 0)):  # a last wave's control is the earlier waves': their audits
            return self._pre_swap(ctx, w)          # on the release are minutes at 1 %, no phase narrows them
        if w["state"] != "pending" or w["idx"] != last or last == 0:
            return idle
        promoted = self._promoted(ctx, last)
        want = max(2, math.ceil(ctx.opts.holdback * len(ctx.devs)))
        if ctx.opts.holdback > 0 and len(self._baselined(ctx, promoted, on_release=True)) < want:
            return idle  # too few to be the control: `_holdback` keeps devices back
        wave = [d for d, v in ctx.devs.items() if v["state"] == "pending" and self._online(ctx, d)]
        arms = self._figures(ctx, {"started_at": ctx.now, "idx": last}, wave,
                             control=promoted[:ctx.opts.control_max])["arms"]
        if arms is None:
            return idle
        errors = baseline_errors(arms, margins=ctx.opts.margins, evidence=ctx.opts.evidence, memo=self.cache.memo)
        ok = all(g["ok"] for g in errors)
        ended = float(waves[last - 1]["ended_at"] or ctx.now)
        cap = ctx.opts.max_soak
        if "seconds" in cap:
            over = ctx.now - ended >= cap["seconds"]
        else:  # requests per device of the control since the wave before it ended
            since = [x for x in arms.pre_control if float(x["server_ts"]) >= ended]
            over = sum(int(x["requests"] or 0) for x in since) / max(1, len(promoted)) >= cap["requests"]
        return {"wait": not ok and not over, "baseline": errors}

    def _pre_swap(self, ctx: _Ctx, w: dict[str, Any]) -> dict[str, Any]:
        """A small wave's pre-swap audit phase: before its devices get the release, they audit at the rollout's
        `audit_rate` on the release they run (a layer with `audit_rate` alone), so that the whole-stream gate's
        baseline is not an hour at the agent's 1 % (about 290 audits: an error of about half a point that no soak
        shrinks). It ends once that gate's error from the baselines alone is within a sixth of its margin
        (`gates.baseline_errors`, as a last wave's control's) or `pre_swap_s` after it began; a wave whose devices
        sent no audits in their baseline (a fleet that does not audit) has none, nor has a last wave (see
        `_settle`), nor one whose control's audits alone leave more than `gates.PRE_SWAP_REACH` of the limit (a
        few devices' minutes at 1 %: no baseline of the wave's own narrows the sum). Both ends are `pre_swap`
        decisions ("pre-swap audit phase: N audits in T s"). Returns `_settle`'s {"wait", "baseline"}."""
        idle: dict[str, Any] = {"wait": False, "baseline": []}
        with self.store.begin() as conn:
            phase = _pre_swap_phase(conn, ctx.row.id, w["idx"])
        if phase is not None and phase.get("phase") == "end":
            return idle
        taken = sum(1 for v in ctx.devs.values() if v["wave"] is not None and v["assigned_at"] is not None
                    and v["state"] != "catch_up")
        waiting = sorted((d for d, v in ctx.devs.items() if v["state"] in ("pending", "control")
                          and self._online(ctx, d)), key=lambda d: order_key(ctx.row.id, d))
        devices = list(phase["devices"]) if phase else waiting[:max(0, w["size"] - taken)]
        control = ([d for d in waiting if d not in devices] + self._promoted(ctx, w["idx"]))[:ctx.opts.control_max]
        arms = self._figures(ctx, {"started_at": ctx.now, "idx": w["idx"]}, devices, control=control)["arms"]
        if arms is None or (phase is None and not any(int(x.get("audits") or 0) for x in arms.pre_wave)):
            return idle  # nothing to compare, or devices that do not audit: no phase
        errors = baseline_errors(arms, margins=ctx.opts.margins, evidence=ctx.opts.evidence, audited=True,
                                 only=("audit_agreement",), memo=self.cache.memo)
        started = float(phase["at"]) if phase else ctx.now
        ready = bool(errors) and all(g["ok"] for g in errors)
        futile = control_futile(errors)
        if phase is None and futile:
            return idle  # the control's own audits leave too much: no richer baseline of the wave's helps
        done = ready or futile or ctx.now - started >= ctx.opts.pre_swap_s
        with self.store.begin() as conn:
            self.lease.fence(conn, now=ctx.now)
            if phase is None and not done:
                self.desired.assign({d: Desired(audit_rate=ctx.opts.audit_rate) for d in devices}, conn=conn)
                record(conn, ctx.row.id, w["idx"], "pre_swap",
                       {"phase": "start", "devices": devices, "baseline": errors},
                       f"wave {w['idx']}: {len(devices)} device(s) audit {ctx.opts.audit_rate:g} of their confident "
                       f"answers on the previous release before the swap (at most {ctx.opts.pre_swap_s:g} s)",
                       self.holder, now=ctx.now)
            elif phase is not None and done:
                since = [x for x in arms.pre_wave if float(x["server_ts"]) > started]  # sent after the layer
                audits = sum(int(x.get("audits") or 0) for x in since)
                gone = [d for d in devices if not self._online(ctx, d)]  # not in the wave: their own rate again
                self.desired.assign(dict.fromkeys(gone, Desired()), conn=conn)
                record(conn, ctx.row.id, w["idx"], "pre_swap", {
                    "phase": "end", "devices": devices, "audits": audits, "seconds": round(ctx.now - started, 1),
                    "inferences": sum(int(x["requests"] or 0) for x in since), "baseline": errors},
                    f"pre-swap audit phase: {audits} audits in {ctx.now - started:.0f} s"
                    + ("" if ready else " (the control's audits alone leave too much)" if futile
                       else " (at its cap; the baseline is as it is)"),
                    self.holder, now=ctx.now)
        return {"wait": not done, "baseline": errors, "pre_swap": True}

    def _fill(self, ctx: _Ctx, changes: dict[str, dict[str, Any]], w: dict[str, Any], *,
              audit: bool = False) -> dict[str, Desired]:
        """Give the release to pending devices, in the rollout's order, until the waves so far hold `size`
        online devices; offline ones met on the way go to the catch-up set and take no place. The last
        wave takes every pending device. Returns the assignments."""
        taken = sum(1 for v in ctx.devs.values() if v["wave"] is not None and v["assigned_at"] is not None
                    and v["state"] != "catch_up")
        need = w["size"] - taken
        assign: dict[str, Desired] = {}
        pending = sorted((d for d, v in ctx.devs.items() if v["state"] == "pending"),
                         key=lambda d: order_key(ctx.row.id, d))
        last = w["idx"] == len(ctx.opts.waves) - 1
        held = self._holdback(ctx, pending) if last else set()
        for dev in pending:
            if dev in held:
                values: dict[str, Any] = {"state": "control", "updated_at": ctx.now,
                                          "detail": "held back as the last wave's control until its gates pass"}
                changes.setdefault(dev, {}).update(values)
                ctx.devs[dev].update(values)
                continue
            if need <= 0 and not last:
                break
            values = {"wave": w["idx"], "updated_at": ctx.now}
            if self._online(ctx, dev):
                values.update(state="assigned", assigned_at=ctx.now, detail="")
                assign[dev] = self._layer(ctx, audit=audit)
                need -= 1
            else:
                values.update(state="catch_up", detail="offline when its wave started")
            changes.setdefault(dev, {}).update(values)
            ctx.devs[dev].update(values)
        return assign

    def _holdback(self, ctx: _Ctx, pending: list[str]) -> set[str]:
        """The last wave's control where the devices of earlier waves cannot be one: fewer than `holdback` of the
        fleet (at least 2) of them have a baseline (`_baselined`: a one-wave rollout, a small fleet, or earlier
        waves that passed moments ago, whose devices have too few windows on the release past their swap's
        warm-up). Then that many pending devices with a baseline of their own (the last online ones, in the
        rollout's order) stay on the previous release until the wave's statistical gates pass. Only when the
        wave starts (no device of the wave assigned yet) and one device at least goes ahead. Counting devices
        online, not devices with a baseline, left a last wave judged against the canary alone, one device's own
        swings against the margin: a false rollback in simulation (bench/bench_gates.py)."""
        last = len(ctx.opts.waves) - 1
        if ctx.opts.holdback <= 0 or any(v["state"] == "control" for v in ctx.devs.values()) or any(
                v["wave"] == last and v["assigned_at"] is not None for v in ctx.devs.values()):
            return set()
        want = max(2, math.ceil(ctx.opts.holdback * len(ctx.devs)))
        if len(self._baselined(ctx, self._promoted(ctx, last), on_release=True)) >= want:
            return set()
        online = [d for d in pending if self._online(ctx, d)]
        ready = self._baselined(ctx, online, on_release=False)
        k = min(want, len(ready), len(online) - 1)
        return set(ready[-k:]) if k > 0 else set()

    def _baselined(self, ctx: _Ctx, devices: list[str], *, on_release: bool) -> list[str]:
        """The `devices` (in their order) that would have a baseline for every figure if a wave started now:
        MIN_BASELINE_WINDOWS windows of MIN_WINDOW_REQUESTS inferences or more within the evidence's baseline_s
        (as `_figures` takes them): `on_release`, a device of an earlier wave, on the release past its swap's
        warm-up; else a device still on what it ran before, on anything but the release."""
        ev = ctx.opts.evidence
        by: dict[str, list[dict[str, Any]]] = {}
        for x in self.cache.windows(devices, ctx.now - ev.baseline_s, now=ctx.now):
            by.setdefault(x["device_id"], []).append(x)
        out = []
        for d in devices:
            mine = sorted(by.get(d, []), key=lambda x: x["server_ts"])
            if on_release:
                mine = _warm([x for x in mine if x["release"] == ctx.row.release
                              and x["server_ts"] >= (ctx.devs[d]["assigned_at"] or ctx.now)],
                             ev.warmup_windows, ev.warmup_s)
            else:
                mine = [x for x in mine if x["release"] != ctx.row.release]
            if sum(int(x["requests"] or 0) >= MIN_WINDOW_REQUESTS for x in mine) >= MIN_BASELINE_WINDOWS:
                out.append(d)
        return out

    def _promoted(self, ctx: _Ctx, wave: int) -> list[str]:
        """Online devices of the waves before `wave` running the release: during `wave` their release does not
        change, so they are a control for it beside the devices still on the previous release (each against its
        own windows on the release before the wave: shared load that moves both cancels)."""
        return sorted((d for d, v in ctx.devs.items() if v["wave"] is not None and v["wave"] < wave
                       and v["assigned_at"] is not None and v["state"] in RAN_STATES and self._online(ctx, d)),
                      key=lambda d: order_key(ctx.row.id, d))

    def _stall(self, ctx: _Ctx, changes: dict[str, dict[str, Any]], opts: RolloutOptions) -> None:
        for dev, d in ctx.devs.items():
            if d["assigned_at"] is None or d["state"] not in ("assigned", *MOVING_STATES):
                continue
            # progress: a reported document (one at every swap state change); while it runs the release
            # (active, soaking), its telemetry too, since a long soak changes no state
            serving = d["state"] in (SwapState.ACTIVE, SwapState.SOAKING)
            quiet_since = max(d["assigned_at"], d["updated_at"], ctx.reported.get(dev, _NOTHING)[1],
                              (ctx.seen.get(dev) or 0.0) if serving else 0.0)
            if ctx.now - quiet_since > opts.stall_after_s:
                values = {"state": "catch_up", "updated_at": ctx.now,
                          "detail": f"no progress for {opts.stall_after_s:g} s"}
                changes.setdefault(dev, {}).update(values)
                d.update(values)

    def _catch_up(self, ctx: _Ctx, changes: dict[str, dict[str, Any]], *, assign: bool) -> None:
        """Catch-up devices heard from since they were set aside come back. While the rollout runs, one that
        already has the release rejoins the current wave and one that has not is pending again (a later
        wave takes it, the last one at the latest); after it succeeded (`assign`), each gets the release."""
        running = ctx.row.state == "running"
        for dev, d in ctx.devs.items():
            if d["state"] != "catch_up" or not self._online(ctx, dev, since=d["updated_at"]):
                continue
            values: dict[str, Any] = {"updated_at": ctx.now, "detail": "caught up"}
            if d["assigned_at"] is None and running:
                values.update(state="pending", wave=None)
            elif d["assigned_at"] is not None:  # it has the release already: its reports since count
                values.update(state="assigned", wave=ctx.row.wave)
            elif assign:
                values.update(state="assigned", assigned_at=ctx.now, wave=ctx.row.wave, catch_up_assign=True)
            else:
                continue
            changes.setdefault(dev, {}).update(values)
            d.update(values)

    def _figures(self, ctx: _Ctx, w: dict[str, Any], current: list[str], *, judged: bool = False,
                 control: list[str] | None = None, keep: bool = False) -> dict[str, Any]:
        """The wave's own devices against the control, each with its baseline: the devices still on the previous
        release (their windows on it before the wave) and the devices of earlier waves (`_promoted`: their windows
        on the release before the wave, past their own swap's warm-up), at most `control_max` in all (`control`:
        these devices instead). `judged`: the statistical gates have decided already (no arms). `keep`: the
        baselines are kept for the next step (`_Kept`, "cache": `evaluate`'s), and read once more when the wave is
        `SETTLE_S` old."""
        start = float(w["started_at"] or ctx.now)
        ev = ctx.opts.evidence
        release = ctx.row.release
        waiting = sorted((d for d, v in ctx.devs.items() if v["state"] in ("pending", "control")
                          and self._online(ctx, d)), key=lambda d: order_key(ctx.row.id, d))
        promoted = self._promoted(ctx, w["idx"])
        control = (waiting + promoted)[:ctx.opts.control_max] if control is None else control
        wins = self.cache.windows(sorted(set(current) | set(control)),
                                  min(start - ev.baseline_s, ctx.now - RATE_LOOKBACK_S), now=ctx.now)
        by: dict[str, list[dict[str, Any]]] = {}
        for x in wins:
            by.setdefault(x["device_id"], []).append(x)

        def pre(devs: list[str]) -> list[dict[str, Any]]:
            """Each device's windows before the wave, on the release it ran before this rollout where it sent
            any (else on whatever it ran: windows that name no release); a promoted device's on the release."""
            out = []
            for d in devs:
                if d in on_release:
                    out += [x for x in on_release[d] if start - ev.baseline_s <= x["server_ts"] < start]
                    continue
                before = [x for x in by.get(d, []) if x["release"] != release
                          and start - ev.baseline_s <= x["server_ts"] < start]
                on_previous = [x for x in before if x["release"] == ctx.devs[d]["previous"]]
                out += on_previous or before
            return out

        mine = {d: sorted((x for x in by.get(d, []) if x["release"] == release
                           and x["server_ts"] >= max(start, ctx.devs[d]["assigned_at"] or ctx.now)),
                          key=lambda x: x["server_ts"]) for d in current}
        post_wave = [x for d in current for x in mine[d][ev.warmup_windows:]]
        warm = {d: float(ws[0]["server_ts"]) + ev.warmup_s for d, ws in mine.items() if ws}
        on_release = {d: _warm(sorted((x for x in by.get(d, []) if x["release"] == release
                                       and x["server_ts"] >= (ctx.devs[d]["assigned_at"] or ctx.now)),
                                      key=lambda x: x["server_ts"]), ev.warmup_windows, ev.warmup_s)
                      for d in promoted if d in control}
        post_control = [x for d in control for x in (on_release[d] if d in on_release else by.get(d, []))
                        if x["server_ts"] >= start and (x["release"] == release) == (d in on_release)]
        kept = (self._baselines(ctx, w, current, control, sorted(on_release), pre, keep=keep)
                if control and current and not judged else None)
        arms = Arms(kept.pre_wave, post_wave, kept.pre_control, post_control, warm) if kept else None
        rates: dict[str, list[float]] = {}
        for x in wins:
            if x["server_ts"] >= ctx.now - RATE_LOOKBACK_S and x["window_s"] > 0:
                rates.setdefault(x["device_id"], []).append(x["requests"] / x["window_s"])
        rate = sum(sum(v) / len(v) for v in rates.values()) if rates else None
        if rate is not None and control:  # the control is a sample: scale to every targeted device
            rate *= len(ctx.devs) / max(1, len(rates))
        held = any(v["state"] == "control" for v in ctx.devs.values())
        kind = ("held back" if held else "cohort") if len(on_release) < len(control) else "earlier waves"
        if on_release and len(on_release) < len(control):
            kind += " and earlier waves"
        return {"arms": arms, "cache": kept.cache if kept else None, "wave": cohort(post_wave),
                "control": cohort(post_control), "control_kind": kind if arms else None, "request_rate": rate,
                "control_devices": {"previous": len(control) - len(on_release), "earlier_waves": len(on_release)}}

    def _baselines(self, ctx: _Ctx, w: dict[str, Any], current: list[str], control: list[str],
                   promoted: list[str], pre: Callable[[list[str]], list[dict[str, Any]]], *, keep: bool) -> _Kept:
        """The wave's and the control's baselines (`pre`), as the step before had them where nothing they depend
        on changed: the same lists, so that `evaluate` finds what it computed from them in its cache. They are
        read once more when the wave is `SETTLE_S` old: a window received just before it started may commit
        later (`window_cache`)."""
        settled = w["started_at"] is not None and ctx.now - float(w["started_at"]) >= SETTLE_S
        key = (ctx.row.id, w["idx"], w["started_at"], settled, tuple(current), tuple(control), tuple(promoted))
        old = self._kept.get(ctx.row.id)
        if keep and old is not None and old.key == key:
            return old
        kept = _Kept(key, pre(current), pre(control), {})
        if keep:
            self._kept[ctx.row.id] = kept
        return kept

    def _budget(self, release: str) -> float | None:
        try:
            return BudgetOverride.parse(self.releases.get(release)["budget"], where="the release's budget").latency_ms
        except FleetError:  # a release removed from the table: judge without a budget
            return None

    @staticmethod
    def _observe_due(conn: Any, rid: int, now: float, every: float) -> bool:
        dc = t.rollout_decisions.c
        last = conn.execute(sa.select(sa.func.max(dc.at)).where(dc.rollout_id == rid, dc.kind == "observe")).scalar()
        return last is None or now - float(last) >= every

    # -- writes --------------------------------------------------------------------------------

    def _write(self, conn: Any, ctx: _Ctx, changes: dict[str, dict[str, Any]], assign: dict[str, Desired],
               wave: int, wave_updates: dict[str, Any]) -> None:
        for dev, values in changes.items():
            if values.pop("catch_up_assign", False):
                assign[dev] = Desired(release=ctx.row.release, soak=Soak.parse(ctx.opts.soak))
        self.desired.assign(assign, conn=conn)
        rd = t.rollout_devices.c
        for dev, values in changes.items():
            conn.execute(t.rollout_devices.update().where(rd.rollout_id == ctx.row.id, rd.device_id == dev)
                         .values(**values))
        if wave_updates:
            conn.execute(t.rollout_waves.update().where(t.rollout_waves.c.rollout_id == ctx.row.id,
                                                        t.rollout_waves.c.idx == wave).values(**wave_updates))

    def _commit(self, ctx: _Ctx, changes: dict[str, dict[str, Any]]) -> None:
        if not changes:
            return
        with self.store.begin() as conn:
            self.lease.fence(conn, now=ctx.now)
            self._write(conn, ctx, changes, {}, ctx.row.wave, {})
            if ctx.row.state == "rolled_back" and not any(v["state"] == "rollback" for v in ctx.devs.values()):
                record(conn, ctx.row.id, None, "restored", {"restored": sum(
                    v["state"] == "restored" for v in ctx.devs.values())},
                    "every device given the release runs the previous one again", self.holder, now=ctx.now)

    def _roll_back(self, ctx: _Ctx, changes: dict[str, dict[str, Any]], kind: str, figures: dict[str, Any],
                   note: str, *, wave_updates: dict[str, Any] | None = None,
                   assign: dict[str, Desired] | None = None) -> None:
        with self.store.begin() as conn:
            self.lease.fence(conn, now=ctx.now)
            self._write(conn, ctx, changes, assign or {}, ctx.row.wave, wave_updates or {})
            self._roll_back_in(conn, ctx, kind, figures, note, ctx.row.wave)

    def _roll_back_in(self, conn: Any, ctx: _Ctx, kind: str, figures: dict[str, Any], note: str, wave: int) -> None:
        """Send every device that was given the release back to what it ran before; the rollout is over."""
        back: dict[str, Desired] = {}
        rd = t.rollout_devices.c
        phase = _pre_swap_phase(conn, ctx.row.id, wave)
        if phase is not None and phase.get("phase") == "start":  # auditing before a swap that never came
            back.update(dict.fromkeys(phase["devices"], Desired()))
        for dev, d in ctx.devs.items():
            if d["state"] in ("restored", "kept", "superseded"):
                continue
            if d["assigned_at"] is None:
                values = {"state": "kept", "updated_at": ctx.now}
            else:
                back[dev] = Desired(release=d["previous"] or ctx.row.previous, rollback=True)
                values = {"state": "rollback", "assigned_at": ctx.now, "updated_at": ctx.now}
            conn.execute(t.rollout_devices.update().where(rd.rollout_id == ctx.row.id, rd.device_id == dev)
                         .values(**values))
            d.update(values)
        self.desired.assign(back, conn=conn)
        conn.execute(t.rollouts.update().where(t.rollouts.c.id == ctx.row.id).values(
            state="rolled_back", reason=note, updated_at=ctx.now))
        record(conn, ctx.row.id, wave, kind, {**figures, "sent_back": len(back)}, note, self.holder, now=ctx.now)


def _warm(windows: list[dict[str, Any]], skip: int, warmup_s: float) -> list[dict[str, Any]]:
    """A device's windows on a release (in time order) past its swap's warm-up: the first `skip` windows and
    those within `warmup_s` of its first one (as a wave device's are for p95 and energy)."""
    if not windows:
        return []
    since = float(windows[0]["server_ts"]) + warmup_s
    return [x for x in windows[skip:] if float(x["server_ts"]) >= since]


def _pre_swap_phase(conn: Any, rollout_id: int, wave: int) -> dict[str, Any] | None:
    """The wave's latest `pre_swap` decision's figures, with its time (`at`); None where it had none."""
    dc = t.rollout_decisions.c
    row = conn.execute(sa.select(dc.at, dc.figures).where(
        dc.rollout_id == rollout_id, dc.wave == wave, dc.kind == "pre_swap").order_by(dc.id.desc()).limit(1)).first()
    return None if row is None else {**json.loads(row.figures), "at": float(row.at)}


def _decided(conn: Any, rollout_id: int, wave: int, kind: str) -> bool:
    """Whether the wave has a decision of this kind."""
    dc = t.rollout_decisions.c
    return bool(conn.execute(sa.select(sa.func.count()).where(
        dc.rollout_id == rollout_id, dc.wave == wave, dc.kind == kind)).scalar())
