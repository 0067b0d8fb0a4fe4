"""The MQTT transport's own floor: a bare echo of escalations through Mosquitto, no model, no admission.

`bench_overload.py` runs the same closed-loop MQTT callers (the agent's transport, the same ~400 KB
pages) against this instead of `tierkit serve`'s bridge: what answers per second and what round trip the
broker and paho allow on this host at that load is the ceiling the bridge is measured against.

It connects as the bridge does (`cloud_service.mqtt_client`: MQTT v5, TCP_NODELAY, the shared
escalation subscription at QoS 1, acknowledging after the reply is published) and answers each
escalation on its Response Topic with its Correlation Data and a `ModelInferResponse` holding
`reply_bytes` bytes (the model's answer size), from paho's network thread: nothing is parsed or decoded.

    python bench/mqtt_echo.py mqtt://127.0.0.1:PORT REPLY_BYTES   # prints `ready`, runs until stdin closes
"""

from __future__ import annotations

import sys
import threading
from typing import Any

import paho.mqtt.client as paho
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from cloud_service import mqtt_client
from cloud_service.protocol import inference_pb2 as pb
from cloud_service.protocol import topics


def main(argv: list[str]) -> int:
    url, reply_bytes = argv[0], int(argv[1])
    host, port = url.removeprefix("mqtt://").rsplit(":", 1)
    response = pb.ModelInferResponse(model_name="echo")
    response.outputs.add(name="y", datatype="UINT8", shape=[reply_bytes])
    response.raw_output_contents.append(bytes(reply_bytes))
    reply = response.SerializeToString()
    subscribed = threading.Event()
    client = mqtt_client.new_client("tierkit-echo", manual_ack=True)

    def on_connect(c: paho.Client, _u: Any, _f: Any, reason: Any, _p: Any) -> None:
        if not reason.is_failure:
            mqtt_client.subscribe_all(c, [topics.shared_escalate_subscription("tierkit-echo")])

    def on_message(c: paho.Client, _u: Any, message: paho.MQTTMessage) -> None:
        reply_to = getattr(message.properties, "ResponseTopic", None)
        if reply_to:
            out = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
            correlation = getattr(message.properties, "CorrelationData", None)
            if correlation is not None:
                out.CorrelationData = correlation
            c.publish(reply_to, reply, qos=1, properties=out)
        c.ack(message.mid, message.qos)

    client.on_connect = on_connect
    client.on_subscribe = lambda *_: subscribed.set()
    client.on_message = on_message
    mqtt_client.start(client, host, int(port), keepalive_s=30, receive_maximum=256)
    if not subscribed.wait(30):
        print("the broker did not grant the subscription", file=sys.stderr)
        return 1
    print("ready", flush=True)
    sys.stdin.read()  # until the bench closes the pipe
    mqtt_client.shutdown(client)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
