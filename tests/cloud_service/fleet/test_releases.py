"""Releases in the fleet: created and registered only when signed by a trusted key; devices download them
with their MQTT credentials (401 bad credentials, 403 revoked, 404 unknown digest)."""

from __future__ import annotations

import base64
import json
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from cloud_service.fleet.fleet import Fleet, FleetConfig
from compilers.release import create_release, open_release, pack_release, unpack_release
from compilers.signing import generate_keypair, load_private_key
from edge_agent.fleet_sync import enroll
from testkit.fleet_process import FleetProcess, cli
from testkit.rollout_harness import tiny_variant_set


def _policy(tmp: Path, version: str) -> Path:
    path = tmp / f"policy-{version}.yaml"
    path.write_text(f"name: digits\nversion: '{version}'\nthreshold: 0.8\nbudget: {{latency_ms: 25}}\n")
    return path


def _get(url: str, user: str | None, password: str | None) -> tuple[int, bytes]:
    headers = {}
    if user is not None:
        headers["Authorization"] = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=30) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        body = exc.read()
        exc.close()
        return exc.code, body


def _post(url: str, data: bytes, token: str) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=data, method="POST", headers={
        "Authorization": f"Bearer {token}", "Content-Type": "application/x-tar"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        body = exc.read()
        exc.close()
        return exc.code, body


def test_release_create_verifies_the_signature_and_devices_download_with_their_credentials(tmp_path: Path) -> None:
    data = tmp_path / "fleet-data"
    variants = tiny_variant_set(tmp_path / "model")
    key, pub = generate_keypair(tmp_path / "ops")
    other_key, _other_pub = generate_keypair(tmp_path / "other")

    got = cli("release", "create", str(variants), "--policy", str(_policy(tmp_path, "1")), "--sign-key", str(key),
              data_dir=data, check=False)
    assert got.returncode == 1
    assert "no release key" in got.stderr
    got = cli("release", "create", str(variants), "--policy", str(_policy(tmp_path, "1")), "--sign-key",
              str(other_key), "--release-key", str(pub), data_dir=data, check=False)
    assert got.returncode == 1
    assert "release refused" in got.stderr
    assert "does not verify" in got.stderr

    first = cli("release", "create", str(variants), "--policy", str(_policy(tmp_path, "1")), "--sign-key", str(key),
                "--release-key", str(pub), data_dir=data).stdout
    d1 = first.split()[2]
    assert "rollback_to: none" in first
    (data / "release-keys").mkdir()
    (data / "release-keys" / "ops.pub").write_bytes(pub.read_bytes())  # the data dir's keys need no flag
    second = cli("release", "create", str(variants), "--policy", str(_policy(tmp_path, "2")), "--sign-key", str(key),
                 data_dir=data).stdout
    d2 = second.split()[2]
    assert d1[:19] in second  # rollback_to defaults to the newest release of the same name
    unsigned = create_release(variants, {"version": "3"}, tmp_path / "unsigned", sign_key=None)
    got = cli("release", "add", str(unsigned.directory), data_dir=data, check=False)
    assert "not signed" in got.stderr
    tampered = create_release(variants, {"version": "4"}, tmp_path / "tampered", sign_key=Ed25519PrivateKey.generate())
    assert "does not verify" in cli("release", "add", str(tampered.directory), data_dir=data, check=False).stderr
    listed = json.loads(cli("releases", "--json", data_dir=data).stdout)
    assert [r["digest"] for r in listed] == [d1, d2]
    assert listed[1]["rollback_to"] == [d1]

    with Fleet.open(FleetConfig(data_dir=data)) as facade:
        idents = []
        proc = FleetProcess(data, None).start()
        try:
            for _ in range(2):
                idents.append(enroll(proc.url, facade.registry.create_token({"kind": "cam"}), tmp_path / f"d{_}"))
            dev, other = idents
            url = f"{proc.url}/v1/releases/{d2}/archive"
            status, body = _get(url, dev.mqtt_username, dev.mqtt_password)
            assert status == 200
            (tmp_path / "dl.tar").write_bytes(body)
            rel = open_release(unpack_release(tmp_path / "dl.tar", tmp_path / "dl"),
                               trusted_keys=[facade.releases.keys[0]], expect_digest=d2)
            assert rel.version == "2"
            assert _get(url, dev.mqtt_username, "wrong")[0] == 401
            assert _get(url, other.mqtt_username, dev.mqtt_password)[0] == 401  # another device's password
            assert _get(url, None, None)[0] == 401
            assert _get(f"{proc.url}/v1/releases/sha256:{'0' * 64}/archive", dev.mqtt_username,
                        dev.mqtt_password)[0] == 404
            facade.revoke(dev.device_id)
            assert _get(url, dev.mqtt_username, dev.mqtt_password)[0] == 403
            admin = facade.registry.create_operator_token("ops", "admin")
            status, rels = proc.call("GET", "/v1/releases", token=admin)
            assert status == 200
            assert [r["version"] for r in rels] == ["1", "2"]
            assert proc.call("GET", "/v1/releases")[0] == 401
            # an archive uploaded by an admin is verified like any other
            third = create_release(variants, {"version": "5"}, tmp_path / "r5",
                                   sign_key=load_private_key(key)).directory
            tar = pack_release(third, tmp_path / "r5.tar").read_bytes()
            reader = facade.registry.create_operator_token("viewer", "read")
            assert _post(f"{proc.url}/v1/releases", tar, reader)[0] == 403
            status, body = _post(f"{proc.url}/v1/releases", tar, admin)
            assert status == 200, body
            assert json.loads(body)["version"] == "5"
            bad = create_release(variants, {"version": "6"}, tmp_path / "r6", sign_key=Ed25519PrivateKey.generate())
            status, body = _post(f"{proc.url}/v1/releases", pack_release(bad.directory, tmp_path / "r6.tar")
                                 .read_bytes(), admin)
            assert status == 422
            assert b"does not verify" in body
        finally:
            proc.stop()


@pytest.mark.parametrize("waves", ["1,5%", "0,100%", "1,150%,100%", "a,100%", ""])
def test_bad_waves_are_refused_with_the_reason(waves: str, tmp_path: Path) -> None:
    from cloud_service.fleet.errors import InvalidDocument
    from cloud_service.fleet.rollouts import make_options

    with pytest.raises(InvalidDocument, match="wave"):
        make_options(waves=waves)


def test_deploy_refuses_unknown_releases_and_empty_selectors(tmp_path: Path) -> None:
    data = tmp_path / "fleet-data"
    got = cli("deploy", "digits@9", "--label", "kind=cam", data_dir=data, check=False)
    assert got.returncode == 1
    assert "not registered" in got.stderr
    assert "--soak" in cli("deploy", "x", "--soak", "ten", data_dir=data, check=False).stderr


def test_wave_sizes_grow_by_one_device_at_least() -> None:
    from cloud_service.fleet.rollouts import parse_waves, wave_sizes

    assert wave_sizes(parse_waves("1,5%,25%,100%"), 20) == [1, 2, 5, 20]
    assert wave_sizes(parse_waves("1,5%,25%,100%"), 200) == [1, 10, 50, 200]
    assert wave_sizes(parse_waves("1,5%,25%,100%"), 2) == [1, 2, 2, 2]
    assert wave_sizes(parse_waves("10,100%"), 4) == [4, 4]
