"""Telemetry windows as a device sends them, built through the wire contract's type.

A test that hand-writes a window's JSON keeps a second copy of the document's shape; built through
`cloud_service.protocol.fleet_docs.TelemetryWindow`, a field the type no longer has fails where the window is
made, and the JSON is exactly what an agent sends (`TelemetryWindow.to_json`).

Example:
    >>> payload = window_json("dev-1", 3, requests=100, p95_ms=9.0)
    >>> parse_telemetry(payload).requests
    100
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Any

from cloud_service.protocol.fleet_docs import TelemetryWindow


def window_doc(device: str, seq: int, *, boot_id: str = "b", ts: float | None = None, **fields: Any) -> dict[str, Any]:
    """Window `seq` of `device` (boot `boot_id`, at `ts`, default now) with `fields` of `TelemetryWindow`."""
    return TelemetryWindow(device=device, boot_id=boot_id, seq=seq, ts=time.time() if ts is None else ts,
                           **fields).to_json()


def window_json(device: str, seq: int, *, extra: Mapping[str, Any] | None = None, **kw: Any) -> bytes:
    """`window_doc` as the bytes a device publishes; `extra` adds keys no window has (an oversized one)."""
    return json.dumps({**window_doc(device, seq, **kw), **(extra or {})}).encode()
