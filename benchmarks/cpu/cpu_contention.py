"""What else ran on the CPUs while a benchmark call ran, and what the CPU is.

A shared box's other work inflates a timing without showing in it, so cpu_runtimes.py sets aside
every run during which other processes used too much CPU, instead of averaging it in. "Other" is
the CPUs' busy time over the run (wall time minus the idle and iowait time in /proc/stat, for the
CPUs this process may run on) minus this process's own CPU time (getrusage, all its threads).
Busy time includes steal time (a hypervisor giving the CPU away), which slows a run all the same.

/proc/stat counts in clock ticks (1/100 s), each CPU's counter on its own, so a window of `wall`
seconds on n CPUs reads "others" to within n / HZ / wall cores: runs must last long enough for
that to stay well under the discard limit (cpu_runtimes.py repeats short calls within a run).
Linux only.
"""
from __future__ import annotations

import os
import resource
import time
from pathlib import Path

HZ = os.sysconf("SC_CLK_TCK")
#: the vector and matrix extensions that decide which kernels each runtime can use
FEATURES = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


def allowed_cpus() -> set[int]:
    return set(os.sched_getaffinity(0))


def idle_ticks(cpus: set[int], stat_text: str | None = None) -> int:
    """Idle plus iowait ticks summed over the CPUs `cpus` (ids), from /proc/stat's cpuN lines."""
    text = Path("/proc/stat").read_text() if stat_text is None else stat_text
    total = 0
    for line in text.splitlines():
        if line.startswith("cpu") and line[3:4].isdigit():
            name, *ticks = line.split()
            if int(name[3:]) in cpus:
                total += int(ticks[3]) + int(ticks[4])
    return total


def others_cores(idle_delta_ticks: int, own_cpu_s: float, wall_s: float, n_cpus: int, hz: int = HZ) -> float:
    """Cores' worth of CPU that other processes used during a window of `wall_s` seconds."""
    busy_s = n_cpus * wall_s - idle_delta_ticks / hz
    return max(0.0, busy_s - own_cpu_s) / wall_s


def resolution_cores(n_cpus: int, wall_s: float, hz: int = HZ) -> float:
    """The most a tick-rounded reading of others_cores can be off, for a window of `wall_s`."""
    return n_cpus / hz / wall_s


def own_cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


class Window:
    """`with Window() as w: ...` -> w.wall_s, w.own_cpu_s, w.others_cores for the block."""

    def __init__(self, cpus: set[int] | None = None):
        self.cpus = allowed_cpus() if cpus is None else cpus

    def __enter__(self):
        self._t = time.perf_counter()
        self._idle = idle_ticks(self.cpus)
        self._cpu = own_cpu_s()
        return self

    def __exit__(self, *exc):
        cpu = own_cpu_s()
        idle = idle_ticks(self.cpus)
        self.wall_s = time.perf_counter() - self._t
        self.own_cpu_s = cpu - self._cpu
        self.others_cores = others_cores(idle - self._idle, self.own_cpu_s, self.wall_s, len(self.cpus))
        return False


def cpu_description(cpuinfo_text: str | None = None, cpus: set[int] | None = None) -> dict:
    """Model name, physical cores among `cpus` (default: this process's) and FEATURES present."""
    text = Path("/proc/cpuinfo").read_text() if cpuinfo_text is None else cpuinfo_text
    cpus = allowed_cpus() if cpus is None else cpus
    model, flags, cores = "unknown", set(), set()
    for block in text.strip().split("\n\n"):
        fields = dict(line.split(":", 1) for line in block.splitlines() if ":" in line)
        fields = {k.strip(): v.strip() for k, v in fields.items()}
        if int(fields.get("processor", -1)) not in cpus:
            continue
        model = fields.get("model name", model)
        flags = set(fields.get("flags", "").split()) or flags
        cores.add((fields.get("physical id", "0"), fields.get("core id", fields.get("processor"))))
    return {"model": model, "logical_cpus": len(cpus), "physical_cores": len(cores) or len(cpus),
            "features": {f: f in flags for f in FEATURES}}


def load_average() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])
