"""`tierkit demo --fleet`: a fleet on loopback, a good release rolled out and a bad one rolled back.

1. Mosquitto with its dynamic-security plugin on a TLS listener, its service accounts from `tierkit broker init`.
2. `tierkit fleet serve` with `--broker-dynsec` (device accounts kept by the fleet) and a release key.
3. `tierkit serve` with the digits cloud model, answering escalations over MQTT (TLS).
4. `--agents N` `tierkit agent` processes, each enrolled with a one-time token, under a steady load of real digits
   images; they escalate what they are unsure of and send telemetry windows.
5. A good release (the same model, signed) rolled out in two waves; then a bad one, whose golden inputs do not
   reproduce on any device, stopped at its canary and rolled back.

It prints the dashboard's address with an operator token, and keeps everything up until Ctrl-C (or for
`--duration` seconds), then stops every process it started.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import multiprocessing
import shutil
import signal
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from runtimes.errors import TierkitError
from sdk._demo_stack import Broker, Stack, free_port

logger = logging.getLogger(__name__)
THRESHOLD = 0.8
LABEL = "kind=demo"
BASELINE_WINDOWS = 20  # windows with traffic a device sends before the first rollout (a window a second)


class _Api:
    """The fleet's HTTP API with an operator token."""

    def __init__(self, url: str, token: str) -> None:
        self.url, self.token = url, token

    def call(self, method: str, path: str, body: Any = None) -> Any:
        req = urllib.request.Request(self.url + path, method=method, data=None if body is None else json.dumps(
            body).encode(), headers={"Authorization": f"Bearer {self.token}", "Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as resp:
            return json.loads(resp.read())

    def wait(self, what: str, check: Callable[[], Any], timeout_s: float) -> Any:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            got = check()
            if got:
                return got
            time.sleep(0.5)
        msg = f"the fleet demo gave up waiting for {what} after {timeout_s:.0f}s"
        raise TierkitError(msg)

    def rollout(self, release: str, want: str, timeout_s: float) -> dict[str, Any]:
        # every device of the demo shares this machine's cores with the fleet, the cloud and the broker: its latency
        # (and the energy modelled from it) says more of them than of a release, so those gates get 5x control
        # here (a real fleet keeps the defaults); the accuracy and verification gates are the defaults.
        # A difference in differences is no surer than each device's baseline: 20 s of a device's windows (400
        # requests) tell its escalation rate to about 2 points (binomial), two devices' difference to about 3, so
        # a 5-point margin could not be passed in a demo's minutes (the canary would soak to its maximum); the
        # demo's escalation margin is 15 points. The agents send a window a second, not every 10 s: the evidence's
        # time buckets, warm-up and variance blocks are scaled to it, and the canary's audit phase before its swap
        # is held to 10 s
        body = {"release": release, "label": LABEL, "waves": "1,100%", "soak": "20",
                "margins": {"min_requests": 20, "p95_ratio": 4.0, "energy_ratio": 4.0, "escalation_points": 0.15},
                "evidence": {"bucket_s": 3.0, "warmup_s": 10.0, "block_s": 12.0}, "pre_swap_s": 10}
        rid = self.call("POST", "/v1/rollouts", body)["id"]

        def done() -> dict[str, Any] | None:
            shown = dict(self.call("GET", f"/v1/rollouts/{rid}"))
            if shown["state"] not in ("running", want):
                msg = f"rollout {rid} ended {shown['state']}, not {want}: {shown.get('reason')}"
                raise TierkitError(msg)
            return shown if shown["state"] == want and (want != "rolled_back" or "rollback" not in shown["states"]) \
                else None

        return dict(self.wait(f"rollout {rid} to be {want}", done, timeout_s))


class _Load:
    """Requests of real images to every agent's local endpoint, `rate_rps` each, in a thread."""

    def __init__(self, ports: list[int], model: str, images: np.ndarray, rate_rps: float = 20.0) -> None:
        self.ports, self.model, self.images, self.rate = ports, model, images, rate_rps
        self.answered = self.failed = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fleet-demo-load", daemon=True)

    def __enter__(self) -> _Load:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        import grpc

        from cloud_service.protocol import encode_request, inference_pb2_grpc

        channels = [grpc.insecure_channel(f"127.0.0.1:{p}") for p in self.ports]
        stubs = [inference_pb2_grpc.GRPCInferenceServiceStub(c) for c in channels]  # type: ignore[no-untyped-call]
        k = 0
        try:
            while not self._stop.wait(1 / self.rate):
                x = self.images[k % len(self.images)][None]
                k += 1
                for stub in stubs:
                    try:
                        stub.ModelInfer(encode_request(self.model, {"x": x}), timeout=5)
                        self.answered += 1
                    except grpc.RpcError:
                        self.failed += 1
        finally:
            for c in channels:
                c.close()


def _models(work: Path, out: Callable[[str], None]) -> tuple[Path, Path, str, np.ndarray]:
    """(edge variant set, cloud models directory, cloud model name, the request cycle) on scikit-learn's digits:
    two logistic regressions, a strongly regularised one at the edge (less accurate, often unsure) and a sharper
    one in the cloud, exported to ONNX and compiled (seconds, where training CNNs takes minutes)."""
    from sklearn.linear_model import LogisticRegression

    from compilers import compile_model
    from sdk import _demo_models as zoo

    split = zoo.digits(seed=0)
    x, calib = split.x_train.reshape(len(split.x_train), -1), {"x": split.x_train[:512], "labels": split.y_train[:512]}
    val = {"x": split.x_val, "labels": split.y_val}
    x_test = split.x_test.reshape(len(split.x_test), -1)
    fitted = []
    for role, c in (("edge", 0.05), ("cloud", 1.0)):
        clf = LogisticRegression(C=c, max_iter=2000).fit(x, split.y_train)
        fitted.append(clf)
        onnx_path = _linear_onnx(work / f"{role}.onnx", clf.coef_.T, clf.intercept_)
        out(f"  {role}: logistic regression (C={c}), {clf.score(x_test, split.y_test):.1%} on the held-out digits")
        output = work / "edge" if role == "edge" else work / "models" / "cloud"
        compile_model(str(onnx_path), output=output, precisions=("fp32",), calibration=calib, validation=val,
                      name=f"digits-{role}", progress=False)
    return work / "edge", work / "models", "digits-cloud", _cycle(work / "edge", fitted[0], fitted[1], split.x_test)


def _cycle(edge: Path, edge_clf: Any, cloud_clf: Any, images: np.ndarray) -> np.ndarray:
    """20 test images in blocks of five (four the edge is sure of, one it escalates and the cloud answers as the
    edge would), so that any run of requests escalates a fifth of them and agrees on all: the rollout's gates
    then compare releases, not which images a window happened to hold."""
    from compilers.variants import VariantSet

    temperature = float(VariantSet.load(edge).open().manifest.calibration.get("temperature", 1.0))
    flat = images.reshape(len(images), -1)
    z = edge_clf.decision_function(flat) / temperature
    p = np.exp(z - z.max(axis=1, keepdims=True))
    score = (p / p.sum(axis=1, keepdims=True)).max(axis=1)
    agree = edge_clf.predict(flat) == cloud_clf.predict(flat)
    sure = np.flatnonzero(score > THRESHOLD + 0.1)[:16]
    unsure = np.flatnonzero((score < THRESHOLD - 0.1) & agree)[:4]
    if len(sure) < 16 or len(unsure) < 4:
        msg = f"the digits split gave {len(sure)} sure and {len(unsure)} unsure images (need 16 and 4)"
        raise TierkitError(msg)
    order = [i for k in range(4) for i in (sure[4 * k], unsure[k], *sure[4 * k + 1:4 * k + 4])]
    return np.asarray(images[np.array(order)], np.float32)


def _linear_onnx(path: Path, weight: np.ndarray, bias: np.ndarray) -> Path:
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    graph = helper.make_graph(
        [helper.make_node("Flatten", ["x"], ["xf"]), helper.make_node("MatMul", ["xf", "W"], ["z"]),
         helper.make_node("Add", ["z", "b"], ["logits"])], "digits",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 1, 8, 8])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 10])],
        [numpy_helper.from_array(weight.astype(np.float32), "W"),
         numpy_helper.from_array(bias.astype(np.float32), "b")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9), path)
    return path


