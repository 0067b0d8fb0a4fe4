"""Mosquitto running deploy/mosquitto/mosquitto.conf as shipped, with the dynamic-security file and service
passwords `tierkit broker init` writes, test ports, paths and certificates, and devices added through
cloud_service.identity."""

from __future__ import annotations

import datetime
import json
import os
import queue
import shutil
import socket
import ssl
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import paho.mqtt.client as paho
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from cloud_service import identity
from cloud_service.broker_setup import find_plugin
from sdk.cli import main as tierkit
from testkit.broker import Broker, _free_port
from testkit.cloud_helpers import Pki

DEPLOY = Path(__file__).resolve().parents[1] / "deploy" / "mosquitto"


def dynsec_plugin() -> str:
    path = find_plugin()
    if path is None:
        pytest.skip("Mosquitto's dynamic-security plugin is not installed (Debian's mosquitto package ships it)")
    return str(path)


def broker_init(out: Path, *args: str) -> dict[str, str]:
    """`tierkit broker init --out OUT ARGS`; returns account -> password as written."""
    assert tierkit(["broker", "init", "--out", str(out), *args]) == 0
    return {p.name.removesuffix(".password"): p.read_text().strip() for p in out.glob("*.password")}


def write_crl(pki: Pki, path: Path, revoked: Iterable[Path] = ()) -> None:
    """The test CA's revocation list (PEM) listing the certificates `revoked`."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization

    ca_cert = x509.load_pem_x509_certificate(pki.ca.read_bytes())
    ca_key = serialization.load_pem_private_key((pki.dir / "ca.key").read_bytes(), password=None)
    now = datetime.datetime.now(datetime.UTC)
    builder = (x509.CertificateRevocationListBuilder().issuer_name(ca_cert.subject).last_update(now)
               .next_update(now + datetime.timedelta(days=1)))
    for cert_path in revoked:
        serial = x509.load_pem_x509_certificate(cert_path.read_bytes()).serial_number
        builder = builder.add_revoked_certificate(x509.RevokedCertificateBuilder().serial_number(serial)
                                                  .revocation_date(now).build())
    crl = builder.sign(ca_key, hashes.SHA256())  # type: ignore[arg-type]
    path.write_bytes(crl.public_bytes(serialization.Encoding.PEM))


class DeployBroker(Broker):
    """The shipped broker: devices by certificate on `port`, cloud and fleet by password on `cloud_port`; the
    service accounts and their passwords (`passwords`) from `tierkit broker init ARGS`.

    Args:
        devices: certificate devices added to the first dynamic-security file (as the fleet's enrollment would).
        init: arguments of `tierkit broker init`.
        device_ca: the CA the device listener trusts (default the test PKI's), e.g. the fleet's `ca.pem`.
        crl: its revocation list (default: an empty one of the test PKI's CA, written at start), e.g. the file
            `tierkit fleet serve --crl-file` keeps.
    """

    def __init__(self, workdir: Path, pki: Pki, devices: Iterable[str] = ("cam-1",), init: Iterable[str] = (), *,
                 device_ca: Path | None = None, crl: Path | None = None) -> None:
        super().__init__(workdir)
        self.cloud_port = _free_port()
        self.pki, self.devices, self.init_args = pki, tuple(devices), tuple(init)
        self.device_ca, self.crl, self._own_crl = device_ca or pki.ca, crl or workdir / "fleet-ca.crl", crl is None
        self.pid_file = workdir / "mosquitto.pid"
        self.passwords: dict[str, str] = {}

    def start(self, timeout: float = 10.0) -> DeployBroker:
        """Start, and wait for the service listener too (the base class waits for the device listener only, which
        Mosquitto may open a moment before the second)."""
        super().start(timeout)
        deadline = time.monotonic() + timeout
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.cloud_port), timeout=0.2):
                    return self
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    msg = f"mosquitto did not listen on {self.cloud_port} within {timeout}s: {self.log.read_text()}"
                    raise RuntimeError(msg) from None
                time.sleep(0.05)

    def init(self) -> DeployBroker:
        """`tierkit broker init` into the data directory (once: the plugin keeps its state there)."""
        state = self.workdir / "dynamic-security.json"
        if not state.exists():
            self.passwords = broker_init(self.workdir, *self.init_args)
            doc = json.loads(state.read_text())
            for device in self.devices:
                doc["roles"].append(identity.device_role(device))
                doc["clients"].append(identity.device_client(device))
            state.write_text(json.dumps(doc))
        return self

    def write_conf(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.init()
        if self._own_crl and not self.crl.exists():
            write_crl(self.pki, self.crl)
        text = (DEPLOY / "mosquitto.conf").read_text()
        for old, new in {"/mosquitto/data/": f"{self.workdir}/",
                         "/usr/lib/mosquitto_dynamic_security.so": dynsec_plugin(),
                         "/mosquitto/certs/fleet-ca.pem": str(self.device_ca),
                         "/mosquitto/certs/fleet-ca.crl": str(self.crl),
                         "/mosquitto/certs/server.pem": str(self.pki.server_cert),
                         "/mosquitto/certs/server.key": str(self.pki.server_key),
                         "listener 8883": f"listener {self.port} 127.0.0.1",
                         "listener 8884": f"listener {self.cloud_port} 127.0.0.1",
                         "log_dest stdout": f"log_dest file {self.log}"}.items():
            assert old in text, old
            text = text.replace(old, new)
        if os.geteuid() == 0:
            # As root, Mosquitto drops to user `mosquitto`, which cannot read pytest's private tmp dirs.
            text = "user root\n" + text
        self.conf.write_text(text)


def need_mosquitto() -> None:
    if shutil.which("mosquitto") is None and not Path("/usr/sbin/mosquitto").exists():
        pytest.skip("mosquitto is not installed (make test installs it: apt-get install mosquitto)")


def issue_client_cert(pki: Pki, cn: str) -> tuple[Path, Path]:
    """A client certificate with common name `cn`, signed by the test CA (as a careless CA would)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    ca_cert = x509.load_pem_x509_certificate(pki.ca.read_bytes())
    ca_key = serialization.load_pem_private_key((pki.dir / "ca.key").read_bytes(), password=None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)]))
            .issuer_name(ca_cert.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    stem = pki.dir / f"client-{abs(hash(cn))}"
    cert_path, key_path = stem.with_suffix(".pem"), stem.with_suffix(".key")
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


def connack(port: int, ctx: ssl.SSLContext, username: str, password: str) -> Any:
    """The CONNACK reason a login gets."""
    client = paho.Client(CallbackAPIVersion.VERSION2, client_id=username, protocol=paho.MQTTv5)
    client.tls_set_context(ctx)
    client.username_pw_set(username, password)
    reasons: queue.Queue[Any] = queue.Queue()
    client.on_connect = lambda c, u, f, rc, p: reasons.put(rc)
    client.connect("127.0.0.1", port)
    client.loop_start()
    try:
        return reasons.get(timeout=5)
    finally:
        client.disconnect()
        client.loop_stop()
        client._reset_sockets()  # paho leaves its socket pair (and a late connection) to gc
