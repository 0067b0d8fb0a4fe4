"""A broker's server certificate for 127.0.0.1, signed by the fleet CA (the broker's own PKI in tests)."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from cloud_service.fleet.ca import FleetCA


def server_cert(ca: FleetCA, out: Path) -> tuple[Path, Path]:
    """A broker certificate for 127.0.0.1, signed by the fleet CA (test setup: the broker's own PKI)."""
    import ipaddress

    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "broker")]))
            .issuer_name(ca.cert.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .sign(ca.key, hashes.SHA256()))
    kp, cp = out / "server.key", out / "server.pem"
    kp.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                     serialization.NoEncryption()))
    cp.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return kp, cp
