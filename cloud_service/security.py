"""TLS options for the gRPC server and the MQTT bridge.

Example:
    >>> tls = GrpcTls(cert_file=Path("server.pem"), key_file=Path("server.key"),
    ...               client_ca_file=Path("ca.pem"))          # mutual TLS
    >>> server.add_secure_port("0.0.0.0:8001", tls.server_credentials())
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from runtimes.errors import ConfigError

if TYPE_CHECKING:
    import grpc


def _read(path: Path | None, what: str) -> bytes | None:
    if path is None:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        msg = f"cannot read the {what} {str(path)!r}: {exc.strerror}"
        raise ConfigError(msg) from None


@dataclass(frozen=True, slots=True)
class GrpcTls:
    """Server-side TLS for gRPC.

    Args:
        cert_file: PEM certificate chain of the server.
        key_file: PEM private key of the server.
        client_ca_file: PEM CA bundle; when set, clients must present a certificate it signed
            (mutual TLS).
    """

    cert_file: Path
    key_file: Path
    client_ca_file: Path | None = None

    def __post_init__(self) -> None:
        for name in ("cert_file", "key_file"):
            _read(getattr(self, name), name.replace("_", " "))
        _read(self.client_ca_file, "client CA file")

    def server_credentials(self) -> grpc.ServerCredentials:
        import grpc

        key = _read(self.key_file, "key file")
        cert = _read(self.cert_file, "certificate file")
        ca = _read(self.client_ca_file, "client CA file")
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca,
                                           require_client_auth=ca is not None)


@dataclass(frozen=True, slots=True)
class MqttTls:
    """Client-side TLS for the MQTT bridge.

    Args:
        ca_file: PEM CA bundle that signed the broker's certificate (None: the system store).
        cert_file, key_file: client certificate and key, for brokers that authenticate clients by
            certificate (`require_certificate true` in Mosquitto).
    """

    ca_file: Path | None = None
    cert_file: Path | None = None
    key_file: Path | None = None

    def __post_init__(self) -> None:
        if (self.cert_file is None) != (self.key_file is None):
            msg = "MQTT TLS needs both cert_file and key_file for a client certificate, or neither"
            raise ConfigError(msg)
        for name in ("ca_file", "cert_file", "key_file"):
            _read(getattr(self, name), name.replace("_", " "))

    def context(self) -> ssl.SSLContext:
        """A client SSL context that verifies the broker's certificate and host name."""
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH,
                                         cafile=str(self.ca_file) if self.ca_file else None)
        if self.cert_file is not None and self.key_file is not None:
            ctx.load_cert_chain(str(self.cert_file), str(self.key_file))
        return ctx
