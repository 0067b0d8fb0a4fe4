"""Energy: read real counters where the machine has them, model it where it does not.

Sources, each a cumulative joule counter (`joules()`, monotonic, zero is arbitrary):

- `RaplSource`: Intel RAPL package domains under /sys/class/powercap (`intel-rapl:N/energy_uj`),
  with counter wrap handled through `max_energy_range_uj`. Counts the whole socket, not only this
  process. Often readable by root only (since the Platypus fix, CVE-2020-8694).
- `NvmlSource`: NVIDIA GPUs through `nvmlDeviceGetTotalEnergyConsumption` (Volta and later).
- `JetsonSource`: the INA3221 monitors of Jetson boards give watts, not joules: they are sampled
  at every read and, optionally, on a background thread, and integrated (trapezoids).
- `ModeledSource`: a `PowerProfile`'s busy watts times wall time, where there is no counter.

`EnergyMeter` turns a source into readings, and every `EnergyReading` carries its label
(`measured:rapl`, `measured:nvml`, `measured:jetson` or `modeled:<profile>`), so a modeled figure
is never taken for a measured one. sysfs roots are constructor arguments, so tests can use fake trees.

Example:
    >>> meter = EnergyMeter.auto(PowerProfile("pi5", busy_watts=6.5, idle_watts=2.7))
    >>> with meter.measure() as span:
    ...     session.run(inputs)
    >>> span.reading.joules, span.reading.label
    (0.0123, 'measured:rapl')
"""

from __future__ import annotations

import logging
import math
import re
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from runtimes.errors import BackendUnavailable, ConfigError

logger = logging.getLogger(__name__)

POWERCAP_ROOT = Path("/sys/class/powercap")
JETSON_ROOT = Path("/sys/bus/i2c/drivers")
# Rails that measure the whole module's input on the Jetson boards that have them: read only
# those when present, since the other rails are parts of the same power.
JETSON_TOTAL_RAILS = ("VDD_IN", "POM_5V_IN", "VIN_SYS_5V0")
Clock = Callable[[], float]


@dataclass(frozen=True, slots=True)
class EnergyReading:
    """Energy used over a span, and whether it was measured or modeled (`label`)."""

    joules: float
    seconds: float
    label: str

    @property
    def watts(self) -> float:
        return self.joules / self.seconds if self.seconds > 0 else 0.0

    @property
    def measured(self) -> bool:
        return self.label.startswith("measured:")


@dataclass(frozen=True, slots=True)
class PowerProfile:
    """A device's power model: watts while computing, watts while idle, joules per byte sent.

    Example:
        >>> PowerProfile("jetson-orin-nano", busy_watts=10.0, idle_watts=4.0, joules_per_byte_sent=1e-7)
    """

    name: str
    busy_watts: float
    idle_watts: float = 0.0
    joules_per_byte_sent: float = 0.0

    def __post_init__(self) -> None:
        if not self.name:
            msg = "PowerProfile needs a name (it appears in every label as modeled:<name>)"
            raise ConfigError(msg)
        for field in ("busy_watts", "idle_watts", "joules_per_byte_sent"):
            value = getattr(self, field)
            if not math.isfinite(value) or value < 0:
                msg = f"PowerProfile {self.name!r}: {field} must be a finite number >= 0, got {value!r}"
                raise ConfigError(msg)

    @property
    def label(self) -> str:
        return f"modeled:{self.name}"


# One power profile per kind of machine. `runtimes.hardware.probe()` picks this machine's once
# (`HardwareInfo.power_profile`, shown by `tierkit doctor`), and the compiler (the manifest's energy),
# the agent and the controller all model energy with it, so one machine has one `modeled:<name>` label.
GENERIC_CPU = PowerProfile("generic-cpu", busy_watts=15.0, idle_watts=3.0, joules_per_byte_sent=5e-8)
JETSON = PowerProfile("jetson", busy_watts=10.0, idle_watts=4.0, joules_per_byte_sent=1e-7)
NVIDIA_GPU = PowerProfile("nvidia-gpu", busy_watts=70.0, idle_watts=10.0, joules_per_byte_sent=5e-8)
PROFILES: dict[str, PowerProfile] = {p.name: p for p in (GENERIC_CPU, JETSON, NVIDIA_GPU)}


