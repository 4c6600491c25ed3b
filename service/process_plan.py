"""Which processes `convserve serve` runs (service/supervisor.py starts and keeps them): one model
worker per device, and how many HTTP front ends stand in front of them. Decided once, at start-up,
from the settings and what the host has; the supervisor and `convserve decode --shards` ask here."""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import NamedTuple

from convkernels.registry import visible_cuda_devices

from .settings import Settings, parse_devices


@dataclass(frozen=True)
class Device:
    label: str                 # "cpu", "cuda:0", ...
    cuda_visible: str | None   # what CUDA_VISIBLE_DEVICES is in its worker


def plan_devices(settings: Settings) -> list[Device]:
    """One model worker per GPU when the backend is (or, on auto, would be) cuda; else one, or,
    when CONVSERVE_DEVICES names several ordinals, that many workers on the CPU backend, each a
    device of its own (cpu:0, cpu:1, ...: how the tests emulate several GPUs)."""
    want_cuda = settings.backend == "cuda" or (
        settings.backend == "auto" and importlib.util.find_spec("cupy") is not None)
    count = visible_cuda_devices() if want_cuda else 0
    ordinals = parse_devices(settings.devices)
    if count == 0:
        if ordinals is not None and len(ordinals) > 1:
            return [Device(f"cpu:{i}", None) for i in ordinals]
        return [Device("mlx" if settings.backend == "mlx" else "cpu", None)]
    ordinals = ordinals or list(range(count))
    bad = [i for i in ordinals if i >= count]
    if bad:
        raise ValueError(f"CONVSERVE_DEVICES names GPU(s) {bad}, but {count} are visible")
    parent = os.environ.get("CUDA_VISIBLE_DEVICES")
    physical = [p.strip() for p in parent.split(",")] if parent else [str(i) for i in range(count)]
    return [Device(f"cuda:{i}", physical[i]) for i in ordinals]


def available_cpus() -> int:
    """The cores this process may use: its CPU affinity, and a container's CPU quota (cgroup v2
    cpu.max) where one is set; os.cpu_count() counts the whole host."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        quota, period = open("/sys/fs/cgroup/cpu.max").read().split()
        if quota != "max":
            cores = min(cores, max(1, -(-int(quota) // int(period))))
    except (OSError, ValueError):
        pass
    return cores


def frontends_for(settings: Settings, devices: list[Device]) -> int:
    """--workers, or auto: one front end where the CPU computes, else every core this process may
    use but one per model worker and one for the kernel's network work (at least 2, at most 32).

    Why that many: with GPUs the front ends' CPU (bodies, image codecs) is what limits small
    requests. ConvNeXt-T one image a request, one H200 on a 16-core host (2026-11-30, clients
    costing 0.9 cores): 8 front ends served 7,325 img/s from uint8 .npy bodies (0.85 of the raw
    model) and 4,491 from JPEG (0.52); 14 served 8,046 (0.97) and 5,276 (0.64)."""
    if settings.workers:
        return settings.workers
    if devices[0].cuda_visible is None:
        return 1
    return max(2, min(32, available_cpus() - len(devices) - 1))


def frontend_priority_warning(settings: Settings, devices: list[Device]) -> str | None:
    """FRONTEND_NICE where the CPU computes: the model worker takes every core there, and front
    ends below it answer (health checks too) only in its gaps."""
    if settings.frontend_nice and devices[0].cuda_visible is None:
        return (f"FRONTEND_NICE={settings.frontend_nice} on a CPU backend: the front ends run below the model "
                "worker, which takes every core, and may answer late under load (health checks too); 0 is the default")
    return None


#: pinning leaves at least this many cores a GPU worker (its own included)
CORES_PER_PINNED_WORKER = 4


class Pins(NamedTuple):
    workers: list[frozenset[int]]  # each model worker's core, in device order
    rest: frozenset[int]           # the supervisor, the front ends and everything they start


def pins(settings: Settings, devices: list[Device], cpus: set[int] | None = None) -> Pins | None:
    """Where PIN_WORKERS=on puts the processes: each GPU's model worker on a core of its own, the
    last of `cpus` (this process's affinity), everything else on the others; None: no pinning (off,
    a CPU or Apple GPU worker, which computes on every core, a host without affinity, or fewer than
    CORES_PER_PINNED_WORKER cores a GPU worker). The same cores for every server on a host: that
    is why it is not the default (two servers sharing a host's cores would share their workers').

    Why: a model worker's threads (the device thread, the links thread that reads its front ends,
    CUDA's event thread) share one interpreter lock, so they never compute side by side; on cores
    of their own each hand-over of the lock is a wake-up on another core. One H200, ConvNeXt-T one
    image a request (2026-11-30, two interleaved pairs): the worker took 61 / 64 us of CPU a request
    on one core against 83 / 72 unpinned, its device thread waiting 0.03 times a request against
    0.26, and served 13,876 / 13,189 img/s against 11,955 / 13,181; on two cores 70 us."""
    if settings.pin_workers != "on" or not devices or devices[0].cuda_visible is None:
        return None
    if cpus is None:
        if not hasattr(os, "sched_getaffinity"):
            return None
        cpus = os.sched_getaffinity(0)
    ordered = sorted(cpus)
    if len(ordered) < CORES_PER_PINNED_WORKER * len(devices):
        return None
    own = ordered[len(ordered) - len(devices):]
    return Pins([frozenset([core]) for core in own], frozenset(ordered[:len(ordered) - len(devices)]))
