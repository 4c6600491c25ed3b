"""Overload: a real server offered several times the load it can serve, open loop (arrivals do
not wait for answers, as independent clients would not). A well-behaved server answers only 2xx
or 429/503 with Retry-After, keeps its queue within its setting, keeps the latency of what it
admits bounded, keeps serving at about its capacity (no collapse), and goes back to idle with no
leaked memory or threads afterwards.

  python benchmarks/service/overload.py [--factors 2,4,8] [--seconds 5]

Starts `convserve serve` (NumPy backend, tiny-vae, max_batch 2, max_queue 4), measures its
capacity (closed loop, no rejections), then runs each overload factor and prints one table row
per factor, naming the machine. tests/test_reliability_overload.py runs the same functions.
"""
from __future__ import annotations

import argparse
import io
import os
import re
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[2]
SETTINGS = dict(models="tiny-vae", max_batch=2, max_queue=4, max_queue_delay_ms=2, request_timeout_s=30)
LATENT = (1, 4, 12, 12)  # a 96x96 image: tens of ms per decode on a CPU core


def npy(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return buf.getvalue()


def proc_status(pid: int) -> dict[str, int]:
    """VmRSS (KiB) and Threads of a process."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "Threads"):
                out[key] = int(value.split()[0])
    return out


def gauge(url: str, name: str, **labels) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return 0.0


@dataclass
class Result:
    offered_rps: float
    seconds: float
    statuses: dict[int, int] = field(default_factory=dict)
    latencies_ok: list[float] = field(default_factory=list)
    missing_retry_after: int = 0
    not_problem_json: int = 0
    max_queue_depth: float = 0.0
    depth_samples: int = 0

    @property
    def sent(self) -> int:
        return sum(self.statuses.values())

    @property
    def goodput_rps(self) -> float:
        return self.statuses.get(200, 0) / self.seconds

    def row(self, capacity_rps: float) -> str:
        lat = sorted(self.latencies_ok) or [float("nan")]
        p = lambda q: lat[min(len(lat) - 1, int(q * len(lat)))]  # noqa: E731
        mix = ", ".join(f"{k}: {v}" for k, v in sorted(self.statuses.items()))
        return (f"| {self.offered_rps / capacity_rps:.1f}x | {self.sent} | {mix} | {self.goodput_rps:.1f} "
                f"({self.goodput_rps / capacity_rps:.0%}) | {p(0.5) * 1000:.0f} / {p(0.99) * 1000:.0f} / "
                f"{lat[-1] * 1000:.0f} | {self.max_queue_depth:.0f} |")


def one(client: httpx.Client, url: str, body: bytes) -> tuple[int, float, httpx.Response]:
    t0 = time.perf_counter()
    r = client.post(f"{url}/v1/models/tiny-vae/decode", content=body, params={"format": "npy"},
                    headers={"content-type": "application/x-npy"})
    return r.status_code, time.perf_counter() - t0, r


def capacity(url: str, seconds: float = 3.0, concurrency: int = 4) -> tuple[float, float]:
    """(requests/s, mean latency s) closed loop at a concurrency the queue always admits."""
    body = npy(np.random.default_rng(0).standard_normal(LATENT).astype(np.float32))
    done, lats = [], []
    stop = time.monotonic() + seconds
    with httpx.Client(timeout=60) as client:
        def loop():
            while time.monotonic() < stop:
                status, secs, _ = one(client, url, body)
                assert status == 200, status
                done.append(1)
                lats.append(secs)
        t0 = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            for f in [pool.submit(loop) for _ in range(concurrency)]:
                f.result()
        elapsed = time.perf_counter() - t0
    return len(done) / elapsed, float(np.mean(lats))


def burst(url: str, rate_rps: float, seconds: float, *, workers: int = 64) -> Result:
    """Open-loop arrivals at `rate_rps` for `seconds`, while a sampler scrapes the queue depth."""
    body = npy(np.random.default_rng(1).standard_normal(LATENT).astype(np.float32))
    res = Result(rate_rps, seconds)
    lock = threading.Lock()
    sampling = threading.Event()

    def sample():
        # a regex over the exposition, not a full parse: the sampler must not load the box it measures
        pattern = re.compile(r'^convserve_queue_depth\{model="tiny-vae"\} ([0-9.e+]+)$', re.M)
        with httpx.Client(timeout=10) as c:
            while not sampling.is_set():
                try:
                    m = pattern.search(c.get(f"{url}/metrics").text)
                    if m:
                        res.max_queue_depth = max(res.max_queue_depth, float(m.group(1)))
                        res.depth_samples += 1
                except httpx.HTTPError:
                    pass
                time.sleep(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    limits = httpx.Limits(max_connections=workers, max_keepalive_connections=workers)
    with httpx.Client(timeout=60, limits=limits) as client, ThreadPoolExecutor(workers) as pool:
        def task():
            status, secs, r = one(client, url, body)
            with lock:
                res.statuses[status] = res.statuses.get(status, 0) + 1
                if status == 200:
                    res.latencies_ok.append(secs)
                else:
                    if status in (429, 503) and not r.headers.get("retry-after", "").isdigit():
                        res.missing_retry_after += 1
                    if r.headers.get("content-type") != "application/problem+json":
                        res.not_problem_json += 1

        t0 = time.monotonic()
        n = int(rate_rps * seconds)
        futures = []
        for i in range(n):
            delay = t0 + i / rate_rps - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            futures.append(pool.submit(task))
        for f in futures:
            f.result()
        res.seconds = max(seconds, time.monotonic() - t0)
    sampling.set()
    sampler.join(2)
    return res


def wait_idle(url: str, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if gauge(url, "convserve_queue_depth", model="tiny-vae") == 0 and \
                gauge(url, "convserve_inflight_requests", model="tiny-vae") == 0:
            return True
        time.sleep(0.1)
    return False


# ---- the script ---------------------------------------------------------------------------------------
def start_server() -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONVSERVE_")}
    env.update({"CONVSERVE_BACKEND": "numpy", "CONVSERVE_LOG_LEVEL": "warning"})
    env.update({f"CONVSERVE_{k.upper()}": str(v) for k, v in SETTINGS.items()})
    proc = subprocess.Popen([sys.executable, "-m", "service.cli", "serve", "--port", str(port)], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise SystemExit("server did not get ready")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--factors", default="2,4,8")
    ap.add_argument("--seconds", type=float, default=5.0)
    args = ap.parse_args()
    sys.path.insert(0, str(REPO))
    from benchmarks.machine import describe_machine

    proc, url = start_server()
    try:
        cap, lat = capacity(url)
        before = proc_status(proc.pid)
        print(f"machine: {describe_machine()}")
        print(f"server: {SETTINGS}; latents {LATENT}; capacity {cap:.1f} req/s (closed loop, mean {lat * 1000:.0f} ms)")
        print("| overload | requests | status mix | goodput req/s (of capacity) | admitted latency p50 / p99 / max ms | max queue depth |")
        print("| --- | --- | --- | --- | --- | --- |")
        for factor in (float(f) for f in args.factors.split(",")):
            res = burst(url, factor * cap, args.seconds)
            print(res.row(cap), flush=True)
            wait_idle(url)
        after = proc_status(proc.pid)
        print(f"after: idle={wait_idle(url)}; RSS {before['VmRSS'] / 1024:.0f} -> {after['VmRSS'] / 1024:.0f} MiB; "
              f"threads {before['Threads']} -> {after['Threads']}")
    finally:
        proc.terminate()
        proc.wait(15)


if __name__ == "__main__":
    main()
