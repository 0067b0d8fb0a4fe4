"""Fleet sync, the agent's side of the fleet service: enrollment, desired and reported state, telemetry windows.

Enrollment: the agent generates its own EC key, sends a CSR with the one-time token to
`POST {fleet}/v1/enroll`, and keeps what comes back (device id, certificate signed by the fleet CA,
the CA certificate, MQTT user and password) in a state directory with the key, so a restart reuses
the identity instead of enrolling again. The private key never leaves the device.

Desired and reported (`FleetSync`): a desired document is parsed once (`fleet_docs.parse_desired`) and
applied: budget and threshold over the serving agent (and every agent a swap builds), the telemetry
interval, and the release, which goes to the swapper. The swap's transitions come back here
(`async for step in swapper.transitions(...)`): the daemon serves from the new agent at `active`, and
each step is reported. A reported document is built from the one holder of what runs, the slot store,
and the serving agent, and published (retained) in the order reports are made.

Telemetry windows: the agent's counters are cumulative since it started; `TelemetryWindows` turns
successive snapshots into per-window aggregates (requests, tier mix, latency quantiles, escalation
rate, energy per request with its label, degraded count and reasons, variant and threshold; audits, the
whole-stream agreement estimate with its interval and the data-drift flag, `edge_agent.audit.window_fields`),
each with the boot id and a sequence number the fleet deduplicates by.

Example:
    >>> identity = enroll("http://fleet:8080", "tke_...", Path("/var/lib/tierkit"))
    >>> identity.device_id
    'dev-1a2b3c4d5e6f'
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import importlib.metadata
import json
import logging
import os
import ssl
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from cloud_service.protocol import topics
from cloud_service.protocol.fleet_docs import (
    UNSET,
    Desired,
    LatencyHistogram,
    Reported,
    TelemetryWindow,
    Unset,
    parse_desired,
)
from edge_agent.audit import window_fields
from runtimes.budget import BudgetOverride
from runtimes.errors import ConfigError, TierkitError

if TYPE_CHECKING:
    from edge_agent.agent import EdgeAgent
    from edge_agent.config import AgentConfig
    from edge_agent.daemon import AgentDaemon
    from edge_agent.slots import SlotStore
    from edge_agent.swap import Swapper

logger = logging.getLogger(__name__)


class EnrollmentError(TierkitError):
    """The fleet refused the enrollment, or could not be reached."""


@dataclass(frozen=True)
class FleetIdentity:
    """What enrollment gave this device; paths point into the state directory."""

    device_id: str
    fleet_url: str
    labels: dict[str, str]
    key_file: str
    cert_file: str
    ca_file: str
    mqtt_username: str
    mqtt_password: str


def generate_key_and_csr(name: str = "tierkit-device") -> tuple[bytes, str]:
    """A fresh P-256 key (PEM, PKCS8) and a CSR over it (PEM). The fleet names the device, not the CSR."""
    key = ec.generate_private_key(ec.SECP256R1())
    csr = (x509.CertificateSigningRequestBuilder()
           .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
           .sign(key, hashes.SHA256()))
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    return key_pem, csr.public_bytes(serialization.Encoding.PEM).decode()


def load_identity(state_dir: Path) -> FleetIdentity | None:
    path = state_dir / "fleet.json"
    if not path.exists():
        return None
    try:
        return FleetIdentity(**json.loads(path.read_text()))
    except (ValueError, TypeError) as exc:
        msg = f"{path} is not a fleet identity ({exc}); remove it to enroll again"
        raise ConfigError(msg) from None


def https_context(url: str, ca_file: str | Path | None) -> ssl.SSLContext | None:
    """The TLS context for an `https://` fleet url (verifying against `ca_file`, else the system's CAs)."""
    if not url.startswith("https://"):
        return None
    try:
        return ssl.create_default_context(cafile=str(ca_file) if ca_file else None)
    except (OSError, ssl.SSLError) as exc:
        msg = f"cannot load the fleet's CA file {str(ca_file)!r}: {exc}; check fleet.ca_file (--fleet-ca)"
        raise ConfigError(msg) from None


ENROLL_BACKOFF_MAX_S = 15.0
ENROLL_RETRY_S = 300.0  # how long a starting agent keeps asking a fleet it cannot reach


def enroll(fleet_url: str, token: str, state_dir: Path, *, hardware: dict[str, Any] | None = None,
           agent_version: str = "", timeout_s: float = 10.0, ca_file: str | Path | None = None,
           retry_s: float = 0.0) -> FleetIdentity:
    """Enroll once: reuse the identity in `state_dir` when there is one, else exchange `token` for one
    (over HTTPS verified against `ca_file` for an `https://` url). `retry_s`: for this long, a fleet that cannot
    be reached or answers that it is busy (429, 502, 503, 504) is asked again, with backoff (an agent that boots
    before its fleet or network); a refusal or a certificate that does not verify ends it at once."""
    existing = load_identity(state_dir)
    if existing is not None:
        return existing
    state_dir.mkdir(parents=True, exist_ok=True)
    key_pem, csr_pem = generate_key_and_csr()
    body = json.dumps({"token": token, "csr": csr_pem, "hardware": hardware or {},
                       "agent_version": agent_version}).encode()
    deadline, wait, timed_out = time.monotonic() + retry_s, 0.5, False
    while True:
        try:
            got = _post_enroll(fleet_url, body, timeout_s, ca_file, timed_out)
            break
        except _Transient as exc:
            timed_out = timed_out or exc.timed_out
            if time.monotonic() + wait > deadline:
                raise EnrollmentError(str(exc)) from None
            logger.warning("%s; trying again in %.1f s", exc, wait)
            time.sleep(wait)
            wait = min(2 * wait, ENROLL_BACKOFF_MAX_S)
    key_file, cert_file, ca_file = state_dir / "device.key", state_dir / "device.pem", state_dir / "fleet-ca.pem"
    key_file.touch(mode=0o600)
    key_file.write_bytes(key_pem)
    cert_file.write_text(got["certificate"])
    ca_file.write_text(got["ca_certificate"])
    identity = FleetIdentity(device_id=got["device_id"], fleet_url=fleet_url, labels=got.get("labels", {}),
                             key_file=str(key_file), cert_file=str(cert_file), ca_file=str(ca_file),
                             mqtt_username=got["mqtt_username"], mqtt_password=got["mqtt_password"])
    tmp = state_dir / "fleet.json.tmp"
    tmp.write_text(json.dumps(asdict(identity)))
    os.chmod(tmp, 0o600)
    tmp.replace(state_dir / "fleet.json")
    return identity


def _unusable_url(fleet_url: str, why: object) -> EnrollmentError:
    return EnrollmentError(f"the fleet URL {fleet_url!r} cannot be used to enroll ({why}): "
                           "give http://HOST:PORT or https://...")


class _Transient(Exception):
    """A failure worth asking again about: the fleet not reached, or busy."""

    def __init__(self, msg: str, *, timed_out: bool = False) -> None:
        super().__init__(msg)
        self.timed_out = timed_out


def _post_enroll(fleet_url: str, body: bytes, timeout_s: float, ca_file: str | Path | None,
                 timed_out: bool) -> dict[str, Any]:
    try:
        req = urllib.request.Request(fleet_url.rstrip("/") + "/v1/enroll", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout_s, context=https_context(fleet_url, ca_file)) as resp:
            raw = resp.read()
    except ValueError as exc:  # not a URL urllib can open ("fleet:8080", "htp://...")
        raise _unusable_url(fleet_url, exc) from None
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")[:500]
        msg = f"the fleet at {fleet_url} refused enrollment ({exc.code}): {detail}"
        if exc.code in (429, 502, 503, 504):
            raise _Transient(msg) from None
        if timed_out and "already used" in detail:
            msg += ("; an earlier attempt of this agent timed out, and the fleet may have enrolled it then: "
                    "create another token, and revoke the device it names if it never came up")
        raise EnrollmentError(msg) from None
    except (urllib.error.URLError, OSError) as exc:
        reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
        if not isinstance(reason, OSError):  # urllib's own words: "unknown url type", ...
            raise _unusable_url(fleet_url, reason) from None
        msg = f"cannot reach the fleet at {fleet_url} to enroll: {exc}"
        if isinstance(reason, ssl.SSLError):  # a certificate that does not verify will not verify later
            raise EnrollmentError(msg) from None
        raise _Transient(msg, timed_out=isinstance(reason, TimeoutError)) from None
    try:
        return dict(json.loads(raw))
    except ValueError as exc:
        msg = f"the fleet at {fleet_url} answered enrollment with what is not JSON: {exc}"
        raise EnrollmentError(msg) from None


def model_digest(model: Path) -> str:
    """`sha256:` over the model's manifest(s): each lists the sha256 of every file, so this names what runs."""
    h = hashlib.sha256()
    paths = [model] if model.is_file() else sorted(model.rglob("manifest.json"))
    for p in paths:
        h.update(p.relative_to(model).as_posix().encode() if p != model else b"")
        h.update(p.read_bytes())
    return "sha256:" + h.hexdigest()


def _hardware() -> dict[str, Any]:
    try:
        from runtimes.hardware import probe

        return probe(openvino=False).to_json()  # openvino's device query takes seconds; the rest is enough
    except Exception as exc:  # the hardware profile is informative; enrollment does not depend on it
        return {"error": f"hardware probe failed: {exc}"}


def enrolled_config(config: AgentConfig) -> AgentConfig:
    """Enroll (or reuse the kept identity) and return the config running as that device.

    The device id becomes the enrolled one; MQTT connections log in with the issued user and
    password (for mutual TLS instead, point `cert_file`/`key_file` at the identity's files).
    """
    fleet = config.fleet
    if fleet is None:
        return config
    if load_identity(fleet.state_dir) is None and not fleet.token:
        msg = f"no fleet identity in {fleet.state_dir} and no enrollment token; pass --token T (or fleet.token)"
        raise ConfigError(msg)
    try:
        version = importlib.metadata.version("tierkit")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    ident = enroll(fleet.url, fleet.token, fleet.state_dir, hardware=_hardware(), agent_version=version,
                   ca_file=fleet.ca_file, retry_s=ENROLL_RETRY_S)
    from edge_agent.transports.base import TransportOptions

    transport = dataclasses.replace(config.options.transport or TransportOptions(),
                                    username=ident.mqtt_username, password=ident.mqtt_password)
    options = dataclasses.replace(config.options, device_id=ident.device_id, transport=transport)
    return dataclasses.replace(config, options=options)


# upper bounds (ms) of a window's latency histogram buckets; the last bucket counts what is above them
LATENCY_BOUNDS_MS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000)


