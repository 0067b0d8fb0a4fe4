"""The fleet on a Mosquitto with the dynamic-security plugin: enrolling creates the device's broker client and
role, revoking deletes them and cuts the connected device off at once; no broker, no enrollment (token kept)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from cloud_service import identity
from edge_agent.fleet_sync import EnrollmentError, enroll
from tests.broker import Broker
from tests.fleet.conftest import FLEET_PASSWORD
from tests.fleet.fleet_process import ROOT, FleetProcess, cli
from tests.fleet.mqtt_device import Device
from tests.security.deploy_broker import DEPLOY, dynsec_plugin
from tests.waiting import wait_for

pytestmark = pytest.mark.mqtt


class DynsecBroker(Broker):
    """deploy/fleet/mosquitto-fleet.conf with the shipped roles (deploy/mosquitto/dynamic-security.json)."""

    def write_conf(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        state = self.workdir / "dynamic-security.json"
        if not state.exists():  # the plugin keeps its state there: a restart must not reset it
            doc = json.loads((DEPLOY / "dynamic-security.json").read_text())
            for client in doc["clients"]:
                client.update(identity.password_fields(FLEET_PASSWORD))
            state.write_text(json.dumps(doc))
        text = (ROOT / "deploy" / "fleet" / "mosquitto-fleet.conf").read_text()  # as shipped, ports and paths rendered
        for old, new in {"/mosquitto/data/": f"{self.workdir}/",
                         "/usr/lib/mosquitto_dynamic_security.so": dynsec_plugin(),
                         "\nlistener 1883\n": f"\nlistener {self.port} {self.host}\n",
                         "log_dest stdout": f"log_dest file {self.log}"}.items():
            assert old in text, old
            text = text.replace(old, new)
        self.conf.write_text(("user root\n" if os.geteuid() == 0 else "") + text)


def test_enroll_and_revoke_manage_the_broker_account(tmp_path: Path) -> None:
    broker = DynsecBroker(tmp_path / "broker")
    data = tmp_path / "fleet-data"
    fleet = FleetProcess(data, None, "--mqtt", broker.url, "--mqtt-user", "tierkit-fleet", "--broker-dynsec",
                         env={"TIERKIT_FLEET_MQTT_PASSWORD": FLEET_PASSWORD}).start()
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
        assert Device(broker.host, broker.port, dev, "wrong-password-xyz").connect().is_failure
        other_id = Device(broker.host, broker.port, dev, ident.mqtt_password)
        other_id.client._client_id = b"not-" + dev.encode()  # the right login under another client id
        assert other_id.connect().is_failure
        device = Device(broker.host, broker.port, dev, ident.mqtt_password)
        assert not device.connect().is_failure
        window = {"device": dev, "boot_id": "b", "seq": 1, "ts": time.time(), "window_s": 10, "requests": 3}
        assert not device.publish(f"tierkit/v1/{dev}/telemetry", json.dumps(window).encode()).is_failure
        assert device.publish("tierkit/v1/dev-other/telemetry", b"{}").is_failure  # its own subtree only
        wait_for("the window stored", lambda: fleet.call("GET", f"/v1/telemetry?device={dev}", token=admin)[1]
                 ["windows"])

        assert fleet.call("POST", f"/v1/devices/{dev}/revoke", token=admin)[0] == 200
        wait_for("the revoked device disconnected", lambda: not device.client.is_connected(), timeout=5)
        device.close()
        device = Device(broker.host, broker.port, dev, ident.mqtt_password)
        assert device.connect().is_failure  # its account is gone
    finally:
        if device is not None:
            device.close()
        fleet.stop()
        broker.stop()
