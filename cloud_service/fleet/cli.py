"""`tierkit fleet ...`: run the fleet service and manage it from the shell.

    tierkit fleet serve [--db URL] [--http HOST:PORT] [--http-cert PEM --http-key PEM] [--mqtt mqtts://BROKER]
    tierkit fleet token create --labels site=berlin,kind=cam [--expires 24h]
    tierkit fleet operator create NAME [--role read|admin]
    tierkit fleet devices [--label k=v] [--json]
    tierkit fleet show DEVICE
    tierkit fleet set (--label k=v | --device ID | --all) FILE.yaml [--priority N]
    tierkit fleet drift
    tierkit fleet revoke DEVICE
    tierkit fleet release create VARIANTS_DIR --policy policy.yaml --sign-key ops.key
    tierkit fleet releases
    tierkit fleet deploy RELEASE --label kind=cam --waves 1,5%,25%,100% [--soak 500 | --soak 10m]
    tierkit fleet rollouts
    tierkit fleet rollout show|pause|resume|rollback ID

The management commands work on the fleet database directly (`--data-dir`, or `--db URL` for
PostgreSQL), as an administrator on the fleet's host does; remote operators use the HTTP API with
an operator token. A running `fleet serve` publishes a changed desired layer within a second.
Secrets come from the environment: `TIERKIT_FLEET_MQTT_PASSWORD` (the fleet's broker account).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import signal
import time
import warnings
from pathlib import Path
from typing import Any

from runtimes.documents import read_document
from runtimes.errors import ConfigError

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}



class _Deprecated(argparse.Action):
    """An old spelling of an option: still accepted, with a warning naming the new one."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        new = "--" + self.dest.replace("_", "-")
        # FutureWarning: a deprecation meant for the person at the command line (shown by default)
        warnings.warn(f"{option_string} is deprecated; use {new}", FutureWarning, stacklevel=2)
        setattr(namespace, self.dest, values)

