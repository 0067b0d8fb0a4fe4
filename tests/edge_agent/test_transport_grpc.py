"""The gRPC transport against real grpc.aio servers on loopback: round trip, deadlines, errors, balancing, TLS."""

from __future__ import annotations

import asyncio
import datetime
import socket
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import numpy as np
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from cloud_service.protocol import (
    decode_inputs,
    encode_request,
    encode_response,
    get_parameters,
    inference_pb2_grpc,
    topics,
)
from cloud_service.protocol import inference_pb2 as pb
from edge_agent.transports import TransportOptions, open_transport
from runtimes.errors import CloudTimeout, CloudUnavailable, EscalationError
from testkit.ports import free_port

X = np.arange(64, dtype=np.float32).reshape(1, 1, 8, 8)


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


def run(coro_fn: Callable[[], Any]) -> Any:
    return asyncio.run(coro_fn())


def test_round_trip_fills_model_and_device() -> None:
    async def main() -> None:
        servicer = Doubler()
        async with serving(servicer) as port, \
                open_transport(f"grpc://127.0.0.1:{port}/digits", device_id="cam-7", boot_id="b1") as cloud:
            for i in range(3):
                response = await cloud.escalate(encode_request("", {"x": X + i}, request_id=str(i)), timeout_s=2.0)
                assert response.id == str(i)
                np.testing.assert_array_equal(
                    np.frombuffer(response.raw_output_contents[0], np.float32).reshape(X.shape), (X + i) * 2)
        seen = servicer.calls[0]
        assert seen.model_name == "digits"
        assert get_parameters(seen.parameters)[topics.PARAM_DEVICE] == "cam-7"
        assert get_parameters(seen.parameters)[topics.PARAM_BOOT] == "b1"

    run(main)


def test_deadline_is_honoured_against_a_hanging_servicer() -> None:
    async def main() -> None:
        async with serving(Doubler(hang=True)) as port, \
                open_transport(f"grpc://127.0.0.1:{port}/digits", device_id="cam-7") as cloud:
            start = time.perf_counter()
            with pytest.raises(CloudTimeout, match=f"127.0.0.1:{port}") as info:
                await cloud.escalate(encode_request("", {"x": X}), timeout_s=0.3)
            elapsed = time.perf_counter() - start
        assert elapsed <= 0.3 + 0.15, elapsed
        assert info.value.code == "DEADLINE_EXCEEDED"  # type: ignore[attr-defined]

    run(main)


