"""The hardware probe on this machine and on fake /proc trees."""

from __future__ import annotations

from pathlib import Path

from runtimes.hardware import ISA_FLAGS, probe

X86_CPUINFO = """\
processor\t: 0
model name\t: Intel(R) Xeon(R) Platinum 8480+
physical id\t: 0
core id\t\t: 0
flags\t\t: fpu sse4_2 avx avx2 fma avx512f avx512_vnni avx512_bf16 avx512_fp16 amx_tile amx_int8 amx_bf16

processor\t: 1
model name\t: Intel(R) Xeon(R) Platinum 8480+
physical id\t: 0
core id\t\t: 0
flags\t\t: fpu sse4_2 avx avx2 fma avx512f avx512_vnni avx512_bf16 avx512_fp16 amx_tile amx_int8 amx_bf16

processor\t: 2
model name\t: Intel(R) Xeon(R) Platinum 8480+
physical id\t: 0
core id\t\t: 1
flags\t\t: fpu sse4_2 avx avx2 fma avx512f avx512_vnni avx512_bf16 avx512_fp16 amx_tile amx_int8 amx_bf16
"""

ARM_CPUINFO = """\
processor\t: 0
BogoMIPS\t: 108.00
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp
CPU implementer\t: 0x41

processor\t: 1
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp

Model\t\t: Raspberry Pi 5 Model B Rev 1.0
"""


def _proc(root: Path, cpuinfo: str, mem_kib: int) -> Path:
    root.mkdir()
    (root / "cpuinfo").write_text(cpuinfo)
    (root / "meminfo").write_text(f"MemTotal:       {mem_kib} kB\nMemFree:        1 kB\n")
    return root


def test_x86_flags_cores_and_memory(tmp_path: Path) -> None:
    info = probe(proc_root=_proc(tmp_path / "proc", X86_CPUINFO, 2048), powercap_root=tmp_path,
                 jetson_root=tmp_path, openvino=False, nvml=False)
    assert info.cpu_model == "Intel(R) Xeon(R) Platinum 8480+"
    assert {"avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_int8", "amx_bf16"} <= set(info.isa)
    assert "fpu" not in info.isa
    assert info.physical_cores == 2  # three logical CPUs on two cores
    assert info.memory_bytes == 2048 * 1024
    assert info.energy_source == "modeled"
    assert info.openvino_devices is None
    assert info.gpus == ()


def test_arm_neon_and_model(tmp_path: Path) -> None:
    info = probe(proc_root=_proc(tmp_path / "proc", ARM_CPUINFO, 8 * 1024**2), powercap_root=tmp_path,
                 jetson_root=tmp_path, openvino=False, nvml=False)
    assert info.cpu_model == "Raspberry Pi 5 Model B Rev 1.0"
    assert info.isa == ("asimd", "asimdhp", "asimddp")
    assert info.physical_cores == info.logical_cores  # no topology lines: fall back to logical


def test_isa_flags_are_listed_in_a_stable_order() -> None:
    assert len(set(ISA_FLAGS)) == len(ISA_FLAGS)


def test_this_machine(tmp_path: Path) -> None:
    info = probe(powercap_root=tmp_path, jetson_root=tmp_path, openvino=False)
    assert info.logical_cores >= info.usable_cores >= 1
    assert info.memory_bytes > 0
    assert info.backends["onnxruntime"]
    assert set(info.energy_sources) == {"rapl", "nvml", "jetson"}
    doc = info.to_json()
    assert isinstance(doc["isa"], list)
    assert isinstance(doc["gpus"], list)
