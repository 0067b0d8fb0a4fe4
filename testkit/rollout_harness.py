"""A real fleet for rollout tests and bench/bench_rollout.py: Mosquitto with the fleet's ACL and password
file, a `tierkit fleet serve` process with a release key, N enrolled simulated devices on a first release."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import sqlalchemy as sa

from cloud_service.fleet import schema as t
from cloud_service.fleet.ca import FleetCA
from cloud_service.fleet.desired import DesiredState
from cloud_service.fleet.fleet import Fleet, FleetConfig
from cloud_service.fleet.registry import Registry
from cloud_service.fleet.releases import ReleaseRegistry
from cloud_service.fleet.rollouts import Rollouts
from cloud_service.fleet.store import FleetStore
from cloud_service.fleet.telemetry import TelemetryStore
from compilers.signing import generate_keypair, load_private_key, load_public_key
from edge_agent.fleet_sync import enroll, generate_key_and_csr
from testkit.broker import Broker, _free_port
from testkit.fleet_process import ROOT, FleetProcess
from testkit.rollout_device import Behaviour, SimDevice
from testkit.waiting import wait_for

FLEET_PASSWORD = "fleet-secret-for-tests"


@dataclass(frozen=True)
class TwoReleases:
    """An in-process fleet (no broker, no server) for rollout-engine tests: enrolled devices and two signed
    releases of the same tiny model (`first`, `second`), with the stores the engine reads."""

    reg: Registry
    devices: list[str]
    desired: DesiredState
    releases: ReleaseRegistry
    first: str
    second: str
    tel: TelemetryStore
    rollouts: Rollouts


def rollout_states(store: FleetStore, rid: int) -> dict[str, str]:
    """Each device's state in rollout `rid` (pending, control, soaking, ..., as the engine keeps them)."""
    rd = t.rollout_devices.c
    with store.begin() as conn:
        return {r.device_id: r.state for r in conn.execute(
            sa.select(rd.device_id, rd.state).where(rd.rollout_id == rid))}


def two_releases(store: FleetStore, tmp: Path, n: int) -> TwoReleases:
    """`n` devices enrolled with fresh tokens and keys, and releases "1" and "2" signed by a key made under `tmp`."""
    reg = Registry(store, FleetCA.load_or_create(tmp))
    devices = [reg.enroll(reg.create_token({"kind": "cam"}), generate_key_and_csr()[1]).device_id for _ in range(n)]
    key, pub = generate_keypair(tmp / "ops")
    releases = ReleaseRegistry(store, tmp / "data", [load_public_key(pub)])
    variants, policy = tiny_variant_set(tmp / "model"), tmp / "p.yaml"
    digests = []
    for v in ("1", "2"):
        policy.write_text(f"version: '{v}'\n")
        digests.append(releases.create(variants, policy, sign_key=load_private_key(key))["digest"])
    return TwoReleases(reg, devices, DesiredState(store), releases, digests[0], digests[1], TelemetryStore(store),
                       Rollouts(store, releases))


