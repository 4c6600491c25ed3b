"""The multi-process service on a host with several GPUs: `convserve serve` with CONVSERVE_DEVICES=0,1 starts one
model worker per GPU behind one endpoint; concurrent requests are spread over both (rows per
device in /metrics), each worker sees only its own GPU, every answer equals the single-GPU decode
of the same latents (the same weights, the same kernels), and a worker killed mid-run is started
again on its GPU while the other keeps serving. Skipped with fewer than two GPUs (CI, 1-GPU kinds)."""
from __future__ import annotations

import io
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from gpu_support import cuda_or_skip

pytestmark = pytest.mark.gpu
NPY = {"content-type": "application/x-npy"}


def gpu_count() -> int:
    from convkernels.registry import visible_cuda_devices
    return visible_cuda_devices()


@pytest.fixture(scope="module")
def two_gpu_server(tmp_path_factory):
    cuda_or_skip()
    if gpu_count() < 2:
        pytest.skip(f"needs 2 GPUs, {gpu_count()} visible")
    from live_server import start_server

    server = start_server(tmp_path_factory.mktemp("servers"), ready_timeout=180, backend="cuda", dtype="float16",
                          models="tiny-vae", devices="0,1", max_batch=4, max_queue_delay_ms=1)
    yield server
    server.stop()


def decode(url: str, lat: np.ndarray):
    import httpx

    from live_server import npy
    r = httpx.post(f"{url}/v1/models/tiny-vae/decode", content=npy(lat), headers=NPY,
                   params={"format": "npy"}, timeout=120)
    assert r.status_code == 200, r.text
    return np.load(io.BytesIO(r.content))


def devices(url: str) -> list[dict]:
    import httpx
    return httpx.get(f"{url}/v1/models/tiny-vae", timeout=30).json()["devices"]


def wait_both_ready(url: str, timeout: float = 180) -> list[dict]:
    deadline = time.monotonic() + timeout
    while True:
        ds = devices(url)
        if len(ds) == 2 and all(d["state"] == "ready" for d in ds):
            return ds
        assert time.monotonic() < deadline, ds
        time.sleep(0.2)


def test_two_gpus_share_the_load_and_agree(two_gpu_server):
    from live_server import metric, scrape

    url = two_gpu_server.url
    ds = wait_both_ready(url)
    assert [d["device"] for d in ds] == ["cuda:0", "cuda:1"]
    import httpx
    kernels = httpx.get(f"{url}/v1/kernels", timeout=30).json()["devices"]
    # each worker sees only its own GPU (as its device 0), and they are two different GPUs
    assert [k["backend"]["device"] for k in kernels] == [0, 0]
    assert len({k["backend"]["pci_bus_id"] for k in kernels}) == 2, kernels
    rng = np.random.default_rng()
    lats = [rng.standard_normal((1, 4, 9, 13)).astype(np.float32) for _ in range(8)]
    s0 = scrape(url)
    with ThreadPoolExecutor(16) as pool:
        outs = list(pool.map(lambda i: decode(url, lats[i % 8]), range(64)))
    s1 = scrape(url)
    rows = {d: metric(s1, "convserve_device_rows_total", model="tiny-vae", device=d)
            - metric(s0, "convserve_device_rows_total", model="tiny-vae", device=d) for d in ("cuda:0", "cuda:1")}
    assert sum(rows.values()) == 64 and min(rows.values()) > 0, rows
    for i, out in enumerate(outs):  # whichever GPU ran it, in whichever batch: the same image, to
        # float16's rounding (batch sizes pick different cuDNN kernels: seen 2.4e-3 at one pixel)
        err = np.linalg.norm(out - outs[i % 8]) / np.linalg.norm(outs[i % 8])
        assert err < 1e-3 and np.abs(out - outs[i % 8]).max() < 1e-2, (i, err)


def test_a_killed_gpu_worker_comes_back_while_the_other_serves(two_gpu_server):
    url = two_gpu_server.url
    ds = wait_both_ready(url)
    os.kill(ds[1]["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 30
    while devices(url)[-1]["state"] == "ready" and devices(url)[-1]["pid"] == ds[1]["pid"]:
        assert time.monotonic() < deadline, "the killed worker still shows ready"
        time.sleep(0.05)
    lat = np.random.default_rng().standard_normal((1, 4, 9, 13)).astype(np.float32)
    ref = decode(url, lat)  # cuda:0 serves meanwhile
    back = wait_both_ready(url)
    assert back[1]["pid"] != ds[1]["pid"]
    again = decode(url, lat)
    assert np.linalg.norm(again - ref) / np.linalg.norm(ref) < 1e-3
