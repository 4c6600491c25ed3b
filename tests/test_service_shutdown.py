"""SIGTERM under load: in-flight requests complete, new ones get 503 (the socket stays open while
draining), /readyz turns false, and the process exits 0."""
from __future__ import annotations

import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np

from live_server import metric, npy, scrape

NPY = {"content-type": "application/x-npy"}


def test_sigterm_drains_then_exits_zero(server_factory):
    srv = server_factory(models="tiny-vae", max_batch=1, shutdown_grace_s=60)
    rng = np.random.default_rng()
    # ~0.5 s of decode each on one CPU core, run one at a time: the queue holds seconds of work when
    # SIGTERM lands, so the drain is still under way while the late requests below are answered
    bodies = [npy(rng.standard_normal((1, 4, 64, 64)).astype(np.float32)) for _ in range(5)]

    def decode(data):
        return httpx.post(f"{srv.url}/v1/models/tiny-vae/decode", content=data, headers=NPY,
                          params={"format": "npy"}, timeout=120)

    with ThreadPoolExecutor(len(bodies)) as pool:
        futures = [pool.submit(decode, b) for b in bodies]
        deadline = time.monotonic() + 30
        while metric(scrape(srv.url), "convserve_inflight_requests", model="tiny-vae") < len(bodies):
            assert time.monotonic() < deadline, "requests never all admitted"
            time.sleep(0.02)
        srv.proc.send_signal(signal.SIGTERM)
        time.sleep(0.2)  # the signal handler runs between event-loop ticks
        assert srv.proc.poll() is None, "exited with work in flight"
        late = decode(bodies[0])
        assert late.status_code == 503, late.text
        assert late.json()["type"].endswith("/shutting-down") and "retry-after" in late.headers
        ready = httpx.get(f"{srv.url}/readyz")
        assert ready.status_code == 503
        assert httpx.get(f"{srv.url}/healthz").status_code == 200
        results = [f.result() for f in futures]
    assert [r.status_code for r in results] == [200] * len(bodies)
    for r in results:
        assert np.load(__import__("io").BytesIO(r.content)).shape == (1, 512, 512, 3)
    assert srv.proc.wait(30) == 0
