"""SIGTERM under load: in-flight requests complete, new ones get 503 (the socket stays open while
draining), /readyz turns false, and the process exits 0. Also when the SIGTERM reaches the whole
process group at once (`timeout`, systemd's default KillMode): the model workers wait for the
drain instead of stopping under the work in flight."""
from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np

from live_server import metric, npy, scrape

NPY = {"content-type": "application/x-npy"}


HOLD = 4242.0  # latents holding this value keep the worker busy until the release file exists


def test_sigterm_drains_then_exits_zero(server_factory, tmp_path):
    release = tmp_path / "release"
    srv = server_factory(models="tiny-vae", max_batch=1, shutdown_grace_s=60,
                         fault_hold_value=HOLD, fault_hold_release_file=release)
    rng = np.random.default_rng()
    # the first request holds the worker until the test releases it, so the drain is still under
    # way while the late request below is answered, however fast or loaded the machine is
    latents = [rng.standard_normal((1, 4, 9, 11)).astype(np.float32) for _ in range(5)]
    latents[0][0, 0, 0, 0] = HOLD
    bodies = [npy(x) for x in latents]

    def decode(data):
        return httpx.post(f"{srv.url}/v1/models/tiny-vae/decode", content=data, headers=NPY,
                          params={"format": "npy"}, timeout=120)

    with ThreadPoolExecutor(len(bodies)) as pool:
        futures = [pool.submit(decode, bodies[0])]
        deadline = time.monotonic() + 30
        while not release.with_name("release.holding").exists():
            assert time.monotonic() < deadline, "the held request never reached the worker"
            time.sleep(0.02)
        futures += [pool.submit(decode, b) for b in bodies[1:]]
        while metric(scrape(srv.url), "convserve_inflight_requests", model="tiny-vae") < len(bodies):
            assert time.monotonic() < deadline, "requests never all admitted"
            time.sleep(0.02)
        srv.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        while httpx.get(f"{srv.url}/readyz").status_code != 503:  # the handler runs between loop ticks
            assert time.monotonic() < deadline, "readyz never turned false after SIGTERM"
            time.sleep(0.02)
        assert srv.proc.poll() is None, "exited with work in flight"
        late = decode(bodies[1])
        assert late.status_code == 503, late.text
        assert late.json()["type"].endswith("#shutting-down") and "retry-after" in late.headers
        assert httpx.get(f"{srv.url}/healthz").status_code == 200
        release.touch()
        results = [f.result() for f in futures]
    assert [r.status_code for r in results] == [200] * len(bodies)
    for r, x in zip(results, latents):
        assert np.load(__import__("io").BytesIO(r.content)).shape == (1, 8 * x.shape[2], 8 * x.shape[3], 3)
    assert srv.proc.wait(30) == 0


def test_sigterm_to_the_whole_process_group_still_drains(server_factory, tmp_path):
    release = tmp_path / "release"
    srv = server_factory(models="tiny-vae", max_batch=1, shutdown_grace_s=60, own_group=True,
                         fault_hold_value=HOLD, fault_hold_release_file=release)
    held = np.random.default_rng().standard_normal((1, 4, 9, 11)).astype(np.float32)
    held[0, 0, 0, 0] = HOLD
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(lambda: httpx.post(f"{srv.url}/v1/models/tiny-vae/decode", content=npy(held),
                                                headers=NPY, params={"format": "npy"}, timeout=120))
        deadline = time.monotonic() + 30
        while not release.with_name("release.holding").exists():  # the worker is in the held call
            assert time.monotonic() < deadline, "the held request never reached the worker"
            time.sleep(0.02)
        os.killpg(srv.proc.pid, signal.SIGTERM)  # every process of the server: front ends and workers
        while httpx.get(f"{srv.url}/readyz").status_code != 503:
            assert time.monotonic() < deadline, "readyz never turned false after SIGTERM"
            time.sleep(0.02)
        release.touch()
        r = future.result()
    assert r.status_code == 200, r.text[:300]
    assert srv.proc.wait(30) == 0
    assert "died" not in srv.log(), srv.log()


def _idle_front_end(ready: str) -> None:
    """A stand-in front end: idles until told to drain (SIGTERM), then exits 0 at once, as an idle
    front end does. `ready` appears once its handler is in place."""
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    open(ready, "w").close()
    time.sleep(120)


def test_front_ends_told_to_drain_are_not_restarted(tmp_path):
    """An idle front end ends its drain before front end 0 does: the supervisor must not take
    its exit for a death and start it again."""
    from service import threads
    from service.settings import Settings
    from service.supervisor import Supervisor

    sup = Supervisor(Settings(backend="numpy"))
    try:
        ready = [tmp_path / f"ready-{i}" for i in (1, 2)]
        for i, path in zip((1, 2), ready):
            sup.add_frontend(f"convserve-frontend-{i}", _idle_front_end, (str(path),))
        threads.start(sup._watch, "convserve-supervisor")
        # both started (their handlers in place: a spawned child's start took over a second
        # beside another test process on two cores) and watched
        deadline = time.monotonic() + 60
        while not all(path.exists() for path in ready):
            assert time.monotonic() < deadline, "the stand-in front ends never started"
            time.sleep(0.05)
        time.sleep(0.5)  # the watcher's turn has come since
        sup.drain()
        for child in sup.frontends:
            child.proc.join(30)
            assert child.proc.exitcode == 0
        time.sleep(3.5)  # past the pause a young child's restart waits (2 s), the watcher's turn come again
        assert [child.restarts for child in sup.frontends] == [0, 0]
        assert all(not child.proc.is_alive() for child in sup.frontends)
    finally:
        sup.stop(grace_s=1.0)
