"""No usage telemetry from OpenVINO or NNCF in a tierkit process.

`import openvino` posts an "import" event through the `openvino_telemetry` package, NNCF posts several per
`nncf.quantize` (except under pytest, so in-process tests never see them), and OpenVINO's converter one per
conversion. Each post runs on a thread pool that forks a process to open an HTTPS connection, joins it for up to
3 s and then kills it. Offline (an edge box, an air-gapped build host) the resolver waits, so each event holds a
thread and a process for 3 s, and the interpreter waits for those threads at exit: `tierkit compile --precision
int8`, with its DNS server not answering, exited 4.5 s after writing its result (1.5 s with `silence`), and forked
6 such processes on the way.

tierkit sends no telemetry of its own and lets no library in its process send any: `silence` makes
`openvino_telemetry`'s sender drop every message (the one place every event, session and error message passes
through). Every tierkit module takes OpenVINO from `runtimes.ov_import`, which calls it before OpenVINO loads (and
the one that imports NNCF imports that first), so even the import event is dropped; the consent file and client
id that `openvino_telemetry` keeps under ~/intel are left as they are.
"""

from __future__ import annotations

from typing import Any

_silenced = False


def _drop(self: Any, backend: Any, message: Any) -> None:
    """`TelemetrySender.send`, replaced: the message is not posted, no thread or process is started."""


def silence() -> None:
    """Drop every usage-telemetry message `openvino_telemetry` would post from this process (idempotent; nothing
    to do where the package is not installed)."""
    global _silenced
    if _silenced:
        return
    try:
        from openvino_telemetry.utils.sender import TelemetrySender
    except ImportError:  # OpenVINO then uses its own no-op stub
        _silenced = True
        return
    TelemetrySender.send = _drop
    _silenced = True
