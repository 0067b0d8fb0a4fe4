"""Helpers of the cloud service tests: packages of real models, a real server in a thread, a device.

Shared by tests/cloud_service and tests/e2e; the fixtures that use them are in conftest.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

from cloud_service.config import ServerConfig
from cloud_service.service import CloudService
from compilers.manifest import Manifest
from compilers.package import write_package
from runtimes.spec import TensorSpec

T = TypeVar("T")

DIGITS_INPUTS = (TensorSpec("x", "float32", ("batch", 1, 8, 8)),)
DIGITS_OUTPUTS = (TensorSpec("logits", "float32", ("batch", 10)),)


def make_package(directory: Path, onnx: Path, *, name: str = "digits", version: str = "1",
                 inputs: tuple[TensorSpec, ...] = DIGITS_INPUTS,
                 outputs: tuple[TensorSpec, ...] = DIGITS_OUTPUTS, sign_key: Any = None) -> Path:
    """A package of `onnx` in `directory` (created), described by the given specs."""
    directory.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(onnx, directory / "model.onnx")
    manifest = Manifest(name=name, version=version, target="x86-avx512", precision="fp32", runtime="onnxruntime",
                        artifact="model.onnx", inputs=inputs, outputs=outputs)
    write_package(directory, manifest, sign_key=sign_key)
    return directory


class ServerThread:
    """A `CloudService` running on its own event loop in a background thread."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.loop = asyncio.new_event_loop()
        self.service = CloudService(config)
        self._thread = threading.Thread(target=self.loop.run_forever, name="cloud-service", daemon=True)

    def start(self) -> ServerThread:
        self._thread.start()
        self.call(self.service.start(), timeout=60)
        return self

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = 30) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        if self._thread.is_alive():
            try:
                self.call(self.service.stop(), timeout=60)
            finally:
                self.loop.call_soon_threadsafe(self.loop.stop)
                self._thread.join(10)
        self.loop.close()

    @property
    def grpc(self) -> str:
        return self.service.addresses["grpc"]

    @property
    def metrics_text(self) -> str:
        return self.service.metrics.render().decode()


def metric_value(text: str, name: str, **labels: str) -> float:
    """The value of one sample in Prometheus exposition text (0 when absent)."""
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    total = 0.0
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        head, _, value = line.rpartition(" ")
        metric, _, rest = head.partition("{")
        if metric != name:
            continue
        got = ",".join(sorted(p for p in rest.rstrip("}").split(",") if p))
        if not labels or all(f'{k}="{v}"' in got.split(",") for k, v in labels.items()) or got == want:
            total += float(value)
    return total


@dataclasses.dataclass(frozen=True)
class Pki:
    """A throwaway CA with a server certificate (127.0.0.1, localhost) and client certificates."""

    dir: Path
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path  # CN=cam-1
    client_key: Path
    cloud_cert: Path  # CN=tierkit-cloud
    cloud_key: Path
    other_ca: Path  # a CA that signed nothing here


