"""Cloud URLs, transport options, and the fake transport."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from cloud_service.protocol import encode_request, get_parameters, topics
from cloud_service.protocol import inference_pb2 as pb
from edge_agent.transports import TransportOptions, open_transport, parse_cloud_url
from runtimes.errors import ConfigError
from testkit.fake_transport import FakeTransport


def test_parse_grpc_url_with_several_targets() -> None:
    url = parse_cloud_url("grpc://127.0.0.1:8001,127.0.0.1:8002/digits")
    assert url.kind == "grpc"
    assert not url.tls
    assert url.targets == (("127.0.0.1", 8001), ("127.0.0.1", 8002))
    assert url.model == "digits"


@pytest.mark.parametrize(("url", "scheme", "target", "tls"), [
    ("grpcs://cloud.example:443/m", "grpcs", ("cloud.example", 443), True),
    ("mqtt://broker/m", "mqtt", ("broker", 1883), False),
    ("mqtts://broker/m", "mqtts", ("broker", 8883), True),
    ("grpc://[::1]:9000/m", "grpc", ("::1", 9000), False),
])
def test_parse_schemes_and_default_ports(url: str, scheme: str, target: tuple[str, int], tls: bool) -> None:
    cloud = parse_cloud_url(url)
    assert (cloud.scheme, cloud.targets[0], cloud.tls, cloud.model) == (scheme, target, tls, "m")


@pytest.mark.parametrize("url", ["http://x:1/m", "grpc:///m", "grpc://x:99999/m", "grpc://x:1/a/b",
                                 "mqtt://a:1,b:2/m", "grpc://:80/m"])
def test_bad_urls_raise_config_error(url: str) -> None:
    with pytest.raises(ConfigError, match="cloud URL"):
        parse_cloud_url(url)


def test_open_transport_checks_device_id() -> None:
    with pytest.raises(ConfigError, match="device id"):
        open_transport("grpc://127.0.0.1:1/m", device_id="a/b")


@pytest.mark.parametrize("kwargs", [{"keepalive_s": 5}, {"reconnect_min_s": 5, "reconnect_max_s": 1},
                                    {"retry_max_attempts": 6}, {"cert_file": "c.pem"}, {"max_pending": 0}])
def test_bad_options_raise_config_error(kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigError, match="TransportOptions"):
        TransportOptions(**kwargs)  # type: ignore[arg-type]


def _request() -> pb.ModelInferRequest:
    return encode_request("", {"x": np.arange(4, dtype=np.float32)})


def test_existing_model_name_and_parameters_are_kept() -> None:
    request = encode_request("other", {"x": np.zeros(1, np.float32)}, parameters={topics.PARAM_DEVICE: "cam-1"})

    async def main() -> pb.ModelInferRequest:
        cloud = FakeTransport(lambda r: pb.ModelInferResponse(), model="digits", device_id="cam-7")
        await cloud.escalate(request, timeout_s=1.0)
        return cloud.requests[0]

    seen = asyncio.run(main())
    assert seen.model_name == "other"
    assert get_parameters(seen.parameters)[topics.PARAM_DEVICE] == "cam-1"


def test_serialize_stamps_once_and_leaves_the_request_as_it_was() -> None:
    cloud = FakeTransport(lambda r: pb.ModelInferResponse(), model="digits", device_id="cam-7", boot_id="b1")
    request = encode_request("", {"x": np.arange(4, dtype=np.float32)},
                             parameters={topics.PARAM_BOOT: "mine", topics.PARAM_DEADLINE_MS: 5})
    before = request.SerializeToString(deterministic=True)
    wire = pb.ModelInferRequest.FromString(cloud.serialize(request, **{topics.PARAM_DEADLINE_MS: 99}))
    params = get_parameters(wire.parameters)
    assert wire.model_name == "digits"
    assert params == {topics.PARAM_DEVICE: "cam-7", topics.PARAM_BOOT: "mine", topics.PARAM_DEADLINE_MS: 99}
    assert wire.raw_input_contents == request.raw_input_contents
    assert request.SerializeToString(deterministic=True) == before  # stamped fields taken off again
    # the same bytes the old `request + stamp` concatenation gave, as a message
    assert wire == pb.ModelInferRequest.FromString(
        request.SerializeToString() + cloud.stamp(request, **{topics.PARAM_DEADLINE_MS: 99}))
