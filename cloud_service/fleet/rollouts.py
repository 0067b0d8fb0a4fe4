"""Rollouts: a release deployed to the devices matching a selector, in waves gated on how the model behaves.

`Rollouts.deploy` records a rollout (waves, soak, gate margins, the cloud's capacity) and its
devices, each with the release it ran before; `RolloutEngine` (rollout_engine.py), running inside
`tierkit fleet serve` under a row lease, moves it on. Operators `pause`, `resume` and `rollback` by
hand. Every decision is a row in `rollout_decisions` with the figures it was made on.

Rollout states: running, paused, succeeded, rolled_back. Device states: pending (its wave has not
started), catch_up (offline when its wave started, or stalled), assigned (the release is in its
desired document), the swap states the device reports (downloading ... committed, refused,
rolled_back), rollback (the fleet sent it back), restored (it runs the previous release again),
kept (never took the release; the rollout was rolled back), superseded (a newer rollout took it).

Example:
    >>> rid = Rollouts(store, releases).deploy("sha256:...", {"kind": "cam"}, RolloutOptions(waves=("1", "100%")))
    >>> Rollouts(store, releases).show(rid)["waves"][0]["state"]
    'soaking'
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import sqlalchemy as sa

from cloud_service.fleet import schema as t
from cloud_service.fleet.desired import stored_reported
from cloud_service.fleet.errors import InvalidDocument, RolloutConflict, UnknownRollout
from cloud_service.fleet.gates import Evidence, Margins
from cloud_service.fleet.releases import ReleaseRegistry
from cloud_service.fleet.store import FleetStore
from cloud_service.protocol.fleet_docs import (
    IN_PROGRESS,
    RAN,
    ROLLOUT_MAX_SOAK,
    ROLLOUT_SOAK,
    WAVES,
    WAVES_TEXT,
)

ACTIVE = ("running", "paused")
MOVING_STATES = tuple(s.value for s in IN_PROGRESS)  # a swap not yet ended
RAN_STATES = tuple(s.value for s in RAN)
# device states the engine still has work for (a rollout stays open while any device is in one of them)
OPEN_STATES = ("catch_up", "control", "assigned", *MOVING_STATES, "rollback")


def parse_waves(text: str | list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """`1,5%,25%,100%` -> ("1", "5%", "25%", "100%"); counts or percentages, the last one 100%."""
    items = [s.strip() for s in (text.split(",") if isinstance(text, str) else text) if str(s).strip()]
    for s in items:
        m = re.fullmatch(r"(\d+(?:\.\d+)?)(%?)", s)
        if not m or float(m.group(1)) <= 0 or (m.group(2) and float(m.group(1)) > 100) or (
                not m.group(2) and not m.group(1).isdigit()):
            msg = f"wave {s!r} must be a device count (e.g. 1) or a percentage of the targeted devices (e.g. 5%)"
            raise InvalidDocument(msg)
    if not items or items[-1] != "100%":
        msg = f"waves {','.join(items)!r} must end with 100% (every targeted device), e.g. 1,5%,25%,100%"
        raise InvalidDocument(msg)
    return tuple(items)


def wave_sizes(waves: tuple[str, ...], n: int) -> list[int]:
    """Cumulative device counts: wave i ends when this many targeted devices have been assigned or skipped.

    Each wave adds at least one device while any is left (1,5% of 20 devices: 1, then 2), so that a
    bad release reaches at most the canary plus one device before the canary's figures are judged.
    """
    out, last = [], 0
    for s in waves:
        size = math.ceil(float(s[:-1]) / 100 * n) if s.endswith("%") else int(s)
        last = min(max(size, last + 1), n)
        out.append(last)
    return out


def parse_soak(text: str) -> dict[str, Any]:
    """`500` (requests) or `10m` / `90s` / `1h` (time) -> {"requests": 500} / {"seconds": 600}."""
    text = str(text).strip()
    if text.isdigit() and int(text) > 0:
        return {"requests": int(text)}
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([smh])", text)
    if not m or float(m.group(1)) <= 0:
        msg = f"--soak {text!r} must be a request count (e.g. 500) or a duration (e.g. 10m, 90s)"
        raise InvalidDocument(msg)
    return {"seconds": float(m.group(1)) * {"s": 1, "m": 60, "h": 3600}[m.group(2)]}


INCONCLUSIVE = ("hold", "extend", "rollback", "promote")


@dataclass(frozen=True)
class RolloutOptions:
    """Args:
    waves: cumulative wave sizes (`parse_waves`).
    soak: {"requests": N} or {"seconds": T}: the least a device runs the release before its wave may pass
        (and when the device commits it); the gates decide when the evidence suffices.
    margins: practically relevant differences the gates must tell apart (gates.Margins).
    evidence: the false-rollback rate over the whole rollout, the pass-side error, buckets, baselines
        (gates.Evidence).
    max_soak: a wave still inconclusive this long (time, or requests per device) after it started...
    on_inconclusive: ...is held for the operator (`hold`, the rollout pauses), soaks on (`extend`), is
        rolled back (`rollback`), or, after the canary, passes on the evidence of the waves before it (`promote`;
        a canary is held).
    holdback: share of the targeted devices (at least 2) the last wave keeps on the previous release as its
        control until its statistical gates pass, where fewer than that many devices of earlier waves (on the
        release, whose release does not change during the wave) have a baseline (enough windows on the
        release past their swap's warm-up) to serve as its control.
    control_max: the control cohort is at most this many devices (in the rollout's order).
    cloud_capacity_rps: escalations/s the cloud tier sustains (measured, e.g. bench/bench_cloud.py); None: not gated.
    audit_rate: while a small wave (at most `audit_devices` devices) soaks, its devices audit this share of their
        confident answers (`"audit_rate"` in their desired document; back to their own once the wave is decided):
        the evidence of confident errors, which escalations never see, within the canary. Audits are sent
        after the answer and their energy is counted apart, so the latency and energy gates do not see them.
    pre_swap_s: before such a wave's devices get the release, they audit at `audit_rate` on the release they run,
        until their audit baseline is narrow enough for the whole-stream gate to pass (its error from the baselines
        alone within a sixth of its margin, as a last wave's control's), for at most this many seconds (0: no
        such phase). At the agent's 1 %, an hour of a device's audits (about 290) leaves an error of about half a
        point that no soak of the release shrinks; a minute or two at 50 % halves it.
    stall_after_s: an assigned device that shows no progress for this long joins the catch-up set.
    observe_every_s: how often the figures of a soaking wave are recorded (the dashboard's plots).
    """

    waves: tuple[str, ...] = WAVES
    soak: dict[str, Any] = field(default_factory=lambda: parse_soak(ROLLOUT_SOAK))
    margins: Margins = field(default_factory=Margins)
    evidence: Evidence = field(default_factory=Evidence)
    max_soak: dict[str, Any] = field(default_factory=lambda: parse_soak(ROLLOUT_MAX_SOAK))
    on_inconclusive: str = "hold"
    holdback: float = 0.05
    control_max: int = 200
    cloud_capacity_rps: float | None = None
    audit_rate: float = 0.5
    audit_devices: int = 10
    stall_after_s: float = 300.0
    observe_every_s: float = 10.0
    pre_swap_s: float = 300.0

    def __post_init__(self) -> None:
        parse_waves(self.waves)
        for name, soak in (("soak", self.soak), ("max_soak", self.max_soak)):
            if set(soak) - {"requests", "seconds"} or len(soak) != 1:
                msg = f"{name} {soak!r} must be {{'requests': N}} or {{'seconds': T}}"
                raise InvalidDocument(msg)
        if self.on_inconclusive not in INCONCLUSIVE:
            msg = f"on_inconclusive {self.on_inconclusive!r} must be one of {', '.join(INCONCLUSIVE)}"
            raise InvalidDocument(msg)
        if not (0 <= self.holdback < 1 and self.control_max >= 1):
            msg = (f"holdback {self.holdback!r} must be a share in [0, 1) and control_max {self.control_max!r} "
                   "a device count >= 1")
            raise InvalidDocument(msg)
        if not (0 <= self.audit_rate <= 1 and self.audit_devices >= 0):
            msg = (f"audit_rate {self.audit_rate!r} must be a share in [0, 1] and audit_devices "
                   f"{self.audit_devices!r} a device count >= 0")
            raise InvalidDocument(msg)
        if not self.pre_swap_s >= 0:
            msg = f"pre_swap_s {self.pre_swap_s!r} must be seconds >= 0 (0: no pre-swap audit phase)"
            raise InvalidDocument(msg)
        if self.cloud_capacity_rps is not None and not self.cloud_capacity_rps > 0:
            msg = f"cloud capacity {self.cloud_capacity_rps!r} must be a positive number of escalations/s"
            raise InvalidDocument(msg)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> RolloutOptions:
        doc = json.loads(text)
        known = set(Margins.__dataclass_fields__)
        base = cls()
        return cls(waves=tuple(doc["waves"]), soak=doc["soak"],
                   margins=Margins(**{k: v for k, v in doc["margins"].items() if k in known}),
                   evidence=Evidence(**doc.get("evidence", {})), max_soak=doc.get("max_soak", base.max_soak),
                   on_inconclusive=doc.get("on_inconclusive", base.on_inconclusive),
                   holdback=doc.get("holdback", base.holdback), control_max=doc.get("control_max", base.control_max),
                   cloud_capacity_rps=doc.get("cloud_capacity_rps"), stall_after_s=doc["stall_after_s"],
                   audit_rate=doc.get("audit_rate", base.audit_rate),
                   audit_devices=doc.get("audit_devices", base.audit_devices),
                   observe_every_s=doc["observe_every_s"], pre_swap_s=doc.get("pre_swap_s", base.pre_swap_s))


def order_key(rollout_id: int, device_id: str) -> str:
    """Devices enter waves in a pseudo-random but stable order (not by id, which may follow sites)."""
    return hashlib.sha256(f"{rollout_id}/{device_id}".encode()).hexdigest()


def selector_text(labels: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items())) or "*"


class Rollouts:
    """Create, list, show and steer rollouts over a `FleetStore`."""

    def __init__(self, store: FleetStore, releases: ReleaseRegistry) -> None:
        self.store, self.releases = store, releases

    def deploy(self, release: str, labels: dict[str, str], options: RolloutOptions, *,
               previous: str | None = None) -> int:
        """Start a rollout of `release` (digest, prefix or NAME@VERSION) to the active devices with `labels`."""
        rel = self.releases.find(release)
        if previous is not None:
            previous = self.releases.find(previous)["digest"]
        now = time.time()
        with self.store.begin() as conn:
            devs = [r for r in conn.execute(sa.select(t.devices.c.device_id, t.devices.c.labels)
                                            .where(t.devices.c.revoked_at.is_(None)))
                    if all(json.loads(r.labels).get(k) == v for k, v in labels.items())]
            if not devs:
                msg = f"no active device matches {selector_text(labels)!r}; `tierkit fleet devices` lists them"
                raise InvalidDocument(msg)
            ids = sorted(d.device_id for d in devs)
            rd = t.rollout_devices.c
            busy = conn.execute(sa.select(rd.rollout_id, rd.device_id).join(
                t.rollouts, t.rollouts.c.id == rd.rollout_id).where(
                t.rollouts.c.state.in_((*ACTIVE, "rollback_asked")), rd.device_id.in_(ids))).first()
            if busy is not None:
                msg = (f"device {busy.device_id} is in rollout {busy.rollout_id}, which is still running or paused; "
                       f"let it finish or roll it back first")
                raise RolloutConflict(msg)
            reported = {r.device_id: stored_reported(r.document) for r in conn.execute(
                sa.select(t.reported.c.device_id, t.reported.c.document).where(t.reported.c.device_id.in_(ids)))}
            runs = {d: doc.release for d, doc in reported.items()}
            # a device an earlier rollout is sending back (not yet reported restored) runs, by the time this one
            # reaches it, the release it is sent back to; its report still names the release it leaves, and that
            # one, taken as its previous, would be its baseline and, were this rollout to fail, where it goes back
            runs.update({r.device_id: r.previous or r.rollout_previous for r in conn.execute(
                sa.select(rd.device_id, rd.previous, t.rollouts.c.previous.label("rollout_previous"))
                .join(t.rollouts, t.rollouts.c.id == rd.rollout_id)
                .where(rd.device_id.in_(ids), rd.state == "rollback")) if r.previous or r.rollout_previous})
            if previous is None:
                common = Counter(v for v in runs.values() if isinstance(v, str) and v != rel["digest"]).most_common(1)
                previous = common[0][0] if common else (rel["rollback_to"][-1] if rel["rollback_to"] else None)
            rid = int(conn.execute(t.rollouts.insert().values(
                release=rel["digest"], previous=previous, selector=selector_text(labels), options=options.to_json(),
                state="running", wave=0, reason="", created_at=now, updated_at=now)).inserted_primary_key[0])
            sizes = wave_sizes(options.waves, len(ids))
            conn.execute(t.rollout_waves.insert(), [{"rollout_id": rid, "idx": i, "spec": s, "size": n,
                                                     "state": "pending"} for i, (s, n) in
                                                    enumerate(zip(options.waves, sizes, strict=True))])
            # an older, finished rollout's catch-up or tracking of these devices ends here: this one owns them now
            conn.execute(t.rollout_devices.update().where(rd.device_id.in_(ids), rd.state.in_(OPEN_STATES))
                         .values(state="superseded", updated_at=now))
            conn.execute(t.rollout_devices.insert(), [
                {"rollout_id": rid, "device_id": d, "wave": None, "state": "pending",
                 "previous": runs.get(d) if isinstance(runs.get(d), str) and runs.get(d) != rel["digest"]
                 else previous, "ran": False,
                 "crashes0": reported[d].crashes if d in reported else 0, "assigned_at": None, "updated_at": now,
                 "detail": ""} for d in ids])
            note = f"{rel['name']}@{rel['version']} to {len(ids)} device(s) matching {selector_text(labels)!r}"
            if previous is not None and previous not in rel["rollback_to"]:
                note += (f"; warning: the release does not list {previous[:19]} in its rollback_to, so devices "
                         "may refuse the rollback unless it is the release in their other slot")
            record(conn, rid, None, "start", {"options": asdict(options), "devices": len(ids), "previous": previous},
                   note, "")
        return rid

    def list(self) -> list[dict[str, Any]]:
        with self.store.begin() as conn:
            rows = conn.execute(sa.select(t.rollouts).order_by(t.rollouts.c.id.desc())).all()
            counts: dict[int, Counter[str]] = {}
            for r in conn.execute(sa.select(t.rollout_devices.c.rollout_id, t.rollout_devices.c.state,
                                            sa.func.count()).group_by(t.rollout_devices.c.rollout_id,
                                                                      t.rollout_devices.c.state)):
                counts.setdefault(r[0], Counter())[r[1]] = int(r[2])
        return [{**_rollout_dict(r), "devices": dict(counts.get(r.id, {}))} for r in rows]

    def get(self, rollout_id: int) -> dict[str, Any]:
        with self.store.begin() as conn:
            row = conn.execute(sa.select(t.rollouts).where(t.rollouts.c.id == rollout_id)).first()
        if row is None:
            msg = f"no rollout {rollout_id}; `tierkit fleet rollouts` lists them"
            raise UnknownRollout(msg)
        return _rollout_dict(row)

    def show(self, rollout_id: int, *, decisions: int = 500) -> dict[str, Any]:
        """The rollout, its waves (each with its latest gates), devices by state, devices and decisions."""
        out = self.get(rollout_id)
        with self.store.begin() as conn:
            waves = [dict(w._mapping) for w in conn.execute(sa.select(t.rollout_waves).where(
                t.rollout_waves.c.rollout_id == rollout_id).order_by(t.rollout_waves.c.idx))]
            devs = [dict(d._mapping) for d in conn.execute(sa.select(t.rollout_devices).where(
                t.rollout_devices.c.rollout_id == rollout_id).order_by(t.rollout_devices.c.device_id))]
            dc = t.rollout_decisions.c
            rows = conn.execute(sa.select(t.rollout_decisions).where(dc.rollout_id == rollout_id)
                                .order_by(dc.id.desc()).limit(decisions)).all()
        decs = [dict(r._mapping, figures=json.loads(r.figures)) for r in reversed(rows)]
        for w in waves:
            w.pop("rollout_id", None)
            judged = [d for d in decs if d["wave"] == w["idx"] and d["figures"].get("gates")]
            # the latest look at which the statistical gates were tested (a last wave's final pass, once its
            # held-back control took the release, has no control left to test against)
            tested = [d for d in judged if any("estimate" in g for g in d["figures"]["gates"])] or judged
            w["gates"] = tested[-1]["figures"]["gates"] if tested else []
            w["figures"] = {k: tested[-1]["figures"].get(k) for k in ("wave", "control", "control_kind")} \
                if tested else {}
            w["devices"] = dict(Counter(d["state"] for d in devs if d["wave"] == w["idx"]))
        out.update(waves=waves, states=dict(Counter(d["state"] for d in devs)), device_list=devs, decisions=decs)
        return out

    def pause(self, rollout_id: int, *, by: str = "operator") -> dict[str, Any]:
        return self._move(rollout_id, "running", "paused", "pause", by)

    def resume(self, rollout_id: int, *, by: str = "operator") -> dict[str, Any]:
        return self._move(rollout_id, "paused", "running", "resume", by)

    def request_rollback(self, rollout_id: int, *, by: str = "operator") -> dict[str, Any]:
        """Ask for a rollback; the engine carries it out on its next step (within about a second)."""
        r = self.get(rollout_id)
        if r["state"] not in (*ACTIVE, "succeeded"):
            msg = (f"rollout {rollout_id} is {r['state']}; only a running, paused or succeeded rollout can be "
                   "rolled back")
            raise RolloutConflict(msg)
        with self.store.begin() as conn:
            conn.execute(t.rollouts.update().where(t.rollouts.c.id == rollout_id).values(
                state="rollback_asked", reason=f"rollback asked by {by}", updated_at=time.time()))
            record(conn, rollout_id, r["wave"], "rollback_asked", {}, f"by {by}", "")
        return self.get(rollout_id)

    def _move(self, rollout_id: int, src: str, dst: str, kind: str, by: str) -> dict[str, Any]:
        with self.store.begin() as conn:
            n = conn.execute(t.rollouts.update().where(t.rollouts.c.id == rollout_id, t.rollouts.c.state == src)
                             .values(state=dst, updated_at=time.time())).rowcount
            if n == 1:
                row = conn.execute(sa.select(t.rollouts.c.wave).where(t.rollouts.c.id == rollout_id)).scalar_one()
                record(conn, rollout_id, int(row), kind, {}, f"by {by}", "")
        if n != 1:
            state = self.get(rollout_id)["state"]
            msg = f"rollout {rollout_id} is {state}, not {src}; cannot {kind} it"
            raise RolloutConflict(msg)
        return self.get(rollout_id)


def record(conn: Any, rollout_id: int, wave: int | None, kind: str, figures: dict[str, Any], note: str,
           holder: str, *, now: float | None = None) -> None:
    conn.execute(t.rollout_decisions.insert().values(
        rollout_id=rollout_id, wave=wave, at=time.time() if now is None else now, kind=kind,
        figures=json.dumps(figures, sort_keys=True, default=str), note=note, holder=holder))


def _rollout_dict(row: Any) -> dict[str, Any]:
    d = dict(row._mapping)
    d["options"] = json.loads(d["options"])
    return d


def make_options(*, waves: str = WAVES_TEXT, soak: str = ROLLOUT_SOAK, cloud_capacity_rps: float | None = None,
                 stall_after_s: float = 300.0, observe_every_s: float = 10.0,
                 margins: dict[str, Any] | None = None, evidence: dict[str, Any] | None = None,
                 max_soak: str = ROLLOUT_MAX_SOAK, on_inconclusive: str = "hold", holdback: float = 0.05,
                 control_max: int = 200, audit_rate: float = 0.5, audit_devices: int = 10,
                 pre_swap_s: float = 300.0) -> RolloutOptions:
    """`RolloutOptions` from the CLI's and the API's strings (`--waves 1,5%,100% --soak 10m`)."""
    try:
        m = Margins(**{k: v for k, v in (margins or {}).items() if v is not None})
    except TypeError as exc:
        msg = f"unknown margin: {exc}; margins are {', '.join(Margins.__dataclass_fields__)}"
        raise InvalidDocument(msg) from None
    try:
        e = Evidence(**{k: v for k, v in (evidence or {}).items() if v is not None})
    except TypeError as exc:
        msg = f"unknown evidence option: {exc}; they are {', '.join(Evidence.__dataclass_fields__)}"
        raise InvalidDocument(msg) from None
    return RolloutOptions(waves=parse_waves(waves), soak=parse_soak(soak), margins=m, evidence=e,
                          max_soak=parse_soak(max_soak), on_inconclusive=on_inconclusive, holdback=holdback,
                          control_max=control_max, cloud_capacity_rps=cloud_capacity_rps, audit_rate=audit_rate,
                          audit_devices=audit_devices, pre_swap_s=pre_swap_s,
                          stall_after_s=stall_after_s, observe_every_s=observe_every_s)
