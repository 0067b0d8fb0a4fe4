"""`tierkit export`: a compiled variant as a Triton model repository, and a KServe InferenceService for it.

    tierkit export VARIANTS --triton REPO/ [--variant ID] [--name NAME] [--instances N]
    tierkit export VARIANTS --triton REPO/ --kserve isvc.yaml --storage-uri s3://bucket/REPO

The repository is Triton's layout: `REPO/NAME/config.pbtxt` and `REPO/NAME/1/` holding the package's
files. `config.pbtxt` is a `ModelConfig` in protobuf text format: platform (or backend) from the
package's runtime, inputs and outputs from its manifest (dims without the batch axis when batching),
one CPU instance group, and dynamic batching with preferred sizes taken from the batch curve measured
at compile time (`manifest.latency_ms["batch_N"]`): the smallest batch size within 10 % of the best
per-sample time, and that best one. The InferenceService runs Triton through KServe's
`kserve-tritonserver` runtime on the Open Inference Protocol (v2) from `--storage-uri`.
"""

from __future__ import annotations

import argparse
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from google.protobuf import text_format

from cloud_service.protocol import inference_pb2 as pb
from compilers.manifest import Manifest
from compilers.package import ModelPackage
from compilers.variants import VariantSet, is_package, is_variant_set
from runtimes.errors import ConfigError

__all__ = ["TritonExport", "add_parser", "kserve_manifest", "preferred_batch_sizes", "triton_config",
           "write_triton_repository"]

# Triton's platform (or backend) per tierkit runtime; OpenVINO has a backend and no platform name.
_PLATFORM = {"onnxruntime": ("onnxruntime_onnx", ""), "tensorrt": ("tensorrt_plan", ""),
             "torch": ("pytorch_libtorch", ""), "openvino": ("", "openvino")}
_DATA_TYPES = {"bool": pb.TYPE_BOOL, "uint8": pb.TYPE_UINT8, "int8": pb.TYPE_INT8, "int16": pb.TYPE_INT16,
               "int32": pb.TYPE_INT32, "int64": pb.TYPE_INT64, "float16": pb.TYPE_FP16,
               "float32": pb.TYPE_FP32, "float64": pb.TYPE_FP64, "bfloat16": pb.TYPE_BF16}
_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")  # a Kubernetes object name (RFC 1123 label)


@dataclass(frozen=True, slots=True)
class TritonExport:
    """Options of a Triton export.

    Args:
        name: the model's name in the repository (default: the package's).
        instances: model instances per server (Triton's instance_group count).
        max_batch_size: overrides the largest measured batch size.
        max_queue_delay_us: how long Triton waits to fill a preferred batch.
    """

    name: str | None = None
    instances: int = 1
    max_batch_size: int | None = None
    max_queue_delay_us: int = 100

    def __post_init__(self) -> None:
        if self.instances < 1:
            msg = f"instances must be >= 1, got {self.instances}"
            raise ConfigError(msg)
        if self.max_batch_size is not None and self.max_batch_size < 0:
            msg = f"max_batch_size must be >= 0 (0: no batching), got {self.max_batch_size}"
            raise ConfigError(msg)


def _batch_curve(manifest: Manifest) -> dict[int, float]:
    """Measured p50 milliseconds by batch size."""
    curve: dict[int, float] = {}
    for key, value in manifest.latency_ms.items():
        if key.startswith("batch_") and key[6:].isdigit() and isinstance(value, dict) and value.get("p50"):
            curve[int(key[6:])] = float(value["p50"])
    return curve


def preferred_batch_sizes(manifest: Manifest) -> list[int]:
    """The smallest measured batch size within 10 % of the best per-sample time, and the best one."""
    curve = _batch_curve(manifest)
    if len(curve) < 2:
        return []
    per_sample = {b: ms / b for b, ms in curve.items()}
    best = min(per_sample, key=lambda b: per_sample[b])
    good = min(b for b, t in per_sample.items() if t <= per_sample[best] * 1.1)
    return sorted({b for b in (good, best) if b > 1})


def _batched(manifest: Manifest) -> bool:
    """Every input and output has a dynamic first axis: Triton may batch along it."""
    return all(spec.shape and isinstance(spec.shape[0], str) for spec in (*manifest.inputs, *manifest.outputs))


