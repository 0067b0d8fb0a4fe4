"""`tierkit serve`: the cloud tier as one process.

    tierkit serve --models DIR [--grpc HOST:PORT] [--mqtt mqtt://HOST:PORT] [--metrics HOST:PORT]
    tierkit serve --mqtt mqtt://HOST:PORT --forward grpc://HOST:PORT    (MQTT devices served by Triton/KServe)

Everything binds to loopback unless told otherwise. The bound addresses are printed once the
server is ready; SIGTERM or SIGINT drains and exits 0; SIGHUP rescans the models directory.
Secrets come from the environment, never the command line: `TIERKIT_MQTT_PASSWORD`.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cloud_service.config import BatchingConfig, ModelOptions, MqttConfig, ServerConfig
from cloud_service.security import GrpcTls, MqttTls
from runtimes.documents import read_document
from runtimes.errors import ConfigError

if TYPE_CHECKING:
    from cloud_service.service import CloudService

log = logging.getLogger(__name__)

_BATCH_KEYS = {"max_batch_size", "preferred_batch_sizes", "max_queue_delay_us", "max_queue_size", "admission",
               "queue_target_ms", "queue_interval_ms"}
_MODEL_KEYS = {"instances", "intra_op_threads", "spin", "allow_non_finite"}


def add_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Register `tierkit serve`."""
    p = subparsers.add_parser("serve", help="serve model packages over gRPC (Open Inference Protocol) and MQTT",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", type=Path, metavar="DIR", help="packages and variant sets to serve (required "
                   "unless --forward)")
    p.add_argument("--grpc", metavar="HOST:PORT",
                   help="gRPC address (port 0: any free); default 127.0.0.1:8001, none with --forward")
    p.add_argument("--no-grpc", action="store_true", help="serve MQTT only")
    p.add_argument("--mqtt", metavar="URL", help="MQTT broker, mqtt://HOST:PORT or mqtts://HOST:PORT")
    p.add_argument("--forward", metavar="URL", help="answer MQTT escalations with this Open Inference Protocol "
                   "server, grpc://HOST:PORT (Triton, KServe) instead of local models")
    p.add_argument("--forward-mode", choices=("unary", "stream"), default="unary",
                   help="unary: one ModelInfer call per escalation (default); stream: requests over long-lived "
                        "ModelStreamInfer streams, matched by id (unary if the server lacks the stream RPC)")
    p.add_argument("--forward-streams", type=int, default=1, metavar="N",
                   help="streams to spread forwarded requests over in stream mode (default 1)")
    p.add_argument("--metrics", metavar="HOST:PORT", help="Prometheus endpoint address")
    p.add_argument("--trusted-key", action="append", type=Path, default=[], metavar="PUB",
                   help="Ed25519 public key; packages must be signed by one (repeatable)")
    p.add_argument("--version-floor", type=Path, metavar="FILE",
                   help="JSON file of the newest version loaded per model; older versions are refused "
                        "unless signed as a rollback")
    b = p.add_argument_group("batching (defaults for every model)")
    b.add_argument("--max-batch-size", type=int, default=32)
    b.add_argument("--preferred-batch-sizes", default="", metavar="N,N", help="sizes worth waiting for")
    b.add_argument("--max-queue-delay-us", type=int, default=0)
    b.add_argument("--max-queue-size", type=int, default=512)
    b.add_argument("--no-batching", action="store_true", help="run every request alone")
    b.add_argument("--no-admission", action="store_true",
                   help="queue every request until its deadline instead of refusing at once those it cannot meet")
    b.add_argument("--instances", type=int, default=0,
                   help="model instances (worker threads) per model; 0: one per --threads of the CPUs this "
                        "process may use, at most 4, for an onnxruntime or OpenVINO model that runs a request "
                        "for at least 4 ms on one; else 1")
    b.add_argument("--threads", type=int, default=0,
                   help="intra-op threads per instance (0: the CPUs shared among automatic instances, else "
                        "the backend's default)")
    b.add_argument("--spin", action=argparse.BooleanOptionalAction, default=None,
                   help="onnxruntime's compute threads busy-wait between operators and runs (default: off, "
                        "leaving the CPUs to the server's own threads between runs)")
    b.add_argument("--allow-non-finite", action="store_true", help="accept NaN/Inf inputs")
    b.add_argument("--model-config", type=Path, metavar="FILE",
                   help="YAML/JSON {defaults: {...}, models: {NAME: {...}}} with the keys above in snake_case")
    s = p.add_argument_group("limits and lifecycle")
    s.add_argument("--max-message-mb", type=float, default=16.0, help="largest request accepted")
    s.add_argument("--poll-s", type=float, default=0.0, help="rescan the models directory every N seconds")
    s.add_argument("--drain-s", type=float, default=30.0, help="grace for in-flight requests on shutdown/swap")
    s.add_argument("--grpc-workers", type=int, default=128,
                   help="threads answering gRPC calls: the calls in flight (more are refused)")
    t = p.add_argument_group("security")
    t.add_argument("--grpc-cert", type=Path, help="server certificate (PEM) for gRPC TLS")
    t.add_argument("--grpc-key", type=Path, help="server key (PEM) for gRPC TLS")
    t.add_argument("--grpc-client-ca", type=Path, help="CA for client certificates: mutual TLS")
    t.add_argument("--mqtt-ca", type=Path, help="CA of the broker's certificate")
    t.add_argument("--mqtt-cert", type=Path, help="client certificate for the broker")
    t.add_argument("--mqtt-key", type=Path, help="client key for the broker")
    t.add_argument("--mqtt-username", help="broker user name (password from TIERKIT_MQTT_PASSWORD)")
    m = p.add_argument_group("MQTT")
    m.add_argument("--mqtt-group", default="tierkit", help="shared-subscription group of the replicas "
                   "(a group other than tierkit: tierkit broker init --cloud-group)")
    m.add_argument("--mqtt-client-id", help="stable per replica (default: the --mqtt-username account, "
                   "whose client id the broker pins; without one, tierkit-HOSTNAME-PORT)")
    m.add_argument("--mqtt-session-expiry", type=int, default=5, metavar="S",
                   help="keep this replica's broker session S seconds after a disconnect, so escalations "
                        "queue across a broker restart (default 5)")
    m.add_argument("--mqtt-device-inflight", type=int, default=32, metavar="N",
                   help="escalations of one device answered at once; more get RESOURCE_EXHAUSTED (default 32)")
    m.add_argument("--mqtt-device-rate", type=float, default=500.0, metavar="R",
                   help="escalations per second one device may send; more get RESOURCE_EXHAUSTED (default 500)")
    p.set_defaults(func=run)


def _options(doc: dict[str, Any], base: ModelOptions, where: str) -> ModelOptions:
    unknown = set(doc) - _BATCH_KEYS - _MODEL_KEYS
    if unknown:
        msg = f"{where}: unknown key(s) {sorted(unknown)}; known: {sorted(_BATCH_KEYS | _MODEL_KEYS)}"
        raise ConfigError(msg)
    batching = {k: getattr(base.batching, k) for k in _BATCH_KEYS} | {k: v for k, v in doc.items() if k in _BATCH_KEYS}
    batching["preferred_batch_sizes"] = tuple(batching["preferred_batch_sizes"])
    model = {k: getattr(base, k) for k in _MODEL_KEYS} | {k: v for k, v in doc.items() if k in _MODEL_KEYS}
    return ModelOptions(batching=BatchingConfig(**batching), **model)


def _load_model_config(path: Path, defaults: ModelOptions) -> tuple[ModelOptions, dict[str, ModelOptions]]:
    doc = read_document(path, "model config")
    doc = doc or {}
    if not isinstance(doc, dict) or set(doc) - {"defaults", "models"}:
        msg = f"{path}: expected a mapping with 'defaults' and/or 'models'"
        raise ConfigError(msg)
    defaults = _options(doc.get("defaults") or {}, defaults, f"{path}: defaults")
    models = {str(name): _options(spec or {}, defaults, f"{path}: models.{name}")
              for name, spec in (doc.get("models") or {}).items()}
    return defaults, models


def build_config(args: argparse.Namespace, env: dict[str, str]) -> ServerConfig:
    """Turn the parsed arguments and environment into a `ServerConfig`."""
    if args.forward and not args.mqtt:
        msg = "--forward bridges MQTT escalations: give --mqtt mqtt://BROKER too"
        raise ConfigError(msg)
    if args.models is None and not args.forward:
        msg = "tierkit serve needs --models DIR (or --mqtt with --forward grpc://HOST:PORT)"
        raise ConfigError(msg)
    grpc_address = args.grpc or (None if args.forward else "127.0.0.1:8001")
    preferred = tuple(int(v) for v in args.preferred_batch_sizes.split(",") if v.strip())
    batching = BatchingConfig(max_batch_size=1 if args.no_batching else args.max_batch_size,
                              preferred_batch_sizes=() if args.no_batching else preferred,
                              max_queue_delay_us=args.max_queue_delay_us, max_queue_size=args.max_queue_size,
                              admission=not args.no_admission)
    defaults = ModelOptions(batching=batching, instances=args.instances, intra_op_threads=args.threads,
                            spin=args.spin, allow_non_finite=args.allow_non_finite)
    models: dict[str, ModelOptions] = {}
    if args.model_config:
        defaults, models = _load_model_config(args.model_config, defaults)
    grpc_tls = None
    if args.grpc_cert or args.grpc_key:
        if not (args.grpc_cert and args.grpc_key):
            msg = "gRPC TLS needs both --grpc-cert and --grpc-key"
            raise ConfigError(msg)
        grpc_tls = GrpcTls(args.grpc_cert, args.grpc_key, args.grpc_client_ca)
    elif args.grpc_client_ca:
        msg = "--grpc-client-ca needs --grpc-cert and --grpc-key"
        raise ConfigError(msg)
    mqtt = None
    if args.mqtt:
        tls = MqttTls(args.mqtt_ca, args.mqtt_cert, args.mqtt_key) if (
            args.mqtt_ca or args.mqtt_cert or args.mqtt_key) else None
        port = grpc_address.rpartition(":")[2] if grpc_address and not args.no_grpc else ""
        suffix = port if port not in ("", "0") else str(os.getpid())
        # a broker account's client id is pinned to its name (tierkit broker init): log in under it by default
        client_id = args.mqtt_client_id or args.mqtt_username or f"tierkit-{socket.gethostname()}-{suffix}"
        mqtt = MqttConfig(url=args.mqtt, group=args.mqtt_group, client_id=client_id,
                          session_expiry_s=args.mqtt_session_expiry, username=args.mqtt_username,
                          device_max_inflight=args.mqtt_device_inflight, device_rate_per_s=args.mqtt_device_rate,
                          password=env.get("TIERKIT_MQTT_PASSWORD"), tls=tls)
    # forwarding only: an empty models directory (nothing is served locally)
    models_dir = args.models if args.models is not None else Path(tempfile.mkdtemp(prefix="tierkit-forward-"))
    return ServerConfig(models_dir=models_dir, grpc_address=None if args.no_grpc else grpc_address, grpc_tls=grpc_tls,
                        mqtt=mqtt, metrics_address=args.metrics, trusted_keys=tuple(args.trusted_key),
                        version_floor=args.version_floor,
                        defaults=defaults, models=models, max_message_bytes=int(args.max_message_mb * 1024 * 1024),
                        poll_interval_s=args.poll_s, drain_timeout_s=args.drain_s,
                        grpc_workers=args.grpc_workers, forward=args.forward,
                        forward_mode=args.forward_mode, forward_streams=args.forward_streams)


async def serve(config: ServerConfig) -> None:
    """Run until SIGTERM/SIGINT; print the addresses once ready."""
    from cloud_service.service import CloudService

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    async with CloudService(config) as service:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        reloads: set[asyncio.Task[Any]] = set()

        def reload() -> None:
            task = loop.create_task(service.reload())
            reloads.add(task)
            task.add_done_callback(reloads.discard)

        loop.add_signal_handler(signal.SIGHUP, reload)
        _check_servable(service, config)
        models = ", ".join(f"{m.name}:{m.version}" for m in service.repository) or "none"
        for kind in ("grpc", "mqtt", "metrics"):
            if kind in service.addresses:
                print(f"{kind} {service.addresses[kind]}", flush=True)
        print(f"models {models}", flush=True)
        print("ready", flush=True)
        await stop.wait()
        print("stopping", flush=True)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        loop.remove_signal_handler(sig)


def _check_servable(service: CloudService, config: ServerConfig) -> None:
    """A models directory that holds entries but nothing servable is an error (a wrong path, broken
    packages); an empty one is a warning (models are to be copied in and loaded by SIGHUP or --poll-s)."""
    if len(service.repository) or config.forward is not None:
        return
    expected = ("model packages (directories with manifest.json, or .tkpkg archives) or variant sets "
                "(directories with variants.json)")
    entries = [p for p in config.models_dir.iterdir() if not p.name.startswith(".")]
    if not entries:
        log.warning("--models %r is empty: serving nothing until %s are copied in and loaded (SIGHUP, or "
                    "--poll-s N)", str(config.models_dir), expected)
        print(f"warning: --models {str(config.models_dir)!r} is empty; serving nothing until models are loaded",
              file=sys.stderr, flush=True)
        return
    refused = service.last_reload.refused if service.last_reload is not None else {}
    why = "; ".join(f"{name}: {reason}" for name, reason in list(refused.items())[:3])
    msg = (f"--models {str(config.models_dir)!r} holds nothing servable ({len(entries)} entries"
           f"{f'; {why}' if why else ''}); expected {expected}")
    raise ConfigError(msg)


def run(args: argparse.Namespace) -> int:
    config = build_config(args, dict(os.environ))
    models = config.models_dir
    if not models.is_dir():
        what = "does not exist" if not models.exists() else "is not a directory"
        msg = (f"--models {str(models)!r} {what}; expected a directory of model packages (directories "
               "with manifest.json, or .tkpkg archives) and variant sets (directories with variants.json)")
        raise ConfigError(msg)
    asyncio.run(serve(config))
    print("stopped", file=sys.stderr, flush=True)
    return 0
