"""The fleet's documents, part of the wire contract: desired, reported and telemetry, with the swap states.

Each document is a frozen type with one parser, used where its JSON comes in (the agent for desired, the
fleet's ingest for reported and telemetry); inside, fields are attributes, never string keys. A parser
raises `ConfigError` naming the field and the value. The defaults live here, next to their types.

```
desired    tierkit/v1/{device}/desired (retained, fleet -> device)
           {"version": 7, "budget": {"latency_ms": 25}, "threshold": 0.8, "telemetry_interval_s": 60,
            "release": "sha256:...", "soak": {"requests": 200}, "rollback": false}
reported   tierkit/v1/{device}/reported (retained, device -> fleet): what runs, the swap, slots, golden check
           {"device": "dev-1a2b", "boot_id": "...", "desired_version": 7, "budget": {...}, "threshold": 0.8,
            "variant": "int8", "model_digest": "sha256:...", "release": "sha256:..." | null,
            "swap": {"state": "soaking", "target": "sha256:...", "since": 1.7e9, "soak": {"requests": 40}},
            "slots": {"A": "sha256:...", "B": null, "active": "A"}, "golden": {"ok": true, ...}, "crashes": 0}
telemetry  tierkit/v1/{device}/telemetry: one window of aggregates (`TelemetryWindow`)
```

Example:
    >>> desired = parse_desired(b'{"version": 3, "release": null}')
    >>> desired.release is None, desired.soak_or_default()
    (True, Soak(requests=200, seconds=None))
"""

from __future__ import annotations

import enum
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final, NoReturn

from runtimes.budget import Budget, BudgetOverride
from runtimes.errors import ConfigError


class SwapState(enum.StrEnum):
    """The steps of taking a release on a device (`edge_agent.swap`), in order, then how a swap ends."""

    DOWNLOADING = "downloading"
    VERIFYING = "verifying"
    STAGED = "staged"
    GOLDEN = "golden"
    ACTIVE = "active"
    SOAKING = "soaking"
    COMMITTED = "committed"
    ROLLED_BACK = "rolled_back"
    REFUSED = "refused"

    @property
    def pre_active(self) -> bool:
        """Before the new release serves: a kill here leaves the committed release running."""
        return self in PRE_ACTIVE

    @property
    def live(self) -> bool:
        """The new release serves but is not committed."""
        return self in LIVE

    @property
    def final(self) -> bool:
        return self in FINAL


PRE_ACTIVE: Final = (SwapState.DOWNLOADING, SwapState.VERIFYING, SwapState.STAGED, SwapState.GOLDEN)
LIVE: Final = (SwapState.ACTIVE, SwapState.SOAKING)
IN_PROGRESS: Final = (*PRE_ACTIVE, *LIVE)  # a swap still moving (not ended)
FINAL: Final = (SwapState.COMMITTED, SwapState.ROLLED_BACK, SwapState.REFUSED)
RAN: Final = (SwapState.ACTIVE, SwapState.SOAKING, SwapState.COMMITTED)  # the release served requests

# -- defaults (one place) ---------------------------------------------------------------------------
DEVICE_SOAK_REQUESTS: Final = 200  # a desired release without "soak" is committed after this many requests
ROLLOUT_SOAK: Final = "50"  # `tierkit fleet deploy --soak`: requests (or a duration such as 10m) per device
ROLLOUT_MAX_SOAK: Final = "30m"  # ...and how long a wave may stay inconclusive
WAVES: Final = ("1", "5%", "25%", "100%")  # cumulative wave sizes of a rollout
WAVES_TEXT: Final = ",".join(WAVES)
MIN_TELEMETRY_INTERVAL_S: Final = 1.0
MAX_TELEMETRY_INTERVAL_S: Final = 86400.0
DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")


class Unset(enum.Enum):
    UNSET = "unset"


UNSET: Final = Unset.UNSET  # a key the document does not carry (unlike null, which it sets)

# -- field readers (the only string-keyed reads of the documents) ------------------------------------


_PROSE = frozenset({"error", "reason"})


