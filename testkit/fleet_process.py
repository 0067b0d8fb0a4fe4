"""`tierkit fleet serve` as a real process on a free loopback port, and the CLI, for tests."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from cloud_service.fleet.telemetry import DROP_REASONS

ROOT = Path(__file__).resolve().parents[1]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def windows_accounted(ingest_stats: Mapping[str, int]) -> int:
    """Telemetry windows an ingest has finished with, stored or dropped for a reason (`MqttIngest.stats`, or
    `GET /v1/stats`'s "ingest"): once it reaches what was sent, no window can still come to be stored."""
    return int(ingest_stats.get("stored", 0)) + sum(int(ingest_stats.get(r, 0)) for r in DROP_REASONS)


def cli(*args: str, data_dir: Path, db: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run `tierkit fleet ARGS` against `data_dir` / `db`, in this process (the same `main` the command runs)."""
    from sdk.cli import main

    n = 2 if args[0] in ("token", "operator", "release", "rollout") else 1
    argv = ["fleet", *args[:n], "--data-dir", str(data_dir), *(["--db", db] if db else []), *args[n:]]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    if check and rc:
        msg = f"tierkit {' '.join(argv)} failed ({rc}): {err.getvalue()}"
        raise AssertionError(msg)
    return subprocess.CompletedProcess(argv, rc, out.getvalue(), err.getvalue())


class FleetProcess:
    """Start `tierkit fleet serve --http 127.0.0.1:0 ...`; `url` once it printed its address."""

    def __init__(self, data_dir: Path, db: str | None = None, *extra: str, env: dict[str, str] | None = None,
                 ca: Path | None = None) -> None:
        """`ca`: the CA of the API's certificate, when `extra` serves it over HTTPS (--http-cert)."""
        self.data_dir, self.db, self.extra, self.extra_env = data_dir, db, extra, env or {}
        self.ca = ca
        self.proc: subprocess.Popen[str] | None = None
        self.url = ""

    def start(self, timeout: float = 60.0) -> FleetProcess:
        cmd = [sys.executable, "-m", "sdk.cli", "fleet", "serve", "--http", "127.0.0.1:0",
               "--data-dir", str(self.data_dir), *(["--db", self.db] if self.db else []), *self.extra]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env={**_env(), **self.extra_env})
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        line = ""
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            m = re.search(r"API on (https?://\S+),", line)
            if m:
                self.url = m.group(1)
                return self
            if self.proc.poll() is not None:
                break
        err = self.proc.stderr.read() if self.proc.stderr and self.proc.poll() is not None else ""
        self.stop()
        msg = f"fleet serve did not start: {line!r} {err}"
        raise RuntimeError(msg)

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        for f in (self.proc.stdout, self.proc.stderr):
            if f is not None:
                f.close()
        self.proc = None

    def call(self, method: str, path: str, body: Any = None, *, token: str | None = None) -> tuple[int, Any]:
        """(status, parsed JSON) of one API call."""
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        req = urllib.request.Request(self.url + path, data=data, method=method, headers=headers)
        try:
            context = ssl.create_default_context(cafile=str(self.ca)) if self.ca else None
            with urllib.request.urlopen(req, timeout=30, context=context) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read() or b"null")
