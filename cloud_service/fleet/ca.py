"""The fleet's own certificate authority: it signs device CSRs, so a device's key never leaves it.

The CA key and certificate live in the data directory (`ca.key`, `ca.pem`), created on first use.
`crl` signs the list of revoked device certificates that a broker's `crlfile` checks.
A device certificate's CN is its device id, the MQTT client id the broker confines it by
(`use_identity_as_username true` in Mosquitto; the same in EMQX and VerneMQ).

Example:
    >>> ca = FleetCA.load_or_create(Path("fleet-data"))
    >>> cert_pem = ca.sign(csr_pem, device_id="cam-7")
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from cloud_service.fleet.errors import EnrollmentRefused

_DEVICE_DAYS = 365
CRL_DAYS = 30  # a CRL past its nextUpdate makes OpenSSL refuse every client: the fleet re-signs it daily


class FleetCA:
    """Signs device certificates. Args: key: the CA private key; cert: its self-signed certificate."""

    def __init__(self, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate) -> None:
        self.key, self.cert = key, cert

    @property
    def cert_pem(self) -> str:
        return self.cert.public_bytes(serialization.Encoding.PEM).decode()

    @classmethod
    def load_or_create(cls, data_dir: Path, *, name: str = "tierkit fleet CA") -> FleetCA:
        key_path, cert_path = data_dir / "ca.key", data_dir / "ca.pem"
        if key_path.exists() and cert_path.exists():
            key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
            if not isinstance(key, ec.EllipticCurvePrivateKey):
                msg = f"{key_path} is not an EC private key; move it away to let the fleet create a new CA"
                raise EnrollmentRefused(msg)
            return cls(key, x509.load_pem_x509_certificate(cert_path.read_bytes()))
        data_dir.mkdir(parents=True, exist_ok=True)
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        now = dt.datetime.now(dt.UTC)
        cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=3650))
                .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                             content_commitment=False, key_encipherment=False,
                                             data_encipherment=False, key_agreement=False,
                                             encipher_only=False, decipher_only=False), critical=True)
                .sign(key, hashes.SHA256()))
        key_path.touch(mode=0o600)
        key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        return cls(key, cert)

    def sign(self, csr_pem: str, *, device_id: str) -> tuple[str, str]:
        """Issue a client certificate for the CSR's key with CN=`device_id`. Returns (PEM, serial hex).

        The CSR's own subject is ignored: the fleet, not the device, names the device.
        """
        try:
            csr = x509.load_pem_x509_csr(csr_pem.encode())
        except ValueError as exc:
            msg = f"the certificate signing request is not a PEM CSR ({exc}); send the one the agent generated"
            raise EnrollmentRefused(msg) from None
        if not csr.is_signature_valid:
            msg = "the certificate signing request's signature does not verify; it was altered or built wrong"
            raise EnrollmentRefused(msg)
        now = dt.datetime.now(dt.UTC)
        serial = x509.random_serial_number()
        cert = (x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, device_id)]))
                .issuer_name(self.cert.subject).public_key(csr.public_key()).serial_number(serial)
                .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=_DEVICE_DAYS))
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
                .sign(self.key, hashes.SHA256()))
        return cert.public_bytes(serialization.Encoding.PEM).decode(), format(serial, "x")

    def crl(self, revoked: list[tuple[str, float]], *, now: dt.datetime | None = None) -> str:
        """A certificate revocation list (PEM) of `revoked` (serial hex, revocation time in Unix seconds),
        valid `CRL_DAYS` days from `now`."""
        now = now or dt.datetime.now(dt.UTC)
        b = (x509.CertificateRevocationListBuilder().issuer_name(self.cert.subject)
             .last_update(now - dt.timedelta(minutes=5)).next_update(now + dt.timedelta(days=CRL_DAYS)))
        for serial, at in sorted(revoked):
            if not serial:
                continue  # enrolled before certificates carried a serial: nothing to list
            b = b.add_revoked_certificate(x509.RevokedCertificateBuilder().serial_number(int(serial, 16))
                                          .revocation_date(dt.datetime.fromtimestamp(at, dt.UTC)).build())
        return b.sign(self.key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM).decode()