def modeled_energy(profile: PowerProfile, busy_s: float, idle_s: float = 0.0, bytes_sent: int = 0) -> EnergyReading:
    """Energy `profile` predicts for `busy_s` of compute, `idle_s` of waiting and `bytes_sent` on the radio."""
    if busy_s < 0 or idle_s < 0 or bytes_sent < 0:
        msg = f"busy_s, idle_s and bytes_sent must be >= 0, got {busy_s}, {idle_s}, {bytes_sent}"
        raise ConfigError(msg)
    joules = profile.busy_watts * busy_s + profile.idle_watts * idle_s + profile.joules_per_byte_sent * bytes_sent
    return EnergyReading(joules, busy_s + idle_s, profile.label)


class EnergySource(Protocol):
    label: str

    def joules(self) -> float: ...

    def close(self) -> None: ...


class ModeledSource:
    """Busy watts times wall time: what a span costs if the device computes throughout."""

    def __init__(self, profile: PowerProfile, clock: Clock = time.perf_counter) -> None:
        self.profile, self.label, self._clock = profile, profile.label, clock

    def joules(self) -> float:
        return self.profile.busy_watts * self._clock()

    def close(self) -> None:
        pass


class RaplSource:
    """Intel RAPL package energy, summed over sockets, with counter wrap handled.

    Reads `<root>/intel-rapl:N/energy_uj` of the top-level (package) zones only; sub-zones
    (`intel-rapl:N:M`, core and dram) are parts of a package and would count twice. Wrap is
    detected when a counter goes backwards and corrected with `max_energy_range_uj`; reads must
    come at least once per wrap period (tens of minutes at full load).

    Raises:
        BackendUnavailable: no RAPL zone, or its counters are not readable (often root-only).
    """

    label = "measured:rapl"

    def __init__(self, root: Path = POWERCAP_ROOT) -> None:
        zones = sorted(p for p in Path(root).glob("intel-rapl:*") if re.fullmatch(r"intel-rapl:\d+", p.name))
        if not zones:
            msg = f"no Intel RAPL zones under {root} (not an Intel CPU, a VM, or the powercap driver is not loaded)"
            raise BackendUnavailable(msg)
        try:
            self._ranges = [int((z / "max_energy_range_uj").read_text()) for z in zones]
            self._last = [int((z / "energy_uj").read_text()) for z in zones]
        except PermissionError:
            msg = f"RAPL counters under {root} are readable by root only; run as root or make energy_uj readable"
            raise BackendUnavailable(msg) from None
        except (OSError, ValueError) as exc:
            msg = f"RAPL counters under {root} are unreadable: {exc}"
            raise BackendUnavailable(msg) from None
        self._files = [z / "energy_uj" for z in zones]
        self._total_uj = 0
        self._lock = threading.Lock()

    def joules(self) -> float:
        with self._lock:
            for i, path in enumerate(self._files):
                now = int(path.read_text())
                delta = now - self._last[i]
                if delta < 0:  # the counter wrapped at max_energy_range_uj
                    delta += self._ranges[i]
                self._total_uj += delta
                self._last[i] = now
            return self._total_uj / 1e6

    def close(self) -> None:
        pass


