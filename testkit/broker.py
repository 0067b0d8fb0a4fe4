"""A real Mosquitto broker on a free loopback port, for tests. Config written per test, never a shared one."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Broker:
    """Mosquitto bound to 127.0.0.1 with TCP_NODELAY and persistence on.

    Args:
        workdir: where the config, persistence file and log go.
        extra_conf: lines appended to the listener's config (ACLs, passwords, TLS).
    """

    def __init__(self, workdir: Path, *, extra_conf: str = "", port: int | None = None) -> None:
        self.workdir = workdir
        self.port = port or _free_port()
        self.host = "127.0.0.1"
        self.extra_conf = extra_conf
        self.proc: subprocess.Popen[bytes] | None = None
        self.conf = workdir / "mosquitto.conf"
        self.log = workdir / "mosquitto.log"

    @property
    def url(self) -> str:
        return f"mqtt://{self.host}:{self.port}"

    def write_conf(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.conf.write_text(
            f"listener {self.port} {self.host}\n"
            "set_tcp_nodelay true\n"
            "persistence true\n"
            f"persistence_location {self.workdir}/\n"
            "autosave_interval 1\n"
            "max_queued_messages 10000\n"
            f"log_dest file {self.log}\n"
            "log_type error\nlog_type warning\nlog_type notice\n"
            + ("" if "allow_anonymous" in self.extra_conf else "allow_anonymous true\n")
            # started as root, mosquitto switches to its own user, which cannot read pytest's private dirs
            + ("user root\n" if os.geteuid() == 0 and "\nuser " not in f"\n{self.extra_conf}" else "")
            + self.extra_conf + "\n"
        )

    def start(self, timeout: float = 10.0) -> Broker:
        binary = shutil.which("mosquitto") or "/usr/sbin/mosquitto"
        if not Path(binary).exists():
            pytest.skip("mosquitto is not installed (make test installs it: apt-get install mosquitto)")
        self.write_conf()
        self.proc = subprocess.Popen([binary, "-c", str(self.conf)], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode() if self.proc.stderr else ""
                log = self.log.read_text() if self.log.exists() else ""
                msg = f"mosquitto exited with {self.proc.returncode}: {err} {log}"
                raise RuntimeError(msg)
            try:
                with socket.create_connection((self.host, self.port), timeout=0.2):
                    return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        msg = f"mosquitto did not listen on {self.port} within {timeout}s"
        raise RuntimeError(msg)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        if self.proc is not None and self.proc.stderr:
            self.proc.stderr.close()
        self.proc = None

    def restart(self, down_s: float = 0.0) -> None:
        """Stop and start again on the same port with the same persistence file."""
        self.stop()
        time.sleep(down_s)
        self.start()
