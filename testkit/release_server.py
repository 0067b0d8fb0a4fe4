"""A stand-in for the fleet's release download endpoint: `GET /v1/releases/{digest}/archive` on loopback.

It answers like the fleet's contract says: 401 for bad credentials (HTTP Basic auth with the device's
MQTT user and password), 403 for a revoked device, 404 for an unknown digest, else the archive. It counts
the downloads, so a test can tell a pointer flip (no download) from a swap.
"""

from __future__ import annotations

import base64
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any


class ReleaseServer:
    """Serves `archives` (digest -> tar path) to `users` (name -> password); `revoked` names get 403."""

    def __init__(self, users: dict[str, str]) -> None:
        self.users = dict(users)
        self.archives: dict[str, Path] = {}
        self.revoked: set[str] = set()
        self.unavailable = False  # answer 503 to everything (a fleet being restarted)
        self.downloads: Counter[str] = Counter()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                server._serve(self)

            def log_message(self, fmt: str, *args: Any) -> None:
                pass

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._httpd.server_address[1]}"

    def _serve(self, h: BaseHTTPRequestHandler) -> None:
        auth = h.headers.get("Authorization", "")
        user, _, password = (base64.b64decode(auth[6:]).decode(errors="replace") if auth.startswith("Basic ")
                             else "").partition(":")
        parts = h.path.strip("/").split("/")
        if self.unavailable:
            self._reply(h, 503, b"try again later")
        elif self.users.get(user) != password or not user:
            self._reply(h, 401, b"bad credentials")
        elif user in self.revoked:
            self._reply(h, 403, b"device revoked")
        elif len(parts) != 4 or parts[:2] != ["v1", "releases"] or parts[3] != "archive" \
                or parts[2] not in self.archives:
            self._reply(h, 404, b"unknown release")
        else:
            self.downloads[parts[2]] += 1
            self._reply(h, 200, self.archives[parts[2]].read_bytes(), "application/x-tar")

    @staticmethod
    def _reply(h: BaseHTTPRequestHandler, code: int, body: bytes, kind: str = "text/plain") -> None:
        h.send_response(code)
        h.send_header("Content-Type", kind)
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)

    def __enter__(self) -> ReleaseServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(5)