def triton_config(manifest: Manifest, options: TritonExport | None = None) -> pb.ModelConfig:
    """The Triton `ModelConfig` for a package's manifest."""
    options = options or TritonExport()
    try:
        platform, backend = _PLATFORM[manifest.runtime]
    except KeyError:
        msg = f"runtime {manifest.runtime!r} has no Triton backend here; exportable: {sorted(_PLATFORM)}"
        raise ConfigError(msg) from None
    batched = _batched(manifest)
    curve = _batch_curve(manifest)
    max_batch = 0  # Triton's "no batching"
    if batched and options.max_batch_size is not None:
        max_batch = options.max_batch_size
    elif batched:
        max_batch = max(curve) if len(curve) > 1 else 32  # unmeasured: tierkit serve's default
    config = pb.ModelConfig(name=options.name or manifest.name, platform=platform, backend=backend,
                            max_batch_size=max_batch, default_model_filename=Path(manifest.artifact).name)
    skip = 1 if max_batch > 0 else 0
    for specs, add in ((manifest.inputs, config.input.add), (manifest.outputs, config.output.add)):
        for spec in specs:
            dims = spec.oip_shape[skip:]
            add(name=spec.name, data_type=_DATA_TYPES[spec.dtype], dims=dims or [1])
    config.instance_group.add(count=options.instances, kind=pb.ModelInstanceGroup.KIND_CPU)
    if max_batch > 1:
        config.dynamic_batching.preferred_batch_size.extend(b for b in preferred_batch_sizes(manifest)
                                                            if b <= max_batch)
        config.dynamic_batching.max_queue_delay_microseconds = options.max_queue_delay_us
    for key, value in (("tierkit.version", manifest.version), ("tierkit.precision", manifest.precision),
                       ("tierkit.target", manifest.target)):
        config.parameters[key].string_value = value
    return config


def write_triton_repository(source: Path, repo: Path, *, variant: str | None = None,
                            options: TritonExport | None = None) -> Path:
    """Write one variant of `source` (a variant set or a package) into the Triton repository `repo`.

    Returns:
        The model's directory, `repo/NAME`.
    """
    if is_variant_set(source):
        package = VariantSet.load(source).open(variant)
    elif is_package(source):
        package = ModelPackage.open(source)
    else:
        msg = f"{source} is neither a variant set (variants.json) nor a model package (manifest.json)"
        raise ConfigError(msg)
    config = triton_config(package.manifest, options)
    model_dir = repo / config.name
    version_dir = model_dir / "1"
    if version_dir.exists():
        shutil.rmtree(version_dir)
    version_dir.mkdir(parents=True)
    for rel in package.manifest.files:
        target = version_dir / Path(rel).name if rel == package.manifest.artifact else version_dir / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(package.directory / rel, target)
    shutil.copyfile(package.directory / "manifest.json", version_dir / "tierkit-manifest.json")  # provenance
    (model_dir / "config.pbtxt").write_text(text_format.MessageToString(config))
    return model_dir


def kserve_manifest(name: str, storage_uri: str) -> dict[str, Any]:
    """A KServe InferenceService serving the Triton repository at `storage_uri` over the v2 protocol."""
    service = name.lower().replace("_", "-")
    if not _NAME.match(service) or len(service) > 63:
        msg = f"{name!r} is not usable as a Kubernetes name; pass --name with lowercase letters, digits and '-'"
        raise ConfigError(msg)
    if "://" not in storage_uri:
        msg = f"storage URI {storage_uri!r} must name where the repository is uploaded, e.g. s3://bucket/models"
        raise ConfigError(msg)
    return {
        "apiVersion": "serving.kserve.io/v1beta1",
        "kind": "InferenceService",
        "metadata": {"name": service, "annotations": {"serving.kserve.io/deploymentMode": "RawDeployment"}},
        "spec": {"predictor": {"model": {
            "modelFormat": {"name": "triton"},
            "runtime": "kserve-tritonserver",
            "protocolVersion": "v2",
            "storageUri": storage_uri,
            "ports": [{"name": "h2c", "protocol": "TCP", "containerPort": 9000}],  # gRPC, as tierkit's agents use
        }}},
    }


def add_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Register `tierkit export`."""
    p = subparsers.add_parser("export", help="write a variant as a Triton model repository (and a KServe manifest)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", type=Path, metavar="VARIANTS", help="a variant set or a model package directory")
    p.add_argument("--triton", type=Path, required=True, metavar="REPO", help="Triton model repository to write")
    p.add_argument("--variant", help="variant id (default: the recommended one)")
    p.add_argument("--name", help="model name in the repository (default: the package's)")
    p.add_argument("--instances", type=int, default=1, help="model instances per Triton server")
    p.add_argument("--max-batch-size", type=int, help="override the largest measured batch size (0: no batching)")
    p.add_argument("--kserve", type=Path, metavar="FILE", help="also write an InferenceService YAML here")
    p.add_argument("--storage-uri", help="where REPO is uploaded, for --kserve (s3://..., gs://..., pvc://...)")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    import yaml

    if args.kserve and not args.storage_uri:
        msg = "--kserve needs --storage-uri: where the Triton repository will be uploaded"
        raise ConfigError(msg)
    options = TritonExport(name=args.name, instances=args.instances, max_batch_size=args.max_batch_size)
    model_dir = write_triton_repository(args.source, args.triton, variant=args.variant, options=options)
    print(f"triton {model_dir}")
    if args.kserve:
        args.kserve.write_text(yaml.safe_dump(kserve_manifest(model_dir.name, args.storage_uri), sort_keys=False))
        print(f"kserve {args.kserve}")
    return 0
