"""The floor under the forward bridge: a bare paho -> gRPC relay of the same bytes, with no tierkit code.

It subscribes to the escalation topics through the same shared subscription at QoS 1 (TCP_NODELAY),
hands each payload unparsed to the upstream's `ModelInfer` as raw bytes (a generic unary call, no
protobuf on either side) and publishes the upstream's bytes to the Response Topic with the
Correlation Data. Nothing else: no topic checks, no duplicate cache, no deadlines, no metrics, no
per-device limits, and paho acknowledges each message as it arrives rather than after the reply.
`bench_forward.py` runs it beside `tierkit serve --forward` to show what Python, paho and grpcio
cost on this host before any of tierkit's work.

    python bench/paho_grpc_relay.py BROKER_PORT UPSTREAM_HOST:PORT
"""

from __future__ import annotations

import signal
import socket
import sys
import threading
from typing import Any

import grpc
import paho.mqtt.client as paho
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

SUBSCRIPTION = "$share/relay/tierkit/v1/+/escalate"


def main(argv: list[str]) -> int:
    broker_port, upstream = int(argv[0]), argv[1]
    channel = grpc.insecure_channel(upstream)
    infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")  # bytes in, bytes out
    client = paho.Client(CallbackAPIVersion.VERSION2, client_id="bench-relay", protocol=paho.MQTTv5)
    ready = threading.Event()

    def on_message(c: paho.Client, userdata: Any, message: paho.MQTTMessage) -> None:
        props = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
        props.CorrelationData = message.properties.CorrelationData
        reply_to = message.properties.ResponseTopic

        def done(future: grpc.Future) -> None:
            if future.exception() is None:
                c.publish(reply_to, future.result(), qos=1, properties=props)

        infer.future(message.payload, timeout=10).add_done_callback(done)

    client.on_socket_open = lambda c, u, s: s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    client.on_connect = lambda c, u, f, rc, p: c.subscribe(SUBSCRIPTION, qos=1)
    client.on_subscribe = lambda c, u, mid, rcs, p: ready.set()
    client.on_message = on_message
    client.connect("127.0.0.1", broker_port)
    client.loop_start()
    if not ready.wait(10):
        return 1
    print("ready", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    stop.wait()
    client.disconnect()
    client.loop_stop()
    client._reset_sockets()  # paho leaves its socket pair (and a late connection) to gc
    channel.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
