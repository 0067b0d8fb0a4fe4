"""`tierkit doctor`: what this machine can run, as a table or as JSON."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from runtimes.hardware import HardwareInfo, probe


def add_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Register `tierkit doctor`."""
    doctor = subparsers.add_parser(
        "doctor", help="show CPU, instruction sets, GPUs, installed backends and energy counters",
        description="Probe this machine: CPU and instruction sets, memory, GPUs (NVML), OpenVINO devices, "
                    "installed backends and which energy counters are readable.")
    doctor.add_argument("--json", action="store_true", help="print the probe as JSON")
    doctor.add_argument("--no-openvino", action="store_true", help="do not import OpenVINO to list its devices")
    doctor.set_defaults(func=run_doctor)


def run_doctor(args: argparse.Namespace) -> int:
    info = probe(openvino=not args.no_openvino)
    if args.json:
        json.dump(info.to_json(), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(render(info))
    return 0


def _gib(n: int) -> str:
    return f"{n / 1024**3:.1f} GiB"


def render(info: HardwareInfo) -> str:
    """The probe as an aligned two-column table."""
    rows: list[tuple[str, Any]] = [
        ("system", f"{info.system} {info.machine}, Python {info.python}"),
        ("cpu", info.cpu_model),
        ("cores", f"{info.physical_cores} physical, {info.logical_cores} logical, {info.usable_cores} usable"),
        ("isa", " ".join(info.isa) or "-"),
        ("memory", _gib(info.memory_bytes)),
    ]
    if info.gpus:
        rows += [(f"gpu {g.index}", f"{g.name}, {_gib(g.memory_bytes)}, sm {g.compute_capability}, "
                                   f"driver {g.driver}") for g in info.gpus]
    else:
        rows.append(("gpu", f"none ({info.gpu_note})"))
    if info.openvino_devices is not None:
        rows.append(("openvino devices", ", ".join(info.openvino_devices) or "none"))
    rows += [(f"backend {name}", version or "not installed") for name, version in info.backends.items()]
    rows += [(f"energy {name}", state) for name, state in info.energy_sources.items()]
    label = "modeled (no readable counter)" if info.energy_source == "modeled" else f"measured:{info.energy_source}"
    rows.append(("energy figures", label))
    rows.append(("energy profile", f"modeled:{info.power_profile} (compiler, agent and controller model with it)"))
    rows += [("note", note) for note in info.notes]
    width = max(len(key) for key, _ in rows)
    return "".join(f"{key:<{width}}  {value}\n" for key, value in rows)
