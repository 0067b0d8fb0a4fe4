"""The fleet on a Mosquitto with the dynamic-security plugin: enrolling creates the device's broker client and
role, revoking deletes them and cuts the connected device off at once; no broker, no enrollment (token kept)."""

from __future__ import annotations

import json
import os
import ssl
import time
from pathlib import Path

import pytest

from edge_agent.fleet_sync import EnrollmentError, enroll
from testkit.broker import Broker
from testkit.cloud_helpers import Pki, write_pki
from testkit.deploy_broker import broker_init, dynsec_plugin
from testkit.fleet_process import ROOT, FleetProcess, cli
from testkit.mqtt_device import Device
from testkit.waiting import wait_for

pytestmark = pytest.mark.mqtt


class DynsecBroker(Broker):
    """deploy/fleet/mosquitto-fleet.conf as shipped (ports and paths rendered) with the dynamic-security file and
    service passwords of `tierkit broker init`."""

    def __init__(self, workdir: Path, pki: Pki) -> None:
        super().__init__(workdir)
        self.pki = pki
        self.passwords: dict[str, str] = {}

    @property
    def url(self) -> str:
        return f"mqtts://{self.host}:{self.port}"

    def tls(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.pki.ca))

    def write_conf(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        if not (self.workdir / "dynamic-security.json").exists():  # the plugin keeps its state there
            self.passwords = broker_init(self.workdir)
        text = (ROOT / "deploy" / "fleet" / "mosquitto-fleet.conf").read_text()  # as shipped, ports and paths rendered
        for old, new in {"/mosquitto/data/": f"{self.workdir}/",
                         "/usr/lib/mosquitto_dynamic_security.so": dynsec_plugin(),
                         "/mosquitto/certs/server.pem": str(self.pki.server_cert),
                         "/mosquitto/certs/server.key": str(self.pki.server_key),
                         "\nlistener 8883\n": f"\nlistener {self.port} {self.host}\n",
                         "log_dest stdout": f"log_dest file {self.log}"}.items():
            assert old in text, old
            text = text.replace(old, new)
        self.conf.write_text(("user root\n" if os.geteuid() == 0 else "") + text)


def test_enroll_and_revoke_manage_the_broker_account(tmp_path: Path) -> None:
    pki = write_pki(tmp_path / "pki")
    broker = DynsecBroker(tmp_path / "broker", pki)
    broker.write_conf()  # the passwords exist before the broker first starts (tierkit broker init)
    data = tmp_path / "fleet-data"
    fleet = FleetProcess(data, None, "--mqtt", broker.url, "--mqtt-ca", str(pki.ca), "--mqtt-username", "tierkit-fleet",
                         "--broker-dynsec", env={"TIERKIT_FLEET_MQTT_PASSWORD": broker.passwords["tierkit-fleet"]}
                         ).start()
    device = None
    try:
        token = cli("token", "create", "--labels", "site=x", data_dir=data).stdout.strip()
        # no broker yet: the account cannot be created, so nothing is enrolled and the token stays usable
        with pytest.raises(EnrollmentError, match=r"unreachable"):
            enroll(fleet.url, token, tmp_path / "dev")
        broker.start()
        admin = cli("operator", "create", "ops", "--role", "admin", data_dir=data).stdout.strip()
        wait_for("the fleet's broker connection",
                 lambda: fleet.call("GET", "/v1/stats", token=admin)[1]["mqtt_connected"])
        ident = enroll(fleet.url, token, tmp_path / "dev")
        dev = ident.device_id
        assert ident.mqtt_username == dev
        assert Device(broker.host, broker.port, dev, "wrong-password-xyz", tls=broker.tls()).connect().is_failure
        # the device's login claiming the fleet's client id: the broker makes its client id its username, so the
        # fleet's session is not taken over (Mosquitto logs a takeover as "already connected, closing old")
        claim = Device(broker.host, broker.port, dev, ident.mqtt_password, tls=broker.tls())
        claim.client._client_id = b"tierkit-fleet"
        assert not claim.connect().is_failure
        claim.close()
        assert "already connected" not in broker.log.read_text()
        device = Device(broker.host, broker.port, dev, ident.mqtt_password, tls=broker.tls())
        assert not device.connect().is_failure
        window = {"device": dev, "boot_id": "b", "seq": 1, "ts": time.time(), "window_s": 10, "requests": 3}
        assert not device.publish(f"tierkit/v1/{dev}/telemetry", json.dumps(window).encode()).is_failure
        assert device.publish("tierkit/v1/dev-other/telemetry", b"{}").is_failure  # its own subtree only
        wait_for("the window stored", lambda: fleet.call("GET", f"/v1/telemetry?device={dev}", token=admin)[1]
                 ["windows"])

        assert fleet.call("POST", f"/v1/devices/{dev}/revoke", token=admin)[0] == 200
        wait_for("the revoked device disconnected", lambda: not device.client.is_connected(), timeout=5)
        device.close()
        device = Device(broker.host, broker.port, dev, ident.mqtt_password, tls=broker.tls())
        assert device.connect().is_failure  # its account is gone
    finally:
        if device is not None:
            device.close()
        fleet.stop()
        broker.stop()
