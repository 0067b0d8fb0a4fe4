"""Targets as data: which runtimes a target has, and which precisions and passes pay on it.

A `Target` lists `Rung`s. Each rung is one candidate variant: a precision, the runtime that runs it,
and the ordered passes that build it. The compiler builds the rungs whose precision was asked
for, measures each on the build host, and keeps those that pass the accuracy guard. Adding a
target is adding data here (or loading a JSON/YAML file with `Target.from_dict`), not code.

Example:
    >>> target = get_target("x86-avx512")
    >>> [r.id for r in target.rungs_for(["fp32", "int8"])]
    ['fp32-ort', 'fp32-ov', 'int8-ort-static', 'int8-ort-dynamic', 'int8-ov']
"""

from __future__ import annotations

import logging
import platform
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from runtimes.documents import read_document
from runtimes.errors import ConfigError
from runtimes.spec import Precision

logger = logging.getLogger(__name__)

RUNTIMES = ("onnxruntime", "openvino", "tensorrt", "torch")
PASSES = ("fuse", "fp16", "quantize_ort", "export_openvino", "quantize_nncf", "tensorrt_engine", "export_torch")
_SHORT = {"onnxruntime": "ort", "openvino": "ov", "tensorrt": "trt", "torch": "torch"}


@dataclass(frozen=True)
class PassSpec:
    """One pass and its parameters, e.g. `PassSpec("quantize_ort", {"mode": "static"})`."""

    name: str
    params: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.name not in PASSES:
            msg = f"pass {self.name!r} is not one of {', '.join(PASSES)}"
            raise ConfigError(msg)
        object.__setattr__(self, "params", dict(self.params))

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, **self.params}


@dataclass(frozen=True)
class Rung:
    """A rung of the ladder: the recipe of one variant (precision, runtime, passes); `note` says why it may not pay."""

    precision: str
    runtime: str
    passes: tuple[PassSpec, ...] = ()
    label: str = ""
    note: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "precision", Precision.parse(self.precision).value)
        if self.runtime not in RUNTIMES:
            msg = f"runtime {self.runtime!r} is not one of {', '.join(RUNTIMES)}"
            raise ConfigError(msg)
        object.__setattr__(self, "passes", tuple(
            p if isinstance(p, PassSpec) else PassSpec(p["name"], {k: v for k, v in p.items() if k != "name"})
            for p in self.passes))

    @property
    def id(self) -> str:
        return "-".join(filter(None, (self.precision, _SHORT[self.runtime], self.label)))


@dataclass(frozen=True)
class Target:
    """A hardware target: the runtimes it has, its devices and its candidate variants.

    Attributes:
        name: target name, recorded in every manifest.
        runtimes: runtimes in order of preference; the first fp32 rung is the latency baseline.
        native: precisions with hardware support (others are emulated and rarely pay).
        devices: OpenVINO device names, or "cpu" / "cuda".
        rungs: candidate variants.
        description: one line for `tierkit compile --help` and reports.
    """

    name: str
    runtimes: tuple[str, ...]
    native: tuple[str, ...]
    rungs: tuple[Rung, ...]
    devices: tuple[str, ...] = ("cpu",)
    description: str = ""

    def __post_init__(self) -> None:
        if not self.rungs:
            msg = f"target {self.name!r} lists no rungs"
            raise ConfigError(msg)
        ids = [r.id for r in self.rungs]
        if len(set(ids)) != len(ids):
            msg = f"target {self.name!r} lists duplicate rungs {ids}: give them distinct labels"
            raise ConfigError(msg)

    def rungs_for(self, precisions: Iterable[str] | None) -> list[Rung]:
        """The rungs whose precision is in `precisions` (None: the defaults this target has), fp32 first."""
        if precisions is None:
            precisions = [p for p in DEFAULT_PRECISIONS if any(r.precision == p for r in self.rungs)]
        wanted = [Precision.parse(p).value for p in precisions]
        missing = sorted(set(wanted) - {r.precision for r in self.rungs})
        if missing:
            have = sorted({r.precision for r in self.rungs})
            msg = f"target {self.name!r} has no {', '.join(missing)} variant; it builds {', '.join(have)}"
            raise ConfigError(msg)
        order = {p: i for i, p in enumerate(("fp32", "fp16", "bf16", "int8"))}
        return sorted((r for r in self.rungs if r.precision in wanted), key=lambda r: order[r.precision])

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "runtimes": list(self.runtimes), "native": list(self.native),
                "devices": list(self.devices), "description": self.description,
                "rungs": [{"precision": r.precision, "runtime": r.runtime, "label": r.label, "note": r.note,
                           "passes": [p.to_json() for p in r.passes]} for r in self.rungs]}

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> Target:
        """Build a target from its `to_json` form (a JSON or YAML file's content)."""
        try:
            rungs = tuple(Rung(r["precision"], r["runtime"], tuple(r.get("passes", ())), r.get("label", ""),
                               r.get("note", "")) for r in doc["rungs"])
            return cls(str(doc["name"]), tuple(doc.get("runtimes", ())), tuple(doc.get("native", ("fp32",))), rungs,
                       tuple(doc.get("devices", ("cpu",))), str(doc.get("description", "")))
        except (KeyError, TypeError) as exc:
            msg = f"target definition is missing or has a bad field ({exc}); see compilers.recipes.Target"
            raise ConfigError(msg) from None


