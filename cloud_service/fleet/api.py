"""The fleet's HTTP API (FastAPI; OpenAPI at /openapi.json, docs at /docs) and the dashboard page.

Operators send `Authorization: Bearer TOKEN` (a read-only or an admin operator token). Devices
call `POST /v1/enroll` with their one-time enrollment token in the body, and download releases
(rollout_api.py) with HTTP Basic auth; they never hold an operator token.
Every `FleetError` becomes its `http_status` with `{"error": message}`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fastapi import Depends, FastAPI, Header, Request
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse
from pydantic import BaseModel, Field

from cloud_service.fleet import view
from cloud_service.fleet.errors import FleetError
from cloud_service.fleet.fleet import Fleet
from cloud_service.fleet.registry import parse_labels

_DASHBOARD = Path(__file__).with_name("dashboard.html")


class EnrollRequest(BaseModel):
    token: str = Field(min_length=1, max_length=256)
    csr: str = Field(min_length=1, max_length=16384)
    hardware: dict[str, Any] = Field(default_factory=dict)
    agent_version: str = Field(default="", max_length=64)


class EnrollResponse(BaseModel):
    device_id: str
    certificate: str
    ca_certificate: str
    mqtt_username: str
    mqtt_password: str
    labels: dict[str, str]


class LayerRequest(BaseModel):
    selector: str = Field(min_length=1, max_length=512, examples=["*", "site=berlin", "device=dev-1a2b"])
    document: dict[str, Any]
    priority: int | None = None


class TokenRequest(BaseModel):
    labels: dict[str, str] = Field(default_factory=dict)
    expires_s: float = Field(default=86400.0, gt=0)


def create_app(fleet: Fleet) -> FastAPI:
    """The API over one `Fleet`."""
    app = FastAPI(title="tierkit fleet", version="1",
                  description="Devices, desired and reported state, telemetry and drift of a tierkit fleet.")

    @app.exception_handler(FleetError)
    async def _fleet_error(_request: Request, exc: FleetError) -> JSONResponse:
        return JSONResponse({"error": str(exc)}, status_code=exc.http_status)

    def _token(authorization: str | None) -> str | None:
        if authorization and authorization.lower().startswith("bearer "):
            return authorization[7:].strip()
        return None

    def reader(authorization: str | None = Header(default=None)) -> str:
        return fleet.registry.authorize(_token(authorization), write=False)

    def admin(authorization: str | None = Header(default=None)) -> str:
        return fleet.registry.authorize(_token(authorization), write=True)

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    def dashboard() -> str:
        return _DASHBOARD.read_text()

    _device_routes(app, fleet, reader, admin)
    _desired_routes(app, fleet, reader, admin)

    @app.get("/v1/telemetry", tags=["telemetry"])
    def telemetry(device: str | None = None, label: str | None = None, since: float = 0.0,
                  until: float | None = None, limit: int = 5000, _op: str = Depends(reader)) -> dict[str, Any]:
        return fleet.telemetry_query(device=device, labels=parse_labels(label, where="label"), since=since,
                                     until=until, limit=max(1, min(limit, 100_000)))

    from cloud_service.fleet.rollout_api import router

    app.include_router(router(fleet, reader, admin))

    @app.get("/v1/fleet/bands", tags=["telemetry"])
    def fleet_bands(by: str = "fleet", hours: int = 24, _op: str = Depends(reader)) -> dict[str, Any]:
        """p50 / p95 across devices of each figure, per group (fleet, release, label:KEY) and hour (stored
        per hour as windows arrive: a read costs a few hundred rows)."""
        return view.bands(fleet.store, by=by[:200], hours=max(1, min(hours, 24 * 31)))

    @app.get("/v1/fleet/devices", tags=["devices"])
    def fleet_devices(after: str = "", before: str = "", limit: int = 50, q: str = "", state: str = "",
                      _op: str = Depends(reader)) -> dict[str, Any]:
        """One page of devices by id (`after` or `before` an id), filtered by a label (`q=site=berlin`) or a
        device-id prefix, and a state (online, offline, revoked)."""
        return view.page(fleet.store, after=after[:128], before=before[:128], limit=limit, q=q[:200], state=state,
                         online_after_s=fleet.config.online_after_s, drift_after_s=fleet.config.drift_after_s,
                         data_drift=fleet.telemetry.data_drift)

    @app.get("/v1/stats", tags=["telemetry"])
    def stats(_op: str = Depends(reader)) -> dict[str, Any]:
        return fleet.stats()

    return app


def _device_routes(app: FastAPI, fleet: Fleet, reader: Callable[..., str], admin: Callable[..., str]) -> None:
    """Enrollment, the CA's revocation list, the device registry and enrollment tokens."""

    @app.post("/v1/enroll", response_model=EnrollResponse, tags=["devices"])
    def enroll(req: EnrollRequest) -> EnrollResponse:
        got = fleet.enroll(req.token, req.csr, hardware=req.hardware, agent_version=req.agent_version)
        return EnrollResponse(device_id=got.device_id, certificate=got.cert_pem, ca_certificate=got.ca_pem,
                              mqtt_username=got.mqtt_username, mqtt_password=got.mqtt_password, labels=got.labels)

    @app.get("/v1/ca/crl", tags=["devices"], response_class=PlainTextResponse,
             responses={200: {"content": {"application/x-pem-file": {}}}})
    def crl() -> PlainTextResponse:
        """The fleet CA's certificate revocation list (PEM), for a broker's `crlfile`; public, like the CA."""
        return PlainTextResponse(fleet.crl_pem(), media_type="application/x-pem-file")

    @app.get("/v1/devices", tags=["devices"])
    def devices(label: str | None = None, _op: str = Depends(reader)) -> list[dict[str, Any]]:
        return fleet.devices(parse_labels(label, where="label"))

    @app.get("/v1/devices/{device_id}", tags=["devices"])
    def device(device_id: str, _op: str = Depends(reader)) -> dict[str, Any]:
        return fleet.show(device_id)

    @app.post("/v1/devices/{device_id}/revoke", tags=["devices"])
    def revoke(device_id: str, _op: str = Depends(admin)) -> dict[str, Any]:
        fleet.revoke(device_id)
        return {"revoked": device_id}

    @app.post("/v1/tokens", tags=["devices"])
    def token(req: TokenRequest, _op: str = Depends(admin)) -> dict[str, Any]:
        return {"token": fleet.registry.create_token(req.labels, expires_s=req.expires_s),
                "expires_at": time.time() + req.expires_s}


def _desired_routes(app: FastAPI, fleet: Fleet, reader: Callable[..., str], admin: Callable[..., str]) -> None:
    """The desired layers (`fleet_docs.Desired` documents by selector) and the devices drifting from them."""

    @app.get("/v1/desired", tags=["desired"])
    def layers(_op: str = Depends(reader)) -> list[dict[str, Any]]:
        return fleet.desired.layers()

    @app.put("/v1/desired", tags=["desired"])
    def set_layer(req: LayerRequest, _op: str = Depends(admin)) -> dict[str, Any]:
        return {"version": fleet.set_layer(req.selector, req.document, priority=req.priority)}

    @app.get("/v1/drift", tags=["desired"])
    def drift(limit: int | None = None, _op: str = Depends(reader)) -> list[dict[str, Any]]:
        """Devices drifting from their desired document (the first `limit` by id, when given)."""
        return fleet.desired.drift(limit=limit)
