"""Mosquitto running deploy/mosquitto/ as shipped (config and dynamic-security roles), with test ports,
paths and certificates, and devices enrolled through cloud_service.identity."""

from __future__ import annotations

import datetime
import json
import os
import shutil
from collections.abc import Iterable
from pathlib import Path

import pytest

from cloud_service import identity
from tests.broker import Broker, _free_port
from tests.cloud_service.helpers import Pki

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "mosquitto"
PLUGIN_PATHS = ("/usr/lib/x86_64-linux-gnu/mosquitto_dynamic_security.so",
                "/usr/lib/aarch64-linux-gnu/mosquitto_dynamic_security.so", "/usr/lib/mosquitto_dynamic_security.so")


def dynsec_plugin() -> str:
    for path in PLUGIN_PATHS:
        if Path(path).exists():
            return path
    pytest.skip("Mosquitto's dynamic-security plugin is not installed (Debian's mosquitto package ships it)")
    raise AssertionError  # unreachable


class DeployBroker(Broker):
    """The shipped broker: devices by certificate on `port`, cloud and fleet by password on `cloud_port`."""

    def __init__(self, workdir: Path, pki: Pki, password: str, devices: Iterable[str] = ("cam-1",)) -> None:
        super().__init__(workdir)
        self.cloud_port = _free_port()
        self.pki, self.password, self.devices = pki, password, tuple(devices)

    def write_conf(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        doc = json.loads((DEPLOY / "dynamic-security.json").read_text())
        for client in doc["clients"]:
            client.update(identity.password_fields(self.password))
        for device in self.devices:
            doc["roles"].append(identity.device_role(device))
            doc["clients"].append(identity.device_client(device))
        (self.workdir / "dynamic-security.json").write_text(json.dumps(doc))
        text = (DEPLOY / "mosquitto.conf").read_text()
        for old, new in {"/mosquitto/data/": f"{self.workdir}/",
                         "/usr/lib/mosquitto_dynamic_security.so": dynsec_plugin(),
                         "/mosquitto/certs/ca.pem": str(self.pki.ca),
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
