"""The processes of `tierkit demo --fleet`, each on loopback: a throwaway certificate authority, Mosquitto with
its dynamic-security plugin over TLS, and `tierkit` subcommands started as child processes and stopped in
reverse order (SIGTERM, then SIGKILL past a bound), so that nothing outlives the demo.

Example:
    >>> with Stack(workdir) as stack:
    ...     broker = stack.broker()
    ...     fleet = stack.spawn("fleet", ["fleet", "serve", ...], ready=r"API on (\\S+),")
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from cloud_service.broker_setup import find_plugin, init_broker
from runtimes.errors import BackendUnavailable, TierkitError


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def write_pki(directory: Path) -> tuple[Path, Path, Path]:
    """A throwaway CA and a server certificate for 127.0.0.1: (ca.pem, server.pem, server.key)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    directory.mkdir(parents=True, exist_ok=True)
    now = dt.datetime.now(dt.UTC)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = (x509.CertificateBuilder().subject_name(name("tierkit demo CA")).issuer_name(name("tierkit demo CA"))
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=2))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True).sign(ca_key, hashes.SHA256()))
    server = (x509.CertificateBuilder().subject_name(name("127.0.0.1")).issuer_name(ca.subject)
              .public_key(key.public_key()).serial_number(x509.random_serial_number())
              .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=2))
              .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                                                          x509.DNSName("localhost")]), critical=False)
              .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
              .sign(ca_key, hashes.SHA256()))
    paths = directory / "ca.pem", directory / "server.pem", directory / "server.key"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(server.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    os.chmod(paths[2], 0o600)
    return paths


@dataclass(frozen=True)
class Broker:
    """Where the demo's broker listens (TLS) and the service accounts' passwords."""

    port: int
    ca: Path
    passwords: dict[str, str]

    @property
    def url(self) -> str:
        return f"mqtts://127.0.0.1:{self.port}"


class Stack:
    """Child processes of the demo, logged to `workdir/NAME.log`, stopped in reverse order on exit."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.procs: list[tuple[str, subprocess.Popen[str], IO[str]]] = []

    def __enter__(self) -> Stack:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def spawn(self, name: str, argv: list[str], *, env: dict[str, str] | None = None, ready: str | None = None,
              timeout_s: float = 120.0) -> str:
        """Start `argv` (a `tierkit` command line, or a program's when argv[0] is a path); wait until a line of its
        output matches `ready` and return the regex's first group (or the line)."""
        log = (self.workdir / f"{name}.log").open("w")
        cmd = argv if argv[0].startswith("/") else [sys.executable, "-m", "sdk.cli", *argv]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, env={**os.environ, **(env or {})},
                                bufsize=1)
        self.procs.append((name, proc, log))
        if ready is None:
            return ""
        assert proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        for line in proc.stdout:
            log.write(line)
            m = re.search(ready, line)
            if m:
                self._drain(proc, log)
                return m.group(1) if m.groups() else line.strip()
            if time.monotonic() > deadline:
                break
        msg = f"{name} did not start ({' '.join(cmd[:6])} ...); its log: {self.workdir / (name + '.log')}"
        raise TierkitError(msg)

    @staticmethod
    def _drain(proc: subprocess.Popen[str], log: IO[str]) -> None:
        """Copy the rest of the child's output into its log (a full pipe would block the child)."""
        import threading

        def copy() -> None:
            assert proc.stdout is not None
            try:
                for line in proc.stdout:
                    log.write(line)
            except (ValueError, OSError):  # the demo closed the pipe or the log: it is stopping
                return

        threading.Thread(target=copy, name="demo-log", daemon=True).start()

    def broker(self) -> Broker:
        """Mosquitto with the dynamic-security plugin on one TLS listener (devices and services by password,
        username = client id, as `deploy/fleet/mosquitto-fleet.conf`), its accounts from `tierkit broker init`."""
        binary, plugin = shutil.which("mosquitto") or "/usr/sbin/mosquitto", find_plugin()
        if not Path(binary).exists() or plugin is None:
            msg = ("tierkit demo --fleet needs Mosquitto with its dynamic-security plugin: apt-get install mosquitto "
                   "(Debian's package ships the plugin), or make mosquitto")
            raise BackendUnavailable(msg)
        data = self.workdir / "broker"
        passwords = init_broker(data)
        ca, cert, key = write_pki(self.workdir / "pki")
        port = free_port()
        conf = data / "mosquitto.conf"
        conf.write_text(
            ("user root\n" if os.geteuid() == 0 else "")  # as root Mosquitto drops to `mosquitto`, locked out of here
            + f"per_listener_settings false\nset_tcp_nodelay true\nallow_anonymous false\nplugin {plugin}\n"
            f"plugin_opt_config_file {data / 'dynamic-security.json'}\nlog_dest file {self.workdir / 'broker.log'}\n"
            f"listener {port} 127.0.0.1\ncertfile {cert}\nkeyfile {key}\nuse_username_as_clientid true\n")
        self.spawn("mosquitto", [binary, "-c", str(conf)])
        for _ in range(200):
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                    return Broker(port, ca, passwords)
            except OSError:
                time.sleep(0.05)
        msg = f"mosquitto did not start on 127.0.0.1:{port}; see {self.workdir / 'broker.log'}"
        raise BackendUnavailable(msg)

    def stop_one(self, name: str) -> None:
        for entry in [e for e in self.procs if e[0] == name]:
            self._stop(entry)
            self.procs.remove(entry)

    def stop(self) -> None:
        while self.procs:
            self._stop(self.procs.pop())

    @staticmethod
    def _stop(entry: tuple[str, subprocess.Popen[str], IO[str]]) -> None:
        _name, proc, log = entry
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        if proc.stdout is not None:
            proc.stdout.close()
        log.close()
