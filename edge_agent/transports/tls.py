"""TLS settings of the transports, from `TransportOptions`: gRPC channel credentials and an SSL context for paho."""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Any

import grpc

from edge_agent.transports.base import TransportOptions
from runtimes.errors import ConfigError


def _read(path: str | None, what: str) -> bytes | None:
    if path is None:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        msg = f"cannot read the {what} {path!r}: {exc.strerror}; check TransportOptions"
        raise ConfigError(msg) from None


def grpc_credentials(options: TransportOptions) -> grpc.ChannelCredentials:
    """Channel credentials: the CA (or the system roots) and, for mutual TLS, the client certificate.

    The server name override is a channel option (`grpc.ssl_target_name_override`), not part of these.
    """
    return grpc.ssl_channel_credentials(
        root_certificates=_read(options.ca_file, "CA file"),
        private_key=_read(options.key_file, "client key file"),
        certificate_chain=_read(options.cert_file, "client certificate file"),
    )


class _PahoContext(ssl.SSLContext):
    """The SSL context paho wraps its sockets with, mending two gaps of paho 2.x.

    - It verifies `server_name`, when set, instead of the host paho connects to (paho has no override).
    - It runs the handshake itself and closes the socket when the handshake fails: paho leaves such a
      socket open, one per failed reconnect attempt, until the garbage collector finds it. paho's own
      later `do_handshake()` on the finished socket does nothing.
    """

    server_name = ""

    def wrap_socket(self, sock: Any, *args: Any, **kwargs: Any) -> ssl.SSLSocket:
        if self.server_name:
            kwargs["server_hostname"] = self.server_name
        tls_sock = super().wrap_socket(sock, *args, **kwargs)
        try:
            tls_sock.do_handshake()
        except BaseException:
            tls_sock.close()
            raise
        return tls_sock


def ssl_context(options: TransportOptions) -> ssl.SSLContext:
    """A client SSL context that verifies the server (CA file or system roots) and presents a client cert if set."""
    context = _PahoContext(ssl.PROTOCOL_TLS_CLIENT)
    context.server_name = options.server_name or ""
    try:
        if options.ca_file:
            context.load_verify_locations(cafile=options.ca_file)
        else:
            context.load_default_certs()
        if options.cert_file and options.key_file:
            context.load_cert_chain(options.cert_file, options.key_file)
    except (OSError, ssl.SSLError) as exc:
        msg = (f"cannot load the TLS files ca_file={options.ca_file!r} cert_file={options.cert_file!r}: {exc}; "
               "check TransportOptions")
        raise ConfigError(msg) from None
    return context
