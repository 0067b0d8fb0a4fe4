"""Build small real model packages for the agent and SDK tests without the full compiler."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

from compilers.manifest import Manifest
from compilers.package import ModelPackage, write_package
from compilers.variants import VariantEntry, VariantSet
from runtimes.registry import open_session
from runtimes.spec import TensorSpec
from testkit.zoo import Split


def energy_stats(logits: np.ndarray, temperature: float = 1.0) -> dict[str, float]:
    z = logits.astype(np.float64) / temperature
    top = z.max(axis=1)
    e = -temperature * (top + np.log(np.exp(z - top[:, None]).sum(axis=1)))
    return {"energy_mean": float(e.mean()), "energy_std": float(e.std()),
            "energy_p01": float(np.percentile(e, 1)), "energy_p99": float(np.percentile(e, 99))}


def make_package(onnx_path: Path, directory: Path, *, name: str, x_val: np.ndarray, y_val: np.ndarray,
                 temperature: float = 1.0, precision: str = "fp32") -> ModelPackage:
    """A package of `onnx_path` with a validation file and calibration like the compiler writes."""
    directory.mkdir(parents=True, exist_ok=True)
    shutil.copy(onnx_path, directory / "model.onnx")
    with open_session(directory / "model.onnx") as session:
        logits = session.run({session.inputs[0].name: x_val})[session.outputs[0].name]
        inputs, outputs = session.inputs, session.outputs
    np.savez(directory / "validation.npz", logits=logits, labels=y_val, reference_logits=logits)
    calibration = {"temperature": temperature, "validation_file": "validation.npz",
                   "ood": energy_stats(logits, temperature)}
    manifest = Manifest(name=name, version="1", target="x86", precision=precision, runtime="onnxruntime",
                        artifact="model.onnx", inputs=inputs, outputs=outputs, calibration=calibration)
    return write_package(directory, manifest)


def make_variant_set(directory: Path, models: dict[str, Path], *, name: str, x_val: np.ndarray,
                     y_val: np.ndarray) -> VariantSet:
    """A variant set of `make_package` packages, one per (id, ONNX file), in this order; the first recommended."""
    entries = []
    for i, (vid, onnx_path) in enumerate(models.items()):
        pkg = make_package(onnx_path, directory / vid, name=name, x_val=x_val, y_val=y_val)
        with np.load(pkg.directory / "validation.npz") as data:
            accuracy = float((data["logits"].argmax(axis=1) == data["labels"]).mean())
        entries.append(VariantEntry(id=vid, path=vid, precision="fp32", runtime="onnxruntime", passes=[],
                                    fidelity={"accuracy": accuracy}, latency_ms={"batch_1": {"p50": float(i + 1)}},
                                    size_bytes=(pkg.directory / "model.onnx").stat().st_size, recommended=i == 0))
    vs = VariantSet(directory, name, "x86", tuple(entries))
    vs.write()
    return vs


def profiled_package(directory: Path, onnx: Path, split: Split, *, validation: bool = True,
                     p50_ms: float = 0.2, energy_mj: float = 1.5) -> ModelPackage:
    """A digits package holding the ONNX model, its outputs on the validation split (unless `validation` is
    false), and the latency and energy a controller profiles it by."""
    directory.mkdir(parents=True)
    shutil.copy(onnx, directory / "model.onnx")
    with open_session(directory / "model.onnx", backend="onnxruntime") as session:
        logits = session.run({"x": split.x_val})["logits"]
    if validation:
        np.savez(directory / "validation.npz", logits=logits, labels=split.y_val, reference_logits=logits)
    manifest = Manifest(name="digits", version="1", target="x86", precision="fp32", runtime="onnxruntime",
                        artifact="model.onnx", inputs=(TensorSpec("x", "float32", ("batch", 1, 8, 8)),),
                        outputs=(TensorSpec("logits", "float32", ("batch", 10)),),
                        latency_ms={"batch_1": {"p50": p50_ms, "p95": 1.5 * p50_ms}},
                        energy={"mj": energy_mj, "label": "modeled:test-cpu"},
                        calibration={"temperature": 1.0, "validation_file": "validation.npz"})
    return write_package(directory, manifest)


_COMPILED: dict[tuple[str, str], Path] = {}


def compiled(model: object, split: object, root: Path, name: str, precisions: tuple[str, ...]) -> Path:
    """`compile_model` of a torch module on digits, once per pytest session (keyed by name)."""
    import torch

    from compilers import compile_model

    key = (str(root), name)
    if key not in _COMPILED:
        s = split
        calib = {"x": s.x_train[:512], "labels": s.y_train[:512]}  # type: ignore[attr-defined]
        val = {"x": s.x_val, "labels": s.y_val}  # type: ignore[attr-defined]
        vs = compile_model(model, example_inputs=torch.from_numpy(s.x_test[:1]), output=root / name,  # type: ignore[attr-defined]
                           precisions=precisions, calibration=calib, validation=val, name=name, progress=False)
        _COMPILED[key] = vs.directory
    return _COMPILED[key]
