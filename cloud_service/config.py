"""Options of the cloud service, as frozen dataclasses that validate themselves.

Example:
    >>> ServerConfig(models_dir=Path("models"), grpc_address="127.0.0.1:8001",
    ...              defaults=ModelOptions(batching=BatchingConfig(max_batch_size=64)))
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from urllib.parse import urlsplit

from cloud_service.security import GrpcTls, MqttTls
from runtimes.errors import ConfigError
from runtimes.hardware import usable_cpus


@dataclass(frozen=True, slots=True)
class BatchingConfig:
    """Triton-style dynamic batching of one model.

    A batch is dispatched as soon as a model instance is free and either the queued rows reach the
    largest preferred size (or `max_batch_size`), or the oldest request has waited
    `max_queue_delay_us`. With the default delay of 0 the batcher never waits: requests that pile
    up while an instance is busy form the next batch, which keeps single-request latency low.

    Args:
        max_batch_size: most rows in one run; 1 turns batching off.
        preferred_batch_sizes: batch sizes worth waiting for (up to `max_queue_delay_us`).
        max_queue_delay_us: longest a request waits for a batch to fill.
        max_queue_size: queued requests before new ones are refused with RESOURCE_EXHAUSTED.
        admission: refuse at once (RESOURCE_EXHAUSTED with a retry hint) a request whose deadline the
            queue ahead of it and the model's measured service time cannot meet, drop queued requests
            that can no longer make it, and size each batch so that it ends before its earliest
            deadline (`cloud_service.admission`). False: every request is queued until its deadline.
        queue_target_ms, queue_interval_ms: CoDel's standing-queue detector: once the requests taken
            from the queue have all waited more than the target for a whole interval, requests
            without a deadline are refused at once when the wait ahead exceeds the interval, and
            dropped once they have waited that long.
    """

    max_batch_size: int = 32
    preferred_batch_sizes: tuple[int, ...] = ()
    max_queue_delay_us: int = 0
    max_queue_size: int = 512
    admission: bool = True
    queue_target_ms: float = 5.0
    queue_interval_ms: float = 100.0

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            msg = f"max_batch_size must be >= 1, got {self.max_batch_size}"
            raise ConfigError(msg)
        sizes = tuple(sorted({int(s) for s in self.preferred_batch_sizes}))
        if any(s < 1 or s > self.max_batch_size for s in sizes):
            msg = f"preferred_batch_sizes {list(sizes)} must lie in 1..max_batch_size ({self.max_batch_size})"
            raise ConfigError(msg)
        object.__setattr__(self, "preferred_batch_sizes", sizes)
        if self.max_queue_delay_us < 0:
            msg = f"max_queue_delay_us must be >= 0, got {self.max_queue_delay_us}"
            raise ConfigError(msg)
        if self.max_queue_size < 1:
            msg = f"max_queue_size must be >= 1, got {self.max_queue_size}"
            raise ConfigError(msg)
        if not (0 < self.queue_target_ms <= self.queue_interval_ms):
            msg = (f"queue_target_ms {self.queue_target_ms} and queue_interval_ms {self.queue_interval_ms} must "
                   "satisfy 0 < target <= interval (CoDel's defaults: 5 and 100)")
            raise ConfigError(msg)

    @property
    def target_rows(self) -> int:
        """Rows worth waiting for before dispatching early."""
        return self.preferred_batch_sizes[-1] if self.preferred_batch_sizes else self.max_batch_size


@dataclass(frozen=True, slots=True)
class ModelOptions:
    """How one model is served.

    Args:
        batching: dynamic batching; applies only where every input and output has a dynamic axis 0.
        instances: model instances, each with its own session and worker thread; 0 (the default): chosen
            by `instance_layout` from the CPUs this process may use.
        intra_op_threads: threads per instance inside one operator (0: with `instances` 0, the CPUs shared
            among the instances; else the backend's default).
        spin: onnxruntime's intra-op threads busy-wait between operators and runs (`SessionOptions.spin`);
            None: off (`SERVED_SPIN`).
        allow_non_finite: accept NaN/Inf in floating-point inputs. Off by default: a NaN that
            reaches a classifier yields an arbitrary class, so such inputs are refused with
            INVALID_ARGUMENT unless the model is known to handle them.
    """

    batching: BatchingConfig = field(default_factory=BatchingConfig)
    instances: int = 0
    intra_op_threads: int = 0
    spin: bool | None = None
    allow_non_finite: bool = False

    def __post_init__(self) -> None:
        if self.instances < 0:
            msg = f"instances must be >= 1, or 0 to choose from the CPUs, got {self.instances}"
            raise ConfigError(msg)
        if self.intra_op_threads < 0:
            msg = f"intra_op_threads must be >= 0, got {self.intra_op_threads}"
            raise ConfigError(msg)
        if self.spin is not None and not isinstance(self.spin, bool):
            msg = f"spin must be true, false or absent (the backend's default), got {self.spin!r}"
            raise ConfigError(msg)


AUTO_MAX_INSTANCES = 4  # instances chosen at most, however many CPUs: each holds its own copy of the model
CPU_RUNTIMES = frozenset({"onnxruntime", "openvino"})  # runtimes whose instances share the host's CPUs


# A served model's intra-op threads do not spin unless asked (`--spin`): between runs the server's front end (the
# gRPC and MQTT threads, admission, encoding) needs the CPUs that onnxruntime's spinning threads would hold. On a
# 2-core AVX2 EPYC, a brief model served as one instance of two threads answered 1.1-2.0x as many requests in
# time at 16-128 callers without spinning, and its server used 1.0-1.1 cores where it used 1.3-1.4 (bench/RESULTS.md).
SERVED_SPIN = False

MULTI_INSTANCE_MIN_S = 0.004  # a request's run time on one instance from which automatic instances are several


def instance_layout(options: ModelOptions, runtime: str, cpus: int | None = None,
                    run_s: float | None = None) -> tuple[int, int]:
    """(instances, intra-op threads each) for a model of `runtime`: what `options` says, or where it leaves
    `instances` at 0, one instance per `threads` of the `cpus` (default: `usable_cpus()`), at most
    `AUTO_MAX_INSTANCES`, the CPUs shared among them when `threads` is 0 too; but one instance (with the
    backend's threads) when a request's measured run time on one such instance, `run_s`, is under
    `MULTI_INSTANCE_MIN_S`. A runtime that does not compute on the host's CPUs (TensorRT), or keeps one
    thread pool per process (torch), gets one instance.

    Several instances, each computing on its own CPUs, keep a busy server's compute going while its front
    end (decoding, gRPC, answering: about a millisecond of interpreter time a request on these hosts) takes
    turns on the same CPUs; one session spreading every operator over all of them waits at each operator
    for the slowest of its threads. That pays where a request computes for several times what the front
    end spends on it. Where it does not, the instances' threads queue for the interpreter behind the front
    end's under overload, and one instance keeps more (bench/RESULTS.md, 2026-12-02, two CPUs: a 12 ms
    model answered 1.2-1.7x as many requests in time with two instances from 4 to 32 callers, up to 16x its
    capacity; a 3 ms one collapsed sooner with two).
    """
    if options.instances:
        return options.instances, options.intra_op_threads
    if runtime not in CPU_RUNTIMES or (run_s is not None and run_s < MULTI_INSTANCE_MIN_S):
        return 1, options.intra_op_threads
    cpus = usable_cpus() if cpus is None else cpus
    if options.intra_op_threads:
        return max(1, min(AUTO_MAX_INSTANCES, cpus // options.intra_op_threads)), options.intra_op_threads
    instances = max(1, min(AUTO_MAX_INSTANCES, cpus))
    return instances, max(1, cpus // instances)


@dataclass(frozen=True, slots=True)
class MqttConfig:
    """The MQTT v5 bridge.

    Args:
        url: `mqtt://HOST:PORT` or `mqtts://HOST:PORT` (TLS).
        group: shared-subscription group; replicas in one group share escalations.
        client_id: stable per replica so a restarted replica resumes its session (default: derived
            from the host name and group by the CLI).
        session_expiry_s: how long the broker keeps this replica's session after an unplanned
            disconnect. Default 5 s: long enough that the session (its subscription and the QoS 1
            escalations queued for it) outlives a broker restart or a dropped connection, since the
            bridge reconnects within about a second while the broker was healthy recently; short,
            because while a dead replica's session lives the broker keeps routing its share of the
            shared subscription into it (measured with Mosquitto 2.0 and two replicas: with 30 s a
            SIGKILLed replica swallowed half of all escalations for 30 s; devices re-send the ones
            they journaled, same seq, answered once). With 0, escalations sent while the bridge is
            reconnecting are dropped by the broker. A clean shutdown always ends the session.
        keepalive_s: MQTT keepalive.
        receive_maximum: unacknowledged escalations the broker may have in flight to this replica.
        dedupe_ttl_s: how long a result stays in the duplicate-request cache.
        dedupe_max_entries: bound of that cache.
        username, password: broker credentials, if any.
        tls: TLS options (implied by `mqtts://`).
        device_max_inflight: escalations of one device being answered at once; past it the device
            gets RESOURCE_EXHAUSTED at once, so one device cannot fill `receive_maximum` for all.
        device_rate_per_s: escalations per second one device may send (a token bucket holding
            one second's worth); past it, RESOURCE_EXHAUSTED.
        max_waiting: escalations received and admitted on arrival but not yet queued at their model
            (waiting for the event loop to decode them); past it, the next is refused at once on
            arrival (RESOURCE_EXHAUSTED), so nothing piles up where no deadline is checked.
    """

    url: str = "mqtt://127.0.0.1:1883"
    group: str = "tierkit"
    client_id: str = "tierkit-serve"
    session_expiry_s: int = 5
    keepalive_s: int = 30
    receive_maximum: int = 256
    dedupe_ttl_s: float = 60.0
    dedupe_max_entries: int = 10_000
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    tls: MqttTls | None = None
    device_max_inflight: int = 32
    device_rate_per_s: float = 500.0
    max_waiting: int = 64

    def __post_init__(self) -> None:
        self.endpoint  # noqa: B018 - validates the URL
        if self.max_waiting < 1:
            msg = f"MQTT max_waiting {self.max_waiting} must be >= 1"
            raise ConfigError(msg)
        if self.device_max_inflight < 1 or not self.device_rate_per_s > 0:
            msg = (f"MQTT device_max_inflight {self.device_max_inflight} must be >= 1 and device_rate_per_s "
                   f"{self.device_rate_per_s} > 0")
            raise ConfigError(msg)
        if not self.client_id:
            msg = "MQTT client_id must not be empty"
            raise ConfigError(msg)
        if self.session_expiry_s < 0 or self.keepalive_s < 1 or not 1 <= self.receive_maximum <= 65535:
            msg = (f"MQTT session_expiry_s {self.session_expiry_s} must be >= 0, keepalive_s {self.keepalive_s} "
                   f">= 1, receive_maximum {self.receive_maximum} in 1..65535")
            raise ConfigError(msg)
        if self.dedupe_ttl_s < 0 or self.dedupe_max_entries < 0:
            msg = "dedupe_ttl_s and dedupe_max_entries must be >= 0"
            raise ConfigError(msg)

    @property
    def endpoint(self) -> tuple[str, int, bool]:
        """(host, port, tls) from `url`."""
        parts = urlsplit(self.url)
        if parts.scheme not in ("mqtt", "mqtts") or not parts.hostname:
            msg = f"MQTT url {self.url!r} must look like mqtt://HOST:PORT or mqtts://HOST:PORT"
            raise ConfigError(msg)
        tls = parts.scheme == "mqtts" or self.tls is not None
        try:
            port = parts.port or (8883 if tls else 1883)
        except ValueError:
            msg = f"MQTT url {self.url!r} has an invalid port"
            raise ConfigError(msg) from None
        return parts.hostname, port, tls


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """Everything `tierkit serve` needs.

    Args:
        models_dir: directory holding model packages (directories or `.tkpkg`) and variant sets.
        grpc_address: HOST:PORT for the gRPC server (port 0 picks a free one); None disables gRPC.
        grpc_tls: TLS (and mutual TLS) for gRPC.
        mqtt: the MQTT bridge, or None.
        metrics_address: HOST:PORT for the Prometheus endpoint, or None.
        trusted_keys: Ed25519 public key files; when given, every package must be signed by one.
        version_floor: a JSON file remembering the newest version of each model loaded here; an older
            version is then refused unless it is a signed rollback (`compilers.version_floor`).
        defaults: options for every model; `models` overrides them per model name.
        max_message_bytes: largest request accepted (gRPC and MQTT).
        poll_interval_s: how often the models directory is rescanned for new versions (0 = never;
            `reload()` and SIGHUP still work).
        drain_timeout_s: how long shutdown and hot swap wait for in-flight requests.
        grpc_workers: threads answering gRPC calls: the calls in flight (more are refused with
            RESOURCE_EXHAUSTED).
        kept_memory_bytes: freed memory malloc keeps for the next large message instead of
            unmapping it (`protocol.memory.keep_freed_memory`); 0 leaves the allocator alone.
        forward: `grpc://HOST:PORT` of an Open Inference Protocol server (Triton, KServe) that answers
            the MQTT bridge's escalations instead of the local models (`cloud_service.forward`).
        forward_mode: "stream" (requests over long-lived ModelStreamInfer streams, matched by id) or
            "unary" (one ModelInfer call per request).
        forward_streams: how many streams the stream mode spreads requests over.
    """

    models_dir: Path
    grpc_address: str | None = "127.0.0.1:8001"
    grpc_tls: GrpcTls | None = None
    mqtt: MqttConfig | None = None
    metrics_address: str | None = None
    trusted_keys: tuple[Path, ...] = ()
    defaults: ModelOptions = field(default_factory=ModelOptions)
    models: Mapping[str, ModelOptions] = field(default_factory=dict)
    max_message_bytes: int = 16 * 1024 * 1024
    poll_interval_s: float = 0.0
    drain_timeout_s: float = 30.0
    grpc_workers: int = 128
    kept_memory_bytes: int = 64 << 20
    forward: str | None = None
    forward_mode: str = "unary"
    forward_streams: int = 1
    version_floor: Path | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "models_dir", Path(self.models_dir))
        if self.forward is not None:
            split_forward_url(self.forward)
        if self.forward_mode not in ("stream", "unary") or self.forward_streams < 1:
            msg = (f"forward mode must be stream or unary with forward_streams >= 1, got {self.forward_mode!r} "
                   f"and {self.forward_streams}")
            raise ConfigError(msg)
        object.__setattr__(self, "trusted_keys", tuple(Path(k) for k in self.trusted_keys))
        object.__setattr__(self, "models", MappingProxyType(dict(self.models)))
        for address in (self.grpc_address, self.metrics_address):
            if address is not None:
                split_address(address)
        if self.max_message_bytes < 1024:
            msg = f"max_message_bytes must be >= 1024, got {self.max_message_bytes}"
            raise ConfigError(msg)
        if self.poll_interval_s < 0 or self.drain_timeout_s < 0:
            msg = "poll_interval_s and drain_timeout_s must be >= 0"
            raise ConfigError(msg)
        if self.grpc_workers < 1:
            msg = f"grpc_workers must be >= 1, got {self.grpc_workers}"
            raise ConfigError(msg)

    def options_for(self, model: str) -> ModelOptions:
        return self.models.get(model, self.defaults)


def split_address(address: str) -> tuple[str, int]:
    """`HOST:PORT` (or `[V6]:PORT`) -> (host, port)."""
    host, sep, port = address.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        msg = f"address {address!r} must look like HOST:PORT (e.g. 127.0.0.1:8001)"
        raise ConfigError(msg)
    return host, int(port)


def split_forward_url(url: str) -> tuple[str, bool]:
    """`grpc://HOST:PORT` or `grpcs://HOST:PORT` -> (gRPC target, tls)."""
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme not in ("grpc", "grpcs") or not parts.hostname or port is None or parts.path not in ("", "/"):
        msg = f"forward URL {url!r} must look like grpc://HOST:PORT or grpcs://HOST:PORT (e.g. grpc://triton:8001)"
        raise ConfigError(msg)
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return f"{host}:{port}", parts.scheme == "grpcs"
