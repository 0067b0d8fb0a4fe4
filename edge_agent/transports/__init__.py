"""Escalation transports: gRPC and MQTT v5 speaking the Open Inference Protocol.

`GrpcTransport` and `MqttTransport` are imported lazily by `open_transport`, from
`edge_agent.transports.grpc` / `edge_agent.transports.mqtt`.
"""

from edge_agent.transports.base import (
    CloudURL,
    Transport,
    TransportOptions,
    open_transport,
    parse_cloud_url,
)

__all__ = ["CloudURL", "Transport", "TransportOptions", "open_transport", "parse_cloud_url"]
