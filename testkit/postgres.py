"""A real PostgreSQL (Debian's package) on a free loopback port, in a temporary directory, for tests.

As root, initdb and the server run as the `postgres` user (PostgreSQL refuses to run as root).
"""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

_BIN_DIRS = sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True)


def _binary(name: str) -> str | None:
    for d in _BIN_DIRS:
        if (d / name).exists():
            return str(d / name)
    return shutil.which(name)


def available() -> bool:
    return _binary("initdb") is not None and _binary("pg_ctl") is not None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Postgres:
    """initdb into `workdir`, pg_ctl start on 127.0.0.1:PORT; `url` for SQLAlchemy (psycopg 3).

    `workdir` must be reachable by the `postgres` user: not under pytest's private (0700) tmp tree,
    whose permissions any concurrent pytest run resets; the fixture uses a `tempfile.mkdtemp` directory.
    """

    def __init__(self, workdir: Path) -> None:
        self.workdir, self.port = workdir, _free_port()
        self.data, self.sock = workdir / "pgdata", workdir / "sock"
        self._as: list[str] = []

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, *cmd: str) -> None:
        done = subprocess.run([*self._as, *cmd], capture_output=True, text=True, timeout=60, check=False)
        if done.returncode:
            msg = f"{cmd[0]} failed ({done.returncode}): {done.stderr.strip()} {done.stdout.strip()[-500:]}"
            raise RuntimeError(msg)

    def start(self) -> Postgres:
        if not available():
            pytest.skip("PostgreSQL is not installed (make test installs it: apt-get install postgresql)")
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.sock.mkdir(exist_ok=True)
        if os.geteuid() == 0:
            pw = pwd.getpwnam("postgres")
            for p in (self.workdir, self.sock):
                os.chown(p, pw.pw_uid, pw.pw_gid)
            self._as = ["runuser", "-u", "postgres", "--"]
        self._run(str(_binary("initdb")), "-D", str(self.data), "-A", "trust", "-U", "postgres", "--no-sync")
        with (self.data / "postgresql.conf").open("a") as conf:
            conf.write("fsync = off\nsynchronous_commit = off\nfull_page_writes = off\nmax_connections = 100\n")
        self._run(str(_binary("pg_ctl")), "-D", str(self.data), "-l", str(self.workdir / "pg.log"), "-w",
                  "-t", "30", "start", "-o", f"-p {self.port} -k {self.sock} -h 127.0.0.1")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return self
            except OSError:
                time.sleep(0.05)
        msg = f"PostgreSQL did not listen on {self.port}"
        raise RuntimeError(msg)

    def stop(self, *, remove: bool = True) -> None:
        """Stop the server; `remove=False` keeps the data to start it again.

        Removing: immediately. Keeping: "fast" (connections cut, data flushed), since the test server runs
        with synchronous_commit off, whose last commits an immediate stop would lose.
        """
        if self.data.exists():
            subprocess.run([*self._as, str(_binary("pg_ctl")), "-D", str(self.data), "-m",
                            "immediate" if remove else "fast", "-w", "stop"], capture_output=True, timeout=60,
                           check=False)
        if remove:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def restart(self) -> None:
        """Start a stopped server again on the same port and data."""
        self._run(str(_binary("pg_ctl")), "-D", str(self.data), "-l", str(self.workdir / "pg.log"), "-w",
                  "-t", "30", "start", "-o", f"-p {self.port} -k {self.sock} -h 127.0.0.1")
