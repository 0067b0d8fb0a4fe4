"""The fleet CA's revocation list: a revoked device's certificate is listed, served at GET /v1/ca/crl, written to
the broker's crlfile, and a real Mosquitto checking it refuses that device's TLS connection."""

from __future__ import annotations

import datetime as dt
import ssl
import threading
import urllib.request
from pathlib import Path

import paho.mqtt.client as paho
import pytest
from cryptography import x509
from paho.mqtt.enums import CallbackAPIVersion

from cloud_service.fleet.fleet import Fleet, FleetConfig
from edge_agent.fleet_sync import generate_key_and_csr
from testkit.broker import Broker
from testkit.broker_cert import server_cert
from testkit.fleet_process import FleetProcess
from testkit.waiting import wait_for

pytestmark = pytest.mark.mqtt


def _connects(port: int, ca: Path, cert: Path, key: Path, timeout: float = 5.0) -> bool:
    """Whether a client with this certificate gets a successful CONNACK over mutual TLS."""
    ok, done = [False], threading.Event()

    def on_connect(_c: object, _u: object, _f: object, rc: paho.ReasonCode, _p: object = None) -> None:
        ok[0] = not rc.is_failure
        done.set()

    c = paho.Client(CallbackAPIVersion.VERSION2, client_id="", protocol=paho.MQTTv5)
    c.tls_set(ca_certs=str(ca), certfile=str(cert), keyfile=str(key), tls_version=ssl.PROTOCOL_TLS_CLIENT)
    c.on_connect = on_connect
    c.on_disconnect = lambda *_a: done.set()
    try:
        c.connect("127.0.0.1", port)
    except (ssl.SSLError, OSError):  # refused during the handshake
        sock = c.socket()
        if sock is not None:
            sock.close()
        return False
    c.loop_start()
    try:
        done.wait(timeout)
        return ok[0]
    finally:
        c.disconnect()
        c.loop_stop()
        c._reset_sockets()  # paho leaves its socket pair (and a late connection) to gc


def test_a_revoked_certificate_is_listed_and_refused_by_the_broker(tmp_path: Path) -> None:
    data, crl_file, pid = tmp_path / "fleet-data", tmp_path / "fleet-ca.crl", tmp_path / "mosquitto.pid"
    fleet = Fleet.open(FleetConfig(data_dir=data, crl_file=crl_file, broker_reload=f"kill -HUP $(cat {pid})"))
    broker = None
    try:
        devices = {}
        for name in ("keep", "gone"):
            key_pem, csr = generate_key_and_csr()
            got = fleet.enroll(fleet.registry.create_token({}), csr, hardware={}, agent_version="t")
            (tmp_path / f"{name}.key").write_bytes(key_pem)
            (tmp_path / f"{name}.pem").write_text(got.cert_pem)
            devices[name] = got
        fleet.sync_broker()  # as `tierkit fleet serve` does at start: the (empty) list is written
        empty = x509.load_pem_x509_crl(crl_file.read_bytes())
        assert len(empty) == 0
        assert empty.is_signature_valid(fleet.ca.cert.public_key())  # type: ignore[arg-type]

        skey, scert = server_cert(fleet.ca, tmp_path)
        ca = data / "ca.pem"
        broker = Broker(tmp_path / "broker", extra_conf=(
            f"allow_anonymous false\ncafile {ca}\ncertfile {scert}\nkeyfile {skey}\nrequire_certificate true\n"
            f"use_identity_as_username true\ncrlfile {crl_file}\npid_file {pid}\n")).start()
        for name in ("keep", "gone"):
            assert _connects(broker.port, ca, tmp_path / f"{name}.pem", tmp_path / f"{name}.key"), name

        fleet.revoke(devices["gone"].device_id)  # rewrites the crlfile and has the broker reread it (SIGHUP)
        crl = x509.load_pem_x509_crl(crl_file.read_bytes())
        assert crl.is_signature_valid(fleet.ca.cert.public_key())  # type: ignore[arg-type]
        assert crl.next_update_utc is not None
        assert crl.next_update_utc > dt.datetime.now(dt.UTC) + dt.timedelta(days=7)
        serial = {name: x509.load_pem_x509_certificate((tmp_path / f"{name}.pem").read_bytes()).serial_number
                  for name in devices}
        assert crl.get_revoked_certificate_by_serial_number(serial["gone"]) is not None
        assert crl.get_revoked_certificate_by_serial_number(serial["keep"]) is None

        wait_for("the broker refusing the revoked certificate",
                 lambda: not _connects(broker.port, ca, tmp_path / "gone.pem", tmp_path / "gone.key"), timeout=10)
        assert _connects(broker.port, ca, tmp_path / "keep.pem", tmp_path / "keep.key")
    finally:
        if broker is not None:
            broker.stop()
        fleet.close()

    # another fleet process on the same database serves the same list, without a token
    proc = FleetProcess(data).start()
    try:
        with urllib.request.urlopen(proc.url + "/v1/ca/crl", timeout=30) as resp:
            assert resp.headers["Content-Type"].startswith("application/x-pem-file")
            served = x509.load_pem_x509_crl(resp.read())
        assert served.get_revoked_certificate_by_serial_number(serial["gone"]) is not None
        assert len(served) == 1
    finally:
        proc.stop()


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_enrollments_at_once_each_leave_a_whole_password_file(db_url: str, tmp_path: Path) -> None:
    """Sixteen agents enrolling at once rewrite the broker's password file from sixteen threads: each write leaves a
    whole file (one writer's temporary file taken by another's rename was a 500 to an enrolling agent)."""
    (tmp_path / "broker").mkdir()
    passwd = tmp_path / "broker" / "passwd"
    fleet = Fleet.open(FleetConfig(data_dir=tmp_path / "data", db_url=db_url, broker_passwd=passwd))
    try:
        tokens = [fleet.registry.create_token({"kind": "cam"}) for _ in range(16)]
        errors: list[BaseException] = []

        def enroll(token: str) -> None:
            try:
                fleet.enroll(token, generate_key_and_csr()[1], hardware={}, agent_version="test")
            except BaseException as exc:  # every failure is the finding
                errors.append(exc)

        threads = [threading.Thread(target=enroll, args=(tok,)) for tok in tokens]
        for th in threads:
            th.start()
        for th in threads:
            th.join(60)
        assert not errors, errors
        lines = passwd.read_text().splitlines()
        assert {line.split(":")[0] for line in lines} == {d["device_id"] for d in fleet.devices()}
        assert passwd.stat().st_mode & 0o777 == 0o600
        assert [p.name for p in passwd.parent.iterdir()] == ["passwd"]  # no temporary file left
    finally:
        fleet.close()
