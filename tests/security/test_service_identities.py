"""Service identities no device certificate can take, on the shipped Mosquitto configuration (real broker, the
dynamic-security file `tierkit broker init` writes): certificates named `tierkit-cloud` and `tierkit-fleet` get no
service rights, and client ids cannot be taken across devices and services (Mosquitto logs a session takeover as
"already connected, closing old connection", at the shipped log level)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from testkit.cloud_helpers import Pki
from testkit.deploy_broker import DeployBroker, connack, issue_client_cert, need_mosquitto
from testkit.mqtt_probe import Probe, tls_context
from testkit.waiting import wait_for

pytestmark = pytest.mark.mqtt
NOT_AUTHORIZED = "Not authorized"
SERVICE_TOPICS_SUB = ("$share/tierkit/tierkit/v1/+/escalate", "tierkit/v1/+/escalate",
                      "$share/tierkit-fleet/tierkit/v1/+/telemetry", "$share/tierkit-fleet/tierkit/v1/+/reported",
                      "$CONTROL/dynamic-security/v1/response", "#")
SERVICE_TOPICS_PUB = ("tierkit/v1/cam-1/reply", "tierkit/v1/cam-1/desired", "$CONTROL/dynamic-security/v1")


@pytest.fixture
def deploy(tmp_path: Path, pki: Pki) -> Iterator[DeployBroker]:
    need_mosquitto()
    broker = DeployBroker(tmp_path / "broker", pki, devices=("cam-1",)).start()
    yield broker
    broker.stop()


def _service(deploy: DeployBroker, pki: Pki, name: str, client_id: str | None = None) -> Probe:
    return Probe(deploy.cloud_port, client_id or name, ctx=tls_context(pki, None), username=name,
                 password=deploy.passwords[name])


def _takeovers(deploy: DeployBroker) -> int:
    return deploy.log.read_text().count("already connected")


@pytest.mark.parametrize("cn", ["tierkit-cloud", "tierkit-fleet"])
def test_a_certificate_named_like_a_service_gets_no_service_rights(deploy: DeployBroker, pki: Pki, cn: str) -> None:
    cert = (pki.cloud_cert, pki.cloud_key) if cn == "tierkit-cloud" else issue_client_cert(pki, cn)
    probe = Probe(deploy.port, cn, ctx=tls_context(pki, cert))
    try:
        got = {t: probe.subscribe(t) for t in SERVICE_TOPICS_SUB}
        got |= {t: probe.publish(t, json.dumps({"commands": [{"command": "listClients"}]}).encode(), retain=False)
                for t in SERVICE_TOPICS_PUB}
        assert got == dict.fromkeys((*SERVICE_TOPICS_SUB, *SERVICE_TOPICS_PUB), NOT_AUTHORIZED)
        assert probe.messages.empty()  # no $CONTROL answer, no escalation
    finally:
        probe.close()
    # the same name with no password (or a guessed one) on the service listener: refused outright
    for password in ("", "tierkit"):
        assert connack(deploy.cloud_port, tls_context(pki, cert), cn, password).is_failure


def test_the_service_accounts_hold_their_rights(deploy: DeployBroker, pki: Pki) -> None:
    """The control for the refusals above: the real accounts, with the passwords `tierkit broker init` wrote."""
    cloud = _service(deploy, pki, "tierkit-cloud")
    fleet = _service(deploy, pki, "tierkit-fleet")
    try:
        assert cloud.subscribe("$share/tierkit/tierkit/v1/+/escalate") == "Granted QoS 1"
        assert cloud.subscribe("#") == NOT_AUTHORIZED
        assert fleet.subscribe("$share/tierkit-fleet/tierkit/v1/+/telemetry") == "Granted QoS 1"
        assert fleet.subscribe("tierkit/v1/+/telemetry") == NOT_AUTHORIZED  # only through its shared subscription
        assert fleet.subscribe("$share/tierkit/tierkit/v1/+/escalate") == NOT_AUTHORIZED  # the cloud's, not its own
        assert fleet.subscribe("#") == NOT_AUTHORIZED
        assert fleet.subscribe("$CONTROL/dynamic-security/v1/response") == "Granted QoS 1"
        fleet.publish("$CONTROL/dynamic-security/v1", b'{"commands": [{"command": "listClients"}]}')
        answer = json.loads(fleet.messages.get(timeout=5).payload)["responses"][0]
        assert "CN=cam-1" in answer["data"]["clients"]
    finally:
        cloud.close()
        fleet.close()


def test_no_login_takes_another_identitys_client_id(deploy: DeployBroker, pki: Pki) -> None:
    cloud = _service(deploy, pki, "tierkit-cloud")
    cam1 = Probe(deploy.port, "cam-1", ctx=tls_context(pki, (pki.client_cert, pki.client_key)))
    claims: list[Probe] = []
    try:
        before = _takeovers(deploy)
        # a device certificate, and one named like the service, asking for the cloud's client id
        for cert in (issue_client_cert(pki, "cam-2"), (pki.cloud_cert, pki.cloud_key)):
            claims.append(Probe(deploy.port, "tierkit-cloud", ctx=tls_context(pki, cert)))
        # a service login asking for the device's client id (its username on the certificate listener)
        claims.append(_service(deploy, pki, "tierkit-fleet", client_id="CN=cam-1"))
        assert cloud.subscribe("$share/tierkit/tierkit/v1/+/escalate") == "Granted QoS 1"  # still its session
        assert cam1.subscribe("tierkit/v1/cam-1/reply") == "Granted QoS 1"
        assert _takeovers(deploy) == before
        assert cloud.client.is_connected()
        assert cam1.client.is_connected()
        # the control: the device's own certificate again does take its own session over
        claims.append(Probe(deploy.port, "anything", ctx=tls_context(pki, (pki.client_cert, pki.client_key))))
        wait_for("the broker's takeover notice", lambda: _takeovers(deploy) > before, timeout=5)
    finally:
        for probe in (cloud, cam1, *claims):
            probe.close()
