"""Which processes `convserve serve` runs (service/supervisor.py starts and keeps them): one model
worker per device, and how many HTTP front ends stand in front of them. Decided once, at start-up,
from the settings and what the host has; the supervisor and `convserve decode --shards` ask here."""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

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