class _Fields:
    """Typed reads of one JSON object; every error names `where.field` and the value."""

    def __init__(self, value: object, where: str, *, known: tuple[str, ...] | None = None) -> None:
        if isinstance(value, bytes | str):
            try:
                value = json.loads(value)
            except ValueError as exc:
                msg = f"{where} is not JSON ({exc})"
                raise ConfigError(msg) from None
        if not isinstance(value, Mapping):
            msg = f"{where} must be a JSON object, got {str(value)[:80]!r}"
            raise ConfigError(msg)
        self.doc, self.where = value, where
        if known is not None:
            unknown = sorted(set(value) - set(known))
            if unknown:
                msg = f"{where}: unknown field {unknown[0]!r}; the fields are {', '.join(known)}"
                raise ConfigError(msg)

    def has(self, name: str) -> bool:
        return name in self.doc

    def raw(self, name: str) -> Any:
        return self.doc.get(name)

    def reject(self, name: str, want: str) -> NoReturn:
        msg = f"{self.where}.{name} must be {want}, got {str(self.doc.get(name))[:80]!r}"
        raise ConfigError(msg)

    def number(self, name: str, default: float | None = 0.0, *, lo: float | None = None, hi: float | None = None,
               above: float | None = None) -> float | None:
        v = self.doc.get(name)
        if v is None:
            return default
        ok = isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
        ok = ok and (lo is None or v >= lo) and (hi is None or v <= hi) and (above is None or v > above)
        if not ok:
            bounds = "".join((f" >= {lo}" if lo is not None else "", f" > {above}" if above is not None else "",
                              f" <= {hi}" if hi is not None else ""))
            self.reject(name, f"a finite number{bounds}")
        return float(v)

    def real(self, name: str, default: float = 0.0, *, lo: float | None = None, hi: float | None = None) -> float:
        v = self.number(name, default, lo=lo, hi=hi)
        return default if v is None else v

    def integer(self, name: str, default: int | None = 0, *, lo: int = 0, hi: int = 2**62) -> int | None:
        v = self.doc.get(name)
        if v is None:
            return default
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        if not (isinstance(v, int) and not isinstance(v, bool) and lo <= v < hi):
            self.reject(name, f"an integer in [{lo}, {hi})")
        return int(v)

    def count(self, name: str) -> int:
        v = self.integer(name, 0)
        return 0 if v is None else v

    def text(self, name: str, default: str | None = "", *, max_len: int = 128, min_len: int = 0) -> str | None:
        v = self.doc.get(name)
        if v is None:
            if min_len:
                self.reject(name, f"a string of {min_len} to {max_len} characters")
            return default
        if name in _PROSE and isinstance(v, str):  # an explanation for people: cut, never refused for its length
            v = v.replace("\x00", "")[:max_len]
        if not (isinstance(v, str) and min_len <= len(v) <= max_len and "\x00" not in v):
            self.reject(name, f"a string of {min_len} to {max_len} characters (no NUL)")
        return v

    def flag(self, name: str, default: bool = False) -> bool:
        v = self.doc.get(name)
        if v is None:
            return default
        if not isinstance(v, bool):
            self.reject(name, "true or false")
        return v

    def digest(self, name: str) -> str | None:
        v = self.doc.get(name)
        if v is not None and not (isinstance(v, str) and DIGEST.match(v)):
            self.reject(name, 'a release digest "sha256:<64 hex>" or null')
        return v

    def counts(self, name: str) -> dict[str, int]:
        v = self.doc.get(name)
        if v is None:
            return {}
        if not (isinstance(v, Mapping) and all(isinstance(k, str) and isinstance(n, int) and not isinstance(n, bool)
                                               and n >= 0 for k, n in v.items())):
            self.reject(name, "a mapping of names to counts")
        return {str(k): int(n) for k, n in v.items()}

    def nested(self, name: str) -> _Fields | None:
        v = self.doc.get(name)
        return None if v is None else _Fields(v, f"{self.where}.{name}")


