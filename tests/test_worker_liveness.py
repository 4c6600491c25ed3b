"""A hung model worker and a front end killed outright, on a real server (its processes, signals
and /proc), with the heartbeat and hang limits shortened:

- a worker stopped (SIGSTOP: as deadlocked, or stuck in a device call) turns /readyz 503 within
  5 s, and its requests, in flight and new, get 503 `worker-unresponsive` with Retry-After, not a
  504 at the request timeout; resumed (SIGCONT) it is ready again, the same process; stopped past
  the hang limit it is killed by the supervisor and restarted, and serves again;
- with two devices, a stopped worker's model is served by the other one (/readyz stays 200);
- a front end killed with SIGKILL is reaped at once (no zombie), its death logged with the signal,
  and its shared-memory arena leaves the model worker: the worker holds one arena per live front
  end (service/ipc/shm.py's rules)."""
from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np

from live_server import npy, start_server, wait_for
from test_service_limits import assert_problem

NPY = {"content-type": "application/x-npy"}
HOLD = 4242.0  # latents holding this value keep the worker in its model call until the release file exists
HEARTBEAT_S = 1.5
HANG_S = 8.0


def latents(hold: bool = False) -> np.ndarray:
    x = np.random.default_rng().standard_normal((1, 4, 5, 6)).astype(np.float32)
    if hold:
        x[0, 0, 0, 0] = HOLD
    return x


def decode(url: str, x: np.ndarray) -> httpx.Response:
    return httpx.post(f"{url}/v1/models/tiny-vae/decode", content=npy(x), headers=NPY,
                      params={"format": "npy"}, timeout=120)


def devices(url: str) -> list[dict]:
    return httpx.get(f"{url}/v1/models/tiny-vae", timeout=5).json()["devices"]


def readyz(url: str) -> httpx.Response:
    return httpx.get(f"{url}/readyz", timeout=5)


def assert_unresponsive(r: httpx.Response) -> None:
    assert_problem(r, 503, "worker-unresponsive", "no heartbeat")
    assert int(r.headers["retry-after"]) >= 1


