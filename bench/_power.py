"""Subjects run back to back for a sustained window each, with the energy the GPU drew and the clocks it ran at:
what tells a kernel that is slower at the power limit because it spends more energy per launch from one that is
slower at any clock (bench/NOTES.md, Hopper GEMM §16: hot timing of large products runs at the power limit).

The energy, SM clock, power and the reasons the driver gives for holding the clocks down are NVML's (the driver's
libnvidia-ml), read through ctypes; a thread samples the clocks while a window runs."""

from __future__ import annotations

import ctypes
import math
import statistics
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from mage_gen.measure import Subject, round_order

# nvmlClocksEventReasons (nvml.h): why the clocks are below their maximum
CLOCK_REASONS = {0x1: "gpu_idle", 0x2: "applications_clocks", 0x4: "sw_power_cap", 0x8: "hw_slowdown",
                 0x10: "sync_boost", 0x20: "sw_thermal", 0x40: "hw_thermal", 0x80: "hw_power_brake",
                 0x100: "display_clocks"}
_NVML_CLOCK_SM = 1  # nvmlClockType_t


def clock_reasons(mask: int) -> list[str]:
    """The names of the reasons set in an nvmlClocksEventReasons mask (bits nvml.h does not name as hex)."""
    named = [name for bit, name in CLOCK_REASONS.items() if mask & bit]
    rest = mask & ~sum(CLOCK_REASONS)
    return named + ([hex(rest)] if rest else [])


class Meter(Protocol):
    """What a sustained window reads of the GPU."""

    def energy_mj(self) -> int: ...
    def sm_mhz(self) -> int: ...
    def power_w(self) -> float: ...
    def reasons(self) -> int: ...


class Nvml:
    """The GPU of CUDA device `ordinal`, found by its PCI bus id (NVML numbers GPUs its own way)."""

    def __init__(self, ordinal: int = 0):
        from cuda.bindings import driver as cu

        from mage_gen import gpu

        gpu.open_device(ordinal)
        bus_id = gpu.check(cu.cuDeviceGetPCIBusId(64, gpu.check(cu.cuDeviceGet(ordinal), "cuDeviceGet")),
                           "cuDeviceGetPCIBusId")
        self.lib = ctypes.CDLL("libnvidia-ml.so.1")
        self._call("nvmlInit_v2")
        self.handle = ctypes.c_void_p()
        self._call("nvmlDeviceGetHandleByPciBusId_v2", ctypes.c_char_p(bus_id.split(b"\0", 1)[0]),
                   ctypes.byref(self.handle))
        # the newer name of the same call (drivers before 535 have only the older one)
        self._reasons = next(name for name in ("nvmlDeviceGetCurrentClocksEventReasons",
                                               "nvmlDeviceGetCurrentClocksThrottleReasons")
                             if hasattr(self.lib, name))

    def _call(self, name: str, *args: Any) -> None:
        status = getattr(self.lib, name)(*args)
        if status != 0:
            raise RuntimeError(f"{name} returned NVML error {status}")

    def _read(self, name: str, kind: Any, *args: Any) -> Any:
        value = kind()
        self._call(name, self.handle, *args, ctypes.byref(value))
        return value.value

    def energy_mj(self) -> int:
        return self._read("nvmlDeviceGetTotalEnergyConsumption", ctypes.c_ulonglong)

    def sm_mhz(self) -> int:
        return self._read("nvmlDeviceGetClockInfo", ctypes.c_uint, _NVML_CLOCK_SM)

    def power_w(self) -> float:
        return self._read("nvmlDeviceGetPowerUsage", ctypes.c_uint) / 1000.0

    def reasons(self) -> int:
        return self._read(self._reasons, ctypes.c_ulonglong)


@dataclass
class Sampler:
    """Reads the meter every `period` seconds on a thread while running, each reading tagged with `label`."""

    meter: Meter
    period: float = 0.01
    label: str | None = None
    readings: list[tuple[str, int, float, int]] = field(default_factory=list)  # (label, MHz, W, reasons)
    _stop: threading.Event = field(default_factory=threading.Event)

    def __enter__(self) -> Sampler:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            label = self.label
            if label is not None:
                self.readings.append((label, self.meter.sm_mhz(), self.meter.power_w(), self.meter.reasons()))


