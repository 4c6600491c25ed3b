"""A real `convserve serve` in a child process for the benchmarks: start it with CONVSERVE_*
settings, wait for /readyz (timing it), read its /metrics, stop it."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[2]


def _stat_cpu_seconds(stat: Path, system_only: bool = False) -> float:
    """User + system CPU seconds (system_only: the kernel's part alone) from a process's or
    thread's /proc stat file (clock ticks)."""
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return (int(fields[12]) + (0 if system_only else int(fields[11]))) / os.sysconf("SC_CLK_TCK")


def _context_switches(status: Path) -> tuple[int, int]:
    """A thread's (voluntary, involuntary) context switches so far (/proc .../status)."""
    got = {}
    for line in status.read_text().splitlines():
        if "ctxt_switches:" in line:
            key, _, value = line.partition(":")
            got[key] = int(value)
    return got.get("voluntary_ctxt_switches", 0), got.get("nonvoluntary_ctxt_switches", 0)


def scrape(url: str) -> dict[tuple, float]:
    """/metrics of the server at `url` as {(sample name, sorted label items): value}."""
    out = {}
    for fam in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _established_inodes(port: int) -> set[str]:
    """Socket inodes of the established TCP connections whose local port is `port`."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            f = row.split()
            if f[3] == "01" and int(f[1].rsplit(":", 1)[1], 16) == port:  # 01: ESTABLISHED
                inodes.add(f[9])
    return inodes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, timeout: float = 600.0, log_path: str | None = None, launcher: tuple = ("-m", "service.cli"),
                 **settings):
        """settings: CONVSERVE_<KEY> values (models=..., backend=..., max_batch=...). Any
        CONVSERVE_* variable of this process is dropped first, so a run is what it says.
        launcher: the interpreter arguments before `serve` (another entry to the same CLI)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("CONVSERVE_")}
        env.update({"CONVSERVE_LOG_LEVEL": "warning"})
        env.update({f"CONVSERVE_{k.upper()}": str(v) for k, v in settings.items()})
        out = open(log_path, "ab") if log_path else subprocess.DEVNULL
        t0 = time.monotonic()
        self.proc = subprocess.Popen([sys.executable, *launcher, "serve", "--host", "127.0.0.1",
                                      "--port", str(self.port)], cwd=REPO, env=env, stdout=out,
                                     stderr=subprocess.STDOUT)
        deadline = t0 + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"server exited {self.proc.returncode}" + (f"; log: {log_path}" if log_path else ""))
            try:
                if httpx.get(f"{self.url}/readyz", timeout=2).status_code == 200:
                    self.ready_s = time.monotonic() - t0
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        self.proc.kill()
        raise SystemExit("server not ready")

    def metrics(self) -> dict[tuple, float]:
        """/metrics as {(sample name, sorted label items): value}."""
        return scrape(self.url)

    def batch_stats(self, model: str) -> tuple[float, float]:
        """(batches run, rows run) for one model so far."""
        snap = self.metrics()
        key = (("model", model),)
        return snap.get(("convserve_batch_size_count", key), 0.0), snap.get(("convserve_batch_size_sum", key), 0.0)

    def wait_all_devices(self, model: str, timeout: float = 600.0) -> list[dict]:
        """/readyz turns true with one device ready: wait for every model worker's."""
        deadline = time.monotonic() + timeout
        while True:
            devices = httpx.get(f"{self.url}/v1/models", timeout=30).json().get("devices", [])
            if devices and all(d["state"] == "ready" for d in devices) or time.monotonic() > deadline:
                return devices
            time.sleep(0.2)

    def roles(self) -> dict[str, list[int]]:
        """The server's processes by role: front ends (this server process and the ones it
        spawned) and model workers (whose pids the model cards name); multiprocessing's resource
        tracker is neither."""
        workers = {d["pid"] for d in httpx.get(f"{self.url}/v1/models", timeout=30).json().get("devices", [])}
        out: dict[str, list[int]] = {"front ends": [self.proc.pid], "model workers": []}
        # every thread's children: the supervisor's watch thread starts a restarted front end
        kids = []
        try:
            for task in Path(f"/proc/{self.proc.pid}/task").iterdir():
                try:
                    kids += [int(k) for k in (task / "children").read_text().split()]
                except OSError:
                    continue  # a thread that ended
        except OSError:
            return out
        for pid in kids:
            try:
                if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    out["model workers" if pid in workers else "front ends"].append(pid)
            except OSError:
                continue
        return out

    def pin_workers(self, cpus: set[int]) -> None:
        """Every thread of the model workers on `cpus`, every thread of the front ends on the
        host's other CPUs (threads started later inherit it): an experiment on how much of a
        worker's CPU a request is its sharing cores and caches with the front ends."""
        if str(REPO) not in sys.path:
            sys.path.insert(0, str(REPO))
        from service import threads  # noqa: PLC0415 - the server's own helper, once the repo is importable

        rest = os.sched_getaffinity(0) - cpus
        for role, pids in self.roles().items():
            for pid in pids:
                threads.pin_process(cpus if role == "model workers" else rest, pid)

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds so far of the server's processes by role (roles())."""
        out = {}
        for role, pids in self.roles().items():
            out[role] = 0.0
            for pid in pids:
                try:
                    out[role] += _stat_cpu_seconds(Path(f"/proc/{pid}/stat"))
                except OSError:
                    continue
        return out

    def worker_thread_cpu(self) -> dict[str, float]:
        """CPU seconds so far of the model workers' threads by kernel name (service/threads.py
        names the service's own: worker-<device> runs the model calls, deliver, links, depth-...,
        heartbeat); threads the service did not name (the main thread, BLAS and compute pools,
        the CUDA driver's) are summed as "unnamed". "<name> system" is the part of it spent in the
        kernel (system calls, page faults, the interpreter lock's futex waits; 10 ms ticks): what
        a thread costs beyond its Python and native code. "<name> switches": the times it left its
        core to wait (a lock, a queue, a socket, the interpreter lock); "<name> preempted": the
        times it was taken off it. Each is a hand-off whose cost is not in its code."""
        out: dict[str, float] = {}
        for pid in self.roles()["model workers"]:
            try:
                comm = Path(f"/proc/{pid}/comm").read_text().strip()
                tasks = list(Path(f"/proc/{pid}/task").iterdir())
            except OSError:
                continue
            for task in tasks:
                try:
                    name = (task / "comm").read_text().strip()
                    try:  # nanoseconds on the CPU (stat's ticks are 10 ms: too coarse per thread)
                        seconds = int((task / "schedstat").read_text().split()[0]) / 1e9
                    except (OSError, ValueError, IndexError):
                        seconds = _stat_cpu_seconds(task / "stat")
                    system = _stat_cpu_seconds(task / "stat", system_only=True)
                    switches = _context_switches(task / "status")
                except OSError:
                    continue  # a thread that ended
                name = "unnamed" if name == comm else name
                out[name] = out.get(name, 0.0) + seconds
                out[f"{name} system"] = out.get(f"{name} system", 0.0) + system
                out[f"{name} switches"] = out.get(f"{name} switches", 0.0) + switches[0]
                out[f"{name} preempted"] = out.get(f"{name} preempted", 0.0) + switches[1]
        return out

    def frontend_spread(self) -> list[tuple[int, float]]:
        """Each front end's (established client connections, CPU seconds so far). Clients that
        keep their connections keep the front end they first reached: an uneven share is one
        cause of a latency tail that no single process's figures show."""
        established = _established_inodes(self.port)
        out = []
        for pid in self.roles()["front ends"]:
            try:
                links = [os.readlink(f) for f in Path(f"/proc/{pid}/fd").iterdir()]
                cpu = _stat_cpu_seconds(Path(f"/proc/{pid}/stat"))
            except OSError:
                continue
            out.append((sum(1 for link in links if link.startswith("socket:[") and link[8:-1] in established), cpu))
        return out

    def frontends(self) -> int:
        """HTTP front-end processes: this server process and the front ends it spawned."""
        return len(self.roles()["front ends"])

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