def tiny_variant_set(directory: Path) -> Path:
    """A one-rung variant set of a 64 -> 10 linear ONNX model (no torch needed)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from testkit.packages import make_variant_set

    rng = np.random.default_rng(0)
    w, b = rng.normal(size=(64, 10)).astype(np.float32), np.zeros(10, np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Add", ["h", "b"], ["logits"])], "lin",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 64])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 10])],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    directory.mkdir(parents=True, exist_ok=True)
    onnx.save(model, directory / "lin.onnx")
    x = rng.normal(size=(32, 64)).astype(np.float32)
    make_variant_set(directory / "vs", {"fp32": directory / "lin.onnx"}, name="digits", x_val=x,
                     y_val=(x @ w).argmax(axis=1))
    return directory / "vs"


class RolloutFleet:
    """Context manager: broker + fleet process + `n` devices running release 1 of "digits"."""

    def __init__(self, tmp: Path, n: int, *, db_url: str | None = None, online_after: str = "3s",
                 window_s: float = 0.3, rate_rps: float = 200.0, labels: str = "kind=cam",
                 make_device: Callable[..., SimDevice] = SimDevice) -> None:
        self.tmp, self.n, self.db_url, self.online_after = tmp, n, db_url, online_after
        self.window_s, self.rate_rps, self.labels = window_s, rate_rps, labels
        self.make_device = make_device  # (ident, host, port, first release, behaviours, rate_rps=, window_s=)
        self.data = tmp / "fleet-data"
        self.behaviours: dict[str, Behaviour] = {}
        self.devices: list[SimDevice] = []
        self._versions = iter(range(2, 1000))

    def __enter__(self) -> RolloutFleet:
        tmp = self.tmp
        self.key, pub = generate_keypair(tmp / "ops")
        passwd, pid, port = tmp / "passwd", tmp / "mosquitto.pid", _free_port()
        self.fleet = FleetProcess(
            self.data, self.db_url, "--mqtt", f"mqtt://127.0.0.1:{port}", "--mqtt-username", "tierkit-fleet",
            "--broker-passwd", str(passwd), "--broker-reload", f"kill -HUP $(cat {pid})", "--release-key", str(pub),
            "--online-after", self.online_after, env={"TIERKIT_FLEET_MQTT_PASSWORD": FLEET_PASSWORD})
        self.broker = Broker(tmp / "broker", port=port, extra_conf=(
            f"allow_anonymous false\npassword_file {passwd}\nacl_file {ROOT / 'deploy/fleet/acl'}\n"
            f"pid_file {pid}\nuse_username_as_clientid true\nmax_queued_messages 100000\n"))
        try:
            self.fleet.start()
            self.broker.start()
            self.facade = Fleet.open(FleetConfig(data_dir=self.data, db_url=self.db_url, release_keys=(pub,)))
            self.admin = self.facade.registry.create_operator_token("ops", "admin")
            self.variants = tiny_variant_set(tmp / "model")
            self.first = self.release(version="1")
            self._enroll()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _enroll(self) -> None:
        labels = dict(p.split("=") for p in self.labels.split(",") if p)
        idents = [enroll(self.fleet.url, self.facade.registry.create_token(labels), self.tmp / "devices" / f"d{i}")
                  for i in range(self.n)]
        time.sleep(0.5)  # the broker rereads its password file on SIGHUP
        for ident in idents:
            dev = self.make_device(ident, self.broker.host, self.broker.port, self.first, self.behaviours,
                                   rate_rps=self.rate_rps, window_s=self.window_s)
            dev.ran.add(self.first)
            self.devices.append(dev)
            for attempt in range(20):
                try:
                    dev.start()
                    break
                except RuntimeError:
                    if attempt == 19:
                        raise
                    time.sleep(0.25)
        # the fleet's MQTT session may come up after the devices': deploy only once it hears every one
        self.wait("the fleet to hear every device", lambda: sum(
            d["online"] for d in self.api("GET", "/v1/devices")) == self.n, timeout=60)
        # the gates measure each device against its own baseline: some windows on the first release first
        self.wait("a baseline of 20 windows a device", lambda: len(self.facade.telemetry.windows(
            limit=20 * self.n)) >= 20 * self.n, timeout=60)

    def __exit__(self, *exc: object) -> None:
        for d in self.devices:
            d.stop()
        if getattr(self, "facade", None) is not None:
            self.facade.close()
        self.broker.stop()
        self.fleet.stop()

    def release(self, behaviour: Behaviour | None = None, *, version: str | None = None,
                latency_ms: float = 25.0) -> str:
        """Create and register the next release of "digits"; devices behave on it as `behaviour` says."""
        policy = self.tmp / f"policy-{version or 'next'}-{time.monotonic_ns()}.json"
        policy.write_text(json.dumps({"name": "digits", "version": version or str(next(self._versions)),
                                      "threshold": 0.8, "budget": {"latency_ms": latency_ms}}))
        rel = self.facade.releases.create(self.variants, policy, sign_key=load_private_key(self.key))
        if behaviour is not None:
            self.behaviours[rel["digest"]] = behaviour
        return str(rel["digest"])

    def api(self, method: str, path: str, body: Any = None) -> Any:
        status, got = self.fleet.call(method, path, body, token=self.admin)
        if status != 200:
            msg = f"{method} {path} -> {status}: {got}"
            raise AssertionError(msg)
        return got

    def deploy(self, release: str, **options: Any) -> int:
        body = {"release": release, "label": self.labels, "waves": "1,25%,100%", "soak": "30",
                "margins": {"min_requests": 20},
                # the devices are doubles: a swap has no transient to wait out (real agents: tests/e2e); their windows
                # come every `window_s`, not every 10 s, and the variance's block (120 s: 12 agent windows) with them
                "evidence": {"bucket_s": max(1.0, 3 * self.window_s), "warmup_s": 10 * self.window_s,
                             "block_s": max(1.0, 12 * self.window_s)}, **options}
        return int(self.api("POST", "/v1/rollouts", body)["id"])

    def show(self, rollout_id: int) -> dict[str, Any]:
        return dict(self.api("GET", f"/v1/rollouts/{rollout_id}?decisions=50"))

    def wait(self, what: str, check: Callable[[], Any], timeout: float = 60.0, *, rollout: int | None = None) -> Any:
        """`wait_for`; with `rollout`, a timeout says where that rollout stood (state, wave, its last decisions)."""
        try:
            return wait_for(what, check, timeout, interval=0.2)
        except AssertionError as exc:
            if rollout is None:
                raise
            shown = self.show(rollout)
            brief = {k: shown.get(k) for k in ("state", "wave", "states", "reason")}
            msg = f"{exc}; rollout {rollout}: {brief}; last decisions: {shown.get('decisions', [])[-3:]}"
            raise AssertionError(msg) from exc
