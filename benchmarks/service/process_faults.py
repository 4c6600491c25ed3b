"""The process-fault checks of benchmarks/service/hostile_probe.py, each on a server of its own (its log
read for what the supervisor says and for asyncio noise):

- `hang`: the model worker stopped (SIGSTOP, as a deadlock or a stuck device call would hold it)
  for 20 s and for 85 s with requests arriving all along, on default settings: how soon /readyz
  turns 503, what the requests get and how long they wait, how soon it is ready after SIGCONT;
  then stopped past a 30 s hang limit (CONVSERVE_WORKER_HANG_S=30): when the supervisor kills it
  and when a new worker serves.
- `frontkill`: a front end killed with SIGKILL three times (--workers 2): how soon it is reaped,
  what the log says, and the arenas (memfds) and shared memory the model worker holds after each.
"""
from __future__ import annotations

import os
import signal
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np

from server_process import ServerProcess

NPY = {"content-type": "application/x-npy"}
#: the traffic's decodes: 24x24 latents, 192x192 images, in batches of up to 4
SIDE, WARM, BATCH = 24, "192", 4


def _body(side: int) -> bytes:
    import io
    buf = io.BytesIO()
    np.save(buf, np.random.default_rng(0).standard_normal((1, 4, side, side)).astype(np.float32))
    return buf.getvalue()


def _worker_pid(srv: ServerProcess) -> int:
    return httpx.get(f"{srv.url}/v1/models/tiny-vae", timeout=10).json()["devices"][0]["pid"]


