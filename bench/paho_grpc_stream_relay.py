"""The floor under the forward bridge's stream mode: a bare paho -> ModelStreamInfer relay, no tierkit code.

Like `paho_grpc_relay.py` (same shared subscription at QoS 1, TCP_NODELAY, acknowledged on arrival,
no checks, cache, deadlines, metrics or limits), but every payload goes out on ONE long-lived
bidirectional `ModelStreamInfer` stream with a relay-made id appended as a second `id` field (the
payload is not parsed), and each answer is matched to its request by that id: the answer is parsed
as a `ModelStreamInferResponse` (generated protobuf code) and its `infer_response` published to
the Response Topic with the Correlation Data.

    python bench/paho_grpc_stream_relay.py BROKER_PORT UPSTREAM_HOST:PORT
"""

from __future__ import annotations

import itertools
import queue
import signal
import socket
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import paho.mqtt.client as paho
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cloud_service.protocol import inference_pb2 as pb

SUBSCRIPTION = "$share/relay/tierkit/v1/+/escalate"


def main(argv: list[str]) -> int:
    broker_port, upstream = int(argv[0]), argv[1]
    channel = grpc.insecure_channel(upstream)
    stream = channel.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer",
                                   response_deserializer=pb.ModelStreamInferResponse.FromString)
    client = paho.Client(CallbackAPIVersion.VERSION2, client_id="bench-stream-relay", protocol=paho.MQTTv5)
    outbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
    waiting: dict[str, tuple[str, Properties]] = {}
    ids = itertools.count(1)
    ready = threading.Event()

    def requests() -> Iterator[bytes]:
        while (item := outbox.get()) is not None:
            yield item

    def on_message(c: paho.Client, userdata: Any, message: paho.MQTTMessage) -> None:
        props = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
        props.CorrelationData = message.properties.CorrelationData
        rid = str(next(ids)).encode()
        waiting[rid.decode()] = (message.properties.ResponseTopic, props)
        outbox.put(message.payload + b"\x1a" + bytes((len(rid),)) + rid)

    def read(answers: Any) -> None:
        try:
            for answer in answers:
                reply_to, props = waiting.pop(answer.infer_response.id)
                if not answer.error_message:
                    client.publish(reply_to, answer.infer_response.SerializeToString(), qos=1, properties=props)
        except grpc.RpcError:
            pass  # cancelled at exit

    answers = stream(requests())
    reader = threading.Thread(target=read, args=(answers,), daemon=True)
    reader.start()
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
    outbox.put(None)
    answers.cancel()
    reader.join(5)
    channel.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