@dataclass(frozen=True)
class Window:
    """One subject's sustained window: `replays` replays of a graph of `launches` launches."""

    replays: int
    launches: int
    first_us: float  # per launch: the median of the window's first eighth of replays
    settled_us: float  # per launch: the median of its second half
    mj_per_launch: float  # the energy the GPU drew over the window, over the launches in it (the warm-up's too)
    watts: float  # that energy over the window's wall time


def window(subject: Subject, replays: int, launches: int, meter: Meter) -> Window:
    started, before = time.perf_counter(), meter.energy_mj()
    samples = subject.hot(replays, launches)
    drawn, took = meter.energy_mj() - before, time.perf_counter() - started
    return Window(replays=replays, launches=launches,
                  first_us=statistics.median(samples[:max(1, len(samples) // 8)]),
                  settled_us=statistics.median(samples[len(samples) // 2:]),
                  mj_per_launch=drawn / ((replays + 1) * launches),  # hot() replays once more to warm up
                  watts=drawn / 1000.0 / took if took > 0 else math.nan)


def sustained_rounds(subjects: Sequence[Subject], rounds: int, seconds: float, launches: int,
                     meter: Meter, sampler: Sampler | None = None) -> list[dict[str, Window]]:
    """rounds × each subject for about `seconds` of back-to-back replays (in round_order: reversed every other
    round), its replays sized from a short replay of its own; each round's windows by name."""
    per_launch = {s.name: statistics.median(s.hot(3, launches)) for s in subjects}
    taken = []
    for r in range(rounds):
        got = {}
        for subject in round_order([subjects], r):
            replays = max(8, math.ceil(seconds * 1e6 / (per_launch[subject.name] * launches)))
            if sampler is not None:
                sampler.label = subject.name
            got[subject.name] = window(subject, replays, launches, meter)
            if sampler is not None:
                sampler.label = None
        taken.append(got)
    return taken


def summary(taken: Sequence[dict[str, Window]], readings: Sequence[tuple[str, int, float, int]],
            reference: str) -> dict[str, dict]:
    """Each subject's medians over the rounds, its clocks while it ran, and its settled time and energy per
    launch over `reference`'s, round by round (the median of the rounds' ratios)."""
    out = {}
    for name in taken[0]:
        windows = [t[name] for t in taken]
        mine = [(label, mhz, w, reasons) for label, mhz, w, reasons in readings if label == name]
        row: dict[str, Any] = {key: statistics.median(getattr(w, key) for w in windows)
                               for key in ("first_us", "settled_us", "mj_per_launch", "watts")}
        row["rounds"] = len(windows)
        if mine:
            row["sm_mhz"] = {"median": statistics.median(r[1] for r in mine), "min": min(r[1] for r in mine),
                             "max": max(r[1] for r in mine)}
            row["power_w_median"] = statistics.median(r[2] for r in mine)
            row["readings"] = len(mine)
            row["share_of_readings_power_capped"] = sum("sw_power_cap" in clock_reasons(r[3]) for r in mine) / len(mine)
        if name != reference and reference in taken[0]:
            row["over_reference"] = {
                key: statistics.median(getattr(t[name], key) / getattr(t[reference], key) for t in taken)
                for key in ("settled_us", "mj_per_launch")}
        out[name] = row
    return out


def sustained(subjects: Sequence[Subject], seconds: float, rounds: int, launches: int, reference: str,
              label: str) -> dict:
    """sustained_rounds on this GPU (device 0), sampled and summarized against `reference`, each subject's line
    printed under `label`."""
    meter = Nvml()
    with Sampler(meter) as sampler:
        taken = sustained_rounds(subjects, rounds, seconds, launches, meter, sampler)
    table = summary(taken, sampler.readings, reference)
    for name, row in sorted(table.items(), key=lambda item: item[1]["settled_us"]):
        over = row.get("over_reference")
        print(f"{label} sustained {name:50} {row['first_us']:9.2f} → {row['settled_us']:9.2f} µs "
              f"{row['mj_per_launch']:8.3f} mJ {row['watts']:6.1f} W SM {row.get('sm_mhz', {}).get('median', 0):5.0f} "
              f"MHz capped {row.get('share_of_readings_power_capped', 0):.2f}"
              + (f"  over {reference}: time {over['settled_us']:.4f} energy {over['mj_per_launch']:.4f}"
                 if over else ""),
              flush=True)
    return {"seconds": seconds, "rounds": rounds, "launches_per_replay": launches, "reference": reference,
            "subjects": table}
