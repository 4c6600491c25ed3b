"""PIN_WORKERS=on on a CUDA host (service/process_plan.py `pins`, service/threads.py `pin_process`):
a real `convserve serve` with two front ends; every thread of each GPU's model worker (the CUDA
driver's and the ones started after its models loaded included) runs on one core of its own, the
last cores of the server's set in device order, and no thread of the supervisor or a front end
runs there; the service answers. Skipped without a CUDA GPU (CI runs the plan and the pinning
itself: tests/test_service_devices.py)."""
from __future__ import annotations

import os
from pathlib import Path

import httpx
import numpy as np
import pytest

from gpu_support import cuda_or_skip

pytestmark = pytest.mark.gpu


def affinities(pid: int) -> dict[int, set[int]]:
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            out[int(task.name)] = os.sched_getaffinity(int(task.name))
        except OSError:  # a thread that ended meanwhile
            pass
    return out


def children(pid: int) -> set[int]:
    kids = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            kids |= {int(c) for c in (task / "children").read_text().split()}
        except OSError:
            pass
    return kids


def test_each_gpu_worker_runs_on_a_core_of_its_own(tmp_path):
    cuda_or_skip()
    from live_server import npy, start_server

    cpus = sorted(os.sched_getaffinity(0))
    server = start_server(tmp_path, ready_timeout=150, backend="cuda", models="tiny-convnext", pin_workers="on",
                          cli_args=("--workers", "2"))
    try:
        devices = httpx.get(f"{server.url}/v1/models/tiny-convnext", timeout=30).json()["devices"]
        if len(cpus) < 4 * len(devices):
            pytest.skip(f"{len(cpus)} cores for {len(devices)} GPU workers: pinning stays off below 4 a worker")
        workers = [d["pid"] for d in devices]
        own = cpus[len(cpus) - len(workers):]
        for pid, core in zip(workers, own):
            threads = affinities(pid)
            assert len(threads) > 3  # the device, links, accept, heartbeat threads and CUDA's
            assert all(cpu == {core} for cpu in threads.values()), (pid, core, threads)
        others = [server.proc.pid, *(children(server.proc.pid) - set(workers))]
        assert len(others) >= 2  # front end 0 (the supervisor's process) and front end 1
        for pid in others:
            for cpu in affinities(pid).values():
                assert not cpu & set(own), (pid, cpu, own)
        pixels = np.random.default_rng(0).integers(0, 256, (1, 37, 41, 3), dtype=np.uint8)
        r = httpx.post(f"{server.url}/v1/models/tiny-convnext/encode", content=npy(pixels),
                       headers={"content-type": "application/x-npy"}, timeout=120)
        assert r.status_code == 200, r.text
        assert np.isfinite(r.json()["embeddings"]).all()
    finally:
        assert server.stop(timeout=60) == 0, server.log()
