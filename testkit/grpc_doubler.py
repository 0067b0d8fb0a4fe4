"""A real gRPC (Open Inference Protocol) server on loopback that doubles its input; a throwaway PKI for its TLS."""

from __future__ import annotations

import asyncio
import datetime
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import grpc
import grpc.aio
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from cloud_service.protocol import (
    decode_inputs,
    encode_response,
    inference_pb2_grpc,
)
from cloud_service.protocol import inference_pb2 as pb


class Doubler(inference_pb2_grpc.GRPCInferenceServiceServicer):
    """Returns y = 2x; can hang, fail with a status, or fail with UNAVAILABLE the first `flaky` times."""

    def __init__(self, *, hang: bool = False, status: grpc.StatusCode | None = None, flaky: int = 0) -> None:
        self.calls: list[pb.ModelInferRequest] = []
        self.hang, self.status, self.flaky = hang, status, flaky

    async def ModelInfer(self, request: pb.ModelInferRequest,
                         context: grpc.aio.ServicerContext) -> pb.ModelInferResponse:
        self.calls.append(request)
        if self.hang:
            await asyncio.sleep(30)
        if self.status is not None:
            await context.abort(self.status, f"model {request.model_name!r} is not loaded")
        if len(self.calls) <= self.flaky:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "warming up")
        return encode_response(request.model_name, {"y": decode_inputs(request)["x"] * 2}, request_id=request.id)


@asynccontextmanager
async def serving(servicer: Doubler, credentials: grpc.ServerCredentials | None = None) -> AsyncIterator[int]:
    server = grpc.aio.server()
    inference_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, server)
    port = (server.add_secure_port("127.0.0.1:0", credentials) if credentials
            else server.add_insecure_port("127.0.0.1:0"))
    await server.start()
    try:
        yield port
    finally:
        await server.stop(grace=None)


def make_pki(d: Path) -> dict[str, Path]:
    """A CA, a server certificate for `cloud.test`, and a client certificate, as PEM files in `d`."""
    d.mkdir(parents=True, exist_ok=True)
    ca_key = _key()
    ca = _cert("tierkit test CA", ca_key, None, ca_key, ca=True)
    server_key, client_key = _key(), _key()
    server = _cert("cloud.test", server_key, ca, ca_key,
                   sans=[x509.DNSName("cloud.test")])  # not 127.0.0.1: clients must name it
    client = _cert("cam-7", client_key, ca, ca_key)
    files = {"ca": ca.public_bytes(serialization.Encoding.PEM),
             "server.crt": server.public_bytes(serialization.Encoding.PEM), "server.key": _pem_key(server_key),
             "client.crt": client.public_bytes(serialization.Encoding.PEM), "client.key": _pem_key(client_key)}
    paths = {}
    for name, data in files.items():
        (d / name).write_bytes(data)
        paths[name] = d / name
    return paths


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _cert(subject: str, key: ec.EllipticCurvePrivateKey, issuer: x509.Certificate | None,
          issuer_key: ec.EllipticCurvePrivateKey, *, ca: bool = False,
          sans: list[x509.GeneralName] | None = None) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    builder = (x509.CertificateBuilder().subject_name(name)
               .issuer_name(issuer.subject if issuer else name).public_key(key.public_key())
               .serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())