def _ready(srv: ServerProcess) -> bool:
    try:
        return httpx.get(f"{srv.url}/readyz", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def _secs(x: float | None) -> str:
    return "never" if x is None else f"{x:.2f}s"


def _until(cond, timeout: float, every: float = 0.05) -> float | None:
    """Seconds until cond() held, or None past the timeout."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if cond():
            return time.monotonic() - t0
        time.sleep(every)
    return None


class Traffic:
    """`clients` threads sending decodes one after another: (status or problem kind, seconds)."""

    def __init__(self, srv: ServerProcess, clients: int = 4, side: int = SIDE):
        self.url, self.body, self.stop = f"{srv.url}/v1/models/tiny-vae/decode?format=npy", _body(side), threading.Event()
        self.answers: list[tuple[str, float]] = []
        self.threads = [threading.Thread(target=self._client, daemon=True) for _ in range(clients)]
        for t in self.threads:
            t.start()

    def _client(self) -> None:
        while not self.stop.is_set():
            t0 = time.monotonic()
            try:
                r = httpx.post(self.url, content=self.body, headers=NPY, timeout=120)
                what = str(r.status_code) if r.status_code == 200 else f"{r.status_code} {r.json().get('type', '').split('#')[-1]}"
            except httpx.HTTPError as exc:
                what = type(exc).__name__
            self.answers.append((what, time.monotonic() - t0))
            if what != "200":
                time.sleep(0.5)  # as a client honouring Retry-After a little would

    def end(self) -> str:
        self.stop.set()
        for t in self.threads:
            t.join(130)
        kinds: dict[str, int] = {}
        for what, _ in self.answers:
            kinds[what] = kinds.get(what, 0) + 1
        slowest = max((secs for _, secs in self.answers), default=0.0)
        return f"{dict(sorted(kinds.items()))}, slowest answer {slowest:.1f}s"


def _noise(log_path: str) -> str:
    text = Path(log_path).read_text(errors="replace")
    return f"'never retrieved' x{text.count('never retrieved')}, tracebacks x{text.count('Traceback')}"


def _said(log_path: str, pid: int) -> str:
    """What the supervisor logged about process `pid`."""
    lines = Path(log_path).read_text(errors="replace").splitlines()
    return "supervisor: " + " | ".join(line.split("supervisor: ", 1)[-1] for line in lines
                                        if "supervisor" in line and f"(pid {pid})" in line)


def check_hang() -> None:
    log_path = tempfile.mktemp(prefix="convserve-hang-", suffix=".log")
    # defaults (heartbeat 3 s, hang limit 180 s); the traffic's shape warmed up before /readyz, so
    # no request pays the CPU backend's first-call path measurement (tens of seconds on a busy box)
    srv = ServerProcess(models="tiny-vae", log_path=log_path, warmup_sizes=WARM, max_batch=BATCH)
    try:
        for stop_s in (20, 85):
            pid = _worker_pid(srv)
            traffic = Traffic(srv)
            time.sleep(2)
            os.kill(pid, signal.SIGSTOP)
            t0 = time.monotonic()
            unready = _until(lambda: not _ready(srv), stop_s)
            time.sleep(max(0.0, stop_s - (time.monotonic() - t0)))
            os.kill(pid, signal.SIGCONT)
            back = _until(lambda: _ready(srv), 60)
            time.sleep(2)
            print(f"hang: worker stopped {stop_s}s under 4 clients: /readyz 503 after {_secs(unready)}, ready "
                  f"{_secs(back)} after SIGCONT, same worker: {_worker_pid(srv) == pid}; answers {traffic.end()}")
        print(f"hang: server log: {_noise(log_path)}")
    finally:
        srv.stop()
    log_path = tempfile.mktemp(prefix="convserve-hang-kill-", suffix=".log")
    srv = ServerProcess(models="tiny-vae", log_path=log_path, worker_hang_s=30, warmup_sizes=WARM,
                        max_batch=BATCH)
    try:
        pid = _worker_pid(srv)
        traffic = Traffic(srv)
        time.sleep(2)
        os.kill(pid, signal.SIGSTOP)
        killed = _until(lambda: not Path(f"/proc/{pid}").exists(), 120)
        served = _until(lambda: _ready(srv) and _worker_pid(srv) != pid, 120)
        time.sleep(2)
        print(f"hang: worker stopped past a 30 s hang limit: killed and reaped {_secs(killed)} after the stop, "
              f"a new worker ready {_secs(served)} after that; answers {traffic.end()}; {_said(log_path, pid)}; "
              f"server log: {_noise(log_path)}")
    finally:
        srv.stop()


def _arenas(pid: int) -> set[int]:
    out = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            if os.readlink(fd).startswith("/memfd:convserve-arena"):
                out.add(os.stat(fd).st_ino)
        except OSError:
            pass
    return out


def _shmem_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssShmem:"):
            return int(line.split()[1])
    return 0


def _front_ends(srv: ServerProcess, worker: int) -> list[int]:
    kids = []
    for task in Path(f"/proc/{srv.proc.pid}/task").iterdir():
        try:
            kids += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return [k for k in kids if k != worker and b"spawn_main" in Path(f"/proc/{k}/cmdline").read_bytes()]


def check_frontend_kill() -> None:
    log_path = tempfile.mktemp(prefix="convserve-frontkill-", suffix=".log")
    srv = ServerProcess(models="tiny-vae", workers=2, log_path=log_path)
    try:
        worker = _worker_pid(srv)
        _until(lambda: len(_front_ends(srv, worker)) == 1 and len(_arenas(worker)) == 2, 60)
        traffic = Traffic(srv, clients=2, side=16)
        time.sleep(3)
        print(f"frontkill: before: the worker holds {len(_arenas(worker))} arenas, RssShmem {_shmem_kib(worker)} KiB")
        for i in range(3):
            [front] = _front_ends(srv, worker)
            os.kill(front, signal.SIGKILL)
            reaped = _until(lambda: not Path(f"/proc/{front}").exists(), 30, every=0.01)
            gone = _until(lambda: len(_arenas(worker)) == 1, 30, every=0.01)
            back = _until(lambda: len(_front_ends(srv, worker)) == 1 and len(_arenas(worker)) == 2, 60)
            time.sleep(2)
            print(f"frontkill {i + 1}: reaped {_secs(reaped)} after SIGKILL ({_said(log_path, front)}); its arena left the worker after "
                  f"{_secs(gone)}; a new front end connected {_secs(back)} later: the worker holds {len(_arenas(worker))} "
                  f"arenas, RssShmem {_shmem_kib(worker)} KiB")
        print(f"frontkill: answers meanwhile {traffic.end()}; server log: {_noise(log_path)}")
    finally:
        srv.stop()