@dataclass(frozen=True)
class PruneConfig:
    """Structured channel pruning of a torch model, then recovery.

    Recovery is distillation from the unpruned model on the calibration inputs (no labels needed),
    or `finetune`, a user training loop that takes the pruned module and returns it trained.
    Only structured pruning is offered: zeroed weights (unstructured sparsity) run no faster on
    dense CPU/GPU kernels (0.96x measured at 50%), they only compress better.

    Args:
        ratio: share of channels removed from each prunable layer, in (0, 1).
        importance: "magnitude" (L2 of each channel group) or "taylor" (weight × gradient on the
            calibration inputs, against the teacher's outputs).
        epochs: distillation epochs over the calibration inputs.
        lr: Adam learning rate for distillation.
        batch_size: distillation batch size.
        temperature: distillation softmax temperature (classifiers).
        noise: std of Gaussian noise added to inputs during distillation, relative to their std.
        finetune: a user training loop replacing distillation.
        max_seconds: wall-clock budget for distillation; it stops after the epoch that passes it.
        seed: random seed for the distillation order and noise.

    Example:
        >>> compile_model(net, output="out", example_inputs=x[:1], calibration=x, prune=PruneConfig(0.5))
    """

    ratio: float
    importance: str = "magnitude"
    epochs: int = 40
    lr: float = 2e-3
    batch_size: int = 64
    temperature: float = 2.0
    noise: float = 0.05
    finetune: Callable[[Any], Any] | None = None
    max_seconds: float = 600.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0 < self.ratio < 1:
            msg = f"prune ratio {self.ratio!r} must be in (0, 1), e.g. 0.5 for half of the channels"
            raise ConfigError(msg)
        if self.importance not in ("magnitude", "taylor"):
            msg = f"prune importance {self.importance!r} is not 'magnitude' or 'taylor'"
            raise ConfigError(msg)
        if self.epochs < 0 or self.lr <= 0 or self.batch_size < 1:
            msg = f"prune recovery needs epochs >= 0, lr > 0, batch_size >= 1 (got {self.epochs}, {self.lr}, " \
                  f"{self.batch_size})"
            raise ConfigError(msg)

    def to_json(self) -> dict[str, Any]:
        return {"ratio": self.ratio, "importance": self.importance, "epochs": self.epochs, "lr": self.lr,
                "batch_size": self.batch_size, "temperature": self.temperature, "noise": self.noise,
                "finetune": getattr(self.finetune, "__qualname__", None), "max_seconds": self.max_seconds,
                "seed": self.seed}


