"""`tierkit broker init`: the first dynamic-security file and the service passwords, checked by a real Mosquitto
running the shipped configuration (the accounts log in with the passwords written; the groups given are the ones
the roles allow)."""

from __future__ import annotations

import json
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from sdk.cli import main as tierkit
from testkit.cloud_helpers import Pki, ServerThread
from testkit.deploy_broker import DeployBroker, broker_init, connack, need_mosquitto
from testkit.fleet_process import FleetProcess, cli
from testkit.mqtt_probe import Probe, tls_context
from testkit.waiting import wait_for

GRANTED, REFUSED = "Granted QoS 1", "Not authorized"


def test_init_writes_private_files_and_refuses_what_it_should(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                                             ) -> None:
    passwords = broker_init(tmp_path, "--cloud", "tierkit-cloud-a", "--cloud", "tierkit-cloud-b")
    assert sorted(passwords) == ["tierkit-cloud-a", "tierkit-cloud-b", "tierkit-fleet"]
    assert len(set(passwords.values())) == 3
    assert all(len(pw) >= 24 for pw in passwords.values())
    state = tmp_path / "dynamic-security.json"
    for path in (state, *tmp_path.glob("*.password")):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    doc = json.loads(state.read_text())
    clients = {c["username"]: c for c in doc["clients"]}
    assert clients["tierkit-cloud-b"]["clientid"] == "tierkit-cloud-b"
    assert clients["tierkit-fleet"]["roles"] == [{"rolename": "tierkit-fleet"}]
    assert not any(pw in state.read_text() for pw in passwords.values())  # hashes only
    capsys.readouterr()
    # an existing state holds the enrolled devices: not replaced without --force
    assert tierkit(["broker", "init", "--out", str(tmp_path)]) == 1
    assert "--force" in capsys.readouterr().err
    for bad in (["--cloud", "cam-1"], ["--fleet", "tierkit-cloud-2"], ["--cloud", "tierkit-cloud", "--cloud",
                                                                         "tierkit-cloud"], ["--cloud-group", "a/b"]):
        assert tierkit(["broker", "init", "--out", str(tmp_path / "other"), *bad]) == 1, bad
        err = capsys.readouterr().err
        assert "refused" in err or "of its own" in err or "is not a" in err, err
    assert not (tmp_path / "other" / "dynamic-security.json").exists()


@pytest.fixture
def grouped(tmp_path: Path, pki: Pki) -> Iterator[DeployBroker]:
    need_mosquitto()
    broker = DeployBroker(tmp_path / "broker", pki, init=("--cloud", "tierkit-cloud-a", "--cloud", "tierkit-cloud-b",
                                                          "--cloud-group", "edge", "--fleet-group", "ops")).start()
    yield broker
    broker.stop()


@pytest.mark.mqtt
def test_the_accounts_log_in_with_their_groups(grouped: DeployBroker, pki: Pki) -> None:
    probes = {name: Probe(grouped.cloud_port, name, ctx=tls_context(pki, None), username=name,
                          password=grouped.passwords[name]) for name in ("tierkit-cloud-a", "tierkit-cloud-b",
                                                                         "tierkit-fleet")}
    try:
        for name in ("tierkit-cloud-a", "tierkit-cloud-b"):
            assert probes[name].subscribe("$share/edge/tierkit/v1/+/escalate") == GRANTED
            assert probes[name].subscribe("$share/tierkit/tierkit/v1/+/escalate") == REFUSED
        assert probes["tierkit-fleet"].subscribe("$share/ops/tierkit/v1/+/telemetry") == GRANTED
        assert probes["tierkit-fleet"].subscribe("$share/tierkit-fleet/tierkit/v1/+/telemetry") == REFUSED
    finally:
        for probe in probes.values():
            probe.close()
    assert connack(grouped.cloud_port, tls_context(pki, None), "tierkit-cloud-a",
                   grouped.passwords["tierkit-cloud-b"]).is_failure  # another account's password


@pytest.mark.mqtt
def test_a_group_the_roles_do_not_allow_is_refused_by_name(grouped: DeployBroker, pki: Pki, tmp_path: Path,
                                                          serve: Callable[..., ServerThread], models_dir: Path) -> None:
    from cloud_service.config import MqttConfig
    from cloud_service.security import MqttTls
    from runtimes.errors import TierkitError

    wrong = MqttConfig(url=f"mqtts://127.0.0.1:{grouped.cloud_port}", client_id="tierkit-cloud-a",
                       username="tierkit-cloud-a", password=grouped.passwords["tierkit-cloud-a"],
                       tls=MqttTls(ca_file=pki.ca))  # group "tierkit", the default; the roles allow "edge"
    with pytest.raises(TierkitError, match="--cloud-group"):
        serve(models_dir, grpc_address=None, mqtt=wrong)
    data = tmp_path / "fleet-data"
    fleet = FleetProcess(data, None, "--mqtt", f"mqtts://127.0.0.1:{grouped.cloud_port}", "--mqtt-ca", str(pki.ca),
                         "--mqtt-username", "tierkit-fleet",
                         env={"TIERKIT_FLEET_MQTT_PASSWORD": grouped.passwords["tierkit-fleet"]}).start()
    try:
        admin = cli("operator", "create", "ops", "--role", "admin", data_dir=data).stdout.strip()
        wait_for("the refusal counted", lambda: fleet.call("GET", "/v1/stats", token=admin)[1]["ingest"].get(
            "subscriptions_refused") == 2, timeout=20)
    finally:
        fleet.stop()