def write_pki(root: Path) -> Pki:
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)
    root.mkdir(parents=True, exist_ok=True)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def save(stem: str, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> tuple[Path, Path]:
        cert_path, key_path = root / f"{stem}.pem", root / f"{stem}.key"
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))
        return cert_path, key_path

    def ca(cn: str) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (x509.CertificateBuilder().subject_name(name(cn)).issuer_name(name(cn))
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
                .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                             content_commitment=False, key_encipherment=False, data_encipherment=False,
                                             key_agreement=False, encipher_only=False, decipher_only=False),
                               critical=True)
                .sign(key, hashes.SHA256()))
        return cert, key

    def leaf(cn: str, issuer: tuple[x509.Certificate, ec.EllipticCurvePrivateKey], *, server: bool):
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (x509.CertificateBuilder().subject_name(name(cn)).issuer_name(issuer[0].subject)
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                   .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH if server
                                                         else ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False))
        if server:
            builder = builder.add_extension(x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        return builder.sign(issuer[1], hashes.SHA256()), key

    authority = ca("tierkit test CA")
    ca_path, _ = save("ca", *authority)
    other_path, _ = save("other-ca", *ca("another CA"))
    server_cert, server_key = save("server", *leaf("localhost", authority, server=True))
    client_cert, client_key = save("cam-1", *leaf("cam-1", authority, server=False))
    cloud_cert, cloud_key = save("cloud", *leaf("tierkit-cloud", authority, server=False))
    return Pki(root, ca_path, server_cert, server_key, client_cert, client_key, cloud_cert, cloud_key, other_path)


def make_fake_package(directory: Path, *, name: str = "slow", version: str = "1", delay_s: float = 0.0,
                      width: int = 4) -> Path:
    """A package of the fake backend's seeded linear model ("x" (batch, width) -> "y" (batch, 2))."""
    from testkit.fake_backend import write_fake_model

    directory.mkdir(parents=True, exist_ok=True)
    inputs = (TensorSpec("x", "float32", ("batch", width)),)
    outputs = (TensorSpec("y", "float32", ("batch", 2)),)
    write_fake_model(directory / "model.json", inputs, outputs, delay_s=delay_s)
    manifest = Manifest(name=name, version=version, target="any", precision="fp32", runtime="fake",
                        artifact="model.json", inputs=inputs, outputs=outputs)
    write_package(directory, manifest)
    return directory


class Device:
    """A device's side of MQTT request/response, with plain paho (TCP_NODELAY on, QoS 1)."""

    def __init__(self, host: str, port: int, device_id: str = "cam-1", *, tls: Any = None,
                 username: str | None = None, password: str | None = None, timeout: float = 10) -> None:
        import queue
        import socket

        import paho.mqtt.client as paho
        from paho.mqtt.enums import CallbackAPIVersion

        from cloud_service.protocol import topics

        self.device_id = device_id
        self.replies: queue.Queue[Any] = queue.Queue()
        self.acks: queue.Queue[Any] = queue.Queue()
        self.client = paho.Client(CallbackAPIVersion.VERSION2, client_id=device_id, protocol=paho.MQTTv5)
        self.client.on_socket_open = lambda c, u, s: s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.client.on_message = lambda c, u, m: self.replies.put(m)
        self.client.on_publish = lambda c, u, mid, rc, p: self.acks.put(rc)
        if tls is not None:
            self.client.tls_set_context(tls)
        if username is not None:
            self.client.username_pw_set(username, password)
        subscribed = threading.Event()
        self.client.on_subscribe = lambda *a: subscribed.set()
        self.client.on_connect = lambda c, u, f, rc, p: c.subscribe(topics.reply_topic(device_id), qos=1)
        self.client.connect(host, port)
        self.client.loop_start()
        if not subscribed.wait(timeout):
            self.close()
            msg = f"device {device_id} could not subscribe to its reply topic"
            raise RuntimeError(msg)

    def send(self, payload: bytes, correlation: bytes = b"1", *, topic: str | None = None,
             reply_to: str | None = "") -> None:
        from paho.mqtt.packettypes import PacketTypes
        from paho.mqtt.properties import Properties

        from cloud_service.protocol import topics

        props = Properties(PacketTypes.PUBLISH)
        if reply_to is not None:
            props.ResponseTopic = reply_to or topics.reply_topic(self.device_id)
        props.CorrelationData = correlation
        self.client.publish(topic or topics.escalate_topic(self.device_id), payload, qos=1, properties=props)

    def ask(self, payload: bytes, correlation: bytes = b"1", timeout: float = 10, **kwargs: Any) -> Any:
        """Send and wait for the reply with this correlation data (None on timeout)."""
        import queue
        import time

        self.send(payload, correlation, **kwargs)
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                message = self.replies.get(timeout=left)
            except queue.Empty:
                return None
            if message.properties.CorrelationData == correlation:
                return message
        return None

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()
        self.client._reset_sockets()  # paho leaves its socket pair (and a late connection) to gc


class ServeProcess:
    """`python -m sdk.cli serve ...` until it prints `ready`; the addresses it printed."""

    def __init__(self, *argv: str, timeout: float = 60) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "sdk.cli", "serve", *argv], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        self.addresses: dict[str, str] = {}
        deadline = time.monotonic() + timeout
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            kind, _, value = line.strip().partition(" ")
            if kind == "ready":
                return
            self.addresses[kind] = value
            if time.monotonic() > deadline:
                break
        self.proc.kill()
        msg = f"tierkit serve did not get ready: {self.proc.stderr.read() if self.proc.stderr else ''}"
        raise AssertionError(msg)

    def stop(self, sig: int = signal.SIGTERM) -> tuple[int, str, str]:
        """Signal the process (if still running), wait, close its pipes; (exit code, stdout, stderr)."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        out, err = self.proc.communicate(timeout=30)
        return self.proc.returncode, out, err
