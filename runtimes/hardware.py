"""What this machine can run: CPU and its instruction sets, memory, GPUs, backends, energy counters.

Reads /proc and /sys with the standard library. NVML (the `nvidia-ml-py` package) and OpenVINO
are asked only when installed, imported inside `probe()`, and a failure of either is reported in
the result, never raised: `tierkit doctor` must work on a half-broken machine.

Example:
    >>> info = probe()
    >>> info.isa, info.physical_cores, info.energy_source
    (('avx2', 'avx512f', 'avx512_vnni'), 2, 'modeled')
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
import platform
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from runtimes.energy import (
    GENERIC_CPU,
    JETSON,
    JETSON_ROOT,
    NVIDIA_GPU,
    POWERCAP_ROOT,
    PROFILES,
    PowerProfile,
    probe_sources,
)
from runtimes.registry import available_backends

logger = logging.getLogger(__name__)

# Instruction sets that decide which kernels and precisions pay off (cpuinfo flag names).
ISA_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni",
             "avx512_bf16", "avx512_fp16", "amx_tile", "amx_int8", "amx_bf16", "asimd", "asimdhp", "asimddp",
             "sve", "sve2", "i8mm", "bf16")


@dataclass(frozen=True)
class GpuInfo:
    """One NVIDIA GPU as NVML reports it."""

    index: int
    name: str
    memory_bytes: int
    driver: str
    compute_capability: str


@dataclass(frozen=True)
class HardwareInfo:
    """The result of `probe()`. `to_json()` gives the dict `tierkit doctor --json` prints."""

    system: str
    machine: str
    python: str
    cpu_model: str
    isa: tuple[str, ...]
    logical_cores: int
    physical_cores: int
    usable_cores: int
    memory_bytes: int
    gpus: tuple[GpuInfo, ...]
    gpu_note: str
    openvino_devices: tuple[str, ...] | None
    backends: dict[str, str | None]
    energy_sources: dict[str, str]
    energy_source: str
    notes: tuple[str, ...] = field(default=())
    power_profile: str = GENERIC_CPU.name  # `runtimes.energy.PROFILES` key: how energy is modeled here

    def to_json(self) -> dict[str, Any]:
        doc = asdict(self)
        for key in ("isa", "notes"):
            doc[key] = list(doc[key])
        doc["gpus"] = [asdict(g) for g in self.gpus]
        doc["openvino_devices"] = None if self.openvino_devices is None else list(self.openvino_devices)
        return doc


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def _cpuinfo(proc: Path) -> tuple[str, tuple[str, ...], int]:
    """(model, ISA flags of interest, physical core count or 0) from /proc/cpuinfo."""
    model, flags, cores = "", set(), set()
    phys = core = ""
    for line in _read(proc / "cpuinfo").splitlines():
        key, _, value = (part.strip() for part in line.partition(":"))
        if key in ("model name", "Model", "Hardware", "cpu model") and not model:
            model = value
        elif key in ("flags", "Features"):
            flags.update(value.split())
        elif key == "physical id":
            phys = value
        elif key == "core id":
            core = value
            cores.add((phys, core))
    return model, tuple(f for f in ISA_FLAGS if f in flags), len(cores)


def _memory_bytes(proc: Path) -> int:
    for line in _read(proc / "meminfo").splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    return 0


def _gpus() -> tuple[tuple[GpuInfo, ...], str]:
    if importlib.util.find_spec("pynvml") is None:
        return (), "nvidia-ml-py not installed"
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception as exc:  # the probe reports, never raises (no driver, no device, ...)
        return (), f"NVML unavailable: {exc}"
    try:
        driver = pynvml.nvmlSystemGetDriverVersion()
        found = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(h)
            found.append(GpuInfo(i, _text(pynvml.nvmlDeviceGetName(h)), int(pynvml.nvmlDeviceGetMemoryInfo(h).total),
                                 _text(driver), f"{major}.{minor}"))
        return tuple(found), "ok"
    except Exception as exc:
        return (), f"NVML query failed: {exc}"
    finally:
        pynvml.nvmlShutdown()


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _openvino_devices() -> tuple[tuple[str, ...] | None, str | None]:
    if importlib.util.find_spec("openvino") is None:
        return None, None
    try:
        from runtimes.ov_import import openvino

        core = openvino.Core()
        return tuple(f"{d} ({core.get_property(d, 'FULL_DEVICE_NAME')})" for d in core.available_devices), None
    except Exception as exc:
        return (), f"OpenVINO device query failed: {exc}"


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity: `taskset`, a container's cpuset)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def probe(*, proc_root: Path = Path("/proc"), powercap_root: Path = POWERCAP_ROOT,
          jetson_root: Path = JETSON_ROOT, openvino: bool = True, nvml: bool = True) -> HardwareInfo:
    """Describe this machine. Never raises for a missing or broken optional part.

    Args:
        proc_root: where /proc is (tests pass a fake tree).
        powercap_root, jetson_root: sysfs roots for the energy counters.
        openvino: ask OpenVINO for its devices (imports openvino, ~0.5 s).
        nvml: ask NVML for GPUs and energy counters.
    """
    model, isa, physical = _cpuinfo(proc_root)
    logical = os.cpu_count() or 1
    usable = usable_cpus()
    notes: list[str] = []
    gpus, gpu_note = _gpus() if nvml else ((), "not probed")
    ov_devices, ov_note = _openvino_devices() if openvino else (None, None)
    if ov_note:
        notes.append(ov_note)
    sources = probe_sources(powercap_root=powercap_root, jetson_root=jetson_root, nvml=nvml)
    usable_sources = [name for name, state in sources.items() if state == "ok"]
    return HardwareInfo(
        system=platform.system(), machine=platform.machine(), python=platform.python_version(),
        cpu_model=model or platform.processor() or "unknown", isa=isa, logical_cores=logical,
        physical_cores=physical or logical, usable_cores=usable, memory_bytes=_memory_bytes(proc_root),
        gpus=gpus, gpu_note=gpu_note, openvino_devices=ov_devices, backends=available_backends(),
        energy_sources=sources, energy_source=usable_sources[0] if usable_sources else "modeled",
        notes=tuple(notes), power_profile=_power_profile_name(sources, gpus))


def _power_profile_name(sources: dict[str, str], gpus: tuple[GpuInfo, ...]) -> str:
    """A Jetson board (its power rails) or a machine with an NVIDIA GPU has its own profile; else a CPU."""
    if sources.get("jetson") == "ok":
        return JETSON.name
    if gpus:
        return NVIDIA_GPU.name
    return GENERIC_CPU.name


@functools.cache
def machine_power_profile() -> PowerProfile:
    """This machine's power profile, chosen once per process by the probe (without asking OpenVINO).

    The compiler records energy with it and the agent and its controller model energy with it, so that
    every modeled figure made on one machine carries the same `modeled:<name>` label.
    """
    return PROFILES[probe(openvino=False).power_profile]