def test_a_stopped_worker_is_unresponsive_then_ready_again_and_killed_past_the_hang_limit(server_factory, tmp_path):
    release = tmp_path / "release"
    srv = server_factory(models="tiny-vae", max_batch=1, worker_heartbeat_s=HEARTBEAT_S, worker_hang_s=HANG_S,
                         fault_hold_value=HOLD, fault_hold_release_file=release)
    pid = devices(srv.url)[0]["pid"]

    # stopped while a request runs on it, resumed before the hang limit
    with ThreadPoolExecutor(1) as pool:
        in_flight = pool.submit(decode, srv.url, latents(hold=True))
        wait_for(lambda: release.with_name("release.holding").exists(), 30, "the held request on the worker")
        os.kill(pid, signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            wait_for(lambda: readyz(srv.url).status_code == 503, 5, "/readyz 503 within 5 s of the stop")
            assert_problem(readyz(srv.url), 503, "worker-unresponsive")
            assert_unresponsive(in_flight.result(10))  # answered now, not at the request timeout
            assert_unresponsive(decode(srv.url, latents()))
        finally:
            os.kill(pid, signal.SIGCONT)
        assert time.monotonic() - stopped < HANG_S - 1, "too slow to check before the hang limit"
        release.touch()
    wait_for(lambda: readyz(srv.url).status_code == 200, 10, "ready again after SIGCONT")
    assert decode(srv.url, latents()).status_code == 200
    assert devices(srv.url)[0]["pid"] == pid  # the same worker: resumed, not restarted

    # stopped past the hang limit: killed (SIGKILL, by the supervisor) and restarted
    os.kill(pid, signal.SIGSTOP)
    stopped = time.monotonic()
    wait_for(lambda: not Path(f"/proc/{pid}").exists(), HANG_S + 10, "the hung worker killed and reaped")
    assert time.monotonic() - stopped > HANG_S - 1, "killed before the hang limit"
    wait_for(lambda: readyz(srv.url).status_code == 200, 60, "a new worker ready")
    new = devices(srv.url)[0]
    assert new["pid"] != pid and new["state"] == "ready"
    assert decode(srv.url, latents()).status_code == 200
    log = srv.log_path.read_text(errors="replace")
    assert f"(pid {pid}) is hung: no heartbeat" in log and f"(pid {pid}) died (signal SIGKILL" in log, srv.log()
    assert "never retrieved" not in log and "Traceback" not in log, srv.log()


def test_a_stopped_worker_s_model_is_served_by_another_device(server_factory):
    srv = server_factory(models="tiny-vae", devices="0,1", worker_heartbeat_s=HEARTBEAT_S)
    wait_for(lambda: [d["state"] for d in devices(srv.url)] == ["ready", "ready"], 120, "both devices ready")
    pid = devices(srv.url)[0]["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        wait_for(lambda: "unresponsive" in [d["state"] for d in devices(srv.url)], 5, "cpu:0 unresponsive")
        assert readyz(srv.url).status_code == 200  # cpu:1 serves the model
        with ThreadPoolExecutor(4) as pool:
            assert [r.status_code for r in pool.map(lambda _: decode(srv.url, latents()), range(8))] == [200] * 8
    finally:
        os.kill(pid, signal.SIGCONT)
    wait_for(lambda: [d["state"] for d in devices(srv.url)] == ["ready", "ready"], 10, "cpu:0 ready again")


def test_a_call_holding_the_interpreter_lock_is_busy_not_unresponsive(server_factory, tmp_path):
    """A model call that keeps the interpreter lock past the heartbeat limit (on an H200, CuPy's
    and the cuDNN frontend's compiles for a new shape did, over 3 s) silences the heartbeat thread
    as a stopped worker would; the process is running, so the worker is busy: its request gets
    200, not 503 `worker-unresponsive`, and /readyz stays 200 meanwhile."""
    release = tmp_path / "release"
    release.touch()  # no wait on the file: only the lock is held
    srv = server_factory(models="tiny-vae", max_batch=1, worker_heartbeat_s=1.0, worker_hang_s=60,
                         fault_hold_value=HOLD, fault_hold_release_file=release, fault_hold_lock_s=4)
    with ThreadPoolExecutor(1) as pool:
        held = pool.submit(decode, srv.url, latents(hold=True))
        wait_for(lambda: release.with_name("release.holding").exists(), 60, "the call holding the lock")
        time.sleep(2.5)  # past the 1 s heartbeat limit, inside the 4 s hold
        assert readyz(srv.url).status_code == 200
        assert held.result().status_code == 200
    assert [d["state"] for d in devices(srv.url)] == ["ready"]


def spawned(pid: int) -> list[int]:
    """The server's spawned children: its model workers and further front ends (of every thread:
    the supervisor's thread starts those that died again)."""
    kids = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            kids += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    out = []
    for k in kids:
        try:
            if b"spawn_main" in Path(f"/proc/{k}/cmdline").read_bytes():
                out.append(k)
        except OSError:
            pass
    return out


def arenas(pid: int) -> list[int]:
    """The inode of every front-end arena (a memfd) among the process's open descriptors."""
    out = []
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            if os.readlink(fd).startswith("/memfd:convserve-arena"):
                out.append(os.stat(fd).st_ino)
        except OSError:  # closed meanwhile
            pass
    return out


def test_a_killed_front_end_is_reaped_and_its_arena_leaves_the_worker(tmp_path):
    srv = start_server(tmp_path, models="tiny-vae", cli_args=("--workers", "2"))
    try:
        worker = devices(srv.url)[0]["pid"]
        [front] = [k for k in spawned(srv.proc.pid) if k != worker]
        # front end 0 is the server process itself; each front end maps its own arena (a memfd)
        wait_for(lambda: len(set(arenas(srv.proc.pid))) == len(set(arenas(front))) == 1, 60, "both arenas made")
        mine = set(arenas(srv.proc.pid))
        wait_for(lambda: set(arenas(worker)) == mine | set(arenas(front)), 60, "both front ends connected")
        assert len(arenas(worker)) == 2  # one descriptor per front end
        os.kill(front, signal.SIGKILL)
        # each step is waited for as an event, not timed: the supervisor reaps on the child's
        # sentinel, and a zombie would keep its /proc entry for good
        wait_for(lambda: not Path(f"/proc/{front}").exists(), 60, "the killed front end reaped, no zombie")
        assert front not in spawned(srv.proc.pid)
        wait_for(lambda: f"(pid {front}) died (signal SIGKILL)" in srv.log_path.read_text(errors="replace"), 60,
                 "its death logged with the signal")
        wait_for(lambda: set(arenas(worker)) == mine, 60, "its arena gone from the worker")

        # the front end started in its place connects: again one arena per live front end
        wait_for(lambda: [k for k in spawned(srv.proc.pid) if k != worker], 60, "a front end started again")
        [again] = [k for k in spawned(srv.proc.pid) if k != worker]
        # one descriptor per live front end, waited for as one state like the steps above: a count read
        # once, right after the set had matched, found one descriptor on a loaded CI box (2026-12-01;
        # 2 of 24 runs at 4x the cores, none of 54 after; the cause is not known)
        wait_for(lambda: len(set(arenas(again))) == 1
                 and sorted(arenas(worker)) == sorted(mine | set(arenas(again))), 60,
                 "the new front end connected, one descriptor of each live front end's arena in the worker")
        assert devices(srv.url)[0]["pid"] == worker  # the worker was never restarted for it
    finally:
        code = srv.stop(timeout=30)
    assert code == 0, srv.log()