def _bad_variants(good: Path, out_dir: Path) -> Path:
    """A copy of `good` whose golden reference outputs are shifted: no device reproduces them, so the canary
    refuses the release and the rollout fails its hard gate."""
    from compilers.golden import read_golden, write_golden
    from compilers.package import ModelPackage, write_package

    shutil.copytree(good, out_dir)
    for manifest in sorted(out_dir.rglob("manifest.json")):
        pkg = ModelPackage.open(manifest.parent)
        if pkg.manifest.golden is None:
            continue
        inputs, reference = read_golden(manifest.parent, pkg.manifest.golden)
        shifted = {k: v + (np.abs(v).max() + 1) for k, v in reference.items()}
        record = write_golden(manifest.parent, inputs, shifted, shifted, str(pkg.manifest.precision))
        write_package(manifest.parent, pkg.manifest.replace(golden=record))
    return out_dir


def _agents(stack: Stack, facade: Any, work: Path, n: int, *, edge: Path, broker: Broker, fleet_url: str,
            pub: Path, cloud_model: str) -> list[int]:
    ports = []
    for i in range(n):
        d = work / f"agent{i}"
        d.mkdir(parents=True)
        port = free_port()
        token = facade.registry.create_token({"kind": "demo"})
        (d / "agent.yaml").write_text(
            f"model: {edge}\nlisten: 127.0.0.1:{port}\ncloud: {broker.url}/{cloud_model}\n"
            f"tls: {{ca_file: '{broker.ca}'}}\npolicy: {{threshold: {THRESHOLD}}}\ntelemetry_interval_s: 1\n"
            f"threads: 1\nfleet: {{url: '{fleet_url}', token: {token}, state_dir: '{d / 'state'}', "
            f"release_keys: ['{pub}']}}\n")
        stack.spawn(f"agent{i}", ["agent", "--config", str(d / "agent.yaml")], ready=r"tierkit agent: (serving)")
        ports.append(port)
    return ports