_DECISION_KEYS = ("variant", "threshold", "encoding", "binding", "trigger", "reason", "feasible", "violated",
                  "predicted_accuracy", "predicted_p95_ms", "predicted_energy_mj", "predicted_escalation_rate")
_LINK_KEYS = ("up", "rtt_ms", "rtt_high_ms", "availability", "cloud_accuracy", "epoch", "event")


def decision_summary(doc: dict[str, Any] | None) -> dict[str, Any] | None:
    """The controller's decision in force, as a telemetry window carries it: the point, its predictions, the
    binding constraint, what triggered it and why, with the targets and the link it was decided on."""
    if not doc:
        return None
    inputs = doc.get("inputs") or {}
    link = inputs.get("link") or {}
    return {**{k: doc.get(k) for k in _DECISION_KEYS},
            "inputs": {"latency_target_ms": inputs.get("latency_target_ms"),
                       "energy_target_mj": inputs.get("energy_target_mj"),
                       "deadline_ms": inputs.get("deadline_ms"),
                       "link": {k: link.get(k) for k in _LINK_KEYS} if link else None}}


class TelemetryWindows:
    """Turns cumulative agent snapshots into per-window telemetry documents with (boot id, seq).

    Args:
        boot_id: this run's id; with `seq` it makes every window unique, so redeliveries dedupe.

    `crashes` counts unclean stops found since the last window (the daemon adds them); each window
    carries and resets it.
    """

    _COUNTERS = ("requests", "escalations_sent", "cloud_answers", "degraded", "cache_hits", "escalations_compared",
                 "escalations_agreed", "cloud_refused")

    def __init__(self, boot_id: str) -> None:
        self.boot_id = boot_id
        self.seq = 0
        self.crashes = 0
        self._last: dict[str, Any] = {}
        self._last_ts = time.time()

    def restart(self) -> None:
        """A new agent (a model swap): its counters start at zero; the sequence numbers go on."""
        self._last = {}

    def window(self, snap: dict[str, Any], recent: Callable[[int], np.ndarray] | None = None, *,
               release: str | None = None, model_digest: str = "") -> dict[str, Any]:
        """The window since the last call, as sent (`fleet_docs.TelemetryWindow`), naming the release and
        model that run. `recent(n)` gives the last n request latencies (the agent's `stats.recent_latencies`):
        with it, p50, p95 and the histogram are this window's own; without, the snapshot's quantiles over its
        recent requests stand in."""
        prev = self._last
        d = {k: int(snap.get(k, 0)) - int(prev.get(k, 0)) for k in self._COUNTERS}
        reasons = {k: v - prev.get("reasons", {}).get(k, 0) for k, v in snap.get("reasons", {}).items()}
        energy_total = float(snap.get("energy_mj_per_request", 0.0)) * int(snap.get("requests", 0))
        prev_energy = float(prev.get("energy_mj_per_request", 0.0)) * int(prev.get("requests", 0))
        now = float(snap.get("ts", time.time()))
        self.seq += 1
        self._last, self._last_ts, window_s = snap, now, max(0.0, now - self._last_ts)
        n = d["requests"]
        # the share of this window's answered escalations where the cloud's top-1 equalled the edge's
        # (classification outputs only); None when none was compared
        compared = d["escalations_compared"]
        agreement = min(1.0, max(0.0, d["escalations_agreed"] / compared)) if compared > 0 else None
        crashes, self.crashes = self.crashes, 0
        p50, p95 = float(snap.get("p50_ms", 0.0)), float(snap.get("p95_ms", 0.0))
        hist = None
        lat = recent(n) if recent is not None and n > 0 else None
        if lat is not None and len(lat):  # a window longer than the latencies kept uses the newest ones
            p50, p95 = (float(v) for v in np.percentile(lat, [50, 95]))
            counts = np.bincount(np.searchsorted(LATENCY_BOUNDS_MS, lat, side="left"),
                                 minlength=len(LATENCY_BOUNDS_MS) + 1)
            hist = LatencyHistogram(tuple(float(b) for b in LATENCY_BOUNDS_MS), tuple(int(c) for c in counts))
        return TelemetryWindow(
            device=str(snap.get("device") or ""), boot_id=self.boot_id, seq=self.seq, ts=now, window_s=window_s,
            requests=n, edge=n - d["cloud_answers"], cloud=d["cloud_answers"], p50_ms=p50, p95_ms=p95,
            latency_hist=hist, escalation_rate=min(1.0, d["escalations_sent"] / n) if n else 0.0,
            cloud_refused=d["cloud_refused"], agreement=agreement,
            energy_mj_per_request=max(0.0, energy_total - prev_energy) / n if n else 0.0,
            energy_label=str(snap.get("energy_label") or "unknown"), degraded=d["degraded"],
            degraded_reasons={k: v for k, v in reasons.items() if v > 0}, variant=str(snap.get("variant", "")),
            threshold=snap.get("threshold"), model_digest=model_digest, release=release, crashes=crashes,
            decision=decision_summary(snap.get("decision")), **window_fields(snap, prev)).to_json()