# -- desired ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Soak:
    """How long a device runs a new release before it commits it: N requests and/or T seconds (both, when
    both are given). Example: `Soak(requests=200)`."""

    requests: int | None = None
    seconds: float | None = None

    def __post_init__(self) -> None:
        if self.requests is None and self.seconds is None:
            msg = 'soak must set "requests" or "seconds"'
            raise ConfigError(msg)
        if self.requests is not None and not (isinstance(self.requests, int) and self.requests >= 0):
            msg = f"soak.requests must be a count >= 0, got {self.requests!r}"
            raise ConfigError(msg)
        if self.seconds is not None and not (math.isfinite(self.seconds) and self.seconds >= 0):
            msg = f"soak.seconds must be a duration >= 0, got {self.seconds!r}"
            raise ConfigError(msg)

    @classmethod
    def parse(cls, value: object, *, where: str = "soak") -> Soak:
        f = _Fields(value, where, known=("requests", "seconds"))
        return cls(requests=f.integer("requests", None), seconds=f.number("seconds", None, lo=0))

    def reached(self, progress: SoakProgress) -> bool:
        return ((self.requests is None or progress.requests >= self.requests)
                and (self.seconds is None or progress.seconds >= self.seconds))

    def to_json(self) -> dict[str, float]:
        out: dict[str, float] = {}
        if self.requests is not None:
            out["requests"] = self.requests
        if self.seconds is not None:
            out["seconds"] = self.seconds
        return out


DEFAULT_SOAK: Final = Soak(requests=DEVICE_SOAK_REQUESTS)


@dataclass(frozen=True)
class Desired:
    """What the fleet wants a device to run (`tierkit/v1/{device}/desired`); a layer sets some of it.

    `threshold` and `release` distinguish a key the document does not carry (`UNSET`) from null: a null
    threshold clears the override, a null release goes back to the device's configured model.

    Args:
        version: the fleet's version of the effective document (None in a layer).
        budget: the budget fields it sets over the device's.
        threshold: the escalation threshold.
        telemetry_interval_s: seconds between telemetry windows.
        release: the digest of the release to run.
        soak: how long to run it before committing (None: `DEFAULT_SOAK`).
        rollback: the release is a rollback target (informational for the device).
        audit_rate: the share of confident answers the device audits (a rollout raises it on a small wave's
            devices while the wave soaks); None: the device's own.
    """

    version: int | None = None
    budget: BudgetOverride | None = None
    threshold: float | Unset | None = UNSET
    telemetry_interval_s: float | None = None
    release: str | Unset | None = UNSET
    soak: Soak | None = None
    rollback: bool | None = None
    audit_rate: float | None = None

    def soak_or_default(self) -> Soak:
        return self.soak if self.soak is not None else DEFAULT_SOAK

    def is_empty(self) -> bool:
        return not self.to_json()

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.version is not None:
            out["version"] = self.version
        if self.budget is not None:
            out["budget"] = self.budget.to_json()
        if self.threshold is not UNSET:
            out["threshold"] = self.threshold
        if self.telemetry_interval_s is not None:
            out["telemetry_interval_s"] = self.telemetry_interval_s
        if self.release is not UNSET:
            out["release"] = self.release
        if self.soak is not None:
            out["soak"] = self.soak.to_json()
        if self.rollback is not None:
            out["rollback"] = self.rollback
        if self.audit_rate is not None:
            out["audit_rate"] = self.audit_rate
        return out


DESIRED_FIELDS: Final = ("version", "budget", "threshold", "telemetry_interval_s", "release", "soak", "rollback",
                         "audit_rate")


