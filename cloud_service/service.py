"""The whole cloud tier in one object: models, gRPC, MQTT bridge, metrics, directory polling.

Example:
    >>> async with CloudService(ServerConfig(models_dir=Path("models"), grpc_address="127.0.0.1:0")) as svc:
    ...     print(svc.addresses)          # {"grpc": "127.0.0.1:40123", ...}
    ...     await svc.wait_closed()       # until stop() (the CLI calls it on SIGTERM/SIGINT)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from types import TracebackType
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health, health_pb2

from cloud_service.config import ServerConfig, split_address
from cloud_service.duplicates import DuplicateCache
from cloud_service.metrics import Metrics
from cloud_service.protocol.memory import keep_freed_memory
from cloud_service.repository import ModelRepository, ReloadReport
from cloud_service.server import SERVICE, InferenceServicer, start_grpc_server

if TYPE_CHECKING:
    from cloud_service.forward import ForwardBackend
    from cloud_service.mqtt_bridge import MqttBridge

log = logging.getLogger(__name__)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("tierkit")
    except PackageNotFoundError:
        return "0.0.0"


class CloudService:
    """Serve every model under `config.models_dir` over gRPC and MQTT, with metrics.

    Start and stop with `async with`, or `start()` / `stop()`. `stop()` is graceful: readiness
    and health turn NOT_SERVING, the MQTT bridge stops taking escalations and answers the ones it
    holds, gRPC finishes in-flight calls (up to `drain_timeout_s`), then models are closed.
    """

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.metrics = Metrics()
        self.repository = ModelRepository(config, observer_for=self.metrics.observer,
                                          on_load=lambda name, outcome: self.metrics.model_loads.labels(
                                              name, outcome).inc())
        # one duplicate cache for both transports: a resend is answered whichever one carried it
        mqtt = config.mqtt
        self.duplicates = (DuplicateCache() if mqtt is None
                           else DuplicateCache(mqtt.dedupe_ttl_s, mqtt.dedupe_max_entries))
        self.servicer = InferenceServicer(self.repository, self.metrics, version=_version(),
                                          max_message_bytes=config.max_message_bytes, duplicates=self.duplicates)
        self.addresses: dict[str, str] = {}
        self.last_reload: ReloadReport | None = None
        self._grpc: grpc.Server | None = None
        self._health: health.HealthServicer | None = None
        self._bridge: MqttBridge | None = None
        self._forward: ForwardBackend | None = None
        self._poller: asyncio.Task[None] | None = None
        self._stopped = asyncio.Event()
        self._stopping = False

    async def __aenter__(self) -> CloudService:
        await self.start()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.stop()

    async def start(self) -> None:
        config = self.config
        keep_freed_memory(config.kept_memory_bytes)  # large payloads without page faults on every copy
        try:
            if config.metrics_address:
                host, port = self.metrics.serve(*split_address(config.metrics_address))
                self.addresses["metrics"] = f"{host}:{port}"
            await self.reload()
            if config.grpc_address:
                credentials = config.grpc_tls.server_credentials() if config.grpc_tls else None
                self._grpc, self._health, port = start_grpc_server(self.servicer, config.grpc_address,
                                                                   workers=config.grpc_workers, credentials=credentials)
                host = split_address(config.grpc_address)[0]
                self.addresses["grpc"] = f"{host}:{port}"
            if config.mqtt is not None:
                from cloud_service.mqtt_bridge import MqttBridge

                if config.forward is not None:
                    from cloud_service.forward import ForwardBackend

                    self._forward = ForwardBackend(config.forward, max_message_bytes=config.max_message_bytes,
                                                   mode=config.forward_mode, streams=config.forward_streams)
                    await self._forward.start()
                self._bridge = MqttBridge(config.mqtt, self.repository, self.metrics,
                                          max_message_bytes=config.max_message_bytes, backend=self._forward,
                                          duplicates=self.duplicates)
                await self._bridge.start()
                self.addresses["mqtt"] = config.mqtt.url
            self.servicer.ready = True
            if self._health is not None:
                for name in ("", SERVICE):
                    self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
            if config.poll_interval_s > 0:
                self._poller = asyncio.get_running_loop().create_task(self._poll(config.poll_interval_s))
        except BaseException:
            await self.stop()
            raise

    async def reload(self) -> ReloadReport:
        """Rescan the models directory now (new versions swap in; refused ones leave the old serving)."""
        report = await self.repository.reload()
        self.last_reload = report
        self.metrics.models_ready.set(len(self.repository))
        for label, reason in report.refused.items():
            log.warning("model %s refused: %s", label, reason)
        return report

    async def _poll(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                await self.reload()
            except Exception:  # a failed scan must not stop the polling
                log.exception("rescanning %s failed", self.config.models_dir)

    async def stop(self) -> None:
        """Graceful shutdown (idempotent)."""
        if self._stopping:
            await self._stopped.wait()
            return
        self._stopping = True
        try:
            self.servicer.ready = False
            if self._poller is not None:
                self._poller.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._poller
            if self._health is not None:
                self._health.enter_graceful_shutdown()
            drain = self.config.drain_timeout_s
            if self._bridge is not None:
                await self._bridge.stop(drain)
            if self._forward is not None:
                await self._forward.aclose()
            if self._grpc is not None:
                stopped = self._grpc.stop(grace=drain)
                await asyncio.to_thread(stopped.wait)
            self.servicer.close()
            await self.repository.aclose()
        finally:
            self.metrics.stop()
            self._stopped.set()

    async def wait_closed(self) -> None:
        await self._stopped.wait()