def test_deadline_is_honoured_against_a_silent_tcp_listener() -> None:
    """A peer that accepts TCP and never speaks HTTP/2 costs at most the deadline."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        port = listener.getsockname()[1]

        async def main() -> float:
            async with open_transport(f"grpc://127.0.0.1:{port}/m", device_id="cam-7") as cloud:
                start = time.perf_counter()
                with pytest.raises(CloudTimeout):
                    await cloud.escalate(encode_request("", {"x": X}), timeout_s=0.3)
                return time.perf_counter() - start

        assert run(main) <= 0.3 + 0.15


def test_unreachable_port_is_cloud_unavailable_fast() -> None:
    port = free_port()

    async def main() -> float:
        async with open_transport(f"grpc://127.0.0.1:{port}/m", device_id="cam-7") as cloud:
            start = time.perf_counter()
            with pytest.raises(CloudUnavailable, match=f"127.0.0.1:{port}"):
                await cloud.escalate(encode_request("", {"x": X}), timeout_s=5.0)
            return time.perf_counter() - start

    assert run(main) < 1.0


@pytest.mark.parametrize("status", [grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT,
                                    grpc.StatusCode.RESOURCE_EXHAUSTED])
def test_server_error_status_is_escalation_error_with_code(status: grpc.StatusCode) -> None:
    async def main() -> None:
        async with serving(Doubler(status=status)) as port, \
                open_transport(f"grpc://127.0.0.1:{port}/nope", device_id="cam-7") as cloud:
            with pytest.raises(EscalationError, match="not loaded") as info:
                await cloud.escalate(encode_request("", {"x": X}), timeout_s=2.0)
        assert type(info.value) is EscalationError
        assert info.value.code == status.name  # type: ignore[attr-defined]

    run(main)


def test_unavailable_is_retried_by_the_service_config() -> None:
    async def main() -> None:
        flaky = Doubler(flaky=1)
        async with serving(flaky) as port, \
                open_transport(f"grpc://127.0.0.1:{port}/m", device_id="cam-7") as cloud:
            await cloud.escalate(encode_request("", {"x": X}), timeout_s=2.0)
        assert len(flaky.calls) == 2
        no_retry = Doubler(flaky=1)
        async with serving(no_retry) as port, \
                open_transport(f"grpc://127.0.0.1:{port}/m", device_id="cam-7",
                               options=TransportOptions(retry_max_attempts=1)) as cloud:
            with pytest.raises(CloudUnavailable, match="warming up"):
                await cloud.escalate(encode_request("", {"x": X}), timeout_s=2.0)

    run(main)


def test_two_servers_share_calls_round_robin() -> None:
    async def main() -> None:
        a, b = Doubler(), Doubler()
        async with serving(a) as pa, serving(b) as pb_, \
                open_transport(f"grpc://127.0.0.1:{pa},127.0.0.1:{pb_}/m", device_id="cam-7") as cloud:
            for _ in range(20):
                await cloud.escalate(encode_request("", {"x": X}), timeout_s=2.0)
        assert len(a.calls) + len(b.calls) == 20
        assert len(a.calls) >= 3
        assert len(b.calls) >= 3

    run(main)


# --- TLS ---------------------------------------------------------------------------------------------

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


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_pki(tmp_path_factory.mktemp("pki"))


def _server_credentials(pki: dict[str, Path], *, require_client: bool) -> grpc.ServerCredentials:
    return grpc.ssl_server_credentials(
        [(pki["server.key"].read_bytes(), pki["server.crt"].read_bytes())],
        root_certificates=pki["ca"].read_bytes() if require_client else None,
        require_client_auth=require_client)


def test_tls_with_server_name_override(pki: dict[str, Path]) -> None:
    async def main() -> None:
        async with serving(Doubler(), _server_credentials(pki, require_client=False)) as port:
            options = TransportOptions(ca_file=str(pki["ca"]), server_name="cloud.test")
            async with open_transport(f"grpcs://127.0.0.1:{port}/m", device_id="cam-7", options=options) as cloud:
                response = await cloud.escalate(encode_request("", {"x": X}), timeout_s=5.0)
            assert response.raw_output_contents[0] == (X * 2).tobytes()
            # without the override the name 127.0.0.1 does not match the certificate
            async with open_transport(f"grpcs://127.0.0.1:{port}/m", device_id="cam-7",
                                      options=TransportOptions(ca_file=str(pki["ca"]))) as cloud:
                with pytest.raises(CloudUnavailable):
                    await cloud.escalate(encode_request("", {"x": X}), timeout_s=5.0)
            # a client that does not trust our CA refuses the server
            async with open_transport(f"grpcs://127.0.0.1:{port}/m", device_id="cam-7",
                                      options=TransportOptions(server_name="cloud.test")) as cloud:
                with pytest.raises(CloudUnavailable):
                    await cloud.escalate(encode_request("", {"x": X}), timeout_s=5.0)

    run(main)


def test_mutual_tls_requires_a_client_certificate(pki: dict[str, Path]) -> None:
    async def main() -> None:
        async with serving(Doubler(), _server_credentials(pki, require_client=True)) as port:
            url = f"grpcs://127.0.0.1:{port}/m"
            good = TransportOptions(ca_file=str(pki["ca"]), cert_file=str(pki["client.crt"]),
                                    key_file=str(pki["client.key"]), server_name="cloud.test")
            async with open_transport(url, device_id="cam-7", options=good) as cloud:
                response = await cloud.escalate(encode_request("", {"x": X}), timeout_s=5.0)
            assert response.raw_output_contents[0] == (X * 2).tobytes()
            no_cert = TransportOptions(ca_file=str(pki["ca"]), server_name="cloud.test")
            async with open_transport(url, device_id="cam-7", options=no_cert) as cloud:
                with pytest.raises(CloudUnavailable):
                    await cloud.escalate(encode_request("", {"x": X}), timeout_s=5.0)

    run(main)


def test_missing_certificate_file_fails_at_construction(tmp_path: Path) -> None:
    from runtimes.errors import ConfigError

    with pytest.raises(ConfigError, match="CA file"):
        open_transport("grpcs://127.0.0.1:1/m", device_id="cam-7",
                       options=TransportOptions(ca_file=str(tmp_path / "missing.pem")))