class NvmlSource:
    """Total energy of NVIDIA GPUs (all, or those in `indices`) from NVML's millijoule counter."""

    label = "measured:nvml"

    def __init__(self, indices: tuple[int, ...] | None = None) -> None:
        try:
            import pynvml
        except ImportError:
            msg = "NVML energy needs the nvidia-ml-py package: pip install nvidia-ml-py"
            raise BackendUnavailable(msg) from None
        self._nvml: Any = pynvml
        try:
            pynvml.nvmlInit()
            count = pynvml.nvmlDeviceGetCount()
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in (indices or range(count))]
            if not self._handles:
                raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)
            self.joules()
        except pynvml.NVMLError as exc:
            msg = f"NVML energy counters are not usable here: {exc}"
            raise BackendUnavailable(msg) from None

    def joules(self) -> float:
        total_mj: int = sum(self._nvml.nvmlDeviceGetTotalEnergyConsumption(h) for h in self._handles)
        return total_mj / 1e3

    def close(self) -> None:
        self._nvml.nvmlShutdown()


def _read_number(path: Path) -> float:
    return float(path.read_text().split()[0])


def _milliwatt_reader(power: Path) -> Callable[[], float]:
    return lambda: _read_number(power) / 1e3


def _volt_amp_reader(volts: Path, amps: Path) -> Callable[[], float]:
    """Watts from a millivolt and a milliampere file."""
    return lambda: _read_number(volts) * _read_number(amps) / 1e6


def _jetson_rails(root: Path) -> dict[str, Callable[[], float]]:
    """Rail name -> function returning watts, for both sysfs layouts of the INA3221 driver."""
    rails: dict[str, Callable[[], float]] = {}
    # L4T 32 and earlier: ina3221x/<bus-addr>/iio:deviceN/{rail_name_K, in_power K_input (mW)}
    for name_file in sorted(root.glob("ina3221x/*/iio:device*/rail_name_*")):
        k = name_file.name.rpartition("_")[2]
        power = name_file.parent / f"in_power{k}_input"
        if power.is_file():
            rails[name_file.read_text().strip()] = _milliwatt_reader(power)
    # L4T 34 and later (hwmon): ina3221/<bus-addr>/hwmon/hwmonN/{inK_label, inK_input (mV), currK_input (mA)}
    for label_file in sorted(root.glob("ina3221/*/hwmon/hwmon*/in*_label")):
        k = label_file.name[2:].partition("_")[0]
        volts, amps = label_file.parent / f"in{k}_input", label_file.parent / f"curr{k}_input"
        if volts.is_file() and amps.is_file():
            rails[label_file.read_text().strip()] = _volt_amp_reader(volts, amps)
    return rails


