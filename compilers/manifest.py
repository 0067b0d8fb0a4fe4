"""The model package manifest (`manifest.json`): what a package is, how it was built, how good it is."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from runtimes.errors import ConfigError, PackageError
from runtimes.registry import backend_names
from runtimes.spec import Precision, Task, TensorSpec

SCHEMA_VERSION = 1
MANIFEST_FILE = "manifest.json"


@dataclass(frozen=True)
class Manifest:
    """Everything DESIGN.md lists for a package.

    Attributes:
        name, version: the model's name and version.
        target: the hardware target the variant was built for (e.g. "x86-avx512").
        precision: fp32, fp16, bf16 or int8.
        runtime: the backend that runs `artifact` ("onnxruntime", "openvino", "torch", "tensorrt").
        artifact: path of the model file inside the package.
        task: classification, embedding or regression; decides how fidelity is measured.
        inputs, outputs: tensor specs; named axes are dynamic.
        passes: the passes applied, in order, each {"name": ..., **params}.
        files: relative path -> sha256 of every file except the manifest and its signature.
        reference_sha256: sha256 of the fp32 reference model the variant was derived from.
        fidelity: measured against the reference on held-out data (top1_agreement, accuracy,
            reference_accuracy, cosine_min, cosine_mean, max_abs_error, samples).
        size_bytes: total size of `files`.
        latency_ms: build-host latency, e.g. {"batch_1": {"p50": .., "p95": ..}, "host": .., "threads": ..}.
        energy: modeled or measured energy per inference, e.g. {"mj": .., "label": "modeled:cpu-tdp"}.
        calibration: confidence calibration for the edge policy: temperature, escalation_curve,
            ood statistics, validation file name.
        build: what reproduces the build: tool versions, recipe, arguments, data digests, and the
            precision the runtime reported it executed (`executed_precision`).
        golden: the golden inputs' file, sample count and tolerance (`compilers.golden`); whoever opens
            the variant re-runs them.
        preprocess: optional; how the input is made from a raw uint8 frame (resize, scale, mean/std,
            layout), so a cloud can take the frame itself (`cloud_service.protocol.preprocess`).
    """

    name: str
    version: str
    target: str
    precision: str
    runtime: str
    artifact: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    task: str = Task.CLASSIFICATION.value
    passes: tuple[dict[str, Any], ...] = ()
    files: dict[str, str] = field(default_factory=dict)
    reference_sha256: str = ""
    fidelity: dict[str, float] = field(default_factory=dict)
    size_bytes: int = 0
    latency_ms: dict[str, Any] = field(default_factory=dict)
    energy: dict[str, Any] = field(default_factory=dict)
    calibration: dict[str, Any] = field(default_factory=dict)
    build: dict[str, Any] = field(default_factory=dict)
    golden: dict[str, Any] = field(default_factory=dict)
    preprocess: dict[str, Any] = field(default_factory=dict)
    decoder: str = ""
    created_at: str = ""
    schema_version: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        for attr in ("name", "version", "target", "runtime", "artifact"):
            if not getattr(self, attr):
                msg = f"manifest field {attr!r} is empty"
                raise ConfigError(msg)
        Precision.parse(self.precision)
        if self.runtime not in backend_names():
            msg = (f"manifest names runtime {self.runtime!r}, which this tierkit does not have; it runs "
                   f"{', '.join(backend_names())}")
            raise ConfigError(msg)
        if self.task not in {t.value for t in Task}:
            msg = f"manifest task {self.task!r} is not one of {[t.value for t in Task]}"
            raise ConfigError(msg)
        if not self.inputs or not self.outputs:
            msg = "manifest must declare at least one input and one output"
            raise ConfigError(msg)
        object.__setattr__(self, "inputs", tuple(self.inputs))
        object.__setattr__(self, "outputs", tuple(self.outputs))
        object.__setattr__(self, "passes", tuple(dict(p) for p in self.passes))

    @property
    def temperature(self) -> float:
        return float(self.calibration.get("temperature", 1.0))

    def to_json(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["inputs"] = [s.to_json() for s in self.inputs]
        doc["outputs"] = [s.to_json() for s in self.outputs]
        doc["passes"] = list(self.passes)
        return doc

    def dumps(self) -> bytes:
        return (json.dumps(self.to_json(), indent=2, sort_keys=True) + "\n").encode()

    def replace(self, **changes: Any) -> Manifest:
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        data.update(changes)
        return Manifest(**data)

    @classmethod
    def from_json(cls, doc: Mapping[str, Any], *, where: str = "manifest") -> Manifest:
        if not isinstance(doc, Mapping):
            msg = f"{where}: manifest must be a JSON object"
            raise PackageError(msg)
        version = doc.get("schema_version")
        if version != SCHEMA_VERSION:
            msg = f"{where}: schema_version {version!r} is not supported (this tierkit reads {SCHEMA_VERSION})"
            raise PackageError(msg)
        known = {f.name for f in fields(cls)}
        data = {k: v for k, v in doc.items() if k in known}
        try:
            data["inputs"] = tuple(TensorSpec.from_json(s) for s in doc["inputs"])
            data["outputs"] = tuple(TensorSpec.from_json(s) for s in doc["outputs"])
            return cls(**data)
        except (KeyError, TypeError, ConfigError) as exc:
            msg = f"{where}: invalid manifest: {exc}"
            raise PackageError(msg) from None

    @classmethod
    def loads(cls, raw: bytes, *, where: str = "manifest") -> Manifest:
        try:
            doc = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            msg = f"{where}: {MANIFEST_FILE} is not valid JSON ({exc})"
            raise PackageError(msg) from None
        return cls.from_json(doc, where=where)
