"""`deploy/` as shipped, end to end: `deploy/mosquitto/mosquitto.conf` (ports and paths rendered, nothing else)
with the dynamic-security file and passwords of `tierkit broker init`, TLS on both listeners; `tierkit fleet
serve` over HTTPS and MQTT over TLS with `--broker-dynsec`, keeping the broker's `crlfile`; `tierkit serve`
bridging escalations over TLS; three `tierkit agent` processes enrolled with tokens, on the device listener with
the certificates the fleet issued them. Checked: escalations answered by the cloud, telemetry stored, a desired
threshold applied, a release rolled out (downloaded over HTTPS), one device revoked (its logins deleted, its
certificate refused at the handshake) while the others go on."""

from __future__ import annotations

import json
import ssl
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from compilers.signing import generate_keypair, load_private_key
from edge_agent.fleet_sync import enroll
from testkit import zoo
from testkit.cloud_helpers import ServeProcess, metric_value, write_pki
from testkit.deploy_broker import DeployBroker, need_mosquitto
from testkit.fleet_process import FleetProcess, cli
from testkit.packages import make_package
from testkit.releases import variant_set
from testkit.rollout_fleet import THRESHOLD, Agents, DigitsModels, LoadDriver
from testkit.waiting import wait_for

pytestmark = [pytest.mark.mqtt, pytest.mark.slow]


class TlsAgents(Agents):
    """`Agents` configured as the deployment wants them: the fleet over HTTPS (`fleet.ca_file`), escalations,
    telemetry and desired state over `mqtts://` to the device listener with the fleet-issued certificate."""

    def __init__(self, tmp: Path, n: int, *, fleet_url: str, token: Any, model: Path, broker: tuple[str, int],
                 cloud_model: str, release_key: Path, ca: Path) -> None:
        from testkit.broker import _free_port

        self.tmp, self.n = tmp, n
        self.ports = [_free_port() for _ in range(n)]
        self.procs = [None] * n
        self.logs = [None] * n
        self.device_ids = []
        for i in range(n):
            d = tmp / f"agent{i}"
            d.mkdir(parents=True, exist_ok=True)
            state = d / "state"
            ident = enroll(fleet_url, token(), state, ca_file=ca)  # one token each, over HTTPS
            self.device_ids.append(ident.device_id)
            (d / "agent.yaml").write_text(
                f"model: {model}\nlisten: 127.0.0.1:{self.ports[i]}\n"
                f"cloud: mqtts://{broker[0]}:{broker[1]}/{cloud_model}\n"
                f"tls: {{ca_file: '{ca}', cert_file: '{state / 'device.pem'}', key_file: '{state / 'device.key'}'}}\n"
                f"policy: {{threshold: {THRESHOLD}}}\ntelemetry_interval_s: 1\nthreads: 1\n"
                f"fleet: {{url: '{fleet_url}', state_dir: '{state}', release_keys: ['{release_key}'], "
                f"ca_file: '{ca}'}}\n")


def _devices(fleet: FleetProcess, admin: str) -> dict[str, dict[str, Any]]:
    status, got = fleet.call("GET", "/v1/devices", token=admin)
    assert status == 200, got
    return {d["device_id"]: d for d in got}


def _metric(address: str, name: str, **labels: str) -> float:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as resp:
        return metric_value(resp.read().decode(), name, **labels)


def _handshake(port: int, ca: Path, cert: Path, key: Path) -> str:
    """'ok' when the broker accepts the client certificate's TLS handshake (and a first read), else the error."""
    import socket

    ctx = ssl.create_default_context(cafile=str(ca))
    ctx.load_cert_chain(str(cert), str(key))
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as raw, \
                ctx.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
            tls.sendall(b"\x10\x00")  # a malformed CONNECT: a TLS 1.3 server's refusal arrives on first I/O
            tls.recv(1)
        return "ok"
    except (ssl.SSLError, OSError) as exc:
        return type(exc).__name__ + ": " + str(exc)


