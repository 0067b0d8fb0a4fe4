"""The gRPC transport against real grpc.aio servers on loopback: round trip, deadlines, errors, balancing, TLS."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import numpy as np
import pytest

from cloud_service.protocol import (
    encode_request,
    get_parameters,
    topics,
)
from edge_agent.transports import TransportOptions, open_transport
from runtimes.errors import CloudTimeout, CloudUnavailable, EscalationError
from testkit.grpc_doubler import Doubler, make_pki, serving
from testkit.ports import free_port

X = np.arange(64, dtype=np.float32).reshape(1, 1, 8, 8)


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