class JetsonSource:
    """Jetson INA3221 power rails, integrated into joules.

    Args:
        root: the i2c drivers directory holding `ina3221x/` or `ina3221/`.
        rails: rail names to add up; default: the module input rail (VDD_IN or POM_5V_IN) if the
            board has one, else every rail.
        interval_s: background sampling period; None samples only when `joules()` is called, which
            is exact for constant power and what the tests use.
        clock: time source (seconds).
    """

    label = "measured:jetson"

    def __init__(self, root: Path = JETSON_ROOT, *, rails: tuple[str, ...] | None = None,
                 interval_s: float | None = 0.05, clock: Clock = time.monotonic) -> None:
        found = _jetson_rails(Path(root))
        if not found:
            msg = f"no INA3221 power rails under {root} (not a Jetson, or the driver is not loaded)"
            raise BackendUnavailable(msg)
        totals = [r for r in JETSON_TOTAL_RAILS if r in found]
        wanted = rails or tuple(totals[:1]) or tuple(found)
        unknown = sorted(set(wanted) - set(found))
        if unknown:
            msg = f"Jetson rails {unknown} not found under {root}; this board has {sorted(found)}"
            raise ConfigError(msg)
        self.rails = wanted
        self._readers = [found[r] for r in wanted]
        self._clock = clock
        self._lock = threading.Lock()
        self._t, self._w, self._total = clock(), self._watts(), 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if interval_s is not None:
            self._thread = threading.Thread(target=self._sample_loop, args=(interval_s,), daemon=True,
                                            name="tierkit-jetson-power")
            self._thread.start()

    def _watts(self) -> float:
        return sum(read() for read in self._readers)

    def _sample(self) -> float:
        with self._lock:
            t, w = self._clock(), self._watts()
            self._total += (w + self._w) / 2 * (t - self._t)
            self._t, self._w = t, w
            return self._total

    def _sample_loop(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            try:
                self._sample()
            except OSError:  # a rail file vanished (driver reload): keep the last figure, say so once
                logger.warning("Jetson power rails stopped answering; energy integration is paused")
                return

    def joules(self) -> float:
        return self._sample()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


@dataclass
class Span:
    """One `EnergyMeter.measure()` span; `reading` is set when the `with` block ends."""

    reading: EnergyReading | None = None


class EnergyMeter:
    """Measures the energy of spans of code with one source; every reading carries the source's label.

    Example:
        >>> meter = EnergyMeter(RaplSource())
        >>> meter.start(); session.run(inputs); reading = meter.stop()
    """

    def __init__(self, source: EnergySource, clock: Clock = time.perf_counter) -> None:
        self.source, self._clock = source, clock
        self._start: tuple[float, float] | None = None

    @property
    def label(self) -> str:
        return self.source.label

    @classmethod
    def auto(cls, profile: PowerProfile, *, powercap_root: Path = POWERCAP_ROOT, jetson_root: Path = JETSON_ROOT,
             nvml: bool = True, device: str = "cpu") -> EnergyMeter:
        """The first usable real source that measures `device`, else the modeled `profile`.

        RAPL and Jetson rails measure the CPU package or the whole board; NVML measures NVIDIA GPUs only,
        so it is used only when `device` is one ("cuda", "cuda:0", "gpu"): CPU inference on a machine
        that has a GPU is never labelled `measured:nvml`.
        """
        on_gpu = device.partition(":")[0].lower() in ("cuda", "gpu")
        makers = _source_makers(powercap_root, jetson_root, nvml and on_gpu, jetson_interval_s=0.05)
        for name, make in makers.items():
            try:
                return cls(make())
            except BackendUnavailable as exc:
                logger.debug("energy source %s skipped: %s", name, exc)
        return cls(ModeledSource(profile))

    def start(self) -> None:
        self._start = (self.source.joules(), self._clock())

    def stop(self) -> EnergyReading:
        if self._start is None:
            msg = "EnergyMeter.stop() called before start()"
            raise ConfigError(msg)
        j0, t0 = self._start
        self._start = None
        return EnergyReading(self.source.joules() - j0, self._clock() - t0, self.source.label)

    @contextmanager
    def measure(self) -> Iterator[Span]:
        """Measure the `with` block; independent of `start`/`stop`, and spans may nest."""
        span = Span()
        j0, t0 = self.source.joules(), self._clock()
        try:
            yield span
        finally:
            span.reading = EnergyReading(self.source.joules() - j0, self._clock() - t0, self.source.label)

    def close(self) -> None:
        self.source.close()


def _source_makers(powercap_root: Path, jetson_root: Path, nvml: bool,
                   jetson_interval_s: float | None) -> dict[str, Callable[[], EnergySource]]:
    makers: dict[str, Callable[[], EnergySource]] = {"rapl": lambda: RaplSource(powercap_root)}
    if nvml:
        makers["nvml"] = NvmlSource
    makers["jetson"] = lambda: JetsonSource(jetson_root, interval_s=jetson_interval_s)
    return makers


def probe_sources(*, powercap_root: Path = POWERCAP_ROOT, jetson_root: Path = JETSON_ROOT,
                  nvml: bool = True) -> dict[str, str]:
    """Each real source -> "ok" or why it is not usable (for `tierkit doctor`)."""
    status = {"rapl": "", "nvml": "not probed", "jetson": ""}
    for name, make in _source_makers(powercap_root, jetson_root, nvml, jetson_interval_s=None).items():
        try:
            make().close()
            status[name] = "ok"
        except BackendUnavailable as exc:
            status[name] = str(exc)
    return status