def parse_desired(value: object, *, where: str = "desired document") -> Desired:
    """A desired document (JSON bytes, text or a parsed mapping); `ConfigError` naming the field."""
    f = _Fields(value, where, known=DESIRED_FIELDS)
    budget = f.raw("budget")
    soak = f.raw("soak")
    rollback = f.raw("rollback")
    if rollback is not None and not isinstance(rollback, bool):
        f.reject("rollback", "true or false")
    return Desired(
        version=f.integer("version", None),
        budget=None if budget is None else BudgetOverride.parse(budget, where=f"{where}.budget"),
        threshold=f.number("threshold", None, lo=0, hi=1) if f.has("threshold") else UNSET,
        telemetry_interval_s=f.number("telemetry_interval_s", None, lo=MIN_TELEMETRY_INTERVAL_S,
                                      hi=MAX_TELEMETRY_INTERVAL_S),
        release=f.digest("release") if f.has("release") else UNSET,
        soak=None if soak is None else Soak.parse(soak, where=f"{where}.soak"),
        rollback=rollback, audit_rate=f.number("audit_rate", None, lo=0, hi=1))


# -- reported -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SoakProgress:
    """How far a soak has come: requests served and seconds run on the new release."""

    requests: int = 0
    seconds: float = 0.0

    def to_json(self) -> dict[str, float]:
        return {"requests": self.requests, "seconds": self.seconds}


@dataclass(frozen=True)
class SwapReport:
    """The swap in progress, or the last one: its state, the release it takes, since when, why it ended."""

    state: SwapState
    target: str | None
    since: float = 0.0
    error: str | None = None
    soak: SoakProgress | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"state": self.state.value, "target": self.target, "since": self.since}
        if self.error is not None:
            out["error"] = self.error
        if self.soak is not None:
            out["soak"] = self.soak.to_json()
        return out


@dataclass(frozen=True)
class GoldenReport:
    """The recommended rung's golden check on the device (`compilers.golden`)."""

    ok: bool
    max_rel_error: float | None = None
    variant: str | None = None
    tolerance: float | None = None
    reason: str | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"ok": self.ok, "max_rel_error": self.max_rel_error}
        for name, value in (("variant", self.variant), ("tolerance", self.tolerance), ("reason", self.reason)):
            if value is not None:
                out[name] = value
        return out


@dataclass(frozen=True)
class SlotsReport:
    """What each A/B slot holds and which one runs."""

    a: str | None = None
    b: str | None = None
    active: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"A": self.a, "B": self.b, "active": self.active}


@dataclass(frozen=True)
class Reported:
    """What a device runs, as it reports it (`tierkit/v1/{device}/reported`).

    Args:
        device: the device id (None: not named; the topic names it).
        boot_id: this run of the agent.
        desired_version: the version of the last desired document that took effect.
        budget, threshold, variant: what the agent holds now.
        model_digest: the digest of the model that runs.
        release: the release that runs (None: the configured model).
        swap, slots, golden, crashes: the swap journal's view (enrolled agents).
        error: why the last desired document was not applied.
    """

    device: str | None = None
    boot_id: str = ""
    desired_version: int | None = None
    budget: Budget | None = None
    threshold: float | None = None
    variant: str = ""
    model_digest: str = ""
    release: str | None = None
    swap: SwapReport | None = None
    slots: SlotsReport | None = None
    golden: GoldenReport | None = None
    crashes: int = 0
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"device": self.device, "boot_id": self.boot_id}
        if self.desired_version is not None:
            out["desired_version"] = self.desired_version
        if self.error is not None:
            out["error"] = self.error
        out.update(budget=None if self.budget is None else self.budget.to_json(), threshold=self.threshold,
                   variant=self.variant)
        if self.model_digest:
            out["model_digest"] = self.model_digest
        if self.slots is not None:  # an enrolled agent: its swap journal
            out.update(release=self.release, swap=None if self.swap is None else self.swap.to_json(),
                       slots=self.slots.to_json(), golden=None if self.golden is None else self.golden.to_json(),
                       crashes=self.crashes)
        elif self.release is not None:
            out["release"] = self.release
        return out


def _swap(f: _Fields | None) -> SwapReport | None:
    if f is None:
        return None
    state = f.raw("state")
    if state not in SwapState.__members__.values():
        f.reject("state", f"one of {', '.join(SwapState)}")
    progress = f.nested("soak")
    return SwapReport(SwapState(state), f.text("target", None, max_len=128), f.real("since"),
                      f.text("error", None, max_len=4096),
                      None if progress is None else SoakProgress(progress.count("requests"), progress.real("seconds")))


