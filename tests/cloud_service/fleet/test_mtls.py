"""The certificate a device gets at enrollment logs it in to a real Mosquitto by mutual TLS.

The broker trusts the fleet CA, takes the certificate's CN (the device id) as the username
(`use_identity_as_username`), and the shipped ACL (deploy/fleet/acl) confines it to its own topics.
"""

from __future__ import annotations

import datetime as dt
import ssl
from pathlib import Path

import paho.mqtt.client as paho
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from paho.mqtt.enums import CallbackAPIVersion

from cloud_service.fleet.ca import FleetCA
from cloud_service.fleet.registry import Registry
from cloud_service.fleet.store import FleetStore
from edge_agent.fleet_sync import generate_key_and_csr
from testkit.broker import Broker
from testkit.fleet_process import ROOT
from testkit.waiting import wait_for

pytestmark = pytest.mark.mqtt


def _server_cert(ca: FleetCA, out: Path) -> tuple[Path, Path]:
    """A broker certificate for 127.0.0.1, signed by the fleet CA (test setup: the broker's own PKI)."""
    import ipaddress

    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "broker")]))
            .issuer_name(ca.cert.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .sign(ca.key, hashes.SHA256()))
    kp, cp = out / "server.key", out / "server.pem"
    kp.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                     serialization.NoEncryption()))
    cp.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return kp, cp


def _client(port: int, ca: Path, cert: Path, key: Path) -> tuple[paho.Client, dict[int, object]]:
    acks: dict[int, object] = {}
    c = paho.Client(CallbackAPIVersion.VERSION2, client_id="", protocol=paho.MQTTv5)
    c.tls_set(ca_certs=str(ca), certfile=str(cert), keyfile=str(key), tls_version=ssl.PROTOCOL_TLS_CLIENT)
    c.on_publish = lambda _c, _u, mid, rc, _p: acks.__setitem__(mid, rc)
    c.connect("127.0.0.1", port)
    c.loop_start()
    return c, acks


def test_enrolled_certificate_is_the_mqtt_identity(tmp_path: Path) -> None:
    ca = FleetCA.load_or_create(tmp_path / "ca")
    store = FleetStore.open(f"sqlite:///{tmp_path / 'fleet.db'}")
    try:
        reg = Registry(store, ca)
        ids = []
        for name in ("a", "b"):
            key_pem, csr = generate_key_and_csr()
            got = reg.enroll(reg.create_token({}), csr)
            (tmp_path / f"{name}.key").write_bytes(key_pem)
            (tmp_path / f"{name}.pem").write_text(got.cert_pem)
            ids.append(got.device_id)
    finally:
        store.close()
    skey, scert = _server_cert(ca, tmp_path)
    broker = Broker(tmp_path / "broker", extra_conf=(
        f"allow_anonymous false\nacl_file {ROOT / 'deploy/fleet/acl'}\ncafile {tmp_path / 'ca' / 'ca.pem'}\n"
        f"certfile {scert}\nkeyfile {skey}\nrequire_certificate true\nuse_identity_as_username true\n")).start()
    try:
        c, acks = _client(broker.port, tmp_path / "ca" / "ca.pem", tmp_path / "a.pem", tmp_path / "a.key")
        own = c.publish(f"tierkit/v1/{ids[0]}/telemetry", b"{}", qos=1)
        other = c.publish(f"tierkit/v1/{ids[1]}/telemetry", b"{}", qos=1)
        wait_for("the broker's answers to both publishes", lambda: len(acks) >= 2, timeout=10, interval=0.05)
        assert not acks[own.mid].is_failure  # type: ignore[attr-defined]
        assert acks[other.mid].is_failure  # type: ignore[attr-defined]
        c.disconnect()
        c.loop_stop()
        c._reset_sockets()  # paho leaves its socket pair (and a late connection) to gc
    finally:
        broker.stop()