def _static(**extra: Any) -> PassSpec:
    return PassSpec("quantize_ort", {"mode": "static", "per_channel": True, "method": "minmax", **extra})


_ORT_FP32 = Rung("fp32", "onnxruntime", (PassSpec("fuse"),))
_OV_FP32 = Rung("fp32", "openvino", (PassSpec("export_openvino"),))
_OV_INT8 = Rung("int8", "openvino", (PassSpec("export_openvino"), PassSpec("quantize_nncf")))
_ORT_DYNAMIC = Rung("int8", "onnxruntime", (PassSpec("quantize_ort", {"mode": "dynamic"}),), "dynamic",
                    "pays on MatMul-heavy models (transformers); skipped when there is no MatMul")
_EMULATED_FP16 = "no fp16 arithmetic on this CPU: onnxruntime runs it slower than fp32; kept for size only"
# OpenVINO computes this rung in bf16 (INFERENCE_PRECISION_HINT=bf16); built only where the CPU has it natively.
_OV_BF16 = Rung("bf16", "openvino", (PassSpec("export_openvino"),),
                note="OpenVINO bf16 arithmetic (avx512_bf16 / AMX); never built where it would be emulated")

TARGETS: dict[str, Target] = {t.name: t for t in (
    Target("x86-avx512", ("onnxruntime", "openvino"), ("fp32", "int8"), (
        _ORT_FP32, _OV_FP32,
        Rung("fp16", "onnxruntime", (PassSpec("fp16"),), note=_EMULATED_FP16),
        Rung("fp16", "openvino", (PassSpec("export_openvino", {"compress_to_fp16": True}),),
             note="OpenVINO CPU runs f16 weights as f32: smaller, not faster"),
        # u8s8 is what onnxruntime's VNNI kernels take: s8s8 QDQ ran the ResNet-like CNN at 0.6x fp32.
        Rung("int8", "onnxruntime", (_static(activation_type="uint8"),), "static"), _ORT_DYNAMIC, _OV_INT8,
        _OV_BF16),
        description="x86-64 CPU with AVX-512 (VNNI int8; bf16 where avx512_bf16/AMX): onnxruntime and OpenVINO CPU"),
    Target("x86-avx2", ("onnxruntime", "openvino"), ("fp32", "int8"), (
        _ORT_FP32, _OV_FP32,
        Rung("fp16", "onnxruntime", (PassSpec("fp16"),), note=_EMULATED_FP16),
        # Without VNNI, u8s8 int8 products can saturate: reduce_range keeps weights to 7 bits.
        Rung("int8", "onnxruntime", (_static(activation_type="uint8", reduce_range=True),), "static"),
        _ORT_DYNAMIC, _OV_INT8, _OV_BF16),
        description="x86-64 CPU with AVX2 (no VNNI): onnxruntime and OpenVINO CPU"),
    Target("arm64", ("onnxruntime",), ("fp32", "fp16", "int8"), (
        _ORT_FP32, Rung("fp16", "onnxruntime", (PassSpec("fp16"),)),
        Rung("int8", "onnxruntime", (_static(),), "static"), _ORT_DYNAMIC),
        description="64-bit Arm CPU (Neon; fp16 on ARMv8.2+): onnxruntime"),
    Target("intel-openvino", ("openvino",), ("fp32", "fp16", "int8"), (
        _OV_FP32, Rung("fp16", "openvino", (PassSpec("export_openvino", {"compress_to_fp16": True}),)),
        _OV_INT8, _OV_BF16),
        devices=("CPU", "GPU", "NPU"),
        description="Intel CPU, GPU or NPU through OpenVINO (f16 pays on GPU/NPU)"),
    Target("nvidia-tensorrt", ("tensorrt",), ("fp32", "fp16", "int8"), tuple(
        Rung(p, "tensorrt", (PassSpec("tensorrt_engine", {"precision": p}),))
        for p in ("fp32", "fp16", "bf16", "int8")),
        devices=("cuda",), description="NVIDIA GPU through TensorRT 10 engines with dynamic-shape profiles"),
    Target("torch", ("torch",), ("fp32",), (Rung("fp32", "torch", (PassSpec("export_torch"),)),),
           description="torch.export programs (.pt2) run by torch"),
)}