@pytest.mark.timeout(900)
def test_the_shipped_deployment_over_tls(tmp_path: Path, digits_linear: Any, digits: zoo.Split,
                                         digits_cnn_onnx: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    need_mosquitto()
    pki = write_pki(tmp_path / "pki")  # the broker's and the fleet API's server certificates (127.0.0.1)
    key, pub = generate_keypair(tmp_path / "ops")
    data, bdir = tmp_path / "fleet-data", tmp_path / "broker"
    broker = DeployBroker(bdir, pki, devices=(), device_ca=data / "ca.pem", crl=bdir / "fleet-ca.crl").init()
    assert set(broker.passwords) == {"tierkit-cloud", "tierkit-fleet"}
    fleet = FleetProcess(
        data, None, "--http-cert", str(pki.server_cert), "--http-key", str(pki.server_key),
        "--mqtt", f"mqtts://127.0.0.1:{broker.cloud_port}", "--mqtt-ca", str(pki.ca),
        "--mqtt-username", "tierkit-fleet",
        "--broker-dynsec", "--crl-file", str(broker.crl), "--broker-reload", f"kill -HUP $(cat {broker.pid_file})",
        "--release-key", str(pub), "--online-after", "3s",
        env={"TIERKIT_FLEET_MQTT_PASSWORD": broker.passwords["tierkit-fleet"]}, ca=pki.ca).start()
    cloud = agents = None
    try:
        assert broker.crl.exists()  # the fleet wrote its CA's revocation list before the broker first starts
        broker.start()
        admin = cli("operator", "create", "ops", "--role", "admin", data_dir=data).stdout.strip()
        wait_for("the fleet's TLS connection to the broker",
                 lambda: fleet.call("GET", "/v1/stats", token=admin)[1]["mqtt_connected"], timeout=30)

        models_dir = tmp_path / "cloud-models"
        make_package(digits_cnn_onnx, models_dir / "digits-cloud", name="digits-cloud", x_val=digits.x_val,
                     y_val=digits.y_val)
        monkeypatch.setenv("TIERKIT_MQTT_PASSWORD", broker.passwords["tierkit-cloud"])
        cloud = ServeProcess("--models", str(models_dir), "--no-grpc", "--metrics", "127.0.0.1:0",
                             "--mqtt", f"mqtts://127.0.0.1:{broker.cloud_port}", "--mqtt-ca", str(pki.ca),
                             "--mqtt-username", "tierkit-cloud")
        monkeypatch.delenv("TIERKIT_MQTT_PASSWORD")

        layer = digits_linear[1]
        models = DigitsModels(layer.weight.detach().numpy(), layer.bias.detach().numpy(), digits.x_test)
        local = variant_set(tmp_path / "local", models.linear(tmp_path / "local.onnx"), "local", digits.x_val,
                            digits.y_val)
        agents = TlsAgents(tmp_path / "agents", 3, fleet_url=fleet.url, model=local, ca=pki.ca,
                           token=lambda: _token(data),
                           broker=("127.0.0.1", broker.port), cloud_model="digits-cloud", release_key=pub)
        agents.start()
        _run(fleet, admin, broker, cloud, agents, models, data, tmp_path, key, digits, pki)
    finally:
        codes = agents.stop() if agents is not None else []
        if cloud is not None:
            cloud.stop()
        fleet.stop()
        broker.stop()
    assert all(c == 0 for c in codes), [agents.log_text(i)[-2000:] for i in range(3)] if agents else codes


def _run(fleet: FleetProcess, admin: str, broker: DeployBroker, cloud: ServeProcess, agents: TlsAgents,
         models: DigitsModels, data: Path, tmp: Path, key: Path, digits: zoo.Split, pki: Any) -> None:
    devs = agents.device_ids
    with LoadDriver(agents.ports, models.cycle, rate_rps=10, max_s=240) as load:
        # escalations answered by the cloud over MQTT, telemetry windows stored
        wait_for("escalations answered over MQTT", lambda: _metric(
            cloud.addresses["metrics"], "tierkit_requests_total", protocol="mqtt") >= 10, timeout=60)
        for dev in devs:
            wait_for(f"telemetry of {dev}", lambda dev=dev: fleet.call(
                "GET", f"/v1/telemetry?device={dev}", token=admin)[1]["windows"], timeout=30)
        wait_for("every agent online", lambda: all(d["online"] for d in _devices(fleet, admin).values()), timeout=30)
        for dev in devs:  # each on the certificate listener, its username (and client id) its certificate's subject
            assert f"as CN={dev} (" in broker.log.read_text()

        # desired state: a threshold for one device, applied and reported back
        layer = tmp / "desired.json"
        layer.write_text(json.dumps({"threshold": 0.7}))
        cli("set", "--device", devs[0], str(layer), data_dir=data)
        wait_for("the desired threshold applied", lambda: (d := _devices(fleet, admin)[devs[0]])["threshold"] == 0.7
                 and d["reported_version"] == d["desired_version"], timeout=30)

        # a release rolled out to every device, downloaded over HTTPS
        from cloud_service.fleet.fleet import Fleet, FleetConfig

        root = tmp / "release"
        vs = variant_set(root / "vs", models.linear(root / "model.onnx"), "lin", digits.x_val, digits.y_val)
        policy = root / "policy.json"
        policy.write_text(json.dumps({"name": "digits", "version": "10", "threshold": THRESHOLD,
                                      "budget": {"latency_ms": 250}}))
        with Fleet.open(FleetConfig(data_dir=data, release_keys=(key.with_suffix(".pub"),))) as facade:
            digest = str(facade.releases.create(vs, policy, sign_key=load_private_key(key))["digest"])
        status, got = fleet.call("POST", "/v1/rollouts", {"release": digest, "label": "kind=cam", "waves": "100%",
                                                          "soak": "10", "margins": {"min_requests": 10},
                                                          "holdback": 0}, token=admin)  # no control: soak only
        assert status == 200, got
        rid = got["id"]
        wait_for("the rollout to succeed", lambda: _rollout_state(fleet, admin, rid) == "succeeded", timeout=120)
        assert all(agents.running(i) == digest for i in range(3))

        # one device revoked: its logins deleted (cut off at once), its certificate refused at the handshake
        gone = tmp / "agents" / "agent2" / "state"
        assert _handshake(broker.port, pki.ca, gone / "device.pem", gone / "device.key") == "ok"
        load.pause([2])
        before = _metric(cloud.addresses["metrics"], "tierkit_requests_total", protocol="mqtt")
        assert fleet.call("POST", f"/v1/devices/{devs[2]}/revoke", token=admin)[0] == 200
        wait_for("the revoked certificate refused", lambda: _handshake(
            broker.port, pki.ca, gone / "device.pem", gone / "device.key") != "ok", timeout=30)
        wait_for("the others still answered", lambda: _metric(
            cloud.addresses["metrics"], "tierkit_requests_total", protocol="mqtt") >= before + 5, timeout=30)
        live = _devices(fleet, admin)
        assert live[devs[2]]["revoked_at"] is not None
        log = broker.log.read_text()
        assert f"CN={devs[2]} been disconnected by administrative action" in log  # its logins deleted
        assert "certificate verify failed" in log  # and the CRL, rewritten and reloaded, refuses its certificate
    assert sum(load.sent) > 0
    assert not {k: v for k, v in load.errors.items() if k[0] != 2}, load.errors  # the others never failed
    agents.stop([2])


def _rollout_state(fleet: FleetProcess, admin: str, rid: int) -> str:
    status, shown = fleet.call("GET", f"/v1/rollouts/{rid}", token=admin)
    assert status == 200, shown
    state = str(shown["state"])
    if state not in ("running", "succeeded"):
        msg = f"rollout {rid} ended {state}: {shown.get('reason')}"
        raise AssertionError(msg)
    return state


def _token(data: Path) -> str:
    return cli("token", "create", "--labels", "kind=cam", data_dir=data).stdout.strip()