def parse_duration(text: str) -> float:
    """`90s`, `15m`, `24h`, `7d` or plain seconds."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", str(text))
    if not m or float(m.group(1)) <= 0:
        msg = f"duration {text!r} must be a positive number with an optional unit s, m, h or d (e.g. 24h)"
        raise ConfigError(msg)
    return float(m.group(1)) * _UNITS[m.group(2) or "s"]


def add_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Register `tierkit fleet`."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--data-dir", type=Path, default=Path("fleet-data"), help="CA and SQLite DB (./fleet-data)")
    common.add_argument("--db", metavar="URL", help="database URL: sqlite:///PATH or postgresql://USER@HOST/DB")
    p = subparsers.add_parser("fleet", help="the fleet service: enroll devices, desired state, telemetry",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="fleet_command", metavar="COMMAND", required=True)

    s = sub.add_parser("serve", parents=[common], help="run the HTTP API and MQTT ingestion")
    s.add_argument("--http", default="127.0.0.1:8080", metavar="HOST:PORT", help="API address (port 0: any free)")
    s.add_argument("--http-cert", type=Path, metavar="PEM", help="serve the API over HTTPS with this certificate")
    s.add_argument("--http-key", type=Path, metavar="PEM", help="the key of --http-cert")
    s.add_argument("--mqtt", metavar="URL", help="broker to ingest from and publish desired state to: "
                   "mqtts://HOST[:8883] (TLS) or mqtt://HOST[:1883]")
    s.add_argument("--mqtt-ca", type=Path, help="CA of the broker's certificate (default: the system's)")
    s.add_argument("--mqtt-cert", type=Path, help="client certificate for the broker, if it asks for one")
    s.add_argument("--mqtt-key", type=Path, help="the key of --mqtt-cert")
    s.add_argument("--mqtt-username", help="the fleet's broker account (password: $TIERKIT_FLEET_MQTT_PASSWORD)")
    s.add_argument("--mqtt-user", dest="mqtt_username", action=_Deprecated, help=argparse.SUPPRESS)
    s.add_argument("--group", default="tierkit-fleet", help="shared-subscription group of all fleet processes "
                   "(a group other than tierkit-fleet: tierkit broker init --fleet-group)")
    s.add_argument("--client-id", default="", help="MQTT client id, stable across restarts (default: the "
                   "--mqtt-username account, whose client id the broker pins; without one, host-pid)")
    s.add_argument("--broker-passwd", type=Path, help="Mosquitto password file to keep in sync with the registry")
    s.add_argument("--broker-reload", metavar="CMD", help="command that makes the broker reread that file")
    s.add_argument("--crl-file", type=Path, help="write the CA's revocation list (PEM) here for a broker's crlfile; "
                   "rewritten after every revocation, then --broker-reload runs")
    s.add_argument("--broker-dynsec", action="store_true",
                   help="the --mqtt broker runs Mosquitto's dynamic-security plugin: create each device's client at "
                        "enrollment and delete it at revocation (instead of --broker-passwd)")
    s.add_argument("--drift-after", default="5m", help="reported != desired for longer than this is drift")
    s.add_argument("--daily-bytes", type=int, default=2 * 1024 * 1024, help="telemetry byte cap per device and day")
    s.add_argument("--retention", default="7d", help="raw telemetry kept this long, then rolled up hourly")
    s.add_argument("--online-after", default="2m", help="a device not heard from for longer is offline")
    s.add_argument("--release-key", type=Path, action="append", default=[], metavar="PUB",
                   help="an Ed25519 public key releases must be signed with (repeatable)")
    s.add_argument("--cloud-capacity", type=float, metavar="RPS",
                   help="escalations/s the cloud tier sustains, for rollouts that give none (bench/bench_cloud.py)")
    s.set_defaults(func=_serve)

    tok = sub.add_parser("token", help="enrollment tokens").add_subparsers(dest="token_command", required=True)
    tc = tok.add_parser("create", parents=[common], help="a one-time enrollment token")
    tc.add_argument("--labels", default="", help="labels the device gets, e.g. site=berlin,kind=cam")
    tc.add_argument("--expires", default="24h", help="lifetime (e.g. 90m, 24h, 7d)")
    tc.set_defaults(func=_token_create)

    op = sub.add_parser("operator", help="operator API tokens").add_subparsers(dest="op_command", required=True)
    oc = op.add_parser("create", parents=[common], help="an API token for a person or a script")
    oc.add_argument("name")
    oc.add_argument("--role", choices=("read", "admin"), default="read")
    oc.set_defaults(func=_operator_create)

    d = sub.add_parser("devices", parents=[common], help="list devices")
    d.add_argument("--label", help="only devices with these labels, e.g. site=berlin")
    d.add_argument("--json", action="store_true")
    d.set_defaults(func=_devices)
    sh = sub.add_parser("show", parents=[common], help="one device: registry, desired, reported, usage")
    sh.add_argument("device")
    sh.set_defaults(func=_show)
    st = sub.add_parser("set", parents=[common], help="set a desired layer from a YAML/JSON file")
    who = st.add_mutually_exclusive_group(required=True)
    who.add_argument("--label", help="devices with these labels (k=v[,k=v])")
    who.add_argument("--device", help="one device")
    who.add_argument("--all", action="store_true", help="the fleet default")
    st.add_argument("file", type=Path)
    st.add_argument("--priority", type=int, help="higher wins (defaults: fleet 0, labels 100, device 1000)")
    st.set_defaults(func=_set)
    dr = sub.add_parser("drift", parents=[common], help="devices whose reported state lags the desired one")
    dr.add_argument("--json", action="store_true")
    dr.set_defaults(func=_drift)
    rv = sub.add_parser("revoke", parents=[common], help="cut a device off the API and the broker")
    rv.add_argument("device")
    rv.set_defaults(func=_revoke)
    from cloud_service.fleet.rollout_cli import add_parsers

    add_parsers(sub, common, _fleet)


def _need_extra() -> None:
    try:
        import alembic  # noqa: F401
        import fastapi  # noqa: F401
        import sqlalchemy  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        msg = f"tierkit fleet needs {exc.name}: pip install 'tierkit[fleet]'"
        raise ConfigError(msg) from None


def _fleet(args: argparse.Namespace, **overrides: Any) -> Any:
    _need_extra()
    from cloud_service.fleet.fleet import Fleet, FleetConfig

    return Fleet.open(FleetConfig(data_dir=args.data_dir, db_url=args.db, **overrides))


def _serve(args: argparse.Namespace) -> int:
    _need_extra()
    from cloud_service.fleet.dynsec import DynsecOptions
    from cloud_service.fleet.service import serve_fleet
    from cloud_service.fleet.telemetry import TelemetryLimits
    host, _, port = str(args.http).rpartition(":")
    if not host or not port.isdigit() or int(port) > 65535:
        msg = f"--http {args.http!r} must be HOST:PORT, e.g. 127.0.0.1:8080"
        raise ConfigError(msg)
    http = (host.strip("[]"), int(port))
    if (args.http_cert is None) != (args.http_key is None):
        msg = "HTTPS needs both --http-cert and --http-key"
        raise ConfigError(msg)
    mqtt = _ingest_options(args) if args.mqtt else None
    limits = TelemetryLimits(daily_bytes=args.daily_bytes, retention_s=parse_duration(args.retention))
    users = {args.mqtt_username: mqtt.password} if mqtt is not None and args.mqtt_username and mqtt.password else {}
    dynsec = None
    if args.broker_dynsec:
        if mqtt is None or not args.mqtt_username or args.broker_passwd:
            msg = ("--broker-dynsec needs --mqtt and --mqtt-username (whose role may use $CONTROL/dynamic-security/v1) "
                   "and replaces --broker-passwd: give one of the two")
            raise ConfigError(msg)
        dynsec = DynsecOptions(host=mqtt.host, port=mqtt.port, username=args.mqtt_username, password=mqtt.password,
                               client_id=mqtt.client_id, tls=mqtt.tls)
    fleet = _fleet(args, broker_passwd=args.broker_passwd, broker_reload=args.broker_reload, broker_users=users,
                   drift_after_s=parse_duration(args.drift_after), limits=limits, dynsec=dynsec,
                   crl_file=args.crl_file, online_after_s=parse_duration(args.online_after),
                   release_keys=tuple(args.release_key), cloud_capacity_rps=args.cloud_capacity)
    fleet.sync_broker()  # with --broker-dynsec, serve_fleet reconciles once its broker connection is up

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError):
                loop.add_signal_handler(sig, stop.set)
        scheme = "https" if args.http_cert else "http"
        await serve_fleet(fleet, http=http, mqtt=mqtt, stop=stop, https=(args.http_cert, args.http_key)
                          if args.http_cert else None,
                          ready=lambda port: print(f"tierkit fleet: API on {scheme}://{http[0]}:{port}, "
                                                   f"database {fleet.store.dialect}, mqtt {args.mqtt or 'off'}",
                                                   flush=True))

    try:
        asyncio.run(main())
    finally:
        fleet.close()
    return 0


def _ingest_options(args: argparse.Namespace) -> Any:
    from cloud_service.config import MqttConfig
    from cloud_service.fleet.ingest import IngestOptions
    from cloud_service.security import MqttTls

    tls = MqttTls(args.mqtt_ca, args.mqtt_cert, args.mqtt_key) if (args.mqtt_ca or args.mqtt_cert or
                                                                   args.mqtt_key) else None
    host, port, secure = MqttConfig(url=args.mqtt, tls=tls).endpoint
    if secure and tls is None:
        tls = MqttTls()  # mqtts:// with the system's CAs
    return IngestOptions(host=host, port=port, group=args.group, client_id=args.client_id or args.mqtt_username or "",
                         username=args.mqtt_username, password=os.environ.get("TIERKIT_FLEET_MQTT_PASSWORD"), tls=tls)


def _token_create(args: argparse.Namespace) -> int:
    from cloud_service.fleet.registry import parse_labels

    with _fleet(args) as fleet:
        print(fleet.registry.create_token(parse_labels(args.labels), expires_s=parse_duration(args.expires)))
    return 0


def _operator_create(args: argparse.Namespace) -> int:
    with _fleet(args) as fleet:
        print(fleet.registry.create_operator_token(args.name, args.role))
    return 0


def _devices(args: argparse.Namespace) -> int:
    from cloud_service.fleet.registry import parse_labels

    with _fleet(args) as fleet:
        devs = fleet.devices(parse_labels(args.label, where="--label"))
    if args.json:
        print(json.dumps(devs, indent=2, default=str))
        return 0
    print(f"{'DEVICE':<18} {'STATE':<8} {'LAST SEEN':>10} {'VARIANT':<10} {'THRESH':>6} {'REPORTED':>8} LABELS")
    now = time.time()
    for d in devs:
        state = "revoked" if d["revoked_at"] else ("online" if d["online"] else "offline")
        seen = f"{now - d['last_seen']:.0f}s ago" if d["last_seen"] else "never"
        labels = ",".join(f"{k}={v}" for k, v in sorted(d["labels"].items()))
        thr = "" if d["threshold"] is None else f"{d['threshold']:.2f}"
        print(f"{d['device_id']:<18} {state:<8} {seen:>10} {d['variant'] or '-':<10} {thr:>6} "
              f"{d['reported_version'] or '-'!s:>8} {labels}{'  DRIFT' if d['drift'] else ''}")
    return 0


def _show(args: argparse.Namespace) -> int:
    with _fleet(args) as fleet:
        print(json.dumps(fleet.show(args.device), indent=2, default=str))
    return 0


def _set(args: argparse.Namespace) -> int:
    selector = "*" if args.all else (f"device={args.device}" if args.device else args.label)
    doc = read_document(args.file, "desired document")
    with _fleet(args) as fleet:
        version = fleet.set_layer(selector, doc, priority=args.priority)
    print(f"desired layer {selector!r} is version {version}")
    return 0


def _drift(args: argparse.Namespace) -> int:
    with _fleet(args) as fleet:
        rows = fleet.desired.drift()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    for r in rows:
        print(f"{r['device_id']:<18} desired v{r['desired_version']} reported "
              f"{'v' + str(r['reported_version']) if r['reported_version'] is not None else 'nothing'} "
              f"for {r['behind_s']:.0f}s")
    if not rows:
        print("no drift")
    return 0


def _revoke(args: argparse.Namespace) -> int:
    with _fleet(args) as fleet:
        fleet.revoke(args.device)
    print(f"revoked {args.device}")
    return 0
