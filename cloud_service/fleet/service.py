"""`tierkit fleet serve` as a coroutine: the HTTP API (uvicorn), MQTT ingestion, and the periodic work.

Periodic work: move rollouts on (every second, under the `rollouts` row lease: one process acts),
publish effective desired documents whose version changed (every second, so a layer set through
the CLI or by another fleet process reaches the devices), and roll raw telemetry past its retention
up into hourly rows (every minute); and, in a task of its own, refresh the fleet view's stored bands
(`bands.refresh`, every `bands.REFRESH_S`), so that a dashboard load reads them instead of computing them.
Several processes may run this on one PostgreSQL: the work is
idempotent or leased, and the broker's shared subscription splits ingestion.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from cloud_service.fleet import bands
from cloud_service.fleet.api import create_app
from cloud_service.fleet.errors import FleetError
from cloud_service.fleet.fleet import Fleet
from cloud_service.fleet.ingest import IngestOptions, MqttIngest
from cloud_service.fleet.rollout_engine import RolloutEngine

logger = logging.getLogger(__name__)


async def serve_fleet(fleet: Fleet, *, http: tuple[str, int], mqtt: IngestOptions | None, stop: asyncio.Event,
                      ready: Callable[[int], None] | None = None, rollup_every_s: float = 60.0,
                      https: tuple[Path, Path] | None = None) -> None:
    """Serve until `stop` is set; `ready(http_port)` once the API listens; over HTTPS with `https`
    (certificate, key)."""
    import uvicorn

    class _Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:  # the caller owns SIGINT/SIGTERM (stop event)
            yield

    server = _Server(uvicorn.Config(create_app(fleet), host=http[0], port=http[1], log_level="warning",
                                    lifespan="off", access_log=False,
                                    ssl_certfile=str(https[0]) if https else None,
                                    ssl_keyfile=str(https[1]) if https else None))
    api = asyncio.create_task(server.serve())
    ingest = None
    if mqtt is not None:
        ingest = MqttIngest(mqtt, fleet.registry, fleet.desired, fleet.telemetry)
        if fleet.dynsec is not None:  # one connection: the fleet's broker account has its client id pinned
            ingest.attach_admin(fleet.dynsec)
        fleet.ingest = ingest.start()
    try:
        while not server.started:
            if api.done():
                api.result()
                msg = f"the fleet API could not listen on {http[0]}:{http[1]}"
                raise FleetError(msg)
            await asyncio.sleep(0.02)
        port = int(server.servers[0].sockets[0].getsockname()[1])
        if ready is not None:
            ready(port)
        loop = asyncio.get_running_loop()
        engine = RolloutEngine(fleet.store, fleet.desired, fleet.releases, online_after_s=fleet.config.online_after_s,
                               cloud_capacity_rps=fleet.config.cloud_capacity_rps)
        next_rollup = loop.time() + rollup_every_s
        reconciled = fleet.dynsec is None
        banding = asyncio.create_task(_refresh_bands(fleet, stop))
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 1.0)
            if not reconciled and ingest is not None and ingest.connected.is_set():
                reconciled = True  # revocations the broker missed while this process was away: at once
                with contextlib.suppress(FleetError):
                    await asyncio.to_thread(fleet.reconcile_broker)
            await _periodic(fleet, ingest, engine, roll_up=loop.time() >= next_rollup)
            if loop.time() >= next_rollup:
                next_rollup = loop.time() + rollup_every_s
        banding.cancel()
    finally:
        server.should_exit = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(api, 5.0)
        if ingest is not None:
            await asyncio.to_thread(ingest.stop)
            fleet.ingest = None


async def _refresh_bands(fleet: Fleet, stop: asyncio.Event) -> None:
    """Keep the stored bands of the last day fresh, off the loop that steps rollouts."""
    while not stop.is_set():
        try:
            await asyncio.to_thread(bands.refresh, fleet.store)
        except FleetError as exc:
            logger.warning("fleet bands not refreshed: %s", exc)
        except Exception:  # the view must never take the service down
            logger.exception("fleet bands refresh failed; retried in %s s", bands.REFRESH_S)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), bands.REFRESH_S)


async def _periodic(fleet: Fleet, ingest: MqttIngest | None, engine: RolloutEngine, *, roll_up: bool) -> None:
    def work() -> Any:
        try:
            engine.step()  # before publishing, so that a wave's assignments or a rollback go out in this pass
        except FleetError as exc:
            logger.warning("rollout step skipped: %s", exc)
        except Exception:  # a defect in one rollout must not stop ingestion, desired state or the API
            logger.exception("rollout step failed; retried in a second")
        if ingest is not None:
            ingest.publish_desired()
        else:  # no broker: still compute effective documents, so drift is listed
            fleet.desired.refresh(fleet.registry.devices(include_revoked=False))
        if roll_up:
            fleet.telemetry.roll_up()
            fleet.refresh_crl()
            fleet.reconcile_broker()

    try:
        await asyncio.to_thread(work)  # blocking database work off the event loop that serves the API
    except FleetError as exc:  # BrokerUnavailable included: the next round tries again
        logger.warning("periodic fleet work skipped: %s", exc)