class FleetSync:
    """Desired in, reported out, and the swap between them, for one enrolled (or broker-connected) daemon.

    Args:
        daemon: the daemon whose agent it steers and through which it publishes.
        slots: the slot store, the one record of what runs (None: not enrolled in a fleet).
        swapper: takes the releases desired documents name (None: not enrolled).

    Example:
        >>> sync = FleetSync(daemon, slots, swapper)
        >>> session.listen(topics.desired_topic(device), sync.on_desired)
    """

    def __init__(self, daemon: AgentDaemon, slots: SlotStore | None, swapper: Swapper | None) -> None:
        self.daemon, self.slots, self.swapper = daemon, slots, swapper
        self.applied = 0  # desired documents applied
        self.version: int | None = None  # the version of the last one that took effect
        self._budget: BudgetOverride | None = None  # what desired documents set: it overrides a release's
        self._threshold: float | Unset | None = UNSET
        self._audit_rate: float | None = None  # a rollout's raised audit share (None: the configured one)
        self._lock = asyncio.Lock()
        self._pending: set[asyncio.Task[None]] = set()

    def overrides(self, agent: EdgeAgent) -> None:
        """Lay what desired documents set (budget, threshold, audit share) over a newly built agent."""
        if self._budget is not None:
            agent.set_budget(self._budget.apply(agent.budget))
        if self._threshold is not UNSET:
            agent.set_threshold(self._threshold)
        agent.audits.set_rate(self._audit_rate)

    def on_desired(self, topic: str, payload: bytes, props: Any) -> None:
        """A desired document arrived (on the event loop): parse, apply, report what took effect."""
        if not payload:  # a cleared retained message
            return
        error = None
        try:
            self.apply(parse_desired(payload))
        except (ValueError, TypeError, ConfigError) as exc:
            error = f"desired state not applied: {exc}"
            logger.warning("%s", error)
        self.report(error=error)

    def apply(self, desired: Desired) -> None:
        if desired.release is not UNSET and self.swapper is None:
            msg = "this agent has no fleet section (agent.yaml fleet:), so it cannot take releases"
            raise ConfigError(msg)
        agent = self.daemon.agent
        if desired.budget is not None:
            agent.set_budget(desired.budget.apply(agent.budget))
            self._budget = desired.budget if self._budget is None else self._budget.merged(desired.budget)
        if desired.threshold is not UNSET:
            self._threshold = desired.threshold
            agent.set_threshold(desired.threshold)
        if desired.telemetry_interval_s is not None:
            agent.options = dataclasses.replace(agent.options, telemetry_interval_s=desired.telemetry_interval_s)
        self._audit_rate = desired.audit_rate  # absent from the document: the configured share again
        agent.audits.set_rate(desired.audit_rate)
        if self.swapper is not None:
            self.swapper.want(desired)  # the swap runs in the background
        if desired.version is not None:
            self.version = desired.version  # only once it has taken effect
        self.applied += 1

    def report_doc(self, error: str | None = None) -> Reported:
        """What runs here now: the slot store's record and the serving agent's settings."""
        agent, slots = self.daemon.agent, self.slots
        report = Reported(device=self.daemon.device, boot_id=agent.options.boot_id, desired_version=self.version,
                          budget=agent.budget, threshold=agent.threshold, variant=agent.variant,
                          model_digest=self.daemon.model_digest, error=error)
        if slots is None:
            return report
        swap, held, golden = slots.report()
        return dataclasses.replace(report, release=slots.running, swap=swap, slots=held, golden=golden,
                                   crashes=slots.state.crashes)

    def report(self, error: str | None = None) -> None:
        """Publish the reported document now (retained), in the order of the calls."""
        task = asyncio.get_running_loop().create_task(self._publish(self.report_doc(error)))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _publish(self, report: Reported) -> None:
        async with self._lock:  # reports go out in the order they were made
            try:
                await self.daemon.publish(topics.reported_topic(self.daemon.device),
                                          json.dumps(report.to_json()).encode(), retain=True)
            except (TierkitError, TimeoutError, ConnectionError) as exc:
                logger.info("could not report the applied state: %s", exc)

    async def first_report(self) -> None:
        """Publish the reported document once a broker is connected (retried every second until it is)."""
        while True:
            try:
                async with self._lock:
                    await self.daemon.publish(topics.reported_topic(self.daemon.device),
                                              json.dumps(self.report_doc().to_json()).encode(), retain=True)
                return
            except (TierkitError, TimeoutError, ConnectionError):
                await asyncio.sleep(1.0)

    async def run_swaps(self) -> None:
        """Report every transition of the swap; at `active`, the daemon serves from the new agent first."""
        assert self.swapper is not None
        async for step in self.swapper.transitions(self.daemon.served):
            if step.agent is not None:
                await self.daemon.switch(step.agent)
            self.report()
