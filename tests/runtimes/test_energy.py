"""Energy sources on fake sysfs trees, the modeled fallback, and the labels every reading carries."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

from runtimes.energy import (
    EnergyMeter,
    EnergyReading,
    JetsonSource,
    ModeledSource,
    NvmlSource,
    PowerProfile,
    RaplSource,
    modeled_energy,
    probe_sources,
)
from runtimes.errors import BackendUnavailable, ConfigError

PI = PowerProfile("pi5", busy_watts=6.0, idle_watts=2.5, joules_per_byte_sent=1e-6)


def _rapl_zone(root: Path, name: str, energy_uj: int, max_uj: int) -> Path:
    zone = root / name
    zone.mkdir(parents=True)
    (zone / "name").write_text("package-0\n")
    (zone / "energy_uj").write_text(f"{energy_uj}\n")
    (zone / "max_energy_range_uj").write_text(f"{max_uj}\n")
    return zone


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_rapl_counts_across_a_wrap(tmp_path: Path) -> None:
    zone = _rapl_zone(tmp_path, "intel-rapl:0", energy_uj=999_000_000, max_uj=1_000_000_000)
    source = RaplSource(tmp_path)
    start = source.joules()
    (zone / "energy_uj").write_text("500000000\n")  # +1 J to the top, wrap, +500 J
    assert source.joules() - start == pytest.approx(501.0)
    (zone / "energy_uj").write_text("700000000\n")
    assert source.joules() - start == pytest.approx(701.0)


def test_rapl_sums_packages_and_skips_subzones(tmp_path: Path) -> None:
    zero = _rapl_zone(tmp_path, "intel-rapl:0", 0, 10**12)
    one = _rapl_zone(tmp_path, "intel-rapl:1", 0, 10**12)
    core = _rapl_zone(tmp_path, "intel-rapl:0:0", 0, 10**12)  # part of package 0: must not count twice
    meter = EnergyMeter(RaplSource(tmp_path))
    meter.start()
    (zero / "energy_uj").write_text("2000000\n")
    (one / "energy_uj").write_text("3000000\n")
    (core / "energy_uj").write_text("1000000\n")
    reading = meter.stop()
    assert reading.joules == pytest.approx(5.0)
    assert reading.label == "measured:rapl"
    assert reading.measured


def test_rapl_absent_or_root_only(tmp_path: Path) -> None:
    with pytest.raises(BackendUnavailable, match="no Intel RAPL zones"):
        RaplSource(tmp_path)
    zone = _rapl_zone(tmp_path, "intel-rapl:0", 0, 10)
    (zone / "energy_uj").unlink()
    (zone / "energy_uj").mkdir()  # unreadable as a file, whoever we run as
    with pytest.raises(BackendUnavailable, match="unreadable"):
        RaplSource(tmp_path)


def _hwmon_rail(root: Path, k: int, label: str, millivolts: int, milliamps: int) -> Path:
    hwmon = root / "ina3221" / "1-0040" / "hwmon" / "hwmon3"
    hwmon.mkdir(parents=True, exist_ok=True)
    (hwmon / f"in{k}_label").write_text(f"{label}\n")
    (hwmon / f"in{k}_input").write_text(f"{millivolts}\n")
    (hwmon / f"curr{k}_input").write_text(f"{milliamps}\n")
    return hwmon


def test_jetson_hwmon_rails_integrate_to_joules(tmp_path: Path) -> None:
    hwmon = _hwmon_rail(tmp_path, 1, "VDD_IN", 5000, 2000)  # 10 W for the whole module
    _hwmon_rail(tmp_path, 2, "VDD_CPU_GPU_CV", 5000, 1000)  # part of VDD_IN: ignored by default
    clock = FakeClock()
    source = JetsonSource(tmp_path, interval_s=None, clock=clock)
    assert source.rails == ("VDD_IN",)
    meter = EnergyMeter(source, clock=clock)
    with meter.measure() as span:
        clock.now = 2.0
        assert source.joules() == pytest.approx(20.0)
        (hwmon / "curr1_input").write_text("4000\n")  # 20 W from here
        clock.now = 3.0
    assert span.reading == EnergyReading(pytest.approx(35.0), 3.0, "measured:jetson")  # 20 J + trapezoid 15 J


def test_jetson_legacy_iio_rails_and_explicit_selection(tmp_path: Path) -> None:
    iio = tmp_path / "ina3221x" / "0-0041" / "iio:device1"
    iio.mkdir(parents=True)
    for k, (name, mw) in enumerate([("GPU", 1500), ("CPU", 2500), ("SOC", 1000)]):
        (iio / f"rail_name_{k}").write_text(f"{name}\n")
        (iio / f"in_power{k}_input").write_text(f"{mw}\n")
    clock = FakeClock()
    every = JetsonSource(tmp_path, interval_s=None, clock=clock)  # no VDD_IN here: all rails
    two = JetsonSource(tmp_path, rails=("GPU", "CPU"), interval_s=None, clock=clock)
    clock.now = 4.0
    assert every.joules() == pytest.approx(20.0)
    assert two.joules() == pytest.approx(16.0)
    with pytest.raises(ConfigError, match=r"rails \['NPU'\] not found"):
        JetsonSource(tmp_path, rails=("NPU",), interval_s=None)


def test_jetson_background_sampler_starts_and_stops(tmp_path: Path) -> None:
    _hwmon_rail(tmp_path, 1, "VDD_IN", 5000, 1000)
    source = JetsonSource(tmp_path, interval_s=0.001)
    assert source.joules() >= 0.0
    source.close()
    with pytest.raises(BackendUnavailable, match="no INA3221"):
        JetsonSource(tmp_path / "absent")


def test_modeled_energy_is_labelled_with_the_profile() -> None:
    reading = modeled_energy(PI, busy_s=2.0, idle_s=4.0, bytes_sent=1_000_000)
    assert reading.joules == pytest.approx(6.0 * 2 + 2.5 * 4 + 1.0)
    assert (reading.seconds, reading.label, reading.measured) == (6.0, "modeled:pi5", False)
    assert reading.watts == pytest.approx(23.0 / 6)
    with pytest.raises(ConfigError, match="busy_s"):
        modeled_energy(PI, busy_s=-1)


def test_modeled_meter_charges_busy_watts() -> None:
    clock = FakeClock()
    meter = EnergyMeter(ModeledSource(PI, clock=clock), clock=clock)
    meter.start()
    clock.now = 0.5
    reading = meter.stop()
    assert reading == EnergyReading(pytest.approx(3.0), 0.5, "modeled:pi5")
    with pytest.raises(ConfigError, match="before start"):
        meter.stop()


@pytest.mark.parametrize("bad", [{"busy_watts": -1.0}, {"idle_watts": float("nan")}, {"name": ""}])
def test_power_profile_validates(bad: dict[str, object]) -> None:
    fields: dict[str, object] = {"name": "x", "busy_watts": 1.0, **bad}
    with pytest.raises(ConfigError):
        PowerProfile(**fields)  # type: ignore[arg-type]


def test_auto_falls_back_to_the_model_and_says_so(tmp_path: Path) -> None:
    meter = EnergyMeter.auto(PI, powercap_root=tmp_path / "none", jetson_root=tmp_path / "none", nvml=False)
    assert meter.label == "modeled:pi5"
    _rapl_zone(tmp_path / "powercap", "intel-rapl:0", 0, 10**9)
    assert EnergyMeter.auto(PI, powercap_root=tmp_path / "powercap", nvml=False).label == "measured:rapl"


def _stand_in_nvml(monkeypatch: pytest.MonkeyPatch, counters: dict[int, int]) -> None:
    # No NVIDIA driver here: a stand-in module with NVML's names and units (mJ since driver load).
    nvml = types.ModuleType("pynvml")
    nvml.NVMLError = type("NVMLError", (Exception,), {})  # type: ignore[attr-defined]
    nvml.NVML_ERROR_NOT_FOUND = 6  # type: ignore[attr-defined]
    nvml.nvmlInit = nvml.nvmlShutdown = lambda: None  # type: ignore[attr-defined]
    nvml.nvmlDeviceGetCount = lambda: 2  # type: ignore[attr-defined]
    nvml.nvmlDeviceGetHandleByIndex = lambda i: i  # type: ignore[attr-defined]
    nvml.nvmlDeviceGetTotalEnergyConsumption = lambda h: counters[h]  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "pynvml", nvml)


def test_nvml_source_reads_millijoules(monkeypatch: pytest.MonkeyPatch) -> None:
    counters = {0: 10_000, 1: 5_000}
    _stand_in_nvml(monkeypatch, counters)
    meter = EnergyMeter(NvmlSource())
    with meter.measure() as span:
        counters[0] += 1500
        counters[1] += 500
    assert span.reading is not None
    assert (span.reading.joules, span.reading.label) == (pytest.approx(2.0), "measured:nvml")
    meter.close()


def test_auto_never_labels_cpu_inference_with_the_gpu_counter(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    # a machine with an NVIDIA GPU and no RAPL: NVML measures the GPU, not the CPU that runs the model
    _stand_in_nvml(monkeypatch, {0: 10_000, 1: 5_000})
    none = tmp_path / "none"
    assert EnergyMeter.auto(PI, powercap_root=none, jetson_root=none).label == "modeled:pi5"
    assert EnergyMeter.auto(PI, powercap_root=none, jetson_root=none, device="cpu").label == "modeled:pi5"
    assert EnergyMeter.auto(PI, powercap_root=none, jetson_root=none, device="cuda:0").label == "measured:nvml"


def test_probe_sources_reports_why(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)
    _rapl_zone(tmp_path / "powercap", "intel-rapl:0", 0, 10**9)
    status = probe_sources(powercap_root=tmp_path / "powercap", jetson_root=tmp_path / "none")
    assert status["rapl"] == "ok"
    assert "pip install nvidia-ml-py" in status["nvml"]
    assert "no INA3221" in status["jetson"]