def _release(facade: Any, variants: Path, work: Path, version: str, key: Path, rollback_to: list[str]) -> str:
    from compilers.signing import load_private_key
    from compilers.variants import VariantSet

    policy = work / f"policy-{version}.json"
    policy.write_text(json.dumps({"name": VariantSet.load(variants).name, "version": version,
                                  "threshold": THRESHOLD, "budget": {"latency_ms": 250}}))
    rel = facade.releases.create(variants, policy, sign_key=load_private_key(key), rollback_to=rollback_to)
    return str(rel["digest"])


def run_fleet_demo(*, agents: int = 3, duration_s: float | None = None, workdir: Path | None = None,
                   out: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the demo (see the module docstring); returns its figures. `duration_s` None: until Ctrl-C."""
    from cloud_service.fleet.cli import _need_extra

    _need_extra()  # the fleet's extra (FastAPI, SQLAlchemy, ...), named when missing
    from cloud_service.fleet.fleet import Fleet, FleetConfig
    from compilers.signing import generate_keypair

    if agents < 1:
        msg = f"--agents must be at least 1, got {agents}"
        raise TierkitError(msg)
    tmp = tempfile.TemporaryDirectory(prefix="tierkit-fleet-demo-") if workdir is None else None
    work = Path(workdir or tmp.name)  # type: ignore[union-attr]
    work.mkdir(parents=True, exist_ok=True)
    figures: dict[str, Any] = {"workdir": str(work)}
    try:
        with Stack(work) as stack:
            broker = stack.broker()
            out(f"broker:    {broker.url} (TLS, dynamic security; service accounts from tierkit broker init)")
            out("models:    training and compiling two digits classifiers")
            edge, cloud_dir, cloud_model, images = _models(work, out)
            key, pub = generate_keypair(work / "ops")
            data = work / "fleet-data"
            fleet_url = stack.spawn("fleet", [
                "fleet", "serve", "--data-dir", str(data), "--http", "127.0.0.1:0", "--mqtt", broker.url,
                "--mqtt-ca", str(broker.ca), "--mqtt-username", "tierkit-fleet", "--broker-dynsec", "--release-key",
                str(pub), "--online-after", "5s"], env={"TIERKIT_FLEET_MQTT_PASSWORD": broker.passwords[
                    "tierkit-fleet"]}, ready=r"API on (\S+),")
            stack.spawn("cloud", ["serve", "--models", str(cloud_dir), "--no-grpc", "--mqtt", broker.url,
                                  "--mqtt-ca", str(broker.ca), "--mqtt-username", "tierkit-cloud"],
                        env={"TIERKIT_MQTT_PASSWORD": broker.passwords["tierkit-cloud"]}, ready=r"^(ready)")
            out(f"fleet:     {fleet_url}; cloud: tierkit serve on {broker.url} (model {cloud_model})")
            with Fleet.open(FleetConfig(data_dir=data, release_keys=(pub,))) as facade:
                token = facade.registry.create_operator_token("demo", "admin")
                ports = _agents(stack, facade, work, agents, edge=edge, broker=broker, fleet_url=fleet_url, pub=pub,
                                cloud_model=cloud_model)
                out(f"agents:    {agents} enrolled with tokens, serving on 127.0.0.1:{', '.join(map(str, ports))}")
                figures |= {"dashboard": f"{fleet_url}/#token={token}", "token": token}
                out(f"dashboard: {figures['dashboard']}")
                out(f"token:     {token}")
                with _Load(ports, _set_name(edge), images) as load:
                    figures |= _scenario(_Api(fleet_url, token), facade, work, edge, key, agents, out)
                    figures |= {"answered": load.answered, "failed": load.failed}
                    out(f"requests:  {load.answered} answered by the agents, {load.failed} failed")
                    _hold(duration_s, out)
    finally:
        _end_children()
        if tmp is not None:
            tmp.cleanup()
    out("stopped: every process the demo started has exited")
    return figures


def _end_children() -> None:
    """End the worker processes a library forked in this process (multiprocessing's children): the interpreter
    joins them at exit without a bound, and one left waiting kept the demo from ending after Ctrl-C."""
    for child in multiprocessing.active_children():
        logger.warning("ending %s (pid %s), a worker process left running in the demo", child.name, child.pid)
        child.terminate()
        child.join(5)
        if child.is_alive():
            child.kill()
            child.join(5)


def _set_name(variants: Path) -> str:
    from compilers.variants import VariantSet

    return str(VariantSet.load(variants).name)


def _scenario(api: _Api, facade: Any, work: Path, edge: Path, key: Path, n: int,
              out: Callable[[str], None]) -> dict[str, Any]:
    api.wait("every agent to report", lambda: sum(d["online"] for d in api.call("GET", "/v1/devices")) == n, 90)
    # the gates judge each device against its own windows before the release: a baseline of BASELINE_WINDOWS
    # windows with traffic each first, so that every run of the demo is judged alike
    since = time.time()
    api.wait("a baseline of telemetry from every agent", lambda: _baselined(api, since, n), 90)
    good = _release(facade, edge, work, "2", key, [])
    out(f"release:   good {good[:19]}... rolling out in waves 1,100%")
    passed = api.rollout(good, "succeeded", 240)
    out(f"           succeeded: {passed['states']}")
    bad = _release(facade, _bad_variants(edge, work / "bad-variants"), work, "3", key, [good])
    out(f"release:   bad {bad[:19]}... (its golden inputs do not reproduce) rolling out")
    failed = api.rollout(bad, "rolled_back", 240)
    out(f"           rolled back: {failed.get('reason')}; devices {failed['states']}")
    return {"good": {"release": good, "state": passed["state"], "states": passed["states"]},
            "bad": {"release": bad, "state": failed["state"], "states": failed["states"],
                    "reason": failed.get("reason")}}


def _baselined(api: _Api, since: float, n: int) -> bool:
    windows = api.call("GET", f"/v1/telemetry?label={LABEL}&since={since}")["windows"]
    counts = Counter(w["device_id"] for w in windows if w.get("requests"))
    return len(counts) == n and min(counts.values()) >= BASELINE_WINDOWS


def _hold(duration_s: float | None, out: Callable[[str], None]) -> None:
    if duration_s is not None:
        time.sleep(duration_s)
        return
    # Ctrl-C (SIGINT) or SIGTERM sets a flag the main thread waits on, so that no KeyboardInterrupt can land
    # inside the shutdown that follows; SIGUSR1 writes every thread's stack to stderr (where a stop hangs)
    stop = threading.Event()
    handlers = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        out("running: press Ctrl-C to stop")
        while not stop.wait(1):
            pass
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    out("stopping: the load, then every process the demo started")
