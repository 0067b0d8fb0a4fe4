"""The HTTP API of releases and rollouts (mounted by api.py).

Operators (Bearer token): `GET /v1/releases`, `POST /v1/releases` (admin; body: a release archive),
`GET /v1/rollouts`, `GET /v1/rollouts/{id}`, `POST /v1/rollouts` (admin; deploy),
`POST /v1/rollouts/{id}/pause|resume|rollback` (admin).
Devices (HTTP Basic: their MQTT user and password): `GET /v1/releases/{digest}/archive`; 401 for bad
credentials, 403 for a revoked device, 404 for an unknown digest.
"""

from __future__ import annotations

import base64
import binascii
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends, Header, Request
from fastapi.responses import FileResponse
from pydantic import BaseModel, Field

from cloud_service.fleet.errors import ReleaseRefused, Unauthorized
from cloud_service.fleet.fleet import Fleet
from cloud_service.fleet.registry import parse_labels
from cloud_service.fleet.releases import authenticate_device
from cloud_service.fleet.rollouts import make_options
from cloud_service.protocol.fleet_docs import ROLLOUT_MAX_SOAK, ROLLOUT_SOAK, WAVES_TEXT

MAX_ARCHIVE_BYTES = 2 * 1024**3


class DeployRequest(BaseModel):
    release: str = Field(min_length=1, max_length=200, examples=["sha256:9f2c...", "digits@7"])
    label: str = Field(default="", max_length=512, examples=["kind=cam"])
    waves: str = Field(default=WAVES_TEXT, max_length=200)
    soak: str = Field(default=ROLLOUT_SOAK, max_length=32, examples=["500", "10m"])
    max_soak: str = Field(default=ROLLOUT_MAX_SOAK, max_length=32, examples=["30m", "20000"])
    on_inconclusive: str = Field(default="hold", max_length=16, examples=["hold", "extend", "rollback", "promote"])
    holdback: float = Field(default=0.05, ge=0, lt=1)
    audit_rate: float = Field(default=0.5, ge=0, le=1)
    audit_devices: int = Field(default=10, ge=0)
    pre_swap_s: float = Field(default=300.0, ge=0)
    previous: str | None = Field(default=None, max_length=200)
    cloud_capacity_rps: float | None = Field(default=None, gt=0)
    stall_after_s: float = Field(default=300.0, gt=0)
    margins: dict[str, float] = Field(default_factory=dict, examples=[{"escalation_points": 0.05}])
    evidence: dict[str, float] = Field(default_factory=dict, examples=[{"alpha": 0.01, "bucket_s": 10}])


def router(fleet: Fleet, reader: Callable[..., str], admin: Callable[..., str]) -> APIRouter:
    api = APIRouter()

    @api.get("/v1/releases", tags=["releases"])
    def releases(_op: str = Depends(reader)) -> list[dict[str, Any]]:
        return fleet.releases.list()

    @api.post("/v1/releases", tags=["releases"])
    async def upload(request: Request, _op: str = Depends(admin)) -> dict[str, Any]:
        with tempfile.TemporaryDirectory(prefix="tierkit-upload-") as tmp:
            path, size = Path(tmp) / "release.tar", 0
            with path.open("wb") as fh:
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > MAX_ARCHIVE_BYTES:
                        msg = f"release archive is larger than {MAX_ARCHIVE_BYTES} bytes"
                        raise ReleaseRefused(msg)
                    fh.write(chunk)
            return fleet.releases.register(path)

    @api.get("/v1/releases/{digest}/archive", tags=["releases"], response_class=FileResponse)
    def archive(digest: str, authorization: str | None = Header(default=None)) -> FileResponse:
        user, password = _basic(authorization)
        authenticate_device(fleet.store, user, password)
        path = fleet.releases.archive(digest)
        return FileResponse(path, media_type="application/x-tar", filename=path.name)

    @api.get("/v1/rollouts", tags=["rollouts"])
    def rollouts(_op: str = Depends(reader)) -> list[dict[str, Any]]:
        return fleet.rollouts.list()

    @api.get("/v1/rollouts/{rollout_id}", tags=["rollouts"])
    def show(rollout_id: int, decisions: int = 500, _op: str = Depends(reader)) -> dict[str, Any]:
        return fleet.rollouts.show(rollout_id, decisions=max(1, min(decisions, 10_000)))

    @api.post("/v1/rollouts", tags=["rollouts"])
    def deploy(req: DeployRequest, op: str = Depends(admin)) -> dict[str, Any]:
        opts = make_options(waves=req.waves, soak=req.soak, cloud_capacity_rps=req.cloud_capacity_rps,
                            stall_after_s=req.stall_after_s, margins=req.margins, evidence=req.evidence,
                            max_soak=req.max_soak, on_inconclusive=req.on_inconclusive, holdback=req.holdback,
                            audit_rate=req.audit_rate, audit_devices=req.audit_devices, pre_swap_s=req.pre_swap_s)
        rid = fleet.rollouts.deploy(req.release, parse_labels(req.label, where="label"), opts, previous=req.previous)
        return fleet.rollouts.get(rid)

    @api.post("/v1/rollouts/{rollout_id}/pause", tags=["rollouts"])
    def pause(rollout_id: int, op: str = Depends(admin)) -> dict[str, Any]:
        return fleet.rollouts.pause(rollout_id, by=op)

    @api.post("/v1/rollouts/{rollout_id}/resume", tags=["rollouts"])
    def resume(rollout_id: int, op: str = Depends(admin)) -> dict[str, Any]:
        return fleet.rollouts.resume(rollout_id, by=op)

    @api.post("/v1/rollouts/{rollout_id}/rollback", tags=["rollouts"])
    def rollback(rollout_id: int, op: str = Depends(admin)) -> dict[str, Any]:
        return fleet.rollouts.request_rollback(rollout_id, by=op)

    return api


def _basic(authorization: str | None) -> tuple[str, str]:
    if not authorization or not authorization.lower().startswith("basic "):
        msg = "a device downloads releases with HTTP Basic auth: its MQTT user and password"
        raise Unauthorized(msg)
    try:
        user, sep, password = base64.b64decode(authorization[6:].strip(), validate=True).decode().partition(":")
    except (binascii.Error, UnicodeDecodeError):
        sep = ""
    if not sep:
        msg = "the HTTP Basic credentials are malformed"
        raise Unauthorized(msg)
    return user, password