def _golden(f: _Fields | None) -> GoldenReport | None:
    if f is None:
        return None
    return GoldenReport(f.flag("ok"), f.number("max_rel_error", None), f.text("variant", None),
                        f.number("tolerance", None), f.text("reason", None, max_len=4096))


def _slots(f: _Fields | None) -> SlotsReport | None:
    if f is None:
        return None
    active = f.text("active", None, max_len=1)
    if active not in (None, "A", "B"):
        f.reject("active", '"A", "B" or null')
    return SlotsReport(f.text("A", None), f.text("B", None), active)


def _budget(f: _Fields, where: str) -> Budget | None:
    value = f.raw("budget")
    if value is None:
        return None
    return BudgetOverride.parse(value, where=f"{where}.budget").apply(Budget())


def parse_reported(value: object, *, where: str = "reported document") -> Reported:
    """A reported document (unknown fields are ignored: a newer agent may send more)."""
    f = _Fields(value, where)
    return Reported(device=f.text("device", None, min_len=0), boot_id=f.text("boot_id", "", max_len=64) or "",
                    desired_version=f.integer("desired_version", None), budget=_budget(f, where),
                    threshold=f.number("threshold", None), variant=f.text("variant") or "",
                    model_digest=f.text("model_digest") or "", release=f.text("release", None),
                    swap=_swap(f.nested("swap")), slots=_slots(f.nested("slots")), golden=_golden(f.nested("golden")),
                    crashes=f.count("crashes"), error=f.text("error", None, max_len=4096))


# -- telemetry ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LatencyHistogram:
    """Counts of a window's latencies under each bound (ms); the last count is above the last bound."""

    bounds_ms: tuple[float, ...]
    counts: tuple[int, ...]

    def to_json(self) -> dict[str, list[float] | list[int]]:
        return {"bounds_ms": list(self.bounds_ms), "counts": list(self.counts)}


@dataclass(frozen=True)
class TelemetryWindow:
    """One telemetry window: a device's aggregates since its previous window, unique by (boot_id, seq).

    Counters are this window's; `degraded_reasons` counts why answers degraded, by the reasons a
    `Prediction` carries ("timeout", "unavailable", "breaker_open", "rtt", ...). Audit fields come from
    `edge_agent.audit.window_fields`; `compared`, `audits`, `audit_rate` and `audit_disagreed` may be given
    as such (a simulated device), else the gates derive them. `decision` is the controller's decision in
    force, carried for people (the dashboard) and not read by the fleet.
    """

    device: str
    boot_id: str
    seq: int
    ts: float
    window_s: float = 0.0
    requests: int = 0
    edge: int = 0
    cloud: int = 0
    p50_ms: float = 0.0
    p95_ms: float = 0.0
    latency_hist: LatencyHistogram | None = None
    escalation_rate: float = 0.0
    cloud_refused: int = 0  # escalations sent in the window that the cloud refused (busy)
    agreement: float | None = None
    energy_mj_per_request: float = 0.0
    energy_label: str = ""
    degraded: int = 0
    degraded_reasons: Mapping[str, int] = field(default_factory=dict)
    variant: str = ""
    threshold: float | None = None
    model_digest: str = ""
    release: str | None = None
    crashes: int = 0
    audited: int = 0
    audit_agreement: float | None = None
    agreement_est: float | None = None
    agreement_low: float | None = None
    agreement_high: float | None = None
    data_drift: bool = False
    drift_events: int = 0
    compared: int | None = None
    audits: int = 0
    audit_rate: float | None = None
    audit_disagreed: int = 0
    decision: Mapping[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "device": self.device, "boot_id": self.boot_id, "seq": self.seq, "ts": self.ts, "window_s": self.window_s,
            "requests": self.requests, "tiers": {"edge": self.edge, "cloud": self.cloud}, "p50_ms": self.p50_ms,
            "p95_ms": self.p95_ms, "latency_hist": None if self.latency_hist is None else self.latency_hist.to_json(),
            "escalation_rate": self.escalation_rate, "cloud_refused": self.cloud_refused, "agreement": self.agreement,
            "energy_mj_per_request": self.energy_mj_per_request, "energy_label": self.energy_label,
            "degraded": self.degraded, "degraded_reasons": dict(self.degraded_reasons), "variant": self.variant,
            "threshold": self.threshold, "model_digest": self.model_digest, "release": self.release,
            "crashes": self.crashes, "decision": None if self.decision is None else dict(self.decision),
            "audited": self.audited, "audit_agreement": self.audit_agreement, "agreement_est": self.agreement_est,
            "agreement_low": self.agreement_low, "agreement_high": self.agreement_high,
            "data_drift": self.data_drift, "drift_events": self.drift_events}
        if self.compared is not None:
            out["compared"] = self.compared
        if self.audit_rate is not None:
            out.update(audits=self.audits, audit_rate=self.audit_rate, audit_disagreed=self.audit_disagreed)
        return out


