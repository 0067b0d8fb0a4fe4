"""Escalation round trip: our transports against the raw libraries they wrap, on loopback.

(a) raw grpc.aio unary echo of bytes (generic handler, no protobuf)
(b) our gRPC transport -> an Open Inference Protocol echo that reads and writes the messages as
    `tierkit serve` does (`cloud_service.protocol.wire`: tensors as views of the received bytes, and
    serialized beside the message, not copied into it)
(b0) the generated OIP stub on a plain channel -> the generated servicer (protobuf messages at both
     ends): the bare-stub floor, (b0)/(a) the cost of protobuf's copies
(b1) the generated stub -> the same echo as (b): a stock client against tierkit's server side
(c) raw paho request/response through a local Mosquitto (TCP_NODELAY on both sides)
(d) our MQTT transport through the same broker -> a responder that returns the input as a ModelInferResponse

The same serialized ModelInferRequest travels in all of them, for fp32 inputs of 6 KB, 60 KB, 600 KB
(a 1x3x224x224 image) and 6 MB. Servers and the responder run in a separate process; blocks of
(a)/(b)/(b0), and of (c)/(d), alternate so that drift on a shared host hits both sides of a ratio
alike. Target: (b)/(a) and (d)/(c) <= 1.5x at p50.

Both processes keep freed memory for the next large message as `tierkit serve` and the transports do
(`cloud_service.protocol.memory`); `--kept-memory-bytes 0` measures glibc's defaults instead, where
every copy of a large payload page-faults (the raw paths copy less, so they suffer less).

    python bench/bench_escalation.py [--quick] [--json] [--kept-memory-bytes N]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cloud_service.protocol import encode_request
from cloud_service.protocol import inference_pb2 as pb
from cloud_service.protocol.wire import raw_request

TARGET = 1.5
SHAPES = {"6 KB 1x1536": (1, 1536), "60 KB 1x3x80x64": (1, 3, 80, 64),
          "600 KB 1x3x224x224": (1, 3, 224, 224), "6 MB 10x3x224x224": (10, 3, 224, 224)}
RAW_DEVICE, OIP_DEVICE = "bench-raw", "bench-oip"
MAX_MESSAGE = 16 << 20


def oip_echo(request: pb.ModelInferRequest) -> pb.ModelInferResponse:
    response = pb.ModelInferResponse(model_name=request.model_name, id=request.id)
    for tensor in request.inputs:
        response.outputs.add(name=tensor.name, datatype=tensor.datatype, shape=tensor.shape)
    response.raw_output_contents.extend(request.raw_input_contents)
    return response


def nodelay(sock: Any) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


# --- the far side, in a child process -------------------------------------------------------------

def serve(ports: Any, mqtt_port: int, kept_memory_bytes: int) -> None:
    from cloud_service.protocol.memory import keep_freed_memory

    keep_freed_memory(kept_memory_bytes)  # as `tierkit serve` does
    import grpc
    import grpc.aio
    import paho.mqtt.client as paho
    from paho.mqtt.enums import CallbackAPIVersion
    from paho.mqtt.packettypes import PacketTypes
    from paho.mqtt.properties import Properties

    from cloud_service.protocol import inference_pb2_grpc
    from cloud_service.protocol.wire import RawRequest, RawResponse

    class Servicer(inference_pb2_grpc.GRPCInferenceServiceServicer):
        async def ModelInfer(self, request: pb.ModelInferRequest, context: Any) -> pb.ModelInferResponse:
            return oip_echo(request)

    async def wire_echo(request: RawRequest, context: Any) -> RawResponse:
        message = request.message
        response = pb.ModelInferResponse(model_name=message.model_name, id=message.id)
        for tensor in message.inputs:
            response.outputs.add(name=tensor.name, datatype=tensor.datatype, shape=tensor.shape)
        return RawResponse(response, request.raw)

    async def echo(payload: bytes, context: Any) -> bytes:
        return payload

    def on_message(client: paho.Client, userdata: Any, message: paho.MQTTMessage) -> None:
        props = Properties(PacketTypes.PUBLISH)
        props.CorrelationData = message.properties.CorrelationData
        payload = message.payload
        if message.topic.split("/")[2] == OIP_DEVICE:
            payload = oip_echo(pb.ModelInferRequest.FromString(payload)).SerializeToString()
        client.publish(message.properties.ResponseTopic, payload, qos=1, properties=props)

    if mqtt_port:
        responder = paho.Client(CallbackAPIVersion.VERSION2, client_id="bench-responder", protocol=paho.MQTTv5)
        responder.on_socket_open = lambda c, u, s: nodelay(s)
        responder.on_message = on_message
        responder.on_connect = lambda c, u, f, rc, p: c.subscribe("tierkit/v1/+/escalate", qos=1)
        responder.connect("127.0.0.1", mqtt_port)
        responder.loop_start()

    async def main() -> None:
        options = [("grpc.max_receive_message_length", MAX_MESSAGE), ("grpc.max_send_message_length", MAX_MESSAGE)]
        server = grpc.aio.server(options=options)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "bench.Echo", {"Echo": grpc.unary_unary_rpc_method_handler(echo)}),))
        inference_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(Servicer(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        wire = grpc.aio.server(options=options)  # the same method, answered as tierkit serve reads and writes it
        wire.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("inference.GRPCInferenceService", {
            "ModelInfer": grpc.unary_unary_rpc_method_handler(wire_echo, request_deserializer=RawRequest.parse,
                                                              response_serializer=RawResponse.serialize)}),))
        wire_port = wire.add_insecure_port("127.0.0.1:0")
        await server.start()
        await wire.start()
        ports.put((port, wire_port))
        await server.wait_for_termination()

    asyncio.run(main())


def start_mosquitto(workdir: Path, extra: str = "max_queued_messages 10000\n"
                    ) -> tuple[subprocess.Popen[bytes], int] | None:
    """A throwaway Mosquitto on a free loopback port (TCP_NODELAY, no persistence); None when not installed."""
    binary = shutil.which("mosquitto") or "/usr/sbin/mosquitto"
    if not Path(binary).exists():
        return None
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    conf = workdir / "mosquitto.conf"
    conf.write_text(f"listener {port} 127.0.0.1\nset_tcp_nodelay true\nallow_anonymous true\n"
                    f"persistence false\n{extra}log_dest file {workdir}/mosquitto.log\n")
    proc = subprocess.Popen([binary, "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(100):
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return proc, port
        except OSError:
            time.sleep(0.05)
    proc.kill()
    return None


# --- the near side --------------------------------------------------------------------------------

class RawMqtt:
    """A plain paho request/response client: publish QoS 1 with Response Topic + Correlation Data, wait."""

    def __init__(self, port: int) -> None:
        import paho.mqtt.client as paho
        from paho.mqtt.enums import CallbackAPIVersion

        self.reply = threading.Event()
        self.subscribed = threading.Event()
        self.client = paho.Client(CallbackAPIVersion.VERSION2, client_id=RAW_DEVICE, protocol=paho.MQTTv5)
        self.client.on_socket_open = lambda c, u, s: nodelay(s)
        self.client.on_connect = lambda c, u, f, rc, p: c.subscribe(f"tierkit/v1/{RAW_DEVICE}/reply", qos=1)
        self.client.on_subscribe = lambda c, u, mid, rcs, p: self.subscribed.set()
        self.client.on_message = lambda c, u, m: self.reply.set()
        self.client.connect("127.0.0.1", port)
        self.client.loop_start()
        self.subscribed.wait(10)
        self.n = 0

    def call(self, payload: bytes) -> None:
        from paho.mqtt.packettypes import PacketTypes
        from paho.mqtt.properties import Properties

        self.n += 1
        props = Properties(PacketTypes.PUBLISH)
        props.ResponseTopic = f"tierkit/v1/{RAW_DEVICE}/reply"
        props.CorrelationData = self.n.to_bytes(8, "big")
        self.reply.clear()
        self.client.publish(f"tierkit/v1/{RAW_DEVICE}/escalate", payload, qos=1, properties=props)
        if not self.reply.wait(5):
            msg = "raw MQTT round trip got no reply in 5 s"
            raise TimeoutError(msg)

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()
        self.client._reset_sockets()  # paho leaves its socket pair (and a late connection) to gc


async def measure(pair: dict[str, Callable[[], Awaitable[None] | None]], n: int, rounds: int) -> dict[str, list[float]]:
    """Alternate blocks of n/rounds calls of each function; per-call seconds."""
    times: dict[str, list[float]] = {name: [] for name in pair}
    for fn in pair.values():  # warm-up: connections, caches
        for _ in range(max(5, n // 20)):
            result = fn()
            if result is not None:
                await result
    for _ in range(rounds):
        for name, fn in pair.items():
            for _ in range(max(1, n // rounds)):
                start = time.perf_counter()
                result = fn()
                if result is not None:
                    await result
                times[name].append(time.perf_counter() - start)
    return times


def stats(samples: list[float]) -> dict[str, float]:
    a = np.asarray(samples) * 1e3
    return {"p50_ms": float(np.percentile(a, 50)), "p99_ms": float(np.percentile(a, 99)), "n": len(a)}


def calls_per_path(nbytes: int, quick: bool) -> int:
    """About 12 MB (quick) or 60 MB (full) per path and size; 10 to 3000 calls."""
    return max(10, min(3000, (12 << 20 if quick else 60 << 20) // max(nbytes, 1)))


async def run(grpc_port: int, wire_port: int, mqtt_port: int, quick: bool, kept_memory_bytes: int
              ) -> dict[str, Any]:
    import grpc.aio

    from cloud_service.protocol import inference_pb2_grpc
    from edge_agent.transports import TransportOptions, open_transport

    options = TransportOptions(max_message_bytes=MAX_MESSAGE, kept_memory_bytes=kept_memory_bytes)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}", options=[
        ("grpc.max_receive_message_length", MAX_MESSAGE), ("grpc.max_send_message_length", MAX_MESSAGE)])
    raw_echo = channel.unary_unary("/bench.Echo/Echo")
    stub = inference_pb2_grpc.GRPCInferenceServiceStub(channel)
    wire_channel = grpc.aio.insecure_channel(f"127.0.0.1:{wire_port}", options=[
        ("grpc.max_receive_message_length", MAX_MESSAGE), ("grpc.max_send_message_length", MAX_MESSAGE)])
    stub_to_wire = inference_pb2_grpc.GRPCInferenceServiceStub(wire_channel)
    ours_grpc = open_transport(f"grpc://127.0.0.1:{wire_port}/echo", device_id=OIP_DEVICE, options=options)
    raw_mqtt = RawMqtt(mqtt_port) if mqtt_port else None
    ours_mqtt = (open_transport(f"mqtt://127.0.0.1:{mqtt_port}/echo", device_id=OIP_DEVICE, options=options)
                 if mqtt_port else None)
    if ours_mqtt is not None:
        await ours_mqtt.__aenter__()
    results: dict[str, Any] = {}
    rng = np.random.default_rng(0)
    try:
        for label, shape in SHAPES.items():
            x = rng.random(shape, dtype=np.float32)
            request = encode_request("echo", {"x": x})
            raw = raw_request("echo", {"x": x})  # what the agent builds: the tensor beside the message
            payload = request.SerializeToString()
            n = calls_per_path(len(payload), quick)
            rounds = 5 if quick else 10
            grpc_times = await measure({
                "a_raw_grpc": lambda p=payload: raw_echo(p, timeout=5.0),
                "b_grpc_transport": lambda r=raw: ours_grpc.escalate(r, timeout_s=5.0),
                "b0_oip_stub": lambda r=request: stub.ModelInfer(r, timeout=5.0),
                "b1_stub_to_wire": lambda r=request: stub_to_wire.ModelInfer(r, timeout=5.0),
            }, n, rounds)
            entry = {k: stats(v) for k, v in grpc_times.items()}
            if raw_mqtt is not None and ours_mqtt is not None:
                mqtt_times = await measure({
                    "c_raw_paho": lambda p=payload: raw_mqtt.call(p),
                    "d_mqtt_transport": lambda r=raw: ours_mqtt.escalate(r, timeout_s=5.0),
                }, n, rounds)
                entry.update({k: stats(v) for k, v in mqtt_times.items()})
                entry["ratio_d_c"] = entry["d_mqtt_transport"]["p50_ms"] / entry["c_raw_paho"]["p50_ms"]
            entry["ratio_b_a"] = entry["b_grpc_transport"]["p50_ms"] / entry["a_raw_grpc"]["p50_ms"]
            entry["ratio_b_b0"] = entry["b_grpc_transport"]["p50_ms"] / entry["b0_oip_stub"]["p50_ms"]
            entry["payload_bytes"] = len(payload)
            results[label] = entry
    finally:
        await ours_grpc.aclose()
        await channel.close()
        await wire_channel.close()
        if ours_mqtt is not None:
            await ours_mqtt.aclose()
        if raw_mqtt is not None:
            raw_mqtt.close()
    return results


def report(results: dict[str, Any]) -> None:
    print(f"{'payload':<22} {'path':<18} {'p50 ms':>8} {'p99 ms':>8} {'n':>6}")
    for label, entry in results.items():
        for key in ("a_raw_grpc", "b0_oip_stub", "b1_stub_to_wire", "b_grpc_transport", "c_raw_paho",
                    "d_mqtt_transport"):
            if key in entry:
                s = entry[key]
                print(f"{label:<22} {key:<18} {s['p50_ms']:8.3f} {s['p99_ms']:8.3f} {s['n']:6d}")
        for key in ("ratio_b_a", "ratio_d_c"):
            if key in entry:
                verdict = "ok" if entry[key] <= TARGET else "OVER TARGET"
                print(f"{label:<22} {key:<18} {entry[key]:8.2f}x  (target <= {TARGET}x: {verdict})")
        print(f"{label:<22} {'ratio_b_b0':<18} {entry['ratio_b_b0']:8.2f}x  (tierkit both ends over the bare stub)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few iterations: checks that the bench runs")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--kept-memory-bytes", type=int, default=64 << 20,
                        help="freed memory malloc keeps in both processes (0: glibc's defaults)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-escalation-") as tmp:
        broker = start_mosquitto(Path(tmp))
        mqtt_port = broker[1] if broker else 0
        if broker is None:
            print("mosquitto not found: MQTT paths (c) and (d) skipped (apt-get install mosquitto)", file=sys.stderr)
        ctx = mp.get_context("spawn")
        ports = ctx.Queue()
        server = ctx.Process(target=serve, args=(ports, mqtt_port, args.kept_memory_bytes), daemon=True)
        server.start()
        try:
            grpc_port, wire_port = ports.get(timeout=30)
            time.sleep(0.3)  # let the responder subscribe
            results = asyncio.run(run(grpc_port, wire_port, mqtt_port, args.quick, args.kept_memory_bytes))
        finally:
            server.terminate()
            server.join(5)
            if broker is not None:
                broker[0].terminate()
                broker[0].wait(5)
    if args.json:
        print(json.dumps({"target": TARGET, "quick": args.quick, "kept_memory_bytes": args.kept_memory_bytes,
                          "results": results}, indent=2))
    else:
        report(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