DEFAULT_PRECISIONS = ("fp32", "bf16", "int8")
# GPU compute capability from which TensorRT has fast kernels: fp16 tensor cores (Volta), bf16 (Ampere).
_GPU_NATIVE = {"fp16": (7, 0), "bf16": (8, 0), "int8": (6, 1)}


def native_precisions(runtime: str, probe: Mapping[str, Any]) -> set[str]:
    """The precisions `runtime` computes natively on the probed host (`tierkit doctor`'s probe).

    CPU runtimes: fp32 and int8 everywhere, bf16 with avx512_bf16 or AMX-BF16 (elsewhere OpenVINO
    would run it as f32, or emulate it 3x to 42x slower). TensorRT: by the GPU's compute capability.
    """
    if runtime == "tensorrt":
        out = {"fp32"}
        for gpu in probe.get("gpus") or ():
            cc = tuple(int(x) for x in str(gpu.get("compute_capability", "0.0")).split(".")[:2] if x.isdigit())
            out |= {p for p, need in _GPU_NATIVE.items() if cc >= need}
        return out
    isa = {str(f).lower() for f in probe.get("isa") or ()}
    out = {"fp32", "int8"}
    if isa & {"avx512_bf16", "amx_bf16"}:
        out.add("bf16")
    return out


def target_names() -> list[str]:
    return [*TARGETS, "auto"]


def get_target(target: str | Target | Path, *, probe: Mapping[str, Any] | None = None) -> Target:
    """Resolve a target name, a `Target`, or a `.json`/`.yaml` target file.

    Args:
        target: a name from `target_names()`, "auto", a `Target`, or a path to a target file.
        probe: the hardware probe used by "auto" (default: `probe_host()`).

    Raises:
        ConfigError: unknown name or unreadable file.
    """
    if isinstance(target, Target):
        return target
    text = str(target)
    if text.endswith((".json", ".yaml", ".yml")):
        return _load_target_file(Path(text))
    if text == "auto":
        return TARGETS[auto_target(probe if probe is not None else probe_host())]
    try:
        return TARGETS[text]
    except KeyError:
        msg = f"unknown target {text!r}; expected one of {', '.join(target_names())}, or a .json/.yaml target file"
        raise ConfigError(msg) from None


def _load_target_file(path: Path) -> Target:
    doc = read_document(path, "target file")
    return Target.from_dict(doc)


def probe_host() -> dict[str, Any]:
    """What "auto" reads: `tierkit doctor`'s probe (`runtimes.hardware.probe().to_json()`)."""
    from runtimes import hardware

    return hardware.probe().to_json()


def auto_target(probe: Mapping[str, Any]) -> str:
    """Pick a target name from a `tierkit doctor` probe.

    An NVIDIA GPU with TensorRT installed gives "nvidia-tensorrt"; an Intel GPU or NPU that OpenVINO
    sees gives "intel-openvino"; an Arm CPU "arm64"; an x86 CPU "x86-avx512" or "x86-avx2".
    """
    backends = probe.get("backends") or {}
    if probe.get("gpus") and backends.get("tensorrt"):
        return "nvidia-tensorrt"
    ov_devices = [str(d).upper() for d in probe.get("openvino_devices") or []]
    if backends.get("openvino") and any(d.startswith(("GPU", "NPU")) for d in ov_devices):
        return "intel-openvino"
    arch = str(probe.get("machine") or platform.machine()).lower()
    if arch in ("arm64", "aarch64"):
        return "arm64"
    isa = {str(f).lower() for f in probe.get("isa") or ()}
    target = "x86-avx512" if "avx512f" in isa else "x86-avx2"
    logger.info("auto target: %s (machine %s)", target, arch)
    return target
