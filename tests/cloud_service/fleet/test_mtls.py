"""The certificate a device gets at enrollment logs it in to a real Mosquitto by mutual TLS.

The broker trusts the fleet CA, takes the certificate's CN (the device id) as the username
(`use_identity_as_username`), and the shipped ACL (deploy/fleet/acl) confines it to its own topics.
"""

from __future__ import annotations

import ssl
from pathlib import Path

import paho.mqtt.client as paho
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from cloud_service.fleet.ca import FleetCA
from cloud_service.fleet.registry import Registry
from cloud_service.fleet.store import FleetStore
from edge_agent.fleet_sync import generate_key_and_csr
from testkit.broker import Broker
from testkit.broker_cert import server_cert
from testkit.fleet_process import ROOT
from testkit.waiting import wait_for

pytestmark = pytest.mark.mqtt


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
    skey, scert = server_cert(ca, tmp_path)
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