def _share(f: _Fields, name: str) -> float | None:
    return f.number(name, None, lo=0, hi=1)


def _histogram(f: _Fields | None) -> LatencyHistogram | None:
    if f is None:
        return None
    bounds, counts = f.raw("bounds_ms"), f.raw("counts")
    if not (isinstance(bounds, list) and all(isinstance(b, int | float) and not isinstance(b, bool) for b in bounds)):
        f.reject("bounds_ms", "a list of numbers")
    if not (isinstance(counts, list) and len(counts) == len(bounds) + 1
            and all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in counts)):
        f.reject("counts", "one count per bound and one above them")
    return LatencyHistogram(tuple(float(b) for b in bounds), tuple(int(c) for c in counts))


def parse_telemetry(value: object, *, where: str = "telemetry window") -> TelemetryWindow:
    """A telemetry window (unknown fields are ignored: a newer agent may send more)."""
    f = _Fields(value, where)
    tiers = f.nested("tiers")
    requests = f.count("requests")
    decision = f.raw("decision")
    return TelemetryWindow(
        device=f.text("device", min_len=1) or "", boot_id=f.text("boot_id", min_len=1, max_len=64) or "",
        seq=f.count("seq") if f.has("seq") else _missing(f, "seq"),
        ts=f.real("ts") if f.has("ts") else _missing(f, "ts"),
        window_s=f.real("window_s", lo=0), requests=requests,
        edge=tiers.count("edge") if tiers is not None else requests,
        cloud=tiers.count("cloud") if tiers is not None else 0,
        p50_ms=f.real("p50_ms", lo=0), p95_ms=f.real("p95_ms", lo=0), latency_hist=_histogram(f.nested("latency_hist")),
        escalation_rate=f.real("escalation_rate", lo=0, hi=1), cloud_refused=f.count("cloud_refused"),
        agreement=_share(f, "agreement"),
        energy_mj_per_request=f.real("energy_mj_per_request", lo=0), energy_label=f.text("energy_label", max_len=64)
        or "", degraded=f.count("degraded"), degraded_reasons=f.counts("degraded_reasons"),
        variant=f.text("variant") or "", threshold=f.number("threshold", None), model_digest=f.text("model_digest")
        or "", release=f.text("release", None), crashes=f.count("crashes"), audited=f.count("audited"),
        audit_agreement=_share(f, "audit_agreement"), agreement_est=_share(f, "agreement_est"),
        agreement_low=_share(f, "agreement_low"), agreement_high=_share(f, "agreement_high"),
        data_drift=f.flag("data_drift"), drift_events=f.integer("drift_events", 0, lo=-(2**62)) or 0,
        compared=f.integer("compared", None), audits=f.count("audits"), audit_rate=_share(f, "audit_rate"),
        audit_disagreed=f.count("audit_disagreed"),
        decision=decision if isinstance(decision, Mapping) else None)


def _missing(f: _Fields, name: str) -> Any:
    f.reject(name, "present")
