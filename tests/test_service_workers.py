"""`convserve serve --workers 2`: two HTTP front ends (the server process and one it spawns) behind
one socket, in front of one model worker (the CPU device). /metrics, whichever front end answers
the scrape, reports the whole server, the model worker's batches and kernels included
(prometheus_client multiprocess mode in a directory the CLI makes and removes); the header
timeout holds in every front end; SIGTERM stops them all and the parent exits 0; kept-alive connections reused after idling past the header
timeout and httpx's 5 s pool expiry are served (the keep-alive setting reaches the workers). Under
both HTTP/1.1 parsers (CONVSERVE_HTTP=h11 and httptools)."""
from __future__ import annotations

import os
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest

from live_server import HTTP_PROTOCOLS, metric, metric_sum, npy, scrape, start_server

REQUESTS = 12
HEADER_TIMEOUT_S = 1.5


def worker_pids(pid: int) -> list[int]:
    """The spawned processes of a server: its second front end and its model worker (not
    multiprocessing's resource tracker)."""
    kids = [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    return [k for k in kids if b"spawn_main" in Path(f"/proc/{k}/cmdline").read_bytes()]


def env_of(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


@pytest.mark.parametrize("http", HTTP_PROTOCOLS)
def test_two_workers_share_one_metrics_view_and_stop_cleanly(tmp_path, http):
    srv = start_server(tmp_path, models="tiny-vae", header_timeout_s=HEADER_TIMEOUT_S, http=http,
                       cli_args=("--workers", "2"))
    try:
        workers = worker_pids(srv.proc.pid)
        dirs = {env_of(w).get("PROMETHEUS_MULTIPROC_DIR") for w in workers}
        assert len(workers) == 2 and len(dirs) == 1 and None not in dirs, (workers, dirs)
        metrics_dir = Path(dirs.pop())
        deadline = time.monotonic() + 60  # both front ends connected to the ready model worker
        while sum(httpx.get(f"{srv.url}/readyz", timeout=5).status_code == 200 for _ in range(10)) < 10:
            assert time.monotonic() < deadline, "workers not ready"
            time.sleep(0.2)
        before = scrape(srv.url)

        def decode(_):
            x = np.random.default_rng().standard_normal((1, 4, 6, 5)).astype(np.float32)
            with httpx.Client() as c:  # a fresh connection each: the kernel spreads them over the workers
                return c.post(f"{srv.url}/v1/models/tiny-vae/decode", content=npy(x), headers={"content-type": "application/x-npy"},
                              params={"format": "npy"}, timeout=60).status_code

        with ThreadPoolExecutor(4) as pool:
            assert list(pool.map(decode, range(REQUESTS))) == [200] * REQUESTS
        pids = {p.stem.rsplit("_", 1)[-1] for p in metrics_dir.glob("*.db")}
        assert {str(w) for w in workers} <= pids, (workers, pids)
        for _ in range(8):  # every scrape, whichever worker answers it, sees all requests
            snap = scrape(srv.url)
            done = metric(snap, "convserve_requests_total", model="tiny-vae", endpoint="decode", status="200") - \
                metric(before, "convserve_requests_total", model="tiny-vae", endpoint="decode", status="200")
            assert done == REQUESTS, done
            assert metric(snap, "convserve_inflight_requests", model="tiny-vae") == 0
            assert metric_sum(snap, "convkernels_conv_total") > metric_sum(before, "convkernels_conv_total")

        def unfinished_headers(_) -> tuple[bytes, float]:
            with socket.create_connection(("127.0.0.1", srv.port), timeout=HEADER_TIMEOUT_S + 10) as sock:
                t0 = time.monotonic()
                sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
                reply = b""
                while chunk := sock.recv(65536):
                    reply += chunk
                return reply, time.monotonic() - t0

        def reuse_after(idle_s: float) -> bytes:
            def response(sock) -> bytes:
                data = b""
                while not data.endswith(b'{"status":"ok"}') and (chunk := sock.recv(65536)):
                    data += chunk
                return data

            with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as sock:
                get = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
                sock.sendall(get)
                first = response(sock)
                assert first.startswith(b"HTTP/1.1 200"), first[:200]
                time.sleep(idle_s)
                sock.sendall(get)
                return response(sock)

        with ThreadPoolExecutor(6) as pool:  # several connections: both workers get some
            reused = [pool.submit(reuse_after, idle) for idle in (HEADER_TIMEOUT_S + 0.5, 5.5, 5.5)]
            for reply, secs in pool.map(unfinished_headers, range(6)):
                assert reply.startswith(b"HTTP/1.1 408") and b"header-timeout" in reply, reply[:200]
                assert HEADER_TIMEOUT_S - 0.3 <= secs <= HEADER_TIMEOUT_S + 3, secs
            for f in reused:
                reply = f.result()
                assert reply.startswith(b"HTTP/1.1 200"), reply[:200]
    finally:
        code = srv.stop(timeout=30)
    assert code == 0, srv.log()
    # a front end told to drain is not a death: the supervisor restarted none of them
    assert "died" not in srv.log(), srv.log()
    assert not metrics_dir.exists(), "the metrics directory outlived the server"


def test_a_scrape_while_a_process_creates_its_value_file_answers(tmp_path):
    """A process's first value of a kind creates its file empty and sizes it a moment later; a
    scrape in between used to fail whole (a 500 right after a several-front-end start). Here the
    empty file stands still, as if the scrape came in that moment, in a process of its own
    because the multiprocess mode is chosen when prometheus_client is imported."""
    import subprocess
    import sys

    (tmp_path / "counter_99999.db").write_bytes(b"")
    code = ("from service import metrics\n"
            "metrics.REQUESTS.labels('m', 'decode', '200').inc()\n"
            "print(metrics.exposition().decode())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=Path(__file__).resolve().parents[1],
                         env={**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    assert 'convserve_requests_total{endpoint="decode",model="m",status="200"} 1.0' in out.stdout
    assert "# TYPE convserve_queue_wait_seconds histogram" in out.stdout  # declared, no value yet
