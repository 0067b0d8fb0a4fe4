"""The rollout engine in-process on SQLite and PostgreSQL: row lease (one of two engines acts), rollout layers
in the effective desired document."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from cloud_service.fleet.ca import FleetCA
from cloud_service.fleet.desired import DesiredState
from cloud_service.fleet.errors import InvalidDocument
from cloud_service.fleet.leases import Lease, LeaseLost
from cloud_service.fleet.registry import Registry
from cloud_service.fleet.releases import ReleaseRegistry
from cloud_service.fleet.rollout_engine import RolloutEngine
from cloud_service.fleet.rollouts import Rollouts, make_options
from cloud_service.fleet.store import FleetStore
from compilers.signing import generate_keypair, load_private_key, load_public_key
from edge_agent.fleet_sync import generate_key_and_csr
from testkit.rollout_harness import tiny_variant_set


def _devices(registry: Registry, n: int) -> list[str]:
    return [registry.enroll(registry.create_token({"kind": "cam"}), generate_key_and_csr()[1]).device_id
            for _ in range(n)]


def _signed_releases(store: FleetStore, tmp_path: Path, *versions: str) -> tuple[ReleaseRegistry, list[str]]:
    """A release registry trusting a key made under `tmp_path`, and a release of the tiny model per version."""
    key, pub = generate_keypair(tmp_path / "ops")
    releases = ReleaseRegistry(store, tmp_path / "data", [load_public_key(pub)])
    variants = tiny_variant_set(tmp_path / "model")
    policy = tmp_path / "p.yaml"
    digests = []
    for v in versions:
        policy.write_text(f"version: '{v}'\n")
        digests.append(releases.create(variants, policy, sign_key=load_private_key(key))["digest"])
    return releases, digests


def test_rollout_layer_sits_between_labels_and_device_overrides(store: FleetStore, tmp_path: Path) -> None:
    reg = Registry(store, FleetCA.load_or_create(tmp_path))
    dev = _devices(reg, 1)[0]
    desired = DesiredState(store)
    v1 = desired.set_layer("kind=cam", {"threshold": 0.7, "release": "sha256:" + "1" * 64})
    v2 = desired.assign({dev: {"release": "sha256:" + "2" * 64, "soak": {"requests": 50}}})
    assert v2 > v1
    eff = desired.effective(reg.device(dev))
    assert eff is not None
    assert eff["document"] == {"threshold": 0.7, "release": "sha256:" + "2" * 64, "soak": {"requests": 50}}
    assert eff["version"] == v2
    v3 = desired.set_layer(f"device={dev}", {"release": "sha256:" + "3" * 64})  # the operator's override wins
    eff = desired.effective(reg.device(dev))
    assert eff is not None
    assert eff["document"]["release"] == "sha256:" + "3" * 64
    assert eff["version"] == v3 > v2
    assert desired.assign({dev: {"release": "sha256:" + "4" * 64, "rollback": True}}) > v3
    with pytest.raises(InvalidDocument, match="rollout's layer"):
        desired.set_layer(f"rollout/device={dev}", {"threshold": 0.1})
    other = DesiredState(store).effective({"device_id": "dev-other", "labels": {"kind": "cam"}})
    assert other is not None
    assert other["document"]["release"] == "sha256:" + "1" * 64  # one device's rollout layer is its own


def test_two_engines_on_one_database_only_one_acts(store: FleetStore, tmp_path: Path) -> None:
    reg = Registry(store, FleetCA.load_or_create(tmp_path))
    devices = _devices(reg, 4)
    desired = DesiredState(store)
    releases, (first, second) = _signed_releases(store, tmp_path, "1", "2")
    for d in devices:
        desired.record_reported(d, {"release": first})
    rid = Rollouts(store, releases).deploy(second, {"kind": "cam"}, make_options(waves="1,100%"))

    now = time.time()
    a = RolloutEngine(store, desired, releases, holder="engine-a", lease_ttl_s=5)
    b = RolloutEngine(store, desired, releases, holder="engine-b", lease_ttl_s=5)
    assert a.step(now=now)
    assert not b.step(now=now + 1)
    shown = Rollouts(store, releases).show(rid)
    assert shown["states"] == {"assigned": 1, "pending": 3}
    assert shown["waves"][0]["state"] == "soaking"
    layers = [la for la in desired.layers() if la["selector"].startswith("rollout/")]
    assert len(layers) == 1
    # the canary audits at the rollout's raised share while it soaks (its confident errors, within the canary)
    assert layers[0]["document"] == {"release": second, "soak": {"requests": 50}, "audit_rate": 0.5}
    assert a.step(now=now + 2)  # renewing its own lease
    assert len([la for la in desired.layers() if la["selector"].startswith("rollout/")]) == 1

    assert b.step(now=now + 2 + 5 + 1)  # a's lease ran out: b takes over
    assert a.lease.holder_now()[0] == "engine-b"
    with pytest.raises(LeaseLost), store.begin() as conn:  # a, back from a long pause, cannot write
        a.lease.fence(conn, now=now + 9)
    assert not a.step(now=now + 9)


def test_racing_acquires_have_one_winner(store: FleetStore) -> None:
    for round_ in range(5):
        leases = [Lease(store, f"race-{round_}", holder=f"p{i}", ttl_s=30) for i in range(4)]
        barrier, won = threading.Barrier(4), []

        def take(lease: Lease, barrier: threading.Barrier, won: list[str]) -> None:
            barrier.wait()
            if lease.acquire():
                won.append(lease.holder)

        threads = [threading.Thread(target=take, args=(la, barrier, won)) for la in leases]
        for th in threads:
            th.start()
        for th in threads:
            th.join(30)
        assert len(won) == 1, won


def test_offline_devices_do_not_pass_a_wave_and_rejoin_when_heard_from(store: FleetStore, tmp_path: Path) -> None:
    reg = Registry(store, FleetCA.load_or_create(tmp_path))
    devices = _devices(reg, 3)
    desired = DesiredState(store)
    key, pub = generate_keypair(tmp_path / "ops")
    releases = ReleaseRegistry(store, tmp_path / "data", [load_public_key(pub)])
    policy = tmp_path / "p.yaml"
    policy.write_text("version: '1'\n")
    digest = releases.create(tiny_variant_set(tmp_path / "model"), policy, sign_key=load_private_key(key))["digest"]
    t0 = time.time()
    for d in devices:
        desired.record_reported(d, {"release": None}, now=t0 - 1000)  # last heard from long ago
    rollouts = Rollouts(store, releases)
    rid = rollouts.deploy(digest, {}, make_options(waves="1,100%"))
    engine = RolloutEngine(store, desired, releases, holder="e", online_after_s=120)
    for k in range(3):
        assert engine.step(now=t0 + k)
    shown = rollouts.show(rid)
    assert shown["state"] == "running"  # nobody to judge: the canary wave waits, it does not pass
    assert shown["states"] == {"catch_up": 3}
    assert [d["kind"] for d in shown["decisions"]] == ["start"]
    desired.record_reported(devices[1], {"release": None}, now=t0 + 5)  # one comes back
    engine.step(now=t0 + 6)
    shown = rollouts.show(rid)
    assert shown["states"] == {"catch_up": 2, "assigned": 1}
    assert next(d for d in shown["device_list"] if d["state"] == "assigned")["device_id"] == devices[1]
    eff = desired.effective(reg.device(devices[1]))
    assert eff is not None
    assert eff["document"]["release"] == digest


def test_a_new_releases_default_rollback_target_was_never_rolled_back(store: FleetStore, tmp_path: Path) -> None:
    reg = Registry(store, FleetCA.load_or_create(tmp_path))
    devices = _devices(reg, 2)
    desired = DesiredState(store)
    key, pub = generate_keypair(tmp_path / "ops")
    releases = ReleaseRegistry(store, tmp_path / "data", [load_public_key(pub)])
    variants = tiny_variant_set(tmp_path / "model")
    policy = tmp_path / "p.yaml"
    policy.write_text("version: '1'\n")
    first = releases.create(variants, policy, sign_key=load_private_key(key))["digest"]
    policy.write_text("version: '2'\n")
    bad = releases.create(variants, policy, sign_key=load_private_key(key))["digest"]
    assert releases.get(bad)["rollback_to"] == [first]
    for d in devices:
        desired.record_reported(d, {"release": first})
    rollouts = Rollouts(store, releases)
    rid = rollouts.deploy(bad, {}, make_options(waves="1,100%"))
    rollouts.request_rollback(rid)
    RolloutEngine(store, desired, releases, holder="e").step()
    assert rollouts.get(rid)["state"] == "rolled_back"
    policy.write_text("version: '3'\n")
    third = releases.create(variants, policy, sign_key=load_private_key(key))
    assert third["rollback_to"] == [first]  # not the release that was just rolled back


def test_a_device_still_going_back_is_taken_as_running_what_it_goes_back_to(store: FleetStore,
                                                                              tmp_path: Path) -> None:
    """A rollout deployed right after a rollback, before its device reports the restore, must not take the
    release it leaves for its previous: that would be its baseline and where a failure sends it back."""
    reg = Registry(store, FleetCA.load_or_create(tmp_path))
    devices = _devices(reg, 3)
    desired = DesiredState(store)
    releases, (first, second, third) = _signed_releases(store, tmp_path, "1", "2", "3")
    t0 = time.time()
    for d in devices:
        desired.record_reported(d, {"release": first}, now=t0)
    rollouts = Rollouts(store, releases)
    engine = RolloutEngine(store, desired, releases, holder="e")
    rid = rollouts.deploy(second, {}, make_options(waves="100%"))
    engine.step(now=t0 + 1)
    for d in devices:
        desired.record_reported(d, {"release": second}, now=t0 + 2)
    engine.step(now=t0 + 3)
    assert rollouts.show(rid)["states"] == {"committed": 3}
    rollouts.request_rollback(rid)
    engine.step(now=t0 + 4)
    assert rollouts.show(rid)["states"] == {"rollback": 3}
    desired.record_reported(devices[0], {"release": first}, now=t0 + 5)  # one reports the restore; two do not yet

    rid2 = rollouts.deploy(third, {}, make_options(waves="100%"))
    shown = rollouts.show(rid2)
    assert {d["device_id"]: d["previous"] for d in shown["device_list"]} == dict.fromkeys(devices, first)
    assert shown["previous"] == first
    engine.step(now=t0 + 6)
    rollouts.request_rollback(rid2)
    engine.step(now=t0 + 7)
    for d in devices:
        eff = desired.effective(reg.device(d))
        assert eff is not None
        assert eff["document"]["release"] == first  # not the release rolled back by hand a moment before
