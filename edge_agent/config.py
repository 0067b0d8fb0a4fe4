"""`agent.yaml`: the configuration of `tierkit agent`, read once and turned into option objects.

```yaml
model: ./variants                   # a variant set, package directory or .tkpkg (relative to this file)
device_id: cam-7
cloud: grpc://127.0.0.1:8001/cnn    # or mqtts://BROKER:PORT/MODEL (mqtt:// without TLS); omit for edge only
listen: 127.0.0.1:8500              # the local Open Inference Protocol endpoint
broker: mqtts://127.0.0.1:8883      # optional: telemetry, desired and reported state
tls: {ca_file: broker-ca.pem, cert_file: fleet-state/device.pem, key_file: fleet-state/device.key}
                                    # grpcs:// and mqtts:// (client certificate optional; server_name too)
budget: {latency_ms: 30, energy_mj: 5}
policy: {score: calibrated, target_accuracy: 0.995, max_rate: 0.25, ood: true, keep: true, cache_size: 0}
breaker: {failure_threshold: 5, reset_timeout_s: 2}
journal: {path: ./journal.db, max_bytes: 67108864}
controller: true                    # adapt (variant, threshold) to the budget and the link; default false
# controller: {cloud_accuracy: 0.995, rtt_ms: 20, benchmark_repeats: 20}   # the same, with priors
telemetry_interval_s: 10
threads: 0
fleet: {url: http://fleet:8080, token: tke_..., state_dir: ./fleet-state,  # optional: enroll in a fleet
        release_keys: [ops.pub]}    # releases must be signed with one of these (none: every release refused)
```

Example:
    >>> config = load_config("agent.yaml")
    >>> config.listen
    ('127.0.0.1', 8500)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from edge_agent.adaptive import AdaptiveOptions
from edge_agent.agent import AgentOptions
from edge_agent.breaker import BreakerConfig
from edge_agent.budget import Budget
from edge_agent.controller import ControllerConfig
from edge_agent.policy import Policy
from edge_agent.transports.base import parse_cloud_url
from runtimes.documents import read_document
from runtimes.errors import ConfigError
from runtimes.session import SessionOptions

_KEYS = {"model", "device_id", "cloud", "listen", "broker", "budget", "policy", "breaker", "journal",
         "telemetry_interval_s", "threads", "margin_ms", "controller", "fleet", "tls"}
_TLS_KEYS = ("ca_file", "cert_file", "key_file", "server_name")


@dataclass(frozen=True)
class FleetEnrollment:
    """`fleet:` in agent.yaml (or `tierkit agent --enroll URL --token T`): enroll once, keep the identity.

    Args:
        url: the fleet service's HTTP address.
        token: a one-time enrollment token (`tierkit fleet token create`); unused once enrolled.
        state_dir: where the device key, certificate and identity are kept across restarts (and the
            A/B release slots, the swap journal and the version floor of releases).
        release_keys: Ed25519 public key files releases must be signed with; with none, the device
            refuses every release the fleet sends (`edge_agent.swap`).
        ca_file: the CA of the fleet API's certificate for an `https://` url (None: the system's CAs);
            enrollment and release downloads carry credentials, so give the fleet HTTPS outside a lab.
    """

    url: str
    token: str = ""
    state_dir: Path = Path("fleet-state")
    release_keys: tuple[Path, ...] = ()
    ca_file: Path | None = None


@dataclass(frozen=True)
class AgentConfig:
    """Everything `tierkit agent` needs, validated (`controller`: the agent builds and runs one)."""

    model: Path
    cloud: str | None = None
    listen: tuple[str, int] = ("127.0.0.1", 8500)
    broker: tuple[str, int] | None = None
    broker_tls: bool = False
    budget: Budget = field(default_factory=Budget)
    policy: Policy = field(default_factory=Policy)
    options: AgentOptions = field(default_factory=AgentOptions)
    controller: bool = False
    fleet: FleetEnrollment | None = None


def _section(doc: Mapping[str, Any], key: str, cls: type, where: str) -> Any:
    value = doc.get(key) or {}
    if not isinstance(value, Mapping):
        msg = f"{where}: '{key}' must be a mapping, got {value!r}"
        raise ConfigError(msg)
    known = {f.name for f in fields(cls)}
    unknown = set(value) - known
    if unknown:
        msg = f"{where}: '{key}' has unknown key(s) {sorted(unknown)}; known: {sorted(known)}"
        raise ConfigError(msg)
    try:
        return cls(**value)
    except TypeError as exc:
        msg = f"{where}: '{key}': {exc}"
        raise ConfigError(msg) from None


def _controller(value: Any, where: str) -> tuple[bool, AdaptiveOptions | None]:
    """`controller: true | false | {cloud_accuracy, rtt_ms, benchmark_repeats, config: {...}}`."""
    if value is None or isinstance(value, bool):
        return bool(value), None
    if not isinstance(value, Mapping):
        msg = f"{where}: 'controller' must be true, false or a mapping of priors, got {value!r}"
        raise ConfigError(msg)
    priors = dict(value)
    tuning = priors.pop("config", None)
    adaptive = _section({"controller": priors}, "controller", AdaptiveOptions, where)
    if tuning is not None:
        config = _section({"controller.config": tuning}, "controller.config", ControllerConfig, where)
        adaptive = replace(adaptive, config=config)
    return True, adaptive


def parse_listen(text: str, where: str = "listen") -> tuple[str, int]:
    """`HOST:PORT` (port 0: any free port) -> (host, port)."""
    host, sep, port = str(text).rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        msg = f"{where} {text!r} must be HOST:PORT, e.g. 127.0.0.1:8500"
        raise ConfigError(msg)
    return host.strip("[]"), int(port)


def parse_config(doc: Mapping[str, Any], *, base: Path = Path(), where: str = "agent config") -> AgentConfig:
    """Validate a parsed `agent.yaml` document; relative paths are resolved against `base`."""
    if not isinstance(doc, Mapping):
        msg = f"{where} must be a YAML mapping"
        raise ConfigError(msg)
    unknown = set(doc) - _KEYS
    if unknown:
        msg = f"{where}: unknown key(s) {sorted(unknown)}; known: {sorted(_KEYS)}"
        raise ConfigError(msg)
    if not doc.get("model"):
        msg = f"{where}: 'model' (a variant set or package path) is required"
        raise ConfigError(msg)
    cloud = doc.get("cloud") or None
    if cloud is not None:
        parse_cloud_url(str(cloud))
    broker = None
    if doc.get("broker"):
        url = parse_cloud_url(str(doc["broker"]))
        if url.kind != "mqtt":
            msg = f"{where}: 'broker' must be an mqtt:// URL, got {doc['broker']!r}"
            raise ConfigError(msg)
        broker = url.targets[0]
    journal = doc.get("journal") or {}
    tls = doc.get("tls") or {}
    if not isinstance(tls, Mapping) or set(tls) - set(_TLS_KEYS):
        msg = f"{where}: 'tls' takes {', '.join(_TLS_KEYS)}, got {tls!r}"
        raise ConfigError(msg)
    if not isinstance(journal, Mapping) or set(journal) - {"path", "max_bytes"}:
        msg = f"{where}: 'journal' takes 'path' and 'max_bytes', got {journal!r}"
        raise ConfigError(msg)
    opts: dict[str, Any] = {
        "breaker": _section(doc, "breaker", BreakerConfig, where),
        "session": SessionOptions(intra_op_threads=int(doc.get("threads", 0))),
    }
    if doc.get("device_id"):
        opts["device_id"] = str(doc["device_id"])
    if tls:
        from edge_agent.transports.base import TransportOptions

        def path(key: str) -> str | None:
            return str(base / str(tls[key])) if tls.get(key) else None

        opts["transport"] = TransportOptions(ca_file=path("ca_file"), cert_file=path("cert_file"),
                                             key_file=path("key_file"),
                                             server_name=str(tls["server_name"]) if tls.get("server_name") else None)
    if journal.get("path"):
        opts["journal_path"] = base / str(journal["path"])
    if journal.get("max_bytes"):
        opts["journal_max_bytes"] = int(journal["max_bytes"])
    for key in ("telemetry_interval_s", "margin_ms"):
        if doc.get(key) is not None:
            opts[key] = float(doc[key])
    fleet = None
    if doc.get("fleet"):
        f = doc["fleet"]
        if (not isinstance(f, Mapping) or not f.get("url")
                or set(f) - {"url", "token", "state_dir", "release_keys", "ca_file"}):
            msg = (f"{where}: 'fleet' takes 'url' (required), 'token', 'state_dir', 'release_keys' and 'ca_file', "
                   f"got {f!r}")
            raise ConfigError(msg)
        keys = f.get("release_keys") or []
        if isinstance(keys, str):
            keys = [keys]
        if not isinstance(keys, list) or not all(isinstance(k, str) and k for k in keys):
            msg = f"{where}: 'fleet.release_keys' must be a list of public key files, got {keys!r}"
            raise ConfigError(msg)
        fleet = FleetEnrollment(url=str(f["url"]), token=str(f.get("token") or ""),
                                state_dir=base / str(f.get("state_dir") or "fleet-state"),
                                release_keys=tuple(base / k for k in keys),
                                ca_file=base / str(f["ca_file"]) if f.get("ca_file") else None)
    controller, adaptive = _controller(doc.get("controller"), where)
    if adaptive is not None:
        opts["adaptive"] = adaptive
    return AgentConfig(model=base / str(doc["model"]), cloud=str(cloud) if cloud else None,
                       listen=parse_listen(doc.get("listen", "127.0.0.1:8500")), broker=broker,
                       broker_tls=broker is not None and parse_cloud_url(str(doc["broker"])).tls,
                       budget=_section(doc, "budget", Budget, where), policy=_section(doc, "policy", Policy, where),
                       options=AgentOptions(**opts), controller=controller, fleet=fleet)


def load_config(path: str | Path) -> AgentConfig:
    """Read and validate `agent.yaml`."""
    path = Path(path)
    doc = read_document(path, "agent config")
    return parse_config(doc or {}, base=path.resolve().parent, where=str(path))
