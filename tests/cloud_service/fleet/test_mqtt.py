"""MQTT ingestion and desired publication against a real Mosquitto configured with deploy/fleet/acl."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from edge_agent.fleet_sync import FleetIdentity, enroll
from testkit.broker import Broker
from testkit.fleet_process import FleetProcess, cli
from testkit.mqtt_device import Device
from testkit.waiting import wait_for
from testkit.windows import window_doc

pytestmark = pytest.mark.mqtt


def _window(dev: str, seq: int, **kw: Any) -> dict[str, Any]:
    return window_doc(dev, seq, boot_id="boot1", window_s=10, requests=50, p95_ms=5.0 + seq, escalation_rate=0.1,
                      energy_mj_per_request=1.0, energy_label="modeled", **kw)


def _device(broker: Broker, ident: FleetIdentity) -> Device:
    d = Device(broker.host, broker.port, ident.mqtt_username, ident.mqtt_password)
    assert not d.connect().is_failure
    return d


# PostgreSQL runs the whole store suite by default (test_store.py); this end-to-end path on it is slow-marked
@pytest.mark.parametrize("db_url", ["sqlite", pytest.param("postgresql", marks=pytest.mark.slow)], indirect=True)
def test_ingest_desired_and_revocation(stack: tuple[FleetProcess, Broker, Path, str], tmp_path: Path) -> None:
    fleet, broker, data, db = stack
    admin = cli("operator", "create", "ops", "--role", "admin", data_dir=data, db=db).stdout.strip()
    idents = {}
    for name, site in (("a", "berlin"), ("b", "paris")):
        token = cli("token", "create", "--labels", f"site={site}", data_dir=data, db=db).stdout.strip()
        idents[name] = enroll(fleet.url, token, tmp_path / name)
    a_id, b_id = idents["a"].device_id, idents["b"].device_id
    a, b = _device(broker, idents["a"]), _device(broker, idents["b"])
    wait_for("the fleet's broker connection", lambda: fleet.call("GET", "/v1/stats", token=admin)[1]["mqtt_connected"])

    wrong = Device(broker.host, broker.port, a_id, "not-the-password")
    assert wrong.connect().is_failure

    topic_a, topic_b = f"tierkit/v1/{a_id}/telemetry", f"tierkit/v1/{b_id}/telemetry"
    for seq in (1, 2, 3):
        assert not a.publish(topic_a, _window(a_id, seq)).is_failure
    a.publish(topic_a, _window(a_id, 2))                       # a redelivered window
    a.publish(topic_a, b"\x00garbage")                         # malformed
    a.publish(topic_a, _window(b_id, 7))                       # a names b in its own topic
    denied = a.publish(topic_b, _window(b_id, 9))              # a on b's topic: the broker's ACL refuses
    assert denied is not None
    assert denied.is_failure
    assert a.publish(f"tierkit/v1/{a_id}/desired", {"threshold": 0.0}).is_failure  # desired is read-only

    def windows(dev: str) -> list[dict[str, Any]]:
        return fleet.call("GET", f"/v1/telemetry?device={dev}", token=admin)[1]["windows"]

    got = wait_for("a's three windows", lambda: len(windows(a_id)) == 3 and windows(a_id))
    assert [w["seq"] for w in got] == [1, 2, 3]
    stats = wait_for("drop counters", lambda: (s := fleet.call("GET", "/v1/stats", token=admin)[1])
                     ["dropped"]["impersonating"] and s)
    assert stats["dropped"]["replayed"] == 1
    assert stats["dropped"]["malformed"] == 1
    assert windows(b_id) == []
    by_label = fleet.call("GET", "/v1/telemetry?label=site=berlin", token=admin)[1]["windows"]
    assert {w["device_id"] for w in by_label} == {a_id}

    # desired: a label-scoped layer reaches berlin (retained), not paris
    a.subscribe(f"tierkit/v1/{a_id}/desired")
    b.subscribe(f"tierkit/v1/{b_id}/desired")
    status, body = fleet.call("PUT", "/v1/desired", {"selector": "site=berlin", "document": {"threshold": 0.7}},
                              token=admin)
    assert status == 200
    topic, payload, _retained = a.messages.get(timeout=10)
    assert topic == f"tierkit/v1/{a_id}/desired"
    assert json.loads(payload) == {"version": body["version"], "threshold": 0.7}
    late = _device(broker, idents["a"])  # a reconnecting device gets it retained
    late.close()
    a.close()
    a = _device(broker, idents["a"])
    a.subscribe(f"tierkit/v1/{a_id}/desired")
    topic, payload, retained = a.messages.get(timeout=10)
    assert retained
    assert json.loads(payload)["version"] == body["version"]
    assert b.messages.empty()

    # reported: a says it applied the version; drift lists only... nobody for a
    a.publish(f"tierkit/v1/{a_id}/reported", {"device": a_id, "desired_version": body["version"],
                                               "model_digest": "sha256:feed", "variant": "int8", "threshold": 0.7},
              retain=True)
    shown = wait_for("a's reported state", lambda: (s := fleet.call("GET", f"/v1/devices/{a_id}", token=admin)[1])
                     ["reported"] and s)
    assert shown["reported"]["version"] == body["version"]
    assert shown["device"]["model_digest"] == "sha256:feed"
    fleet.call("PUT", "/v1/desired", {"selector": "*", "document": {"telemetry_interval_s": 30}}, token=admin)
    # the new fleet default is applied by neither: both drift once --drift-after (2 s) has passed
    wait_for("a and b listed as drifting", lambda: {d["device_id"] for d in fleet.call("GET", "/v1/drift",
                                                                                      token=admin)[1]} == {a_id, b_id},
             timeout=20, interval=0.2)

    # revocation: the fleet rewrites the broker's password file and reloads it
    assert fleet.call("POST", f"/v1/devices/{a_id}/revoke", token=admin)[0] == 200
    assert a_id not in (tmp_path / "passwd").read_text()
    # the broker re-checks every connection as it reloads (Mosquitto cuts a client whose account is gone): a
    # window sent before that is dropped by the fleet as revoked; one sent after never reaches it
    if a.publish(topic_a, _window(a_id, 4)) is not None:
        wait_for("the revoked drop", lambda: fleet.call("GET", "/v1/stats", token=admin)[1]["dropped"]["revoked"])
    else:
        assert a.cut, "no PUBACK, yet the broker did not cut the revoked device's connection"
    a.close()
    again = Device(broker.host, broker.port, idents["a"].mqtt_username, idents["a"].mqtt_password)
    assert again.connect().is_failure
    assert [w["seq"] for w in windows(a_id)] == [1, 2, 3]
    b.close()
    assert os.path.exists(tmp_path / "passwd")
